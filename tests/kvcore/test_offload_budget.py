"""The offload part fitted to a job's budget (`kvcore.offload_budget`): the order it prefers, the
floors it keeps, the bytes it counts (those of `kvcore.cost`)."""
from kvcore import offload_budget
from kvcore.plan import OffloadPlan


def test_budget_fit_prefers_wider_prefetch_then_window():
    off = OffloadPlan(enabled=True, low_bits=2, group_size=32, top_k=64, recent_window=64)
    roomy = offload_budget.fit(off, 0.5, 4096, 32, 64)
    assert (roomy.top_k, roomy.recent_window, roomy.group_size, roomy.value_group_size) == (64, 64, 32, 64)
    tight = offload_budget.fit(off, 0.32, 2048, 32, 64)
    assert offload_budget.ratio(tight, 2048, 32, 64) <= 0.32 and tight.group_size == 32
    # per KV head at 2k: the 2-bit copy in pages of 64 rows (two key groups of 32, 32 pages), the
    # window's dense rows, the sinks and prefetch slots as coded rows with their entries, a skip
    # page. 64 slots take a page of entries more than 48 and 32 do, and any window a dense page
    # more than none: at 0.32 the window goes and the prefetch keeps 48 (as cheap as 32)
    assert (tight.top_k, tight.recent_window, tight.value_group_size) == (48, 0, 64)
    hopeless = offload_budget.fit(off, 0.05, 2048, 32, 64)     # nothing fits: the floor, reported as is
    assert offload_budget.ratio(hopeless, 2048, 32, 64) == offload_budget.ratio(tight, 2048, 32, 64) > 0.05
    assert (hopeless.top_k, hopeless.recent_window) == (48, 0)
    assert offload_budget.fit(off, None, 2048, 32, 64) == off


def test_resident_bytes_are_the_pages_of_the_low_bit_copy_and_the_exact_rows():
    """1000 tokens, a window of 16, 4 sinks and 48 prefetch slots, per KV head: fp16 pages (4 KiB)
    hold 64 rows of the 2-bit copy (two key groups of 32): 15 pages for rows [0, 960), the 40 newest
    rows dense in rows 960-999's 3 pages, 52 exact rows in 1 coded page and 2 × 2 entry pages
    (32 entries a page), 1 skip page: 24. fp32 pages (8 KiB) hold 160 rows: 6 + 3 + 1 + 4 + 1 = 15."""
    off = OffloadPlan(enabled=True, low_bits=2, group_size=32, top_k=48, recent_window=16, sink_tokens=4)
    assert offload_budget.resident_bytes(off, 1000, 3, 64, 2) == 3 * 24 * 4096
    assert offload_budget.resident_bytes(off, 1000, 3, 64, 4) == 3 * 15 * 8192
