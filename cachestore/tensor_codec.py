"""Tensors on the wire: `kvplan.v1.Tensor {dtype, shape, data}` (row-major bytes) <-> torch.

`decode` trusts nothing: the dtype must be one we serve, the shape must have the expected
rank and no negative dimension, and the byte length must match shape x itemsize exactly.
Errors are ValueError whose message starts with the field at fault ("k.shape: ...").
"""
from __future__ import annotations

import math

import numpy as np
import torch

from protos import cachestore_pb2

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
NAMES = {dt: name for name, dt in DTYPES.items()}


def encode(t: torch.Tensor) -> cachestore_pb2.Tensor:
    """Any-shape tensor of a served dtype -> wire message (one copy into the bytes)."""
    if t.dtype not in NAMES:
        raise ValueError(f"dtype {t.dtype} cannot be sent; expected one of {', '.join(DTYPES)}")
    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()   # numpy has no bfloat16: go via bytes
    return cachestore_pb2.Tensor(dtype=NAMES[t.dtype], shape=list(t.shape), data=data)


def decode(msg: cachestore_pb2.Tensor, field: str, ndim: int | None = None) -> torch.Tensor:
    """Wire message -> a new, writable, contiguous CPU tensor of shape `msg.shape`."""
    if msg.ByteSize() == 0:
        raise ValueError(f"{field}: missing")
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"{field}.dtype: unsupported {msg.dtype!r}; expected one of {', '.join(DTYPES)}")
    shape = list(msg.shape)
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{field}.shape: expected {ndim} dimensions, got {shape}")
    if any(d < 0 for d in shape):
        raise ValueError(f"{field}.shape: negative dimension in {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise ValueError(
            f"{field}.data: {len(msg.data)} bytes, expected {expected} for {msg.dtype} {shape}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.frombuffer(msg.data, dtype=np.uint8).copy()   # [bytes], owned and writable
    return torch.from_numpy(raw).view(dtype).view(shape)
