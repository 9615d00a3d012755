"""kvplan's one attention function: the handler set for a forward answers it, only in the context
(thread) that set it; with none it is plain causal attention; a sliding window it cannot honour
is refused."""
import threading
import types

import pytest
import torch
import torch.nn.functional as F

from kvcore import attention


def _qkv(tq: int, t: int):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, tq, 8, generator=gen), torch.randn(1, 2, t, 8, generator=gen),
            torch.randn(1, 2, t, 8, generator=gen))                          # q [1, H, Tq, D]; k, v [1, H_kv, T, D]


def test_plain_causal_attention_without_a_handler():
    module = types.SimpleNamespace(layer_idx=0)
    for tq, t in ((5, 5), (1, 5), (3, 7)):
        q, k, v = _qkv(tq, t)
        out, _ = attention.dispatch(module, q, k, v, None, scaling=0.3)
        mask = torch.arange(t)[None, :] <= torch.arange(tq)[:, None] + (t - tq)                   # [Tq, T]
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=mask, scale=0.3).transpose(1, 2)
        torch.testing.assert_close(out, want)


def test_a_handler_answers_only_in_the_context_that_set_it():
    module = types.SimpleNamespace(layer_idx=3)
    q, k, v = _qkv(2, 2)
    seen, other = [], {}

    def handler(mod, q_, k_, v_, scaling):
        seen.append((mod.layer_idx, scaling))
        return torch.zeros(1, 2, 4, 8)

    def elsewhere():
        other["out"] = attention.dispatch(module, q, k, v, None, scaling=0.5)[0]

    with attention.using(handler):
        assert attention.dispatch(module, q, k, v, None, scaling=0.5)[0].abs().sum() == 0
        thread = threading.Thread(target=elsewhere)
        thread.start(), thread.join()
    assert seen == [(3, 0.5)]
    torch.testing.assert_close(other["out"], attention.causal_attention(q, k, v, 0.5))
    assert attention.dispatch(module, q, k, v, None, scaling=0.5)[0].abs().sum() > 0       # reset after the block


def test_a_sliding_window_shorter_than_the_keys_is_refused():
    q, k, v = _qkv(6, 6)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        attention.dispatch(types.SimpleNamespace(layer_idx=1), q, k, v, None, scaling=0.3, sliding_window=4)
    attention.dispatch(types.SimpleNamespace(layer_idx=1), q, k, v, None, scaling=0.3, sliding_window=6)


@pytest.mark.parametrize("tq, t", [(1, 70), (33, 33), (17, 90)])
def test_bf16_causal_attention_is_torchs_flash_kernel_and_the_fp32_math(tq, t):
    """In bf16 (the compute dtype on AVX512-BF16 hosts) every shape the engine sends — a decode row,
    a whole prompt, a chunk after stored rows — takes torch's CPU flash kernel, not the math path's
    [Tq, T] matrices, and stays within bf16 rounding of the fp32 result."""
    from torch.profiler import profile
    gen = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(1, h, n, 64, generator=gen) for h, n in ((9, tq), (3, t), (3, t)))
    with profile() as prof:
        got = attention.causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, names
    assert got.dtype == torch.bfloat16 and got.shape == (1, tq, 9, 64)
    want = attention.causal_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), 0.125)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
