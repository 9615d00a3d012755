"""Hot ops: each a Triton kernel + launcher + plain-torch reference; `dispatch` picks one.

Dispatched ops: gather_rows, build_codebook, reconstruct, ragged_decode_attention, slerp_merge,
slerp_restore, quantize_pack, unpack_dequantize, lowbit_scores, hamming_distance; quant_attend
(a fused C++ kernel on the CPU, the reference elsewhere).
Torch helpers (small or sequential, no kernel): match_or_append, mergeable_share, apply_rope, unrotate_rope, pack_bits.
"""
from kernels.codebook import match_or_append, mergeable_share
from kernels.dispatch import (build_codebook, gather_rows, ragged_decode_attention, reconstruct, slerp_merge,
                              slerp_restore, use_triton)
from kernels.rope_reconstruct import apply_rope, unrotate_rope
from kernels.dispatch import lowbit_scores, quant_attend, quantize_pack, unpack_dequantize
from kernels.dispatch import hamming_distance
from kernels.hamming import pack_bits

__all__ = ["apply_rope", "build_codebook", "gather_rows", "match_or_append", "mergeable_share",
           "quantize_pack", "unpack_dequantize", "lowbit_scores", "quant_attend",
           "hamming_distance", "pack_bits",
           "ragged_decode_attention",
           "reconstruct", "slerp_merge", "slerp_restore", "unrotate_rope", "use_triton"]
