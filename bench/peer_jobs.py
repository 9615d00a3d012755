"""The serving bench's jobs as JSONL for a peer server (vLLM) to send the same prompts: what
`../shared/peers/vllm/export_jobs.py` writes, written here from this checkout's own modules (that
script still imports the model and config modules from their old home in kvplan/, since moved to
kvcore/; its folder is read-only), and handed to the peer's script with `--jobs`.

    python -m bench.peer_jobs --out jobs.jsonl [--requests 20] [--lengths 3500] [--new-tokens 256]
                              [--budget-jobs 4] [--max-batched-tokens 512]

The first line is a header ({"header": {budget bytes, model path, bytes per token, ...}}); every
other line one job: id, family, length, depth, answer, key, prompt (the text `bench.serve` sends:
context + "\\n\\n" + question), messages (that one user turn), prompt_token_ids (after the chat
template, as `executor.prompt.build` makes them) and max_tokens. The cases are `bench.load.cases`
in `bench.serve`'s order; the budget is `bench.summary.jobs_budget` of --budget-jobs full jobs."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--lengths", type=int, nargs="+", default=[3500])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budget-jobs", type=float, default=4.0)
    ap.add_argument("--max-batched-tokens", "--max-num-batched-tokens", dest="max_batched_tokens", type=int, default=512,
                    help="the project's chunk (bench.serve's default; vLLM's --max-num-batched-tokens)")
    return ap


def export(args: argparse.Namespace) -> dict:
    """Write args.out -> its header."""
    from transformers import AutoTokenizer

    from bench import load
    from bench.summary import full_job_bytes, jobs_budget, model_shape
    from executor import prompt as prompts
    from kvcore import model as models
    from kvcore.config import ModelConfig, from_env

    mcfg = from_env(ModelConfig)
    model_dir = models.prepare(mcfg)
    tok = AutoTokenizer.from_pretrained(model_dir)
    shape = model_shape(mcfg, args.max_batched_tokens)
    budget = jobs_budget(shape, args, args.budget_jobs)
    per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2          # K and V, fp16
    header = dict(model_dir=str(model_dir), checkout=str(Path(__file__).resolve().parents[1]), requests=args.requests,
                  lengths=args.lengths, new_tokens=args.new_tokens, budget_jobs=args.budget_jobs,
                  kv_budget_bytes=budget, full_job_bytes=full_job_bytes(shape, max(args.lengths) + 64, args.new_tokens),
                  fp16_kv_bytes_per_token=per_token, kv_budget_tokens_fp16=budget // per_token, shape=shape,
                  storage_dtype=mcfg.storage_dtype, compute_dtype=mcfg.compute_dtype)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for i, c in enumerate(load.cases(tok, args.requests, args.lengths)):
            text = c.context + "\n\n" + c.question                  # what bench.load sends as the prompt
            messages = [{"role": "user", "content": text}]          # executor.validation: prompt -> one user turn
            p = prompts.build(tok, messages, "")
            ids = list(p.context_ids) + list(p.question_ids)
            f.write(json.dumps(dict(index=i, id=c.id, family=c.family, length=c.length, depth=c.depth, answer=c.answer,
                                    key=c.key, prompt=text, messages=messages, prompt_token_ids=ids,
                                    prompt_tokens=len(ids), max_tokens=args.new_tokens)) + "\n")
    return header


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    header = export(args)
    print(json.dumps(dict(out=str(args.out), **{k: header[k] for k in (
        "kv_budget_bytes", "kv_budget_tokens_fp16", "full_job_bytes", "fp16_kv_bytes_per_token")})))


if __name__ == "__main__":
    main()
