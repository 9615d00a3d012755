"""The model's linear layers through oneDNN with their weights packed once (CPU, fp32 or bf16).

At decode the projections, MLP and LM head see a few rows (one per running sequence) against
every weight: the step reads every weight for a handful of rows, so how fast weights are read
is the step's speed. oneDNN's linear over weights reordered once into its blocked layout reads
them faster than torch's default CPU path (MKL sgemm) for such few rows (docs/benchmarks.md,
"Figures behind the code"). The same library torch's inductor uses for CPU linears
(`torch.ops.mkldnn._linear_pointwise`).

`pack(model)` swaps every `nn.Linear` of the decoder layers for a `PackedLinear` that holds only
the packed weight (the float one freed: no second copy); the LM head keeps its weight (tied to
the embeddings) beside a packed copy. Linears of one input are packed as one (`fuse`: a layer's
q, k, v as `qkv`, its MLP's gate and up as `gate_up`); the engine and the model's own forward still
call q_proj, k_proj, …, whose calls on one input share one product. Results differ from MKL's in
rounding only (~1e-4 in fp32).

In bf16 (the compute dtype on hosts with AVX512-BF16 or AMX, `kvcore.host`) oneDNN runs its
brgemm bf16 kernels (`brg_matmul:avx512_core_bf16`, or `avx512_core_amx` on AMX: bf16 products,
fp32 accumulation, bf16 out), reading half the weight bytes of fp32; `ONEDNN_VERBOSE=1` names the
kernel each call takes (tests/kvcore/test_packed_linear.py checks it)."""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether this torch has oneDNN's packed linear (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(torch.nn.Module):
    """y = x·Wᵀ + b for x [..., in_features] on the CPU in W's dtype (fp32 or bf16), W packed by oneDNN."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)          # [out, in], oneDNN's layout
        bias = linear.bias
        # no autograd: with a bias that asks for gradients oneDNN plans a training pass, and in bf16
        # that is its reference (scalar) kernel
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        if keep_weight:
            self.weight = linear.weight            # tied to another module (the embeddings): held anyway

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


class FusedLinear(torch.nn.Module):
    """Linears of one input as one packed product: x [..., in] -> [..., Σ out_i], the parts side by
    side in order (a decoder layer's q, k, v projections; its MLP's gate and up). One call where there
    were several: at decode each product reads its weights for a few rows, and a call's own cost is a
    good part of that (docs/benchmarks.md, "Figures behind the code")."""

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        self.sizes = [lin.out_features for lin in linears]
        self.in_features, self.out_features = linears[0].in_features, sum(self.sizes)
        w = torch.cat([lin.weight.detach() for lin in linears])                 # [Σ out, in]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        biases = [lin.bias for lin in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else w.new_zeros(n) for b, n in zip(biases, self.sizes)])
        self.register_buffer("bias", bias, persistent=False)
        self._last: tuple | None = None           # (input, its product): what the parts' calls share

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Part i of x's product [..., out_i]; the parts of one input (the same tensor, as a layer's
        q, k and v projections of its hidden states) share one product."""
        last = self._last                         # one read: another thread's forward may replace it
        if last is None or last[0] is not x:
            last = self._last = (x, self.forward(x))
        at = sum(self.sizes[:i])
        out = last[1][..., at:at + self.sizes[i]].contiguous()
        if i == len(self.sizes) - 1:
            self._last = None                     # the last part: nothing held past the layer
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, parts={self.sizes}, packed=oneDNN"


class FusedPart(torch.nn.Module):
    """Stands in for one of a `FusedLinear`'s linears (the model's own forward calls it as before)."""

    def __init__(self, fused: FusedLinear, i: int):
        super().__init__()
        self.in_features, self.out_features, self.i = fused.in_features, fused.sizes[i], i
        self.__dict__["fused"] = fused            # not a submodule: the layer holds it once, as `qkv` / `gate_up`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.i)


FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}   # name -> the linears


def fuse(module: torch.nn.Module) -> int:
    """Each submodule holding all the linears of a FUSED entry (a Llama-style attention, MLP) gets
    them as one `FusedLinear` under that name, each replaced by its `FusedPart` -> how many fused."""
    done = 0
    for m in list(module.modules()):
        for name, parts in FUSED.items():
            linears = [getattr(m, p, None) for p in parts]
            if all(type(lin) is torch.nn.Linear for lin in linears) and \
                    len({(lin.in_features, lin.weight.dtype, lin.weight.device) for lin in linears}) == 1:
                fused = FusedLinear(linears)
                setattr(m, name, fused)
                for i, p in enumerate(parts):
                    setattr(m, p, FusedPart(fused, i))
                done += 1
    return done


DTYPES = (torch.float32, torch.bfloat16)      # what oneDNN packs here (fp16 linears have no fast CPU kernel)


@functools.lru_cache(maxsize=1)
def packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: only with avx512bw/vl/dq or avx_ne_convert (an
    AVX2-only host refuses: 'bf16 path needs the cpu support avx_ne_convert or avx512bw, ...')."""
    if not available():
        return False
    try:
        PackedLinear(torch.nn.Linear(8, 8).bfloat16(), keep_weight=False)(torch.randn(1, 8).bfloat16())
        return True
    except RuntimeError:
        return False


def pack(model: torch.nn.Module) -> int:
    """Swap the linears of a CPU fp32 or bf16 causal LM in place -> how many were packed (0: left
    as they were, where oneDNN is missing, the model is not on the CPU in one of DTYPES, or it is
    bf16 on a CPU where oneDNN packs no bf16)."""
    head = model.get_output_embeddings()
    if not available() or head is None or head.weight.device.type != "cpu" or head.weight.dtype not in DTYPES:
        return 0
    if head.weight.dtype == torch.bfloat16 and not packs_bf16():
        log.warning("oneDNN cannot pack bf16 weights on this CPU: the linears stay torch's (bf16 emulated, "
                    "slower than fp32 here; KVPLAN_COMPUTE_DTYPE=auto picks float32 on such a host)")
        return 0
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    fused = fuse(model)
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, keep_weight=id(child.weight) in tied))
    return len(swaps) + fused
