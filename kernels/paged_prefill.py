"""Prefill attention over the engine's paged pool: a step's query rows of S segments (prompt chunks
of S sequences, packed), each attending causally to its own streams' dense rows — the context
already stored and the step's new rows, which are written into the pool before attention runs.

The pool (`kvcore.blocks`): one uint8 arena of pages of P = 2·R·D·2 bytes; a dense page holds R K
rows [R, D] fp16 then R V rows [R, D] fp16. A stream (one KV head of one layer of one sequence)
holds its rows 0, 1, … at pages table[0], table[1], … (row r in page table[r // R], slot r % R).

    kernels     Triton on CUDA (`_paged_prefill_kernel`: flash-style, one program per block of a
                segment's query rows and query head, online softmax over key blocks gathered from
                the pages, fp32 accumulation; bf16/fp16 queries multiply the fp16 keys in fp16 on
                the tensor cores — exact for |q| < 65,504 — fp32 ones in fp32; the grid depends on
                shapes alone) and C++ on the CPU
                (`paged_prefill` of the `kernels.cpu_extension` module, where it exports one)
    launcher    `paged_prefill`: checks shapes and dtypes (ValueError naming the argument), picks
                the kernel for the device
    reference   `paged_prefill_reference`: the same math in plain torch, segment by segment

Query row j of segment s (rows q_start[s] .. q_start[s + 1] - 1, n_s of them; q_start rises from 0
to N) sits at position kv_len[s] - n_s + j and sees rows 0..that position of its KV head; query
head h reads KV head h // (H / H_kv). kv_len[s] >= n_s and the table holds kv_len[s] rows; the
kernels take these as given (reading them back would sync a CUDA step), the reference checks them.

Shapes: N packed query rows, H query heads, H_kv KV heads, D head dim, S segments, MB table width."""
from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels._triton import HAS_TRITON, pow2_at_least, require_triton, tl, triton
from kernels.backend import backend

Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REF_CHUNK = 256         # query rows the reference scores at a time (bounds its [H, chunk, kv_len] logits)
BLOCK_M, BLOCK_N = 64, 64   # query rows and key rows a Triton program takes at a time (CUDA)


