"""Hot ops: each a Triton kernel + launcher + plain-torch reference; `dispatch` picks one."""
from kernels.dispatch import gather_rows, use_triton

__all__ = ["gather_rows", "use_triton"]
