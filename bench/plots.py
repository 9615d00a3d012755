"""NIAH grids as PNG heatmaps: length (rows) × depth (columns), correct / incorrect / not run,
one panel per mode, one file per strategy and requested ratio."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt                              # noqa: E402
from matplotlib.colors import ListedColormap                 # noqa: E402
from matplotlib.patches import Patch                         # noqa: E402

from bench.harness import MODES                              # noqa: E402

COLORS = ListedColormap(["#d9d9d9", "#d7301f", "#1a9850"])   # not run, incorrect, correct


def niah_grid(rows: list[dict], strategy: str, ratio: float, out: Path) -> Path:
    """rows: quality rows of family `niah` for this strategy and ratio, one per mode."""
    rows = sorted(rows, key=lambda r: MODES.index(r["mode"]))
    lengths = sorted({c["length"] for r in rows for c in r["cases"]})
    depths = sorted({c["depth"] for r in rows for c in r["cases"]})
    panel_w = max(3.6, 1.4 + 0.8 * len(depths))                  # inches
    fig, axes = plt.subplots(1, len(rows), figsize=(panel_w * len(rows), 1.6 + 0.55 * len(lengths)), squeeze=False)
    for ax, row in zip(axes[0], rows):
        grid = [[0] * len(depths) for _ in lengths]
        for c in row["cases"]:
            grid[lengths.index(c["length"])][depths.index(c["depth"])] = 2 if c["correct"] else 1
        ax.imshow(grid, cmap=COLORS, vmin=0, vmax=2, aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context tokens")
        ax.set_title(f"{row['mode']}  {row['correct']}/{row['total']}  (kv {row['measured_ratio']:.2f})", fontsize=9)
    label = "full" if strategy == "full" else f"{strategy} @ reserve {ratio:g}"
    fig.suptitle(f"NIAH — {label}", fontsize=10)
    fig.legend(handles=[Patch(color=COLORS(2), label="correct"), Patch(color=COLORS(1), label="incorrect")],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def throughput_by_budget(runs: list[dict], out: Path) -> Path:
    """Decode tokens/s against the KV budget, a line per strategy (`bench.serve` runs)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy in dict.fromkeys(r["strategy"] for r in runs):
        pts = sorted((r["kv_budget_bytes"] / 2**20, r["decode_tps"]) for r in runs if r["strategy"] == strategy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=strategy)
    ax.set_xlabel("executor KV budget (MiB)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode throughput under one KV budget")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
