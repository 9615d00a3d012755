"""Whether an answer's compression put it at risk: `kv_risk`, the share of the answer's tokens
that no `NGRAM`-gram of the answer copied from the prompt covers. An answer read from the
context is copied token for token; where compression dropped what it was read from, the model
makes the missing part up, and that part is in no n-gram of the prompt.

Measured on the quality bench (docs/benchmarks.md, "Does an answer know it is at risk?"): it
separates the compressed answers that differ from the uncompressed run's from those that match
where the plan's predicted retained attention and the tokens' probabilities do not. `THRESHOLD`
was chosen there on the 1000-token cases and checked on the 2000-token ones. It speaks of
answers read from the prompt: a free answer (a poem, a summary in other words) is ungrounded
by nature, and is flagged when its cache was compressed."""
from __future__ import annotations

from kvcore.plan import CompressionPlan

NGRAM = 4            # tokens an answer's copied run must share with the prompt to count as copied
THRESHOLD = 0.05     # kv_risk above this on a compressed cache: kv_at_risk (tuned on the bench's 1k cases)


def grounded(prompt_ids: list[int], answer_ids: list[int], n: int = NGRAM) -> float:
    """Share of answer tokens covered by an n-gram of the answer that occurs in the prompt; an
    answer shorter than n: 1.0 when it occurs in the prompt whole, else 0.0 (empty: 1.0)."""
    if not answer_ids:
        return 1.0
    if len(answer_ids) < n:
        m = len(answer_ids)
        return float(any(prompt_ids[i:i + m] == answer_ids for i in range(len(prompt_ids) - m + 1)))
    grams = {tuple(answer_ids[i:i + n]) for i in range(len(answer_ids) - n + 1)}
    firsts = {g[0] for g in grams}                          # only the prompt's n-grams that could match
    seen = grams & {tuple(prompt_ids[i:i + n]) for i in range(len(prompt_ids) - n + 1) if prompt_ids[i] in firsts}
    covered = [False] * len(answer_ids)
    for i in range(len(answer_ids) - n + 1):
        if tuple(answer_ids[i:i + n]) in seen:
            covered[i:i + n] = [True] * n
    return sum(covered) / len(covered)


def compressed(plan: CompressionPlan) -> bool:
    """Whether the plan drops or approximates anything (a layer not full, or an offload part)."""
    return plan.offload.enabled or any(lp.kind != "full" for lp in plan.layers)


def kv_risk(prompt_ids: list[int], generated: list[int]) -> float:
    """1 - grounded: the share of the answer (its generated tokens; an end-of-text token that
    ended it is not one) no copied n-gram covers, in [0, 1]."""
    return 1.0 - grounded(prompt_ids, generated)


def at_risk(risk: float, plan: CompressionPlan) -> bool:
    """Flag an answer when its cache was compressed and its risk is above `THRESHOLD`."""
    return compressed(plan) and risk > THRESHOLD
