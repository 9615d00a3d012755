"""Codebook reconstruction + RoPE: against transformers' own Llama rotary code, unrotate∘apply = id,
and the Triton kernel (interpreter child process, see `tests.kernels.interp`) against the reference."""
from __future__ import annotations

import sys

import pytest
import torch

import kernels
from kernels import rope_reconstruct as rr
from kernels._triton import INTERPRETED
from tests.kernels.interp import interpreted_fixture, rel_err

ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
}


def hf_rotary(kind: str, head_dim: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                      max_position_embeddings=8192, rope_parameters=ROPE[kind])
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("kind", list(ROPE))
@pytest.mark.parametrize("head_dim", [64, 24])
def test_reconstruct_with_rope_equals_transformers(kind, head_dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    rot = hf_rotary(kind, head_dim)
    g = torch.Generator().manual_seed(head_dim)
    C = torch.nn.functional.normalize(torch.randn(9, head_dim, generator=g), dim=1)      # [n, D]
    ref = torch.randint(0, 9, (50,), generator=g)                                        # [N]
    mag = 0.1 + 5 * torch.rand(50, generator=g)                                          # [N]
    pos = torch.randint(0, 8000, (50,), generator=g)                                     # [N] gaps, unsorted
    k_pre = C[ref] * mag[:, None]                                                        # [N, D]
    cos, sin = rot(k_pre, pos[None])                                                     # [1, N, D]
    _, k_hf = apply_rotary_pos_emb(k_pre[None, None], k_pre[None, None], cos, sin)      # [1, 1, N, D]
    out = kernels.reconstruct(C, ref, mag, pos, rot.inv_freq, rot.attention_scaling)
    assert out.dtype == torch.float32 and out.shape == (50, head_dim)
    assert rel_err(out, k_hf[0, 0]) < 1e-6
    assert rel_err(rr.apply_rope(k_pre, pos, rot.inv_freq, rot.attention_scaling), k_hf[0, 0]) < 1e-6


@pytest.mark.parametrize("kind", list(ROPE))
def test_unrotate_inverts_apply(kind):
    rot = hf_rotary(kind, 64)
    x = torch.randn(3, 40, 64)                                           # [H, N, D]
    pos = torch.randint(0, 8000, (3, 40))                                # [H, N]
    y = rr.apply_rope(x, pos, rot.inv_freq, rot.attention_scaling)
    assert rel_err(y, x) > 0.1, "rotation did something"
    assert rel_err(rr.unrotate_rope(y, pos, rot.inv_freq, rot.attention_scaling), x) < 1e-6


def test_values_have_no_rotation_and_dtypes():
    C = torch.randn(4, 5).half()                                         # [n, D], odd D: fine without RoPE
    ref = torch.tensor([3, 0, 3, 1], dtype=torch.int16)
    mag = torch.tensor([1.0, 2.0, 0.0, 0.5]).half()
    out = kernels.reconstruct(C, ref, mag, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    assert torch.equal(out, (C.float()[ref.long()] * mag.float()[:, None]).half())


def test_dispatch_rejects_bad_args():
    C, ref, mag = torch.randn(4, 8), torch.tensor([0, 3]), torch.ones(2)
    with pytest.raises(IndexError, match="index 4 out of range for 4 codebook entries"):
        kernels.reconstruct(C, torch.tensor([0, 4]), mag)
    with pytest.raises(ValueError, match="ref a 1-D"):
        kernels.reconstruct(C, ref.float(), mag)
    with pytest.raises(ValueError, match="mag must be"):
        kernels.reconstruct(C, ref, torch.ones(3))
    with pytest.raises(ValueError, match="inv_freq"):
        kernels.reconstruct(C, ref, mag, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="pos must be"):
        kernels.reconstruct(C, ref, mag, torch.tensor([1.0, 2.0]), torch.ones(4))


# ---- the Triton kernel, under the interpreter ----

# name: (n, D, N, C dtype, ref dtype, mag dtype, rope, pos dtype, out dtype, scaling, block_n, block_d)
CASES = {
    "rope_D24_N37_int16_fp16mag": (7, 24, 37, torch.float32, torch.int16, torch.float16, True, torch.int64,
                                   torch.float32, 1.0, 16, None),
    "rope_D64_N19_yarn_scaling": (5, 64, 19, torch.float32, torch.int32, torch.float32, True, torch.int32,
                                  torch.float32, 1.1386, 8, None),
    "rope_D6_N5_fp16_C_and_out": (3, 6, 5, torch.float16, torch.int64, torch.float16, True, torch.int64,
                                  torch.float16, 1.0, 4, None),
    "values_D24_N37_two_blocks": (7, 24, 37, torch.float32, torch.int64, torch.float32, False, None,
                                  torch.float32, 1.0, 16, 16),
    "values_D5_N13_bf16": (4, 5, 13, torch.bfloat16, torch.int16, torch.float16, False, None,
                           torch.bfloat16, 1.0, 8, 4),
    "rope_D16_N21_uint8_ref_200_entries": (200, 16, 21, torch.float32, torch.uint8, torch.float16, True,
                                           torch.int32, torch.float32, 1.0, 16, None),
    "no_rows": (3, 8, 0, torch.float32, torch.int64, torch.float32, True, torch.int64, torch.float32, 1.0, 16, None),
}


def _inputs(name):
    n, D, N, cdt, rdt, mdt, rope, pdt, odt, scaling, block_n, block_d = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    C = torch.nn.functional.normalize(torch.randn(n, D, generator=g), dim=1).to(cdt)        # [n, D]
    ref = torch.randint(0, n, (N,), generator=g).to(rdt)                                    # [N]
    mag = (0.1 + 3 * torch.rand(N, generator=g)).to(mdt)                                    # [N]
    pos = torch.randint(0, 8000, (N,), generator=g).to(pdt) if rope else None               # [N]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)) if rope else None       # [D/2]
    return (C, ref, mag, pos, inv_freq, scaling, odt), dict(block_n=block_n, block_d=block_d)


def _child(out_path: str) -> None:
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(rr._reconstruct_kernel).__name__}
    for name in CASES:
        args, blocks = _inputs(name)
        C, ref = args[0], args[1]
        out = torch.full((ref.shape[0], C.shape[1]), float("nan"), dtype=args[6])        # [N, D] poisoned
        rr.reconstruct_triton(*args, out=out, **blocks)
        results[name] = out
    args, _ = _inputs("rope_D24_N37_int16_fp16mag")
    results["dispatch"] = (kernels.use_triton(args[0]), kernels.reconstruct(*args))
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_rope_reconstruct")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    args, _ = _inputs(name)
    out = interpreted[name]
    ref = rr.reconstruct_reference(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any(), "kernel left poisoned (unwritten) elements"
    tol = 1e-6 if ref.dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol


def test_dispatch_uses_triton_under_interpreter(interpreted):
    used, out = interpreted["dispatch"]
    args, _ = _inputs("rope_D24_N37_int16_fp16mag")
    assert used is True and rel_err(out, rr.reconstruct_reference(*args)) < 1e-6


@pytest.mark.parametrize("bad, message", [
    (lambda C, r, m, p, f: (C[:, ::2], r, m, p, f[:6]), "unit column stride"),
    (lambda C, r, m, p, f: (C, r.float(), m, p, f), "ref must be"),
    (lambda C, r, m, p, f: (C, r, m.double(), p, f), "mag must be"),
    (lambda C, r, m, p, f: (C, r, m, p.float(), f), "pos must be"),
    (lambda C, r, m, p, f: (C, r, m, p, f[:5]), "inv_freq must be"),
    (lambda C, r, m, p, f: (C, r[::2], m[::2], p[::2], f), "contiguous"),
])
def test_launcher_rejects_bad_args(bad, message):
    C = torch.randn(4, 24)
    args = bad(C, torch.arange(8) % 4, torch.ones(8), torch.arange(8), torch.ones(12))
    with pytest.raises(AssertionError, match=message):
        rr.reconstruct_triton(*args)


if __name__ == "__main__":
    _child(sys.argv[1])


def test_uint8_refs_into_a_codebook_of_exactly_256_entries():
    """uint8 cannot hold 256: the range check must not wrap (a codebook grows to 256 in decode)."""
    import kernels
    C = torch.nn.functional.normalize(torch.randn(256, 8), dim=-1)
    ref = torch.tensor([0, 34, 255], dtype=torch.uint8)
    mag = torch.tensor([1.0, 2.0, 3.0])
    out = kernels.reconstruct(C, ref, mag)
    torch.testing.assert_close(out, C[ref.long()] * mag[:, None])
