"""SpeCache's executor-resident low-bit copy of one layer (all its KV heads at once).

KIVI form: K quantized per channel (each run of g consecutive tokens shares one fp16 scale and
zero per channel), V per token (runs of g_v channels), codes packed into uint8; at 1 bit the
midpoint quantizer (SpeCache's fix: levels (3·min+max)/4 and (min+3·max)/4). Key groups then get
`KEY_REFINE` least-squares refits of their scale and zero (`kernels.quant`; same storage, same
scoring kernel): on SmolLM2's keys at 2k tokens (three prompts, every layer, the question's
queries) the error of attention with the top-32 rows exact and the rest low-bit fell from 0.089
to 0.042 (2-bit) and from 0.158 to 0.096 (1-bit), and the top-32 found among the low-bit top-128
rose from 0.978 to 0.983 (2-bit) / 0.842 to 0.865 (1-bit). Values keep min/max: refitting a
token's group of channels clips its outlier channels, a bias the attention's sum keeps (the
same error measure rose, 0.042 -> 0.051 at 2 bits). The newest rows
stay in the storage dtype, as in KIVI: values in a sliding window of `residual` rows (an older
row is quantized as soon as it leaves it), keys until a whole group of g rows lies past the
window. `seal()` — called at the end of a prefill call — quantizes all but the newest `residual`
keys too, the last, partial key group padded with copies of its last row (the padded rows are
held, so counted, and dropped on dequantization); so after a prefill both tails hold `residual`
rows and during decode the key tail fewer than `residual + g`.

Row r of the quantized parts is the token at position r (every token is kept, in order).

Shapes: H KV heads, Qk / Qv quantized key / value rows, n key groups (n·g >= Qk with padding),
D head dim."""
from __future__ import annotations

import math

import torch

from kernels import lowbit_scores, quantize_pack, unpack_dequantize


KEY_REFINE = 3        # least-squares refits of each key group's scale and zero


def _quantize(x: torch.Tensor, bits: int, group: int, refine: int = 0):
    """x: [N, L] -> codes [N, L·b/8], scale, zero [N, L/g]; the midpoint quantizer at 1 bit."""
    return quantize_pack(x, bits, group, midpoint=bits == 1, refine=refine)


