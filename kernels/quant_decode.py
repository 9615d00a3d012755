"""Decode attention of a KV group's query heads over its KIVI-quantized rows, fused for the CPU:
the packed codes are read once, in place — keys scored with the scale folded into the query and
the zero into one bias per key group, values summed with the probability folded into each
token's scale — never a dequantized copy of K or V. At batch on this CPU decode is bound by the
rows the step touches; the torch composition (`quant_attend_reference`) makes a float copy of
every code at every step, which costs several times the arithmetic.

    kernel      numba (LLVM), one specialization per (bits, g, g_v, D, h) compiled at first use;
                the constants let LLVM vectorize the unpacking and the h-way FMAs (AVX-512 here); each
                pass takes one code position of every byte, accumulated in that permuted order
    launcher    `QuantRows`: a group's quantized rows checked once and held as zero-copy views (the
                kernel converts fp16 itself) until a flush; `attend_groups_cpu` runs every KV group
                of a layer in one call, adding the queries, the few tail rows (as fp32), the masks
    reference   `quant_attend_reference`: the same math in plain torch

Layout (`executor.layers.quant.QuantGroup`): keys per channel in groups of g tokens, values per
token in runs of g_v channels, codes packed low bits first; the newest R rows dense.
Shapes: h query heads; n key groups; Q = n·g quantized rows; R tail rows; U = Q + R; D head dim."""
from __future__ import annotations

import math

import numpy as np
import torch

from kernels.quant import per_byte, quantize_pack_reference, unpack_dequantize_reference as unpack_dequantize

_KERNELS: dict[tuple[int, int, int, int, int], object] = {}


try:
    import numba  # noqa: F401  (the kernel needs it)
    HAS_NUMBA = True
except ImportError:            # the reference serves
    HAS_NUMBA = False


class QuantRows:
    """One KV group's quantized rows as the decode kernel reads them: checked once and held as
    zero-copy numpy views (fp16 as its bits) until the rows change — a flush makes a new one."""

    def __init__(self, k_codes: torch.Tensor,  # [n, D, g·b/8] uint8: keys per channel in groups of g tokens
                 k_scale: torch.Tensor,        # [n, D] fp16
                 k_zero: torch.Tensor,         # [n, D] fp16
                 v_codes: torch.Tensor,        # [Q = n·g, D·b/8] uint8: values per token
                 v_scale: torch.Tensor,        # [Q, D/g_v] fp16
                 v_zero: torch.Tensor,         # [Q, D/g_v] fp16
                 bits: int):
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
        if k_codes.dim() != 3 or v_codes.dim() != 2 or k_codes.dtype != torch.uint8 or v_codes.dtype != torch.uint8:
            raise ValueError(f"k_codes must be uint8 [n, D, B] and v_codes uint8 [Q, B], got {k_codes.dtype} "
                             f"{list(k_codes.shape)} and {v_codes.dtype} {list(v_codes.shape)}")
        n, d, g = k_codes.shape[0], k_codes.shape[1], k_codes.shape[2] * per_byte(bits)
        q_rows = v_codes.shape[0]
        if v_codes.shape[1] * per_byte(bits) != d or q_rows != n * g or not v_scale.shape[1] or d % v_scale.shape[1]:
            raise ValueError(f"codes do not match: k_codes {list(k_codes.shape)}, v_codes {list(v_codes.shape)}, "
                             f"v_scale {list(v_scale.shape)} at {bits} bits")
        if tuple(k_scale.shape) != (n, d) or k_zero.shape != k_scale.shape or v_scale.shape != v_zero.shape \
                or v_scale.shape[0] != q_rows:
            raise ValueError(f"scales and zeros must be k [{n}, {d}], v [{q_rows}, D/g_v]; got {list(k_scale.shape)}, "
                             f"{list(k_zero.shape)}, {list(v_scale.shape)}, {list(v_zero.shape)}")
        if any(t.dtype != torch.float16 for t in (k_scale, k_zero, v_scale, v_zero)):
            raise ValueError("scales and zeros must be fp16")
        self.tensors = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
        self.bits, self.g, self.gv, self.d, self.rows = bits, g, d // v_scale.shape[1], d, q_rows
        self.on_cpu = not k_codes.is_cuda
        self._arrays: tuple | None = None

    def check(self, q: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, mask: torch.Tensor | None) -> None:
        """q [h, D]; tails [R, D]; mask [h, Q + R] bool or None — else ValueError naming it."""
        d = self.d
        if q.dim() != 2 or q.shape[1] != d:
            raise ValueError(f"q must be [h, {d}], got {list(q.shape)}")
        if k_tail.shape != v_tail.shape or k_tail.dim() != 2 or k_tail.shape[1] != d:
            raise ValueError(f"tails must both be [R, {d}], got {list(k_tail.shape)} and {list(v_tail.shape)}")
        u = self.rows + k_tail.shape[0]
        if mask is not None and (tuple(mask.shape) != (q.shape[0], u) or mask.dtype != torch.bool):
            raise ValueError(f"mask must be bool [{q.shape[0]}, {u}], got {mask.dtype} {list(mask.shape)}")

    def arrays(self) -> tuple:
        """The rows as the kernel reads them (zero-copy views, made once)."""
        if self._arrays is None:
            kc, ks, kz, vc, vs, vz = self.tensors
            self._arrays = (kc.contiguous().numpy(), _bits16(ks), _bits16(kz), vc.contiguous().numpy(), _bits16(vs),
                            _bits16(vz))
        return self._arrays

    def attend_reference(self, q, k_tail, v_tail, mask, scaling: float) -> torch.Tensor:
        return quant_attend_reference(q, *self.tensors, k_tail, v_tail, mask, self.bits, scaling)


