"""What the paper-scale simulator studies in launch/ share: a rate search that keeps each
point's measurements, a worker pool, table cells and rows, and the attainment-vs-rate plot.

The studies (reproduce_paper.py, bench_muxwise_sim.py, bench_flowprefill_sim.py) keep
their own workloads, policies and table contents; this module holds the pieces each of
them used to write again. matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Callable, Sequence
from pathlib import Path

from lp_jax.sim.slo import RateSearch, sustainable_rate


# ----- sweeps ----------------------------------------------------------------------------------
def search_rate(measure: Callable[[float], dict], grid: Sequence[float], key: str,
                **search) -> tuple[RateSearch, dict[float, dict]]:
    """`sustainable_rate` over the attainment `measure(rate)[key]`, keeping every measured
    point: (the search, rate -> what `measure` returned). `search`: sustainable_rate's
    keyword arguments."""
    points: dict[float, dict] = {}

    def evaluate(rate: float) -> float:
        points[rate] = measure(rate)
        return points[rate][key]

    return sustainable_rate(evaluate, grid, **search), points


class _Serial:
    imap_unordered = staticmethod(map)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def pool(workers: int):
    """A context manager with `imap_unordered`: a fork pool of `workers` processes, or for
    one worker the tasks run in this process, in order."""
    return mp.get_context("fork").Pool(workers) if workers > 1 else _Serial()


# ----- markdown ----------------------------------------------------------------------------------
def missing(x) -> bool:
    """No value to print: None or NaN."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def cell(x, spec: str) -> str:
    """`x` formatted by `spec`, or "-" when it is missing."""
    return "-" if missing(x) else format(x, spec)


def rate_cell(rate: float, lower_bound_only: bool, lowest: float) -> str:
    """A sustainable rate: "1.50", "1.50+" (every rate tried passed), or "< 0.20" (the
    lowest rate tried, `lowest`, already failed)."""
    if not rate:
        return f"< {lowest:.2f}"
    return f"{rate:.2f}{'+' if lower_bound_only else ''}"


def row(cells: Sequence[str]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(cells) + " |"


# ----- figures -----------------------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot on the Agg backend (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attainment(path: Path, panels: Sequence[dict], *, grid: tuple[int, int],
                    figsize: tuple[float, float], title: str, dpi: int,
                    target_pct: float = 90.0, plt=None) -> None:
    """SLO attainment (%) against request rate, one subplot a panel; subplots beyond the
    panels are left blank. A panel: {"title", "curves": [(rates, attainment %, plot
    keyword arguments)], "vlines": [(rate, axvline keyword arguments)], "legend": legend
    keyword arguments}. The target is a dashed gray line."""
    plt = plt or pyplot()
    fig, axes = plt.subplots(*grid, figsize=figsize)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for rates, att, style in panel["curves"]:
            ax.plot(rates, att, "o-", **style)
        for rate, style in panel.get("vlines", ()):
            ax.axvline(rate, **style)
        ax.axhline(target_pct, color="gray", ls="--", lw=1)
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(-2, 102)
        ax.legend(**panel["legend"])
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