class LowBitKV:
    def __init__(self, k: torch.Tensor, v: torch.Tensor, bits: int, group: int, residual: int,
                 dtype: torch.dtype = torch.float16, value_group: int | None = None):
        """k, v: [H, T, D] post-RoPE keys and values of every token so far. value_group: channels
        sharing a value scale (default: `group`), capped at the head dim's divisors."""
        h, _, d = k.shape
        self.bits, self.group, self.residual = bits, group, residual
        self.v_group = math.gcd(value_group or group, d)
        kb = group * bits // 8
        dev = k.device
        self.k_codes = torch.empty(h, 0, d, kb, dtype=torch.uint8, device=dev)             # [H, n, D, g·b/8]
        self.k_scale = torch.empty(h, 0, d, dtype=torch.float16, device=dev)               # [H, n, D]
        self.k_zero = torch.empty(h, 0, d, dtype=torch.float16, device=dev)                # [H, n, D]
        self.v_codes = torch.empty(h, 0, d * bits // 8, dtype=torch.uint8, device=dev)     # [H, Qv, D·b/8]
        self.v_scale = torch.empty(h, 0, d // self.v_group, dtype=torch.float16, device=dev)   # [H, Qv, D/g_v]
        self.v_zero = torch.empty(h, 0, d // self.v_group, dtype=torch.float16, device=dev)
        self.pads: list[tuple[int, int]] = []     # (key group, valid rows) of padded key groups
        self._columns: tuple[int, torch.Tensor] | None = None      # (key groups, their valid score columns)
        self.k_rows = 0                           # Qk: keys in low-bit form
        self.k_tail, self.v_tail = k.to(dtype), v.to(dtype)                                   # [H, N - Qk|Qv, D]
        self._quantize_values()

    @property
    def quantized(self) -> int:
        """Positions 0..Q-1 whose key or value is low-bit (the prefetch candidates): values
        leave the window first, so these are the low-bit values' rows."""
        return max(self.k_rows, self.v_codes.shape[1])

    @property
    def tail(self) -> int:
        """Newest keys in the storage dtype."""
        return self.k_tail.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [H, T, D] the next T positions."""
        self.k_tail = torch.cat([self.k_tail, k.to(self.k_tail.dtype)], dim=1)
        self.v_tail = torch.cat([self.v_tail, v.to(self.v_tail.dtype)], dim=1)
        whole = (self.tail - self.residual) // self.group * self.group
        if whole > 0:
            self._quantize_keys(whole)
        self._quantize_values()

    def seal(self) -> None:
        """Quantize every key but the newest `residual` (end of a prefill call)."""
        m = self.tail - self.residual
        if m > 0:
            self._quantize_keys(m)

    def _quantize_keys(self, m: int) -> None:
        """The oldest m tail keys, per channel in groups of g tokens (the last one padded)."""
        h, _, d = self.k_tail.shape
        g, n = self.group, -(-m // self.group)
        k = self.k_tail[:, :m]                                                              # [H, m, D]
        if m % g:                                                   # pad the last key group with its last row
            self.pads.append((self.k_codes.shape[1] + n - 1, m % g))
            k = torch.cat([k, k[:, -1:].expand(h, n * g - m, d)], dim=1)
        rows = k.reshape(h, n, g, d).transpose(2, 3).reshape(h * n * d, g)                 # [H·n·D, g]
        codes, scale, zero = _quantize(rows, self.bits, g, KEY_REFINE)
        self.k_codes = torch.cat([self.k_codes, codes.view(h, n, d, -1)], dim=1)
        self.k_scale = torch.cat([self.k_scale, scale.view(h, n, d)], dim=1)
        self.k_zero = torch.cat([self.k_zero, zero.view(h, n, d)], dim=1)
        self.k_rows += m
        self.k_tail = self.k_tail[:, m:].clone()                  # clone: free the rows

    def _quantize_values(self) -> None:
        """Values older than the window, per token (KIVI's sliding value window)."""
        m = self.v_tail.shape[1] - self.residual
        if m <= 0:
            return
        h, _, d = self.v_tail.shape
        codes, scale, zero = _quantize(self.v_tail[:, :m].reshape(h * m, d), self.bits, self.v_group)
        self.v_codes = torch.cat([self.v_codes, codes.view(h, m, -1)], dim=1)
        self.v_scale = torch.cat([self.v_scale, scale.view(h, m, -1)], dim=1)
        self.v_zero = torch.cat([self.v_zero, zero.view(h, m, -1)], dim=1)
        self.v_tail = self.v_tail[:, m:].clone()

    def rows(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> K, V [H, N, D] of every position in `dtype`: dequantized rows, then the tails, each
        row written once into one buffer (decode scores keys from their codes: `key_scores`)."""
        h, n, d, kb = self.k_codes.shape
        g, qk = self.group, self.k_rows
        k_out = torch.empty(h, qk + self.tail, d, dtype=dtype, device=self.k_tail.device)
        v_out = torch.empty_like(k_out)
        k = unpack_dequantize(self.k_codes.reshape(h * n * d, kb), self.k_scale.reshape(-1, 1),
                              self.k_zero.reshape(-1, 1), self.bits, g, dtype).view(h, n, d, g)   # [H, n, D, g]
        at = 0
        for a, b, valid in self._key_runs(n):          # whole groups, then a padded group's valid rows
            part = k[:, a:b].transpose(2, 3)                                                 # [H, b-a, g, D]
            if valid is None:
                k_out[:, at:at + (b - a) * g].view(h, b - a, g, d).copy_(part)
                at += (b - a) * g
            else:
                k_out[:, at:at + valid].copy_(part[:, 0, :valid])
                at += valid
        k_out[:, qk:] = self.k_tail
        self._values_into(v_out, None)
        return k_out, v_out

    def values(self, dtype: torch.dtype, v_new: torch.Tensor | None = None) -> torch.Tensor:
        """-> V [H, N (+ T), D] of every position in `dtype` (then v_new [H, T, D] when given)."""
        h, qv, d = self.v_codes.shape[0], self.v_codes.shape[1], self.v_tail.shape[2]
        total = qv + self.v_tail.shape[1] + (0 if v_new is None else v_new.shape[1])
        return self._values_into(torch.empty(h, total, d, dtype=dtype, device=self.v_tail.device), v_new)

    def _values_into(self, v_out: torch.Tensor, v_new: torch.Tensor | None) -> torch.Tensor:
        h, qv, d = v_out.shape[0], self.v_codes.shape[1], v_out.shape[2]
        v_out[:, :qv].copy_(unpack_dequantize(self.v_codes.reshape(h * qv, -1), self.v_scale.reshape(h * qv, -1),
                                              self.v_zero.reshape(h * qv, -1), self.bits, self.v_group,
                                              v_out.dtype).view(h, qv, d))
        v_out[:, qv:qv + self.v_tail.shape[1]] = self.v_tail
        if v_new is not None:
            v_out[:, qv + self.v_tail.shape[1]:] = v_new
        return v_out

    def key_scores(self, q: torch.Tensor) -> torch.Tensor:
        """q: [H, R, D] -> q · K [H, R, N] fp32 over every stored position: the low-bit keys'
        scores straight from their codes (`kernels.lowbit_scores`, no dequantized copy), then
        the tail's."""
        scores = lowbit_scores(q, self.k_codes, self.k_scale, self.k_zero, self.bits)     # [H, R, n·g]
        if self.pads:
            scores = scores.index_select(-1, self._valid_columns())                      # [H, R, Qk]
        tail = torch.einsum("hrd,hld->hrl", q.float(), self.k_tail.float())              # [H, R, N - Qk]
        return torch.cat([scores, tail], dim=-1)

    def _valid_columns(self) -> torch.Tensor:
        """[Qk] the columns of `lowbit_scores`' n·g that are stored rows (padded rows left out)."""
        n, g = self.k_codes.shape[1], self.group
        if self._columns is None or self._columns[0] != n:
            dev = self.k_codes.device
            cols = [torch.arange(a * g, (b * g if valid is None else a * g + valid), device=dev)
                    for a, b, valid in self._key_runs(n)]
            self._columns = (n, torch.cat(cols) if cols else torch.empty(0, dtype=torch.long, device=dev))
        return self._columns[1]

    def _key_runs(self, n: int) -> list[tuple[int, int, int | None]]:
        """(first group, end group, valid rows of a padded group or None) covering n key groups."""
        runs, a = [], 0
        for group, valid in self.pads:
            if group > a:
                runs.append((a, group, None))
            runs.append((group, group + 1, valid))
            a = group + 1
        if n > a:
            runs.append((a, n, None))
        return runs

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                self.k_tail, self.v_tail]
