"""bench.gpu_kernels' own parts on the CPU: a measured row's error and ratios, the table it prints,
and a machine without CUDA told so (exit 2) unless it asks for the interpreter check."""
import pytest
import torch

from bench import gpu_kernels as G


def test_a_row_holds_the_error_and_the_ratios():
    x = torch.arange(1.0, 5.0)
    case = dict(op="double", shape="4", kernel=lambda: x * 2, ref=lambda: sum([x] * 2), exact=lambda: x * 2 + 0.08,
                bytes=32)
    row = G.measure(case, budget_s=0.0)
    assert row["max_rel_err"] == pytest.approx(0.08 / 8.08, rel=1e-5)
    assert row["ref_over_kernel"] == pytest.approx(row["ref_s"] / row["kernel_s"])
    assert row["kernel_GBps"] == pytest.approx(32 / row["kernel_s"] / 1e9)
    assert "kernel_graph_s" not in row                                   # no graph_calls: not captured
    table = G.table([row])
    assert table.splitlines()[2].startswith("| double | 4 | 9.9e-03 |") and "GB/s" in table


def test_without_cuda_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the bench would run")
    assert G.main(["--limit-s", "30"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
