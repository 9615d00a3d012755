"""What a serving bench run measured, and the budget it ran under — shared by `bench.serve`'s
throughput run and `bench.scenarios`: percentiles, a run's summary from its jobs and the
executor's metrics, the KV budget of K full-KV jobs, and the model's shape that sizes it."""
from __future__ import annotations

import math

from bench import load
from bench.risk import auc
from bench.stack import metric
from kvcore import model as models
from kvcore import plan_cost
from kvcore.config import ModelConfig
from kvcore.plan import full_plan


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def full_job_bytes(cfg: dict, context: int, new_tokens: int) -> int:
    """What one full-KV job of `context` prompt tokens and `new_tokens` reserves (`kvcore.plan_cost`)."""
    return plan_cost.plan_bytes(full_plan(cfg["layers"], "sizing"), cfg["kv_heads"], cfg["q_heads"], cfg["head_dim"],
                                context, 0, new_tokens, 2, cfg["chunk"])


def jobs_budget(shape: dict, args, k: float) -> int:
    """The KV budget of `--budget-jobs` k: what k full-KV jobs of the longest length reserve (with
    room for a chat template's tokens)."""
    return int(k * full_job_bytes(shape, max(args.lengths) + 64, args.new_tokens))


def summarize(sent: list[load.Sent], before: dict, after: dict, budget: int) -> dict:
    ok = [s for s in sent if s.result is not None]
    d = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)      # noqa: E731
    dec_s, dec_t = d("kvplan_executor_step_seconds_total", kind="decode"), d("kvplan_executor_step_tokens_total", kind="decode")
    mix_s, mix_t = d("kvplan_executor_step_seconds_total", kind="mixed"), d("kvplan_executor_step_tokens_total", kind="mixed")
    start, end = min(s.t_submit for s in sent), max(s.t_done for s in sent)
    tokens = sum(r.result.generated_tokens for r in ok)
    return dict(
        requests=len(sent), done=len(ok), errors=[s.error for s in sent if s.error][:5],
        correct=sum(s.correct for s in sent), **risk(ok),
        decode_tps=dec_t / dec_s if dec_s else float("nan"),
        decode_mixed_tps=(dec_t + mix_t) / (dec_s + mix_s) if dec_s + mix_s else float("nan"),
        output_tps=tokens / (end - start), requests_ps=len(ok) / (end - start), makespan_s=end - start,
        generated=tokens,
        ttft=[pct([s.ttft_s for s in sent], q) for q in (50, 90, 99)],
        tpot=[pct([s.tpot_s for s in sent], q) for q in (50, 90, 99)],
        itl=[pct([g for s in sent for g in s.itl_s], q) for q in (50, 90, 99)],
        e2e=[pct([s.t_done - s.t_submit for s in ok], q) for q in (50, 90, 99)],
        peak_kv_bytes=metric(after, "kvplan_executor_kv_peak_bytes"), kv_budget_bytes=budget,
        most_decoding=metric(after, "kvplan_executor_decoding_sequences_peak"),
        measured_ratio=sum(r.result.reserve_ratio for r in ok) / len(ok) if ok else float("nan"),
        decode_step_s=dec_s / d("kvplan_executor_steps_total", kind="decode") if dec_s else float("nan"),
        prefill_step_s=(d("kvplan_executor_step_seconds_total", kind="prefill")
                        / max(1.0, d("kvplan_executor_steps_total", kind="prefill"))),
    )


def risk(ok: list[load.Sent]) -> dict:
    """The answers' own risk flag (`kv_at_risk`) against their being wrong: how many were flagged,
    how many of the wrong ones, and the AUC of 1 - kv_risk for right over wrong answers (None when
    either is empty)."""
    wrong = [s for s in ok if not s.correct]
    return dict(at_risk=sum(s.result.kv_at_risk for s in ok), wrong_at_risk=sum(s.result.kv_at_risk for s in wrong),
                risk_auc=auc([1 - s.result.kv_risk for s in ok if s.correct], [1 - s.result.kv_risk for s in wrong]))


def model_shape(mcfg: ModelConfig, chunk: int) -> dict:
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(models.prepare(mcfg))
    heads = c.num_attention_heads
    return dict(layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, q_heads=heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, chunk=chunk)