def paged_prefill_reference(q: torch.Tensor, arena: torch.Tensor, table: torch.Tensor, kv_len: torch.Tensor,
                            q_start: torch.Tensor, page_rows: int, scaling: float) -> torch.Tensor:
    """q [N, H, D] -> [N, H, D] in q's dtype: each segment's rows' causal softmax(q·kᵀ·scaling)·v over
    their streams' rows, in fp32. It reads the values back (so it checks them: q_start rising from 0
    to N, no segment with more query rows than kv_len); the kernels take them as given."""
    n, h, d = q.shape
    hk, r = table.shape[1], page_rows
    rows = arena.view(torch.float16).view(-1, d)                                 # [pages·2R, D]: K rows, then V rows
    out = torch.empty(n, h, d, dtype=torch.float32, device=q.device)
    lens, starts = kv_len.tolist(), q_start.tolist()
    if starts[0] != 0 or starts[-1] != n or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"q_start must rise from 0 to {n} (the packed rows), got {starts}")
    for s, length in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        if b - a > length:
            raise ValueError(f"segment {s}: {b - a} query rows but kv_len {length}")
        at = torch.arange(length, device=table.device)
        first = (table[s, :, at // r].long() * (2 * r) + at % r).to(arena.device)    # [H_kv, L] K row indices
        k, v = rows[first].float().to(q.device), rows[first + r].float().to(q.device)   # [H_kv, L, D]
        qs = q[a:b].float().transpose(0, 1).reshape(hk, (h // hk) * (b - a), d)     # [H_kv, g·n, D] (head-major)
        for c0 in range(0, b - a, REF_CHUNK):
            c1 = min(c0 + REF_CHUNK, b - a)
            qc = qs.view(hk, h // hk, b - a, d)[:, :, c0:c1].reshape(hk, -1, d)     # [H_kv, g·c, D]
            logits = torch.bmm(qc, k.transpose(1, 2)) * scaling                      # [H_kv, g·c, L]
            pos = torch.arange(length - (b - a) + c0, length - (b - a) + c1, device=q.device)
            seen = at.to(q.device)[None, :] <= pos[:, None]                          # [c, L]
            logits = logits.view(hk, h // hk, c1 - c0, length).masked_fill(~seen, float("-inf"))
            o = torch.matmul(torch.softmax(logits, -1), v[:, None])                  # [H_kv, g, c, D]
            out[a + c0:a + c1] = o.reshape(h, c1 - c0, d).transpose(0, 1)
    return out.to(q.dtype)


def _check(q, arena, table, kv_len, q_start, page_rows) -> None:
    if q.dim() != 3 or q.dtype not in Q_DTYPES or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous fp32/bf16/fp16 [N, H, D], got {q.dtype} {list(q.shape)}"
                         f"{'' if q.is_contiguous() else ' (not contiguous)'}")
    n, h, d = q.shape
    if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() % (2 * d):
        raise ValueError(f"arena must be uint8 [bytes] of whole fp16 rows of {d}, got {arena.dtype} {list(arena.shape)}")
    if table.dtype != torch.int32 or table.dim() != 3 or not table.shape[1] or h % table.shape[1]:
        raise ValueError(f"table must be int32 [S, H_kv, MB] with H_kv dividing {h} query heads, "
                         f"got {table.dtype} {list(table.shape)}")
    s = table.shape[0]
    if kv_len.dtype != torch.int32 or tuple(kv_len.shape) != (s,):
        raise ValueError(f"kv_len must be int32 [{s}], got {kv_len.dtype} {list(kv_len.shape)}")
    if q_start.dtype != torch.int32 or tuple(q_start.shape) != (s + 1,):
        raise ValueError(f"q_start must be int32 [{s + 1}], got {q_start.dtype} {list(q_start.shape)}")
    if not isinstance(page_rows, int) or page_rows < 1:
        raise ValueError(f"page_rows must be a positive int, got {page_rows!r}")
    if q.is_cuda:
        for name, t in (("arena", arena), ("table", table), ("kv_len", kv_len), ("q_start", q_start)):
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q on {q.device}: a CUDA step keeps them on one device")


def fast(device: torch.device) -> bool:
    """Whether a kernel (not the reference) serves this device: Triton on CUDA, the C++ one on the CPU
    (`kernels.backend` decides)."""
    kind = backend(device)
    return kind == "triton" or kind == "cpp" and hasattr(cpu_extension.module(), "paged_prefill")


def paged_prefill(q: torch.Tensor, arena: torch.Tensor, table: torch.Tensor, kv_len: torch.Tensor,
                  q_start: torch.Tensor, page_rows: int, scaling: float) -> torch.Tensor:
    """q [N, H, D] contiguous; arena [bytes] u8; table [S, H_kv, MB], kv_len [S], q_start [S + 1] (int32)
    -> [N, H, D] in q's dtype. Triton on CUDA, the C++ kernel on the CPU where built, else the reference."""
    _check(q, arena, table, kv_len, q_start, page_rows)
    kind = backend(q.device)
    if kind == "triton":
        return paged_prefill_triton(q, arena, table, kv_len, q_start, page_rows, scaling)
    ext = cpu_extension.module() if kind == "cpp" else None
    if ext is not None and hasattr(ext, "paged_prefill"):
        return ext.paged_prefill(q, arena, table.contiguous(), kv_len.contiguous(), q_start.contiguous(), page_rows,
                                 float(scaling))
    return paged_prefill_reference(q, arena, table, kv_len, q_start, page_rows, scaling)


if HAS_TRITON:

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr,        # [N, H, D] contiguous (fp32, bf16 or fp16)
        arena_ptr,    # [bytes] uint8: pages of R K rows then R V rows, fp16
        out_ptr,      # [N, H, D] contiguous, q's dtype
        table_ptr,    # [S, H_kv, MB] int32 contiguous
        len_ptr,      # [S] int32
        qs_ptr,       # [S + 1] int32
        S, MB, qk_scale,              # qk_scale: the softmax scale times log2(e) (the kernel exponentiates in base 2)
        H: tl.constexpr, HKV: tl.constexpr,
        D: tl.constexpr, DP: tl.constexpr,    # head dim, and it rounded up to a power of two (>= 16)
        R: tl.constexpr,                      # rows a page holds
        SP: tl.constexpr,                     # S + 1 rounded up to a power of two
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        LOWP: tl.constexpr,                   # products in fp16 (q is bf16/fp16), else fp32 (q is fp32)
    ):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        # which segment's which query block: block counts of every segment, prefix-summed
        i = tl.arange(0, SP)
        lo = tl.load(qs_ptr + i, mask=i < S, other=0)
        hi_ = tl.load(qs_ptr + i + 1, mask=i < S, other=0)
        nb = (hi_ - lo + BLOCK_M - 1) // BLOCK_M                        # [SP], 0 past S
        ends = tl.cumsum(nb, 0)
        seg = tl.sum((ends <= pid).to(tl.int32), 0)                    # S or more: a spare program
        local = pid - tl.sum(tl.where(i < seg, nb, 0), 0)
        live = seg < S
        sc = tl.minimum(seg, S - 1)
        q0 = tl.load(qs_ptr + sc)
        n_s = tl.load(qs_ptr + sc + 1) - q0
        length = tl.load(len_ptr + sc)
        m = local * BLOCK_M + tl.arange(0, BLOCK_M)
        mvalid = m < tl.where(live, n_s, 0)
        pos = length - n_s + m                                          # [BLOCK_M] each row's position
        stop = tl.where(live, length - n_s + tl.minimum(local * BLOCK_M + BLOCK_M, n_s), 0)   # keys [0, stop)
        dd = tl.arange(0, DP)
        dmask = dd < D
        qrow = (q0 + m).to(tl.int64) * (H * D) + h * D
        q = tl.load(q_ptr + qrow[:, None] + dd[None, :], mask=mvalid[:, None] & dmask[None, :], other=0.0)
        if LOWP:
            q = q.to(tl.float16)
        else:
            q = q.to(tl.float32)
        half = arena_ptr.to(tl.pointer_type(tl.float16))
        trow = (sc * HKV + h // (H // HKV)).to(tl.int64) * MB          # this stream's table row
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        for n0 in range(0, stop, BLOCK_N):
            kr = n0 + tl.arange(0, BLOCK_N)
            kvalid = (kr < stop) & (kr // R < MB)
            page = tl.load(table_ptr + trow + kr // R, mask=kvalid, other=0).to(tl.int64)
            at = page * (2 * R * D) + (kr % R) * D                      # [BLOCK_N] first fp16 of each K row
            kt = tl.load(half + at[None, :] + dd[:, None], mask=kvalid[None, :] & dmask[:, None],
                         other=0.0)                                                        # [DP, BLOCK_N]
            v = tl.load(half + at[:, None] + R * D + dd[None, :], mask=kvalid[:, None] & dmask[None, :],
                        other=0.0)                                                         # [BLOCK_N, DP]
            if LOWP:
                s = tl.dot(q, kt)
            else:
                s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
            s = s * qk_scale
            seen = (kr[None, :] <= pos[:, None]) & kvalid[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # a row that has seen no key yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if LOWP:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + qrow[:, None] + dd[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=mvalid[:, None] & dmask[None, :])


LOG2E = 1.4426950408889634


def paged_prefill_triton(q: torch.Tensor, arena: torch.Tensor, table: torch.Tensor, kv_len: torch.Tensor,
                         q_start: torch.Tensor, page_rows: int, scaling: float, block_m: int = BLOCK_M,
                         block_n: int = BLOCK_N, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """The Triton kernel (CUDA, or anywhere under TRITON_INTERPRET=1), arguments as `paged_prefill`
    (checked here too). Grid: (ceil(N / block_m) + S, H) programs — every segment's query blocks fit
    in it whatever the split of N — so nothing is read back from the device to launch it."""
    require_triton()
    _check(q, arena, table, kv_len, q_start, page_rows)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's tiles), got {b}")
    n, h, d = q.shape
    out = torch.empty_like(q)
    s = table.shape[0]
    if n == 0 or s == 0:
        return out.zero_()
    table = table if table.is_contiguous() else table.contiguous()
    grid = (triton.cdiv(n, block_m) + s, h)
    _paged_prefill_kernel[grid](
        q, arena, out, table, kv_len, q_start, s, table.shape[2], float(scaling) * LOG2E,
        H=h, HKV=table.shape[1], D=d, DP=pow2_at_least(d, 16), R=page_rows, SP=pow2_at_least(s + 1),
        BLOCK_M=block_m, BLOCK_N=block_n, LOWP=q.dtype != torch.float32, num_warps=num_warps, num_stages=num_stages)
    return out
