"""The timeline of a decision trace: a Gantt chart, one row per request (matplotlib, Agg
backend, imported lazily).

Each prefill chunk is a bar on its request's row from when its step started to when it
ended, colored by the first layer of the plan's span (a layered or FlowPrefill prompt
walks down the colormap as it crosses the stack); each decode step is a tick at the
step's end. Markers: arrival (open circle), finish (black square), a pause of the
request's prefill batch (red down-triangle), its resume (green up-triangle), a recompute
preemption (red cross). Time is in seconds from the first event. Rows run top to bottom
in arrival order; `max_rows` keeps the first ones.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from lp_jax.trace.writer import load

_MARKERS = {  # event -> (marker, color, legend label)
    "arrival": ("o", "none", "arrival"), "finish": ("s", "black", "finish"),
    "pause": ("v", "tab:red", "pause"), "resume": ("^", "tab:green", "resume"),
    "preempt": ("X", "tab:red", "recompute preemption"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_rows(lines: list[dict], max_rows: int | None = None) -> list[int]:
    """The seq ids of the rows, in arrival order (requests seen only in plans last)."""
    arrivals = {d["seq"]: d["t"] for d in lines if d["event"] == "arrival"}
    seen = set(arrivals)
    rows = sorted(arrivals, key=lambda s: (arrivals[s], s))
    for d in lines:
        if d["event"] == "plan":
            for sid in [*d["decode"], *(c["seq"] for c in d["prefill"])]:
                if sid not in seen:
                    seen.add(sid)
                    rows.append(sid)
    return rows if max_rows is None else rows[:max_rows]


def plot_timeline(trace: str | Path | list[dict], out: str | Path, *,
                  title: str | None = None, max_rows: int | None = 200) -> list[str]:
    """Draws the trace (a path or its loaded lines) to the PNG `out`; returns the row
    labels, top to bottom."""
    plt = _pyplot()
    lines = load(trace) if isinstance(trace, (str, Path)) else trace
    header = next((d for d in lines if d["event"] == "header"), {})
    num_units = 2 * header.get("num_layers", 1)
    rows = timeline_rows(lines, max_rows)
    y = {sid: i for i, sid in enumerate(rows)}
    times = [d[k] for d in lines if d["event"] != "header"
             for k in ("t", "start", "end") if d.get(k) is not None]
    t0 = min(times, default=0.0)

    bars = defaultdict(list)  # row -> [(x, width, unit_start)]
    ticks_x, ticks_y = [], []
    marks = defaultdict(lambda: ([], []))
    for d in lines:
        ev = d["event"]
        if ev == "plan":
            start, end = d["start"] - t0, d["end"] - t0
            for c in d["prefill"]:
                if c["seq"] in y:
                    bars[y[c["seq"]]].append((start, end - start, d["unit_start"]))
            for sid in d["decode"]:
                if sid in y:
                    ticks_x.append(end)
                    ticks_y.append(y[sid])
        elif ev in ("arrival", "finish", "preempt"):
            if d["seq"] in y:
                marks[ev][0].append(d["t"] - t0)
                marks[ev][1].append(y[d["seq"]])
        elif ev in ("pause", "resume"):
            for sid in d["seqs"]:
                if sid in y:
                    marks[ev][0].append(d["t"] - t0)
                    marks[ev][1].append(y[sid])

    fig, ax = plt.subplots(figsize=(12, min(2.4 + 0.28 * max(len(rows), 1), 60.0)))
    cmap = plt.get_cmap("viridis")
    for row, spans in bars.items():
        ax.broken_barh([(x, w) for x, w, _ in spans], (row - 0.35, 0.7),
                       facecolors=[cmap(u / num_units) for _, _, u in spans],
                       edgecolor="black", linewidth=0.3)
    if ticks_x:
        ax.scatter(ticks_x, ticks_y, marker="|", s=60, color="tab:gray", linewidths=0.8,
                   label="decode step")
    for ev, (mx, my) in marks.items():
        marker, color, label = _MARKERS[ev]
        edge = "black" if color == "none" else color
        ax.scatter(mx, my, marker=marker, s=30, facecolors=color, edgecolors=edge,
                   label=label, zorder=3)
    labels = [f"seq {sid}" for sid in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7 if len(rows) > 40 else 9)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time (s)")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, num_units / 2))
    layers = num_units // 2
    fig.colorbar(sm, ax=ax, pad=0.01, ticks=range(0, layers + 1, max(1, layers // 8))
                 ).set_label("prefill span: first layer")
    if title is None:
        title = (f"{header.get('source', 'trace')}: {header.get('policy', '?')}, "
                 f"{header.get('clock', '?')} clock")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="lower center", ncol=6, fontsize=8, frameon=False)
    ax.grid(axis="x", lw=0.3)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # the legend below
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return labels


def summary(lines: list[dict]) -> dict:
    """Counts of each event, and the estimator's error over the measured plans."""
    counts = defaultdict(int)
    errs = []
    for d in lines:
        counts[d["event"]] += 1
        if d["event"] == "plan" and d.get("measured_s") and d.get("predicted_s") is not None:
            errs.append(abs(d["predicted_s"] - d["measured_s"]) / d["measured_s"])
    out = {k: counts[k] for k in ("plan", "arrival", "finish", "pause", "resume", "preempt")}
    out["mean_abs_rel_error"] = sum(errs) / len(errs) if errs else None
    return out
