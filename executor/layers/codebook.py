"""`codebook` cache layer (SpindleKV): eviction first (GQA `repeat`), then each KV group's kept
tokens are stored as codebook indices + magnitudes + positions — where that measurably holds
fewer bytes than the dense rows; otherwise the group stays dense."""
from __future__ import annotations

import torch

from executor.layers.evicted import EvictedLayer
from executor.layers.groups import CodebookGroup, DenseGroup, nbytes


class CodebookLayer(EvictedLayer):
    kind = "codebook"

    def make_group(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor):
        cb = self.plan.codebook
        coded = CodebookGroup(k, v, pos, self.storage_dtype, self.ctx.rope, cb.theta_k, cb.theta_v, weight)
        dense_bytes = 2 * k.shape[0] * k.shape[1] * torch.empty((), dtype=self.storage_dtype).element_size()
        return coded if nbytes(coded) < dense_bytes else DenseGroup(k, v, pos, self.storage_dtype)
