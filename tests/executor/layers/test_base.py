"""The phase a forward runs under: an enum a name still sets, set for one forward and reset after
it whatever happens, and read by a layer in one place (`FullLayer.attend`) that calls
`end_context` once at the context's last chunk."""
import pytest
import torch

from executor.cache import PlannedCache
from executor.layers.base import CacheState, Phase
from kvplan.plan import CompressionPlan, Eviction, LayerPlan


def test_a_phase_is_set_by_its_member_or_its_name_and_an_unknown_name_is_refused():
    state = CacheState()
    assert state.phase is Phase.CONTEXT
    state.phase = "spec"
    assert state.phase is Phase.SPEC and state.phase == "spec" and state.phase.speculative
    with pytest.raises(ValueError):
        state.phase = "compresss"
    assert [p for p in Phase if p.prefills_context] == [Phase.CONTEXT, Phase.COMPRESS, Phase.STATS]


def test_running_resets_the_phase_after_the_forward_even_when_it_fails():
    state = CacheState()
    with state.running(Phase.PREDECODE, step=0):
        assert state.phase is Phase.PREDECODE and state.step == 0
    assert state.phase is Phase.AFTER
    with pytest.raises(RuntimeError):
        with state.running("compress"):
            raise RuntimeError("the forward failed")
    assert state.phase is Phase.AFTER                  # a failed last chunk never compresses again


@torch.inference_mode()
def test_a_layer_ends_its_context_once_at_the_last_chunk():
    ev = Eviction(keep_tokens=2, window=2, sink_tokens=1)
    plan = CompressionPlan("t", "snapkv", (LayerPlan(0, eviction=ev),))
    cache = PlannedCache(plan, 1, 1, 8, torch.float16, 2)
    cache.state.context_tokens = 10
    layer, calls = cache.layers[0], []
    end = layer.end_context
    layer.end_context = lambda *a: (calls.append(cache.state.phase), end(*a))
    for phase, t in ((Phase.CONTEXT, 6), (Phase.COMPRESS, 4), (Phase.AFTER, 1)):
        k, v = torch.randn(1, 1, t, 8), torch.randn(1, 1, t, 8)                  # [1, H_kv, T, D]
        with cache.state.running(phase):
            kk, vv = layer.update(k, v)
            out = layer.attend(torch.randn(1, 2, t, 8), kk, vv, 0.35)            # [1, T, H, D]
        assert out.shape == (1, t, 2, 8)
    assert calls == [Phase.COMPRESS] and layer.compressed
    assert layer.kept_tokens() == 1 + 2 + 2 + 1                                  # sinks, kept, window, the decode row
