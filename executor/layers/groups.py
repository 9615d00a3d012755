"""Token stores of one KV group in a compressed layer: the group's kept tokens (the union over
its query heads in GQA `repeat` mode) followed by every token added after compression.

`DenseGroup` keeps post-RoPE K and V rows in the storage dtype. `CodebookGroup` keeps
SpindleKV's form: unit-vector codebooks for pre-RoPE K and for V, per token an index into
each (dtype as small as the codebook allows), its two magnitudes and its position; keys get
RoPE re-applied on reconstruction, new tokens join their best entry above θ or extend it."""
from __future__ import annotations

import torch

from kernels import build_codebook, match_or_append, reconstruct
from kernels.rope_reconstruct import unrotate_rope


UINT8_ENTRIES, INT16_ENTRIES = 256, 32768      # most entries a uint8 / int16 index can address


def index_dtype(n: int) -> torch.dtype:
    """The smallest integer dtype that indexes n entries."""
    return torch.uint8 if n <= UINT8_ENTRIES else torch.int16 if n <= INT16_ENTRIES else torch.int32


def index_bytes(n: torch.Tensor) -> torch.Tensor:
    """Bytes of one `index_dtype(n)` index, elementwise over entry counts n."""
    return torch.where(n <= UINT8_ENTRIES, 1, torch.where(n <= INT16_ENTRIES, 2, 4))


def dense_bytes(tokens, head_dim: int, dtype: torch.dtype):
    """Bytes of dense K and V rows for `tokens` tokens of one group (int or tensor)."""
    return tokens * 2 * head_dim * dtype.itemsize


def _fits(t: torch.Tensor, n: int) -> torch.Tensor:
    """Widen an index tensor when the codebook outgrows its dtype."""
    return t if index_dtype(n).itemsize <= t.element_size() else t.to(index_dtype(n))


class DenseGroup:
    coded = False

    def __init__(self, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype):
        """k_post, v: [U, D] kept rows (post-RoPE keys); pos: [U] their positions."""
        self.k, self.v = k_post.to(dtype), v.to(dtype)

    @property
    def num_tokens(self) -> int:
        return self.k.shape[0]

    def append(self, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k_post, v: [T_new, D]; pos: [T_new]."""
        self.k = torch.cat([self.k, k_post.to(self.k.dtype)])
        self.v = torch.cat([self.v, v.to(self.v.dtype)])

    def materialize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> post-RoPE K, V: [U, D] in the compute dtype."""
        return self.k.to(dtype), self.v.to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class CodebookGroup:
    coded = True

    def __init__(self, codes_k: tuple, codes_v: tuple, pos: torch.Tensor, dtype: torch.dtype,
                 rope: tuple[torch.Tensor, float], theta_k: float, theta_v: float):
        """codes_k/codes_v: (C [n, D] unit rows, ref [U] entry of each token, mag [U]) for pre-RoPE K
        and for V; entries no token points at are dropped. pos: [U] int positions;
        rope: (inv_freq [D/2], attention_scaling)."""
        self.dtype, self.rope, self.theta_k, self.theta_v = dtype, rope, theta_k, theta_v
        self.ck, self.ref_k, self.mag_k = self._compact(*codes_k)          # [nK, D], [U], [U]
        self.cv, self.ref_v, self.mag_v = self._compact(*codes_v)          # [nV, D], [U], [U]
        self.pos = pos.to(torch.int32)                                     # [U]

    def _compact(self, c: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor):
        used, ref = torch.unique(ref.long(), return_inverse=True)
        return c[used].to(self.dtype), ref.to(index_dtype(len(used))), mag.to(self.dtype)

    @classmethod
    def build(cls, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype,
              rope: tuple[torch.Tensor, float], theta_k: float, theta_v: float,
              weight: torch.Tensor | None = None) -> "CodebookGroup":
        """k_post, v: [U, D]; pos: [U]; weight: [U] how many query heads kept each token (GQA dedup)."""
        k_pre = unrotate_rope(k_post.float(), pos, *rope)                   # codebooks work pre-RoPE
        return cls(build_codebook(k_pre, theta_k, weight), build_codebook(v.float(), theta_v, weight),
                   pos, dtype, rope, theta_k, theta_v)

    @property
    def num_tokens(self) -> int:
        return self.pos.shape[0]

    def append(self, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k_post, v: [T_new, D]; pos: [T_new]."""
        k_pre = unrotate_rope(k_post.float(), pos, *self.rope)
        self.ck, rk = match_or_append(self.ck, k_pre, self.theta_k)         # fp16 codebooks, fp32 cosines
        self.cv, rv = match_or_append(self.cv, v.float(), self.theta_v)
        self.ref_k = _fits(self.ref_k, len(self.ck))
        self.ref_v = _fits(self.ref_v, len(self.cv))
        self.ref_k = torch.cat([self.ref_k, rk.to(self.ref_k.dtype)])
        self.ref_v = torch.cat([self.ref_v, rv.to(self.ref_v.dtype)])
        self.mag_k = torch.cat([self.mag_k, k_pre.norm(dim=-1).to(self.dtype)])
        self.mag_v = torch.cat([self.mag_v, v.float().norm(dim=-1).to(self.dtype)])
        self.pos = torch.cat([self.pos, pos.to(torch.int32)])

    def materialize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> post-RoPE K (RoPE re-applied at each token's own position), V: [U, D]."""
        k = reconstruct(self.ck, self.ref_k, self.mag_k, self.pos, self.rope[0], self.rope[1], out_dtype=dtype)
        v = reconstruct(self.cv, self.ref_v, self.mag_v, out_dtype=dtype)
        return k, v

    def tensors(self) -> list[torch.Tensor]:
        return [self.ck, self.cv, self.ref_k, self.ref_v, self.mag_k, self.mag_v, self.pos]


def nbytes(group) -> int:
    return sum(t.nbytes for t in group.tensors())
