"""The cost model: bytes of each storage form of a KV cache layer at every step of a job.

Planner and executor both read it (neither imports the other): the executor's cache layers grow
their stores by its rules and bound their own growth with it, the engine reserves a job's bytes
with it, and a plan states its worst step with it (`plan_bytes`).

Every figure is for one sequence (batch 1) and an upper bound where the form depends on the
data (a codebook's entries, a merged pair's retained rows, the union a GQA `repeat` group
keeps); `itemsize` is the storage dtype's (2 for fp16, as a GPU deployment stores).

A job's steps: its prompt prefilled in chunks (the context, then the question), then one row per
generated token fed back (`job_adds`)."""
from __future__ import annotations

import math

import numpy as np

ROW_CHUNK = 16                  # rows a dense store grows by when decode outgrows it (held, so counted)
UINT8_ENTRIES, INT16_ENTRIES = 256, 32768      # most entries a uint8 / int16 index can address
POS_BYTES = 4                   # int32 position of a coded key
SCALE_BYTES = 2                 # fp16 scale and zero of a quantized group


def grown(capacity: int, used: int, m: int, chunk: int = ROW_CHUNK) -> int:
    """A store's capacity after `m` rows join `used` of `capacity`: unchanged while they fit,
    else grown by max(m, chunk) past the used rows."""
    return capacity if used + m <= capacity else used + max(m, chunk)


def capacities(capacity: int, used: int, adds, chunk: int = ROW_CHUNK) -> list[int]:
    """A dense store's capacity after each of `adds` (row counts), from (capacity, used)."""
    out = []
    for m in adds:
        capacity = grown(capacity, used, m, chunk)
        used += m
        out.append(capacity)
    return out


def held_after(appends: list[int], chunk: int = ROW_CHUNK) -> list[int]:
    """Rows held past an exactly sized store's first rows after each of `appends`: what a job's
    added rows cost, spare capacity included.  -> [len(appends)]"""
    return capacities(0, 0, appends, chunk)


def index_dtype_bytes(n: int) -> int:
    """Bytes of the smallest integer index that addresses n entries."""
    return 1 if n <= UINT8_ENTRIES else 2 if n <= INT16_ENTRIES else 4


def dense_row_bytes(head_dim: int, itemsize: int) -> int:
    """K and V of one token on one KV head, dense."""
    return 2 * head_dim * itemsize


def job_adds(context: int, suffix: int, new_tokens: int, chunk: int) -> tuple[list[int], list[int]]:
    """-> (the context's prefill chunks, the rows added after it: the question's chunks, then one
    per generated token fed back; the last one never is)."""
    ctx = [min(chunk, context - a) for a in range(0, context, chunk)]
    after = [min(chunk, suffix - a) for a in range(0, suffix, chunk)] + [1] * max(new_tokens - 1, 0)
    return ctx, after


TAIL_CHUNK = 8                  # rows a quant layer's dense tail storage grows by (held, so counted)


def quant_tail(tokens, residual: int, group: int):
    """Rows in a `quant` layer's dense tail with `tokens` stored (a number or an array): all of
    them until the tail reaches residual + group, then residual + (tokens - residual) mod group
    (whole groups of the oldest are quantized as it gets there)."""
    tokens = np.asarray(tokens)
    return np.where(tokens < residual + group, tokens, residual + (tokens - residual) % group)


def tail_storage_rows(rows, residual: int, group: int):
    """Rows the storage of a tail of `rows` rows holds (a number or an array): rounded up to a whole
    TAIL_CHUNK (decode rows are written in place, the storage grows a chunk at a time and is made
    anew at each flush), never more than residual + group - 1, the most the tail holds."""
    return np.minimum(-(-rows // TAIL_CHUNK) * TAIL_CHUNK, residual + group - 1)


def quant_tail_rows(tokens, residual: int, group: int):
    """Rows the tail's storage holds with `tokens` stored (`tail_storage_rows` of `quant_tail`)."""
    return tail_storage_rows(quant_tail(tokens, residual, group), residual, group)


def quant_bytes(tokens, bits: int, group: int, residual: int, head_dim: int, itemsize: int,
                value_group: int | None = None):
    """Bytes one KV group of a `quant` layer holds with `tokens` stored (a number or an array):
    whole groups of `group` quantized (K per channel, V per token, fp16 scales and zeros) once
    the tail passes `residual + group`, the tail's storage dense (`quant_tail_rows`)."""
    tokens = np.asarray(tokens)
    q = tokens - quant_tail(tokens, residual, group)
    gv = math.gcd(value_group or group, head_dim)
    k = q * head_dim * bits / 8 + (q // group) * head_dim * 2 * SCALE_BYTES
    v = q * (head_dim * bits / 8 + 2 * SCALE_BYTES * head_dim // gv)
    return quant_tail_rows(tokens, residual, group) * dense_row_bytes(head_dim, itemsize) + k + v


def lowbit_bytes(tokens: int, heads: int, head_dim: int, bits: int, group: int, residual: int, key_tail: int,
                 value_group: int | None = None, pads: int = 2, itemsize: int = 2) -> int:
    """Upper bound of a SpeCache low-bit copy's bytes holding `tokens` tokens, `key_tail` keys and
    `residual` values in the storage dtype, with at most `pads` padded key groups."""
    qk, qv = max(tokens - key_tail, 0), max(tokens - residual, 0)
    n = -(-qk // group) + pads
    k = n * head_dim * (group * bits // 8 + 2 * SCALE_BYTES)
    v = qv * (head_dim * bits // 8 + 2 * SCALE_BYTES * (head_dim // math.gcd(value_group or group, head_dim)))
    return heads * (k + v + (min(key_tail, tokens) + min(residual, tokens)) * head_dim * itemsize)


def offload_fixed_bytes(sinks: int, top_k: int, heads: int, head_dim: int, tokens: int, itemsize: int) -> int:
    """An offload layer's sink rows and prefetch buffer (rows + int16/int32 positions)."""
    idx = 2 if tokens < 1 << 15 else 4
    return heads * (sinks * dense_row_bytes(head_dim, itemsize) + top_k * (dense_row_bytes(head_dim, itemsize) + idx))


def coded_row_bytes(head_dim: int, itemsize: int) -> int:
    """Most one added row costs a codebook group past nothing: K and V each a new entry, an
    int32 index and a magnitude, and the key's position."""
    return 2 * (head_dim * itemsize + 4 + itemsize) + POS_BYTES
