"""Token stores of one KV group in a compressed layer: the group's kept tokens (the union over
its query heads in GQA `repeat` mode) followed by every token added after compression.

`DenseGroup` keeps post-RoPE K and V rows in the storage dtype. `CodebookGroup` keeps
SpindleKV's form: unit-vector codebooks for pre-RoPE K and for V, per token an index into
each (dtype as small as the codebook allows), its two magnitudes and its position; keys get
RoPE re-applied on reconstruction, new tokens join their best entry above θ or extend it."""
from __future__ import annotations

import torch

from executor.attention import group_attention
from kernels import build_codebook, dense_decode, match_or_append, reconstruct
from kvcore import cost
from kernels.rope_reconstruct import unrotate_rope


UINT8_ENTRIES, INT16_ENTRIES = cost.UINT8_ENTRIES, cost.INT16_ENTRIES
ROW_CHUNK, grown, held_after = cost.ROW_CHUNK, cost.grown, cost.held_after     # the stores' growth rule


def index_dtype(n: int) -> torch.dtype:
    """The smallest integer dtype that indexes n entries."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[cost.index_dtype_bytes(n)]


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
    """K/V rows in preallocated storage: decode writes each new row in place and grows the
    storage ROW_CHUNK rows at a time, instead of copying every row at every step. The spare
    rows are held memory, so `tensors()` returns them too (at most ROW_CHUNK - 1 per group)."""
    coded = False

    def __init__(self, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype):
        """k_post, v: [U, D] kept rows (post-RoPE keys); pos: [U] their positions."""
        self._k, self._v = k_post.to(dtype), v.to(dtype)                  # [capacity, D]
        self.n = k_post.shape[0]

    @property
    def k(self) -> torch.Tensor:
        return self._k[:self.n]

    @property
    def v(self) -> torch.Tensor:
        return self._v[:self.n]

    @property
    def num_tokens(self) -> int:
        return self.n

    def append(self, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k_post, v: [T_new, D]; pos: [T_new]."""
        m = k_post.shape[0]
        cap = grown(self._k.shape[0], self.n, m)
        if cap > self._k.shape[0]:
            self._k = torch.cat([self.k, self._k.new_empty(cap - self.n, self._k.shape[1])])
            self._v = torch.cat([self.v, self._v.new_empty(cap - self.n, self._v.shape[1])])
        self._k[self.n:self.n + m] = k_post
        self._v[self.n:self.n + m] = v
        self.n += m

    def materialize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> post-RoPE K, V: [U, D] in the compute dtype."""
        return self.k.to(dtype), self.v.to(dtype)

    def attend(self, q: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """q: [h_n, Tq, D] the group's query heads; mask: [h_n, Tq, U] bool (True = seen) or None
        -> [h_n, Tq, D]. A decode row reads the stored rows in the fused kernel."""
        if q.shape[1] == 1 and dense_decode.handles(self._k):
            return dense_decode.dense_decode_groups(q.transpose(0, 1), [self.k], [self.v],
                                                    None if mask is None else [mask[:, 0]], scaling).transpose(0, 1)
        k, v = self.materialize(q.dtype)
        return group_attention(q, k, v, mask, scaling)

    def tensors(self) -> list[torch.Tensor]:
        return [self._k, self._v]

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows join in turn (`kvcore.cost`)."""
        rows = cost.capacities(self._k.shape[0], self.n, adds)[-1] if adds else self._k.shape[0]
        return rows * cost.dense_row_bytes(self._k.shape[1], self._k.element_size())


class CodedRows:
    """One tensor's rows (pre-RoPE K or V) as SpindleKV codes: unit-vector codebook C [n, D],
    per row an entry index ref [U] (dtype as small as the codebook allows) and its norm mag [U]."""

    def __init__(self, c: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, theta: float, dtype: torch.dtype):
        """c: [n, D] unit rows (entries no row points at are dropped); ref: [U]; mag: [U]."""
        used, ref = torch.unique(ref.long(), return_inverse=True)
        self.c, self.ref, self.mag, self.theta = c[used].to(dtype), ref.to(index_dtype(len(used))), mag.to(dtype), theta

    @classmethod
    def build(cls, x: torch.Tensor, theta: float, weight: torch.Tensor | None, dtype: torch.dtype) -> "CodedRows":
        """x: [U, D] fp32 rows; weight: [U] multiplicities (GQA dedup) or None."""
        return cls(*build_codebook(x, theta, weight), theta, dtype)

    def append(self, x: torch.Tensor) -> None:
        """x: [T_new, D] fp32: each row joins its best entry above θ or extends the codebook."""
        self.c, ref = match_or_append(self.c, x, self.theta)                 # fp16 codebook, fp32 cosines
        self.ref = _fits(self.ref, len(self.c))
        self.ref = torch.cat([self.ref, ref.to(self.ref.dtype)])
        self.mag = torch.cat([self.mag, x.norm(dim=-1).to(self.mag.dtype)])

    def tensors(self) -> list[torch.Tensor]:
        return [self.c, self.ref, self.mag]


