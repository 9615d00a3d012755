"""A decode step's decoder layers in one call on the CPU: per layer the fused q/k/v product, RoPE,
the new K/V rows into the pool, decode attention over every stream whatever its forms, the output
projection, residual and RMSNorm, the fused gate/up product, SiLU·up, the down projection and the
next layer's RMSNorm. The engine's Python loop (`executor.engine.model_runner.ModelRunner.model`)
calls the same ops one by one; at a decode step its Python between them was a third of the step.

    kernel      C++ (`kernels/cpu_decode_step.cpp`, `decode_layers` of the CPU extension): the
                same kernels in the same order (`kernels/cpu_decoder_ops.cpp`, the paged decode of
                `kernels/cpu_decode.cpp`, oneDNN's packed linear through torch's dispatcher), the
                GIL released — its rows are the reference's bit for bit
    launcher    `decode_layers`: the kernel where the extension has it, else the reference
    reference   `decode_layers_reference`: the loop in Python over the same launchers

`Weights.of(model)` takes the layers' packed weights (`kvcore.packed_linear`: q/k/v and gate/up
fused, no biases, a SiLU MLP); a model packed otherwise has none (None) and its steps take the loop.

Shapes: N rows (one per decoding sequence), hidden = H·D, H query heads, H_kv KV heads, D head
dim, L layers, G = N·H_kv decode streams (sequence-major, then KV head)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_extension
from kernels import decoder_ops as ops
from kernels.kv_write import write_kv
from kernels.paged_decode import TASK_ROWS, form_table, paged_decode
from kvcore.blocks import Layout


@dataclass(frozen=True)
class Weights:
    """Per layer [L]: the packed products and the norms' weights."""
    qkv: list[torch.Tensor]          # [(H + 2 H_kv)·D, hidden] packed
    o: list[torch.Tensor]            # [hidden, H·D] packed
    gate_up: list[torch.Tensor]      # [2F, hidden] packed
    down: list[torch.Tensor]         # [hidden, F] packed
    ln_in: list[torch.Tensor]        # [hidden] input RMSNorm
    ln_post: list[torch.Tensor]      # [hidden] post-attention RMSNorm

    @classmethod
    def of(cls, model) -> "Weights | None":
        """A Llama-style causal LM packed by `kvcore.packed_linear` -> its layers' weights (None:
        not packed so, a bias, or an MLP that is not SiLU)."""
        from kvcore.packed_linear import FusedLinear, PackedLinear
        if getattr(model.config, "hidden_act", "silu") != "silu":
            return None
        layers = model.model.layers
        parts = [(getattr(l.self_attn, "qkv", None), l.self_attn.o_proj, getattr(l.mlp, "gate_up", None), l.mlp.down_proj)
                 for l in layers]
        kinds = (FusedLinear, PackedLinear, FusedLinear, PackedLinear)
        if not all(type(p) is k and p.bias is None for ps in parts for p, k in zip(ps, kinds)):
            return None
        return cls(*([ps[j].packed for ps in parts] for j in range(4)),
                   [l.input_layernorm.weight for l in layers], [l.post_attention_layernorm.weight for l in layers])


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def decode_layers_reference(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: Weights,
                            eps: float, heads: int, kv_heads: int, rows: torch.Tensor, write_at: torch.Tensor,
                            arena: torch.Tensor, tables: list[torch.Tensor], layout: Layout, scaling: float,
                            rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [N, hidden] the residual (in place), y [N, hidden] its layer-0 RMSNorm; cos, sin [N, D];
    rows: the arena's fp16 rows [n, D]; write_at [L, N, H_kv] int64 each new row's K row; tables
    [L, G, …] in `kernels.paged_decode.NAMES` order; rope: (cos, sin) [T, D] fp32 of coded keys ->
    x after the last layer."""
    n, d = x.shape[0], layout.head_dim
    hn = heads // kv_heads
    for i in range(len(w.qkv)):
        qkv = _linear(y, w.qkv[i]).view(n, heads + 2 * kv_heads, d)
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        ops.rope_(q, cos, sin)
        ops.rope_(k, cos, sin)
        write_kv(rows, write_at[i].reshape(-1), k.reshape(-1, d), v.reshape(-1, d), layout.rows)
        attn, _ = paged_decode(q.float().reshape(n * kv_heads, hn, d), arena, *(t[i] for t in tables), layout,
                               scaling, rope, group_heads=hn)                       # [G, h_n, D] fp32
        y = ops.add_rms_norm(x, _linear(attn.view(n, heads * d).to(x.dtype), w.o[i]), w.ln_post[i], eps)
        gu = _linear(y, w.gate_up[i])
        f = gu.shape[1] // 2
        m = _linear(ops.silu_mul(gu[:, :f].contiguous(), gu[:, f:].contiguous()), w.down[i])
        if i + 1 < len(w.qkv):
            y = ops.add_rms_norm(x, m, w.ln_in[i + 1], eps)
        else:
            x.add_(m)
    return x


def decode_layers(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: Weights, eps: float,
                  heads: int, kv_heads: int, rows: torch.Tensor, write_at: torch.Tensor, arena: torch.Tensor,
                  tables: list[torch.Tensor], layout: Layout, scaling: float,
                  rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """As `decode_layers_reference` (its arguments), in one C++ call where the extension has it."""
    mod = cpu_extension.module()
    if mod is None or not hasattr(mod, "decode_layers") or x.device.type != "cpu" or layout.itemsize != 2:
        return decode_layers_reference(x, y, cos, sin, w, eps, heads, kv_heads, rows, write_at, arena, tables,
                                       layout, scaling, rope)
    return mod.decode_layers(x, y, cos.contiguous(), sin.contiguous(), w.qkv, w.o, w.gate_up, w.down, w.ln_in,
                             w.ln_post, float(eps), heads, kv_heads, rows, write_at, layout.rows, arena,
                             [t.contiguous() for t in tables], form_table(layout), rope[0].float().contiguous(),
                             rope[1].float().contiguous(), layout.page_bytes, layout.coded_rows, layout.entry_rows,
                             float(scaling), TASK_ROWS)

