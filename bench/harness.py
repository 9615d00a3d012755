"""The benches' in-process job path: the real model and runner, a prompt per mode, a plan per
(strategy, reserve ratio), and teacher-forced per-step logits for fidelity.

Modes (where the question sits relative to compression):
- `query_aware`: the question is inside the compressed part (context + "\\n\\n" + question).
- `query_agnostic`: the context is compressed first, the question prefilled after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor import prompt as P
from executor.prompt import Prompt
from cachestore.handle import LocalHandle
from executor.runner import Prefix, Runner, RunResult, Sampling
from kvcore import model as models
from kvcore.config import ModelConfig, from_env
from kvcore.model import LoadedModel
from kvcore.plan import CompressionPlan
from planner.predict import copy_retained_attention, retained_attention
from kvcore.statistics import ProbeStats
from planner.probe import Prober
from planner.request import ModelShape, PlanInput
from planner.strategies import STRATEGIES

MODES = ("query_aware", "query_agnostic")


class UnknownStrategy(ValueError):
    pass


def check_strategies(names: list[str]) -> list[str]:
    missing = [n for n in names if n not in STRATEGIES]
    if missing:
        raise UnknownStrategy(f"unknown strategies {missing}; registered: {sorted(STRATEGIES)}")
    return names


@dataclass
class Harness:
    lm: LoadedModel
    runner: Runner
    prober: Prober | None = None
    _probed: tuple | None = None          # (ids, gqa_mode, stats): the last prompt's probe (with losses)

    @classmethod
    def load(cls) -> "Harness":
        cfg = from_env(ModelConfig)
        lm = models.load(cfg)
        return cls(lm, Runner(lm, getattr(torch, cfg.storage_dtype)))

    def warmup(self, strategies: list[str], tokens: int = 256) -> None:
        """One short job per strategy, so first-call costs (allocator, lazy imports) stay out of timings."""
        ids = self.tokenizer("The river keeps flowing to the sea. " * (tokens // 8), add_special_tokens=False)["input_ids"]
        for s in strategies:
            self.run(Prompt(ids[:tokens], []), s, 0.5, 4)

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    @property
    def shape(self) -> ModelShape:
        lm = self.lm
        return ModelShape(lm.num_layers, lm.num_kv_heads, lm.num_query_heads, lm.head_dim)

    def prompt(self, context: str, question: str, mode: str) -> Prompt:
        if mode == "query_aware":
            return P.build(self.tokenizer, [{"role": "user", "content": context + "\n\n" + question}], "")
        if mode == "query_agnostic":
            return P.build(self.tokenizer, [{"role": "user", "content": context}], question)
        raise ValueError(f"mode {mode!r} is not one of {MODES}")

    def probe(self, ids: list[int], gqa_mode: str = "repeat", losses: bool = False) -> ProbeStats:
        """The planner's probe of a prompt, as the planner service runs it; the last prompt's
        result is kept, so the strategies of one prompt share one probe."""
        got = self._probed
        if got is None or got[0] != ids or got[1] != gqa_mode:
            self.prober = self.prober or Prober(lm=self.lm)
            got = self._probed = (list(ids), gqa_mode, self.prober.probe(ids, gqa_mode, losses=True))
        return got[2]

    def predicted_retained(self, plan: CompressionPlan, ids: list[int]) -> float:
        """The planner's yardstick for a plan of this prompt (`planner.predict`)."""
        return retained_attention(plan, self.probe(ids), self.lm.num_kv_heads)

    def predicted_copy(self, plan: CompressionPlan, ids: list[int]) -> float:
        """The copy-aware yardstick (`planner.predict.copy_retained_attention`)."""
        return copy_retained_attention(plan, self.probe(ids), self.lm.num_kv_heads)

    def plan(self, strategy: str, ids: list[int] | int, ratio: float, suffix_tokens: int = 0,
             new_tokens: int = 0) -> CompressionPlan:
        """ids: the context's token ids (probing strategies need them) or just its length;
        suffix_tokens, new_tokens: what the job adds after them, as the executor tells the planner."""
        n = ids if isinstance(ids, int) else len(ids)
        probe = None if isinstance(ids, int) else (lambda **kw: self.probe(ids, **kw))
        inp = PlanInput("bench", strategy, n, self.shape, reserve_ratio=ratio, probe=probe,
                        suffix_tokens=suffix_tokens, new_tokens=new_tokens)
        return STRATEGIES[strategy].plan(inp, f"bench-{strategy}-{ratio:g}")

    def run(self, prompt: Prompt, strategy: str, ratio: float, max_new_tokens: int,
            prefix: Prefix | None = None, plan: CompressionPlan | None = None, store=None,
            measure_recall: bool = False, record_logits: bool = False):
        """-> the run's result (`record_logits`: and each generated token's row of logits [V]).
        `prefix`: the prompt's leading chunks prefilled once (`Runner.prefix_of`); a run whose
        plan chunks the prompt alike starts there, the others prefill everything. `plan`: the
        strategy's plan of this prompt when the caller already made it. Offload plans: `store`
        the job's cachestore handle (None: in process), fitted to `ratio` as a job's budget."""
        plan = plan or self.plan(strategy, list(prompt.context_ids), ratio, len(prompt.question_ids), max_new_tokens)
        return self.runner.run(prompt, plan, Sampling(max_new_tokens=max_new_tokens), prefix=prefix,
                               store=store, budget=ratio, measure_recall=measure_recall,
                               record_logits=record_logits)

    # -- fidelity ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forced_logits(self, prompt: Prompt, plan: CompressionPlan, forced: list[int] | int) -> tuple[torch.Tensor, RunResult]:
        """Per-step next-token logits [n, V] (fp32) over a continuation: `forced` tokens are fed
        one decode step at a time through the planned cache (teacher forcing); an int n instead
        decodes n greedy tokens (the reference). Row i predicts continuation token i."""
        n = forced if isinstance(forced, int) else len(forced)
        sampling = Sampling(max_new_tokens=n, ignore_eos=True, forced=() if isinstance(forced, int) else tuple(forced))
        store = LocalHandle() if plan.offload.enabled else None       # offload: speculative decode steps
        run, rows = self.runner.run(prompt, plan, sampling, store=store, record_logits=True)
        if store is not None:
            store.release()
        return torch.stack(rows[:n]), run


def agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """ref, got: [n, V] logits -> (greedy top-1 agreement, mean KL(ref || got) in nats)."""
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return top1, kl


def measured_ratio(cache_or_result) -> float:
    layers = cache_or_result.layer_bytes() if hasattr(cache_or_result, "layer_bytes") else cache_or_result.layers
    full = sum(x.full_kv_bytes for x in layers)
    return sum(x.kv_bytes for x in layers) / full if full else 1.0
