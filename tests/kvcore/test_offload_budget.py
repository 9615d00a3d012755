"""The offload part fitted to a job's budget (`kvcore.offload_budget`): the order it prefers, the
floors it keeps, the bytes it counts (those of `kvcore.cost`)."""
from kvcore import cost, offload_budget
from kvplan.plan import OffloadPlan


def test_budget_fit_prefers_wider_prefetch_then_window():
    off = OffloadPlan(enabled=True, low_bits=2, group_size=32, top_k=64, recent_window=64)
    roomy = offload_budget.fit(off, 0.5, 4096, 32, 64)
    assert (roomy.top_k, roomy.recent_window, roomy.group_size, roomy.value_group_size) == (64, 64, 32, 64)
    tight = offload_budget.fit(off, 0.2, 2048, 32, 64)
    assert offload_budget.ratio(tight, 2048, 32, 64) <= 0.2 and tight.group_size == 32
    # keys per channel over 32 tokens (16 code + 8 scale bytes a token and head at 2 bits), values
    # per token (16 + 4), up to 35 fp16 keys and 4 values in the window, 32 prefetched rows: 0.2 at 2k
    assert (tight.top_k, tight.recent_window, tight.value_group_size) == (32, 4, 64)
    hopeless = offload_budget.fit(off, 0.05, 2048, 32, 64)     # nothing fits: the floor, reported as is
    assert offload_budget.ratio(hopeless, 2048, 32, 64) > 0.05
    assert hopeless.top_k == 32 and hopeless.recent_window <= 1
    assert offload_budget.fit(off, None, 2048, 32, 64) == off


def test_resident_bytes_are_the_cost_models_low_bit_copy_and_fixed_rows():
    off = OffloadPlan(enabled=True, low_bits=2, group_size=32, top_k=48, recent_window=16, sink_tokens=4)
    for itemsize in (2, 4):
        want = (cost.lowbit_bytes(1000, 3, 64, 2, 32, 16, 40, off.value_group_size, itemsize=itemsize)
                + cost.offload_fixed_bytes(4, 48, 3, 64, 1000, itemsize))
        assert offload_budget.resident_bytes(off, 1000, 40, 3, 64, itemsize) == want
