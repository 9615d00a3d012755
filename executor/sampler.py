"""Next-token choice: greedy at temperature 0, else temperature + nucleus (top-p) sampling with a
seeded generator so a job is reproducible."""
from __future__ import annotations

import torch


class Sampler:
    def __init__(self, temperature: float, top_p: float, seed: int | None):
        self.temperature = temperature
        self.top_p = top_p
        self.gen = torch.Generator().manual_seed(seed) if seed is not None else torch.Generator()
        if seed is None:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [V] for the last position -> token id."""
        if self.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < self.top_p   # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))