class CodebookGroup:
    """SpindleKV's form of one group, K and V each coded or dense (whichever holds fewer bytes:
    a codebook that cannot merge enough costs more than the rows). Coded keys are pre-RoPE with
    their int32 positions; dense keys are post-RoPE rows, as in `DenseGroup`."""
    coded = True

    def __init__(self, k: CodedRows | torch.Tensor, v: CodedRows | torch.Tensor, pos: torch.Tensor,
                 dtype: torch.dtype, rope: tuple[torch.Tensor, float]):
        """k: coded pre-RoPE K or dense post-RoPE K rows [U, D]; v: coded V or dense rows [U, D];
        pos: [U] int positions; rope: (inv_freq [D/2], attention_scaling)."""
        self.dtype, self.rope = dtype, rope
        self.k = k if isinstance(k, CodedRows) else k.to(dtype)
        self.v = v if isinstance(v, CodedRows) else v.to(dtype)
        self.pos = pos.to(torch.int32) if self.k_coded else None          # [U], only to re-apply RoPE
        self.num_rows = pos.shape[0]

    @property
    def k_coded(self) -> bool:
        return isinstance(self.k, CodedRows)

    @property
    def v_coded(self) -> bool:
        return isinstance(self.v, CodedRows)

    @classmethod
    def build(cls, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype,
              rope: tuple[torch.Tensor, float], theta_k: float, theta_v: float,
              weight: torch.Tensor | None = None) -> "CodebookGroup":
        """Both tensors coded. k_post, v: [U, D]; pos: [U]; weight: [U] how many query heads kept
        each token (GQA dedup)."""
        k_pre = unrotate_rope(k_post.float(), pos, *rope)                   # codebooks work pre-RoPE
        return cls(CodedRows.build(k_pre, theta_k, weight, dtype), CodedRows.build(v.float(), theta_v, weight, dtype),
                   pos, dtype, rope)

    @property
    def num_tokens(self) -> int:
        return self.num_rows

    def append(self, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k_post, v: [T_new, D]; pos: [T_new]."""
        if self.k_coded:
            self.k.append(unrotate_rope(k_post.float(), pos, *self.rope))
            self.pos = torch.cat([self.pos, pos.to(torch.int32)])
        else:
            self.k = torch.cat([self.k, k_post.to(self.dtype)])
        if self.v_coded:
            self.v.append(v.float())
        else:
            self.v = torch.cat([self.v, v.to(self.dtype)])
        self.num_rows += pos.shape[0]

    def keys(self, dtype: torch.dtype) -> torch.Tensor:
        """-> post-RoPE K [U, D] (coded: RoPE re-applied at each token's own position)."""
        if not self.k_coded:
            return self.k.to(dtype)
        return reconstruct(self.k.c, self.k.ref, self.k.mag, self.pos, self.rope[0], self.rope[1], out_dtype=dtype)

    def materialize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> post-RoPE K, V: [U, D] (inspection and tests; attention never builds V)."""
        v = reconstruct(self.v.c, self.v.ref, self.v.mag, out_dtype=dtype) if self.v_coded else self.v.to(dtype)
        return self.keys(dtype), v

    def attend(self, q: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """q: [h_n, Tq, D]; mask: [h_n, Tq, U] bool (True = seen) or None -> [h_n, Tq, D].
        Coded values are never rebuilt: the attention weights, times each token's V magnitude,
        are summed per codebook entry and multiply the entries (spec §7.3), U scalars instead of
        U rows."""
        hn, tq, d = q.shape
        if not self.v_coded:
            return group_attention(q, self.keys(q.dtype), self.v.to(q.dtype), mask, scaling)
        logits = torch.matmul(q, self.keys(q.dtype).T).mul_(scaling)                          # [h_n, Tq, U]
        if mask is not None:
            logits.masked_fill_(~mask, float("-inf"))
        w = torch.softmax(logits, dim=-1).mul_(self.v.mag.to(q.dtype)).view(hn * tq, -1)     # [h_n Tq, U]
        per_entry = q.new_zeros(hn * tq, self.v.c.shape[0]).index_add_(1, self.v.ref.long(), w)
        return (per_entry @ self.v.c.to(q.dtype)).view(hn, tq, d)

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.k, self.v]
        held = [t for p in parts for t in (p.tensors() if isinstance(p, CodedRows) else [p])]
        return held + ([self.pos] if self.pos is not None else [])

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows join in turn: each row at most a new
        entry, an index and a magnitude per coded part (a dense row per dense part), the key's
        position; every index widened to int32."""
        now = sum(t.nbytes for t in self.tensors())
        added, d = sum(adds), (self.k if not self.k_coded else self.k.c).shape[-1]
        widen = sum(3 * (p.ref.shape[0] + added) for p in (self.k, self.v) if isinstance(p, CodedRows))
        return now + added * cost.coded_row_bytes(d, self.dtype.itemsize) + widen