def attend_groups_cpu(rows: list[QuantRows], q: torch.Tensor, k_tails: list, v_tails: list, masks: list | None,
                      scaling: float) -> torch.Tensor:        # [G, h, D] fp32
    """The fused kernel over G groups of one layer at once (arguments as `QuantRows.check` accepts
    them, the groups alike in bits, g, g_v and D): q [G, h, D]; a tail pair and a mask (or None)
    per group."""
    first = rows[0]
    n_groups, h, d = q.shape
    key = (first.bits, first.g, first.gv, d, h)
    kern = _KERNELS.get(key) or _KERNELS.setdefault(key, _build(*key))
    kc, ks, kz, vc, vs, vz = zip(*(r.arrays() for r in rows))
    out = np.empty((n_groups, h, d), dtype=np.float32)
    seen = (_ALL_SEEN,) * n_groups if masks is None else tuple(m.contiguous().numpy() for m in masks)
    kern(q.float().contiguous().numpy(), kc, ks, kz, vc, vs, vz, tuple(_f32(t) for t in k_tails),
         tuple(_f32(t) for t in v_tails), seen, masks is not None, np.float32(scaling), out)
    return torch.from_numpy(out)


_ALL_SEEN = np.ones((1, 1), dtype=np.bool_)


def warm(head_dim: int, heads: int, bits=(2, 4, 8), group: int = 32) -> None:
    """Compile the kernels a service will run (a few seconds each), before the first job needs them."""
    if not HAS_NUMBA:
        return
    for b in bits:
        key = (b, group, math.gcd(group, head_dim), head_dim, heads)
        if key not in _KERNELS:
            _KERNELS[key] = _build(*key)
            rows = torch.zeros(group, head_dim)                 # on the CPU: the reference packs it
            kc, ks, kz = quantize_pack_reference(rows.T.contiguous(), b, group)
            vc, vs, vz = quantize_pack_reference(rows, b, key[2])
            r = QuantRows(kc.view(1, head_dim, -1), ks.view(1, head_dim), kz.view(1, head_dim), vc, vs, vz, b)
            attend_groups_cpu([r], torch.zeros(1, heads, head_dim), [rows[:1]], [rows[:1]], None, 1.0)


def _f32(x: torch.Tensor) -> np.ndarray:
    return x.float().contiguous().numpy()


def _bits16(x: torch.Tensor) -> np.ndarray:
    """An fp16 tensor's bits as uint16, zero-copy (numba has no fp16: the kernel converts)."""
    return x.contiguous().view(torch.uint16).numpy()


