"""What a budget meets before the prefill: a plan from a stand-in of the prompt's statistics.

A probing strategy plans from the statistics its job's prefill gathers, so a budget its plan
cannot hold was refused only after that prefill (13 s on a long prompt, and after a stream's
200). What decides whether a budget can be held does not need the prompt's attention: how many
tokens a strategy always keeps (sinks, window), what its storage forms cost, and — for a strategy
that merges layers — whether this model's adjacent layers are alike. So the executor asks first
for a plan from a stand-in (`PlanRequest.precheck`): uniform window scores over the job's
prompt length, no storage-form losses, and the layer statistics (similar rows, adjacent-layer
angles) of a real probe of the prompt's first PREFIX_TOKENS tokens; a budget that plan cannot
hold is refused as the real one would be (`planner.fit`), with the same words, before any prefill.

    standin(prefix_probe, tokens)   the stand-in probe (`PlanInput.probe`'s form)
    standin_input(inp, prefix_probe) the job's input with it (and even layer shares for XKV)
    compresses(plan)                whether a plan compresses any layer
    note(strategy, plan)            a refusal's model-made cause (MiniCache finding no pair alike)
    cannot_compress(strategy, ...)  why a strategy compresses nothing on a model ("": it does),
                                    from a reference text's prefix (`kvplan strategies`)

The real plan still decides the job; the stand-in only refuses early what the real plan would
refuse (whether a budget can be held does not read the scores: the eviction presets' budgets are
totals, and `auto`'s costs are its forms' bytes)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from kvcore.statistics import BITS, FRACTIONS, Losses, ProbeStats
from kvcore.plan import CompressionPlan
from planner.request import ModelShape, PlanInput

PREFIX_TOKENS = 128            # the prompt's tokens a precheck probes (a mini-prefill: well under a second)
REFERENCE_TOKENS = 2048        # the prompt length `cannot_compress` plans for
REFERENCE_RATIO = 0.5
PARTS = ("eviction", "codebook", "merge", "quant", "offload")   # a composed definition's compressing parts
REFERENCE_TEXT = (             # any ordinary prose: what the model's layers look like on text
    "The committee met on a wet Tuesday in the old library. The treasurer read the accounts, the "
    "secretary read the letters that had come in since the spring, and the chair asked whether anyone "
    "had news of the bridge repairs. Nobody had. They agreed to write to the council again, to hold the "
    "summer fair on the first Saturday of July, and to buy a new kettle for the hall, the old one having "
    "finally given up after twenty years of service. The meeting closed at nine, and the members walked "
    "home under umbrellas, talking about the weather and the price of coal.")


def standin(prefix_probe: Callable[..., ProbeStats], tokens: int) -> Callable[..., ProbeStats]:
    """A probe of a `tokens`-token prompt from a real probe of its prefix (`prefix_probe`, lazy, in
    the strategy's GQA mode): the prefix's layer statistics, uniform window scores, and losses
    (when asked) that make every share free to evict and every quantized form dear: `auto` then
    quantizes only where no dense plan fits — the plan a budget is likeliest to hold (a quantizing
    plan must leave its floor dense: `planner.fit`), so the stand-in refuses no budget a real plan
    would hold; its "fits" figures may be lower than the real plan's."""
    def probe(losses: bool = False, **kw) -> ProbeStats:
        got = prefix_probe(**kw)
        m, heads = got.window_scores.shape[:2]
        f, b = np.asarray(FRACTIONS), np.asarray(BITS)
        return dataclasses.replace(
            got, tokens=tokens,
            window_scores=np.broadcast_to(np.float32(1.0 / max(1, tokens)), (m, heads, tokens)),   # [m, H_e, T]
            losses=Losses(fractions=f, evict=np.zeros((m, len(f))), retained=np.tile(f, (m, 1)),
                          bits=b, quant=np.tile((b < 16).astype(np.float64), (m, 1))) if losses else None)
    return probe


def standin_input(inp: PlanInput, prefix_probe: Callable[..., ProbeStats]) -> PlanInput:
    """The job's plan input with the stand-in probe (`standin`) and even layer shares: uniform
    scores split XKV's total evenly over the layers (the probe's ties would otherwise hand whole
    layers the budget in layer order: a plan no prompt gives), no profile."""
    m = inp.model.num_layers
    return dataclasses.replace(inp, probe=standin(prefix_probe, inp.prompt_tokens), profile="",
                               layer_shares=(1.0 / m,) * m)


def compresses(plan: CompressionPlan) -> bool:
    """Whether the plan stores any layer other than whole (or offloads)."""
    return plan.offload.enabled or any(lp.kind != "full" for lp in plan.layers)


def note(strategy, plan: CompressionPlan) -> str:
    """A refusal's cause the strategy knows: a strategy that merges layers merged none because this
    model's adjacent layers are unlike ("" otherwise)."""
    d = strategy.definition
    if d is None or d.merge is None or compresses(plan):
        return ""
    return (f" (no pair of its adjacent layers is alike enough to merge on this model: {strategy.name} compresses "
            "nothing here; `kvplan strategies` marks it)")


def cannot_compress(strategy, model: ModelShape, prefix_probe: Callable[..., ProbeStats] | None) -> str:
    """Why `strategy` keeps every layer whole on this model ("": it compresses): its plan at
    REFERENCE_RATIO of a REFERENCE_TOKENS-token prompt, from the stand-in of a reference text's
    probe (`prefix_probe`, lazy, any GQA mode; None: the strategy does not probe). A strategy
    that declares nothing to compress (`full`) is never meant to and is not marked."""
    d = strategy.definition
    if d is not None and d.kind == "compose" and not any(getattr(d, part) for part in PARTS):
        return ""
    inp = PlanInput(job_id="check", strategy=strategy.name, prompt_tokens=REFERENCE_TOKENS, model=model,
                    reserve_ratio=REFERENCE_RATIO,
                    probe=standin(lambda **kw: prefix_probe(gqa_mode=strategy.probe_mode, **kw), REFERENCE_TOKENS)
                    if strategy.probe_mode and prefix_probe is not None else None)
    if compresses(strategy.plan(inp, "check")):
        return ""
    return "its plans keep every layer whole; a budget below 1 is refused"


def reference(prober) -> tuple[ModelShape, Callable[..., ProbeStats]]:
    """The shape of the model `prober` loads and a lazy probe of REFERENCE_TEXT on it: what
    `cannot_compress` reads."""
    from planner.probe import once
    lm = prober.model()
    shape = ModelShape(lm.num_layers, lm.num_kv_heads, lm.num_query_heads, lm.head_dim, lm.fingerprint)
    return shape, once(prober.probe, lm.tokenizer(REFERENCE_TEXT)["input_ids"])
