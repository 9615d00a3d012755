"""Hot ops: each a Triton kernel + launcher + plain-torch reference; `dispatch` picks one.

Dispatched ops: gather_rows, build_codebook, reconstruct, ragged_decode_attention.
Torch helpers (small or sequential, no kernel): match_or_append, mergeable_share, apply_rope, unrotate_rope.
"""
from kernels.codebook import match_or_append, mergeable_share
from kernels.dispatch import build_codebook, gather_rows, ragged_decode_attention, reconstruct, use_triton
from kernels.rope_reconstruct import apply_rope, unrotate_rope

__all__ = ["apply_rope", "build_codebook", "gather_rows", "match_or_append", "mergeable_share",
           "ragged_decode_attention",
           "reconstruct", "unrotate_rope", "use_triton"]
