"""What the codebook press weighs before it stores a KV group: the group's candidate tokens, each
tensor of them (pre-RoPE K, V) as a `CodedPart` with its codebook where one could pay, and the
group's bytes and rows as functions of the eviction rank k the layer keeps up to.

Ranks: the window and sink tokens have rank -1 (always kept); the scored tokens 0..k_max-1, best
first. A token is kept at k when its rank is below k; a head's rank of a token it does not keep
is k_max, which no k the layer weighs passes. Shapes: U candidate tokens, D head dim, n
codebook entries, h_n query heads of the group, K the ranks k weighed at once."""
from __future__ import annotations

from dataclasses import dataclass

META_BYTES = 17     # a coded row's fields in the pool: two entries, a position (int32), two magnitudes, a head byte

import torch



def count_below(sorted_values: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """How many of `sorted_values` are < k, for each k of ks [K] -> [K]."""
    return torch.searchsorted(sorted_values, ks)


def first_rank(index: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The smallest `rank` [U] among the rows that point at each entry some row points at
    (`index` [U]), sorted -> [n_used]: an entry no row points at is never needed."""
    used, inv = torch.unique(index, return_inverse=True)
    first = torch.empty(len(used), dtype=rank.dtype, device=rank.device)
    return first.scatter_reduce(0, inv, rank, "amin", include_self=False).sort().values


@dataclass(frozen=True)
class CodedPart:
    """One tensor of a group's candidates: dense rows, or codes where a codebook could pay."""
    name: str                                  # "k" (pre-RoPE keys) | "v"
    theta: float
    extra: int                                 # bytes per coded row besides index and magnitude (key positions)
    codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # (C [n, D], ref [U], mag [U]); None: never coded
    first: torch.Tensor | None = None          # [n] sorted: the rank at which each entry is first needed
    rebuilt: torch.Tensor | None = None        # [U, D] post-RoPE rows as the codes give them back

    @property
    def codable(self) -> bool:
        return self.codes is not None

    def coded_bytes(self, rows: torch.Tensor, ks: torch.Tensor, row_bytes: int, itemsize: int) -> torch.Tensor:
        """Bytes of the coded form holding rows [K] tokens at each k of ks [K]: the entries first
        needed below k (each row's entry, magnitude and position are priced once per row by the
        pool's coded pages, `META_BYTES`). Only for a codable part."""
        return count_below(self.first, ks) * row_bytes


@dataclass(frozen=True)
class Candidate:
    """One KV group's candidate tokens and what storing them costs at each rank k."""
    pos: torch.Tensor                          # [U] sorted token positions
    k: torch.Tensor                            # [U, D] post-RoPE keys
    v: torch.Tensor                            # [U, D]
    weight: torch.Tensor                       # [U] how many of the group's heads keep each token
    min_rank: torch.Tensor                     # [U] the smallest rank k at which the token is kept
    parts: dict[str, CodedPart]                # "k", "v"
    itemsize: int                              # the storage dtype's
    head_rank: torch.Tensor | None = None      # [h_n, U] each head's rank of each token (k_max: not kept)

    def __post_init__(self):
        object.__setattr__(self, "_sorted_rank", self.min_rank.sort().values)

    @property
    def row_bytes(self) -> int:
        """One dense row of one tensor."""
        return self.k.shape[1] * self.itemsize

    def rows(self, ks: torch.Tensor) -> torch.Tensor:
        """Tokens the group keeps at each k of ks [K] -> [K]."""
        return count_below(self._sorted_rank, ks)

    def part_bytes(self, name: str, ks: torch.Tensor, coded: bool) -> torch.Tensor:
        """Bytes of part `name` at each k of ks [K]: coded (the smaller of coded and dense where it
        is codable) or dense."""
        rows = self.rows(ks)
        dense = rows * self.row_bytes
        part = self.parts[name]
        if not coded or not part.codable:
            return dense
        return torch.minimum(part.coded_bytes(rows, ks, self.row_bytes, self.itemsize), dense)

    def bytes(self, ks: torch.Tensor, coded: tuple[str, ...] = ("k", "v")) -> torch.Tensor:
        """The group's bytes at each k of ks [K], the parts in `coded` in their smaller form, and
        every row's fields in the pool's coded pages."""
        return sum(self.part_bytes(name, ks, name in coded) for name in self.parts) + META_BYTES * self.rows(ks)

    def coded_parts(self, k_star: int, allowed: tuple[str, ...]) -> tuple[str, ...]:
        """The parts stored coded at k_star: allowed, codable, and smaller than dense rows."""
        ks = torch.tensor([k_star], device=self.min_rank.device)
        rows = self.rows(ks)
        return tuple(name for name in allowed if self.parts[name].codable
                     and int(self.parts[name].coded_bytes(rows, ks, self.row_bytes, self.itemsize)[0])
                     < int(rows[0]) * self.row_bytes)

    def kept(self, k_star: int) -> torch.Tensor:
        """[U] bool: the tokens kept at k_star."""
        return self.min_rank < k_star
