"""Next tokens for every sampled row of a step at once: greedy rows by one argmax, the others by
temperature and nucleus (top-p) sampling, each row drawing from its own seeded generator, so a
job's tokens depend on its own seed and logits only — never on what it is batched with. For the
rows whose job asked, the sampled token's log-probability and the most likely tokens' (`logprobs`)."""
from __future__ import annotations

import torch


def generator(seed: int | None) -> torch.Generator:
    """A job's generator: seeded when the job gives a seed (reproducible), else from entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           gens: list[torch.Generator | None]) -> list[int]:
    """logits: [R, V]; temperature, top_p: [R]; gens: a generator per row (None for greedy rows)
    -> R token ids. Top-p keeps the smallest set of most likely tokens whose mass reaches p
    (always the top one)."""
    out = logits.argmax(dim=-1)                                                     # [R]
    hot = (temperature > 0).nonzero()[:, 0]
    if len(hot):
        probs = torch.softmax(logits[hot].float() / temperature[hot, None], dim=-1)  # [S, V]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)   # ties in one order, batched or not
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p[hot, None]
        sorted_p = sorted_p * keep
        cdf = torch.cumsum(sorted_p, dim=-1)                                         # [S, V]
        u = torch.stack([torch.rand((), generator=gens[i]).to(cdf.device) for i in hot.tolist()]) * cdf[:, -1]   # [S]
        pick = torch.searchsorted(cdf, u[:, None]).clamp_max(cdf.shape[1] - 1)      # [S, 1]
        out[hot] = order.gather(1, pick)[:, 0]
    return out.tolist()


def logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list[int], list[float]]]:
    """logits: [S, V]; tokens: the S sampled ids -> per row (the token's log-probability, the k
    most likely ids, their log-probabilities), of the model's own distribution: log-softmax of the
    logits before temperature and top-p, as OpenAI's API and vLLM report them."""
    lp = torch.log_softmax(logits.float(), dim=-1)                                      # [S, V]
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k <= 0:
        return [(c, [], []) for c in chosen]
    top = lp.topk(k, dim=-1)                                                             # [S, k]
    return list(zip(chosen, top.indices.tolist(), top.values.tolist()))
