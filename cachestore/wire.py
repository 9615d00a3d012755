"""`GetStream`'s chunks in the protobuf wire format, built and read by hand so a row's bytes are
copied once on each side (gRPC Python takes and gives whole `bytes` objects; building a `Chunk`
message and serializing it would copy the payload twice more). Any gRPC client still reads them
as `kvplan.v1.Chunk` messages: the first carries `shape` and `dtype`, every later one one slice
of K (field 1) or of V (field 2)."""
from __future__ import annotations

import numpy as np

K_FIELD, V_FIELD = 1, 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def data_chunk(field: int, data: np.ndarray) -> bytes:
    """Chunk{k or v: data's bytes} (data: 1-D uint8): one copy, from data into the message."""
    return b"".join([bytes([field << 3 | 2]), _varint(data.size), memoryview(data)])


def read_data_chunk(message: bytes) -> tuple[int, memoryview]:
    """(field, a view of the payload) of a `data_chunk` message; ValueError for anything else."""
    tag, n, shift, pos = message[0], 0, 0, 1
    if tag not in (K_FIELD << 3 | 2, V_FIELD << 3 | 2):
        raise ValueError(f"not a K/V data chunk (tag {tag:#x})")
    while True:
        byte = message[pos]
        n |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            break
    if pos + n != len(message):
        raise ValueError(f"chunk of {len(message)} bytes announces {n} payload bytes after a {pos}-byte header")
    return tag >> 3, memoryview(message)[pos:]
