"""The PNG charts of ``canzona plan``: per-rank loads of every policy, and (``--sweep``) step time
against ranks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_canzona.planning.report import COST_UNITS
from lightning_canzona.tools.plan.analysis import PolicyResult


def write_load_chart(path: str | Path, results: Mapping[str, PolicyResult], title: str) -> Path:
    """Draw one panel per policy (rank on x, load on y, lower bound dashed) and save a PNG.

    Owner-based policies share a y-axis so that their panels compare at a glance; ``sync``, whose
    every rank carries the whole model, gets its own.
    """
    policies = list(results)
    figure, axes = _panels(len(policies))
    shared = None
    for axis, policy in zip(axes[0], policies):
        rep = results[policy].report
        scale, unit = COST_UNITS[rep.cost]
        loads = [load / scale for load in rep.rank_loads]
        ranks = range(len(loads))
        if policy != "sync":
            if shared is None:
                shared = axis
            else:
                axis.sharey(shared)
        if len(loads) <= 64:
            axis.bar(ranks, loads, width=0.8, color="tab:blue")
        else:
            axis.step(ranks, loads, where="mid", color="tab:blue", linewidth=0.8)
        axis.axhline(
            rep.lower_bound / scale, color="tab:red", linestyle="--", linewidth=1, label="lower bound"
        )
        axis.set_title(f"{policy}: makespan/bound {rep.makespan_over_bound:.3f}", fontsize=9)
        axis.set_xlabel("rank")
        axis.set_ylabel(f"load [{unit}]")
        axis.legend(fontsize=7, loc="lower right")
    return _save(figure, title, path)


def write_scale_chart(
    path: str | Path, curves: Mapping[str, Mapping[str, list[float]]], ranks: list[int], title: str
) -> Path:
    """Projected step time against ranks (log-log), one panel per optimizer, one line per plan
    (`lightning_canzona.tools.plan.sweep.scale_curves`)."""
    figure, axes = _panels(len(curves))
    for axis, (optimizer, lines) in zip(axes[0], curves.items()):
        for label, seconds in lines.items():
            axis.plot(ranks, [s * 1e3 for s in seconds], marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(optimizer, fontsize=9)
        axis.set_xlabel("ranks")
        axis.set_ylabel("optimizer step [ms]")
        axis.legend(fontsize=7)
    return _save(figure, title, path)


def _panels(count: int) -> tuple[Any, Any]:
    """A figure of ``count`` panels side by side, and its axes (a 1 × count array)."""
    # Imported here: matplotlib is slow to import and only this command draws.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, count, figsize=(4.2 * count, 3.6), squeeze=False)


def _save(figure: Any, title: str, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
