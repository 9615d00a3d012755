"""What every press needs besides the layer's rows: the pool's tables, the model's attention shape
and RoPE, and the plan checks every press shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedPlan(ValueError):
    """A plan the pool's forms cannot hold (its kind, its stacking, its shape)."""


@dataclass(frozen=True)
class PressContext:
    tables: object                                   # executor.engine.block_tables.BlockTables
    num_query_heads: int
    scaling: float
    rope: tuple[torch.Tensor, float]                 # (inv_freq [D/2], attention_scaling): keys back to pre-RoPE
    rope_tables: tuple[torch.Tensor, torch.Tensor]   # (cos, sin) [T, D] fp32: what the kernels turn coded keys by

    @property
    def num_kv_heads(self) -> int:
        return self.tables.H

    @property
    def group(self) -> int:
        """Query heads of a KV group."""
        return self.num_query_heads // self.tables.H