def quant_attend_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_tail, v_tail, mask, bits: int,
                           scaling: float) -> torch.Tensor:
    """What the kernel computes, in plain torch (dequantized copies of K and V). -> [h, D] fp32"""
    n, d = k_codes.shape[0], q.shape[1]
    g = k_codes.shape[2] * per_byte(bits)
    gv = d // v_scale.shape[1]
    k = unpack_dequantize(k_codes.reshape(n * d, -1), k_scale.reshape(-1, 1), k_zero.reshape(-1, 1), bits, g)
    k = torch.cat([k.view(n, d, g).transpose(1, 2).reshape(n * g, d), k_tail.float()])            # [U, D]
    v = torch.cat([unpack_dequantize(v_codes, v_scale, v_zero, bits, gv), v_tail.float()])          # [U, D]
    scores = (q.float() @ k.T) * scaling                                                           # [h, U]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _build(bits: int, g: int, gv: int, d: int, h: int):
    """The kernel for one (bits, g, g_v, D, h): numba source written with every size a constant and
    the h query heads unrolled (one accumulator each), so that LLVM vectorizes each inner loop
    over a key group's g tokens or a token's g_v channels, unpacking each byte's codes in place."""
    from numba import njit

    src = "\n".join(_source(bits, g, gv, d, h))
    scope = {"np": np, "math": math, "half": _half()}
    exec(compile(src, f"<quant_attend {bits}b g{g} gv{gv} d{d} h{h}>", "exec"), scope)   # noqa: S102 (our own source)
    one = njit(fastmath=True, nogil=True, boundscheck=False)(scope["kernel"])

    @njit(nogil=True, boundscheck=False)
    def groups(q, kc, ks, kz, vc, vs, vz, kt, vt, seen, masked, scaling, out):
        """Every KV group of a layer in one call: q, out [G, h, D]; the rest G-tuples of arrays."""
        for i in range(len(kc)):
            one(q[i], kc[i], ks[i], kz[i], vc[i], vs[i], vz[i], kt[i], vt[i], seen[i], masked, scaling, out[i])

    return groups


_HALF = []


def _half():
    """numba: fp16 bits [N, M] uint16 -> [N, M] fp32 (normals, subnormals, inf and NaN)."""
    if not _HALF:
        from numba import njit

        @njit(fastmath=False, nogil=True, boundscheck=False)
        def half(x):
            out = np.empty(x.shape, dtype=np.uint32)
            flat, bits = x.ravel(), out.ravel()
            for i in range(flat.size):
                u = np.uint32(flat[i])
                sign, e, m = (u >> 15) << 31, (u >> 10) & 0x1F, u & 0x3FF
                if e == 0x1F:
                    bits[i] = sign | 0x7F800000 | (m << 13)
                elif e != 0:
                    bits[i] = sign | ((e + 112) << 23) | (m << 13)
                elif m == 0:
                    bits[i] = sign
                else:                                   # subnormal: normalize the mantissa
                    e = np.uint32(113)
                    while (m & 0x400) == 0:
                        m <<= 1
                        e -= 1
                    bits[i] = sign | (e << 23) | ((m & 0x3FF) << 13)
            return out.view(np.float32)
        _HALF.append(half)
    return _HALF[0]


def _code(byte: str, p: int, bits: int, mask: int) -> str:
    """The expression of code p (low bits first) of `byte`, as fp32."""
    if bits == 8:
        return f"np.float32({byte})"
    return f"np.float32((np.int32({byte}) >> {p * bits}) & {mask})"


