"""Hot ops: each a kernel (Triton, or C++ on the CPU) + launcher + plain-torch reference; which
one runs is decided in one place, `kernels.backend` (its `ENABLED` switch: the references everywhere).

Dispatched ops (`kernels.dispatch`): gather_rows, build_codebook, reconstruct, slerp_merge, slerp_restore,
quantize_pack, unpack_dequantize, lowbit_scores, hamming_distance. The engine's own (`paged_decode`,
`paged_prefill`, `decoder_ops`, `kv_write`, `quant_attention`) ask `kernels.backend` in their launchers.
Torch helpers (small or sequential, no kernel): mergeable_share, apply_rope, unrotate_rope, pack_bits.
"""
from kernels.codebook import mergeable_share
from kernels.backend import use_triton
from kernels.dispatch import build_codebook, gather_rows, reconstruct, slerp_merge, slerp_restore
from kernels.rope_reconstruct import apply_rope, unrotate_rope
from kernels.dispatch import lowbit_scores, quantize_pack, unpack_dequantize
from kernels.dispatch import hamming_distance
from kernels.hamming import pack_bits

__all__ = ["apply_rope", "build_codebook", "gather_rows", "mergeable_share", "quantize_pack", "unpack_dequantize",
           "lowbit_scores", "hamming_distance", "pack_bits", "reconstruct", "slerp_merge", "slerp_restore",
           "unrotate_rope", "use_triton"]
