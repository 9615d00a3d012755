"""One KV block: the rows of one (tenant, job, layer, kv-head), held in host memory.

Rows are appended in chunks (an append copies only the new rows) and joined into one tensor
the first time they are read. `nbytes` is the real size of every tensor held, positions
included. Validation messages name the request field at fault.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass(frozen=True)
class Rows:
    positions: torch.Tensor   # [N] int64, token position of each row
    k: torch.Tensor           # [N, D]
    v: torch.Tensor           # [N, D]
    staged: bool = False      # served from the prefetch staging area

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.k.nbytes + self.v.nbytes


def check_rows(positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """positions [T] int64, k [T, D], v [T, D] of one floating dtype, T >= 1, D >= 1."""
    if k.dim() != 2:
        raise ValueError(f"k.shape: must be [T, D], got {list(k.shape)}")
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError(f"k.shape: needs at least one row and one column, got {list(k.shape)}")
    if not k.dtype.is_floating_point:
        raise ValueError(f"k.dtype: must be a floating dtype, got {_name(k.dtype)}")
    if v.shape != k.shape:
        raise ValueError(f"v.shape: {list(v.shape)} does not match k.shape {list(k.shape)}")
    if v.dtype != k.dtype:
        raise ValueError(f"v.dtype: {_name(v.dtype)} does not match k.dtype {_name(k.dtype)}")
    if positions.dim() != 1 or positions.shape[0] != k.shape[0]:
        raise ValueError(f"positions: {positions.numel()} values for {k.shape[0]} rows of k")
    if positions.dtype != torch.int64:
        raise ValueError(f"positions: must be int64, got {_name(positions.dtype)}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Block:
    def __init__(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        check_rows(positions, k, v)
        self.dtype = k.dtype
        self.width = k.shape[1]              # D
        self._chunks = [(positions, k, v)]   # each ([t] int64, [t, D], [t, D])
        self.rows = k.shape[0]
        self.nbytes = positions.nbytes + k.nbytes + v.nbytes

    def check_append(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        check_rows(positions, k, v)
        if k.dtype != self.dtype:
            raise ValueError(f"k.dtype: {_name(k.dtype)} does not match the block's {_name(self.dtype)}")
        if k.shape[1] != self.width:
            raise ValueError(f"k.shape: D={k.shape[1]} does not match the block's D={self.width}")

    def append(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
        """Append rows (checked with `check_append` first); returns the bytes added."""
        self.check_append(positions, k, v)
        self._chunks.append((positions, k, v))
        self.rows += k.shape[0]
        added = positions.nbytes + k.nbytes + v.nbytes
        self.nbytes += added
        return added

    def all_rows(self) -> Rows:
        """Every row, in append order (joins the chunks once)."""
        if len(self._chunks) > 1:
            self._chunks = [tuple(torch.cat(parts) for parts in zip(*self._chunks))]
        positions, k, v = self._chunks[0]
        return Rows(positions, k, v)

    def gather(self, idx: torch.Tensor) -> Rows:
        """Rows idx ([N] int64) as new tensors; IndexError names an index outside [0, rows)."""
        rows = self.all_rows()
        return Rows(
            positions=kernels.gather_rows(rows.positions.view(-1, 1), idx).view(-1),  # [N]
            k=kernels.gather_rows(rows.k, idx),                                       # [N, D]
            v=kernels.gather_rows(rows.v, idx),                                       # [N, D]
        )