def _source(bits: int, g: int, gv: int, d: int, h: int) -> list[str]:
    per, mask, nv, hs = 8 // bits, (1 << bits) - 1, d // gv, range(h)
    L = ["def kernel(q, kc, ks16, kz16, vc, vs16, vz16, kt, vt, seen, masked, scaling, out):",
         "    ks = half(ks16); kz = half(kz16); vs = half(vs16); vz = half(vz16)",
         "    n = kc.shape[0]; Q = vc.shape[0]; R = kt.shape[0]; U = Q + R",
         f"    scores = np.empty(({h}, U), dtype=np.float32)"]
    L += [f"    acc{i} = np.empty({g}, dtype=np.float32)" for i in hs]
    # keys, per key group j: acc_h[i] = sum_d (q_hd s_jd) code_jdi + sum_d q_hd z_jd
    L += ["    for j in range(n):"] + [f"        b{i} = np.float32(0.0)" for i in hs]
    L += [f"        for dd in range({d}):", "            zj = kz[j, dd]"] + [f"            b{i} += q[{i}, dd] * zj" for i in hs]
    L += [f"        for i in range({g}):"] + [f"            acc{i}[i] = b{i}" for i in hs]
    L += [f"        for dd in range({d}):", "            row = kc[j, dd]", "            sj = ks[j, dd]"]
    L += [f"            w{i} = q[{i}, dd] * sj" for i in hs]
    for p in range(per):      # code p of every byte: one contiguous pass, accumulated in the permuted order
        L += [f"            for k in range({g // per}):", f"                x = {_code('row[k]', p, bits, mask)}"]
        L += [f"                acc{i}[{p * (g // per)} + k] += w{i} * x" for i in hs]
    L += [f"        for k in range({g // per}):"]
    L += [f"            scores[{i}, j * {g} + k * {per} + {p}] = acc{i}[{p * (g // per)} + k] * scaling"
          for i in hs for p in range(per)]
    # the dense tail
    L += ["    for t in range(R):"] + [f"        s{i} = np.float32(0.0)" for i in hs]
    L += [f"        for dd in range({d}):", "            x = kt[t, dd]"] + [f"            s{i} += q[{i}, dd] * x" for i in hs]
    L += [f"        scores[{i}, Q + t] = s{i} * scaling" for i in hs]
    # softmax per head (masked columns first)
    L += [f"    for hh in range({h}):",
          "        if masked:",
          "            for t in range(U):",
          "                if not seen[hh, t]:",
          "                    scores[hh, t] = -np.inf",
          "        m = np.float32(-np.inf)",
          "        for t in range(U):",
          "            m = max(m, scores[hh, t])",
          "        tot = np.float32(0.0)",
          "        for t in range(U):",
          "            e = np.float32(math.exp(scores[hh, t] - m))",
          "            scores[hh, t] = e",
          "            tot += e",
          "        inv = np.float32(1.0) / tot",
          "        for t in range(U):",
          "            scores[hh, t] *= inv"]
    # values, per token: o_h[k] += (p_ht s_tc) code_tk; the zeros summed apart per channel run
    L += [f"    o{i} = np.zeros({d}, dtype=np.float32)" for i in hs]
    L += [f"    z = np.zeros(({h}, {nv}), dtype=np.float32)", "    for t in range(Q):", "        row = vc[t]"]
    L += [f"        p{i} = scores[{i}, t]" for i in hs]
    L += [f"        for c in range({nv}):", "            s = vs[t, c]", "            zz = vz[t, c]"]
    L += [f"            w{i} = p{i} * s" for i in hs] + [f"            z[{i}, c] += p{i} * zz" for i in hs]
    for p in range(per):      # o{i} in the permuted order too: channel k * per + p at p * D / per + k
        L += [f"            for k in range(c * {gv // per}, (c + 1) * {gv // per}):",
              f"                x = {_code('row[k]', p, bits, mask)}"]
        L += [f"                o{i}[{p * (d // per)} + k] += w{i} * x" for i in hs]
    L += ["    for t in range(R):"] + [f"        p{i} = scores[{i}, Q + t]" for i in hs]
    L += [f"        for k in range({d // per}):"]
    L += [f"            o{i}[{p * (d // per)} + k] += p{i} * vt[t, k * {per} + {p}]" for i in hs for p in range(per)]
    L += [f"    for k in range({d // per}):"]
    L += [f"        out[{i}, k * {per} + {p}] = o{i}[{p * (d // per)} + k] + z[{i}, (k * {per} + {p}) // {gv}]"
          for i in hs for p in range(per)]
    return L
