"""PNG figures for the roofline recheck (matplotlib, Agg backend, imported lazily).

Design note. Three figures mirror the printed tables: MoE arithmetic intensity against
tokens per layer step with each accelerator's ridge line; expert-weight bytes of one
prompt against chunk size with the layered-prefill level; and activated experts against
decode batch size under uniform and skewed routing, with the paper's Table 1 points.
Each function writes one file and returns its path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lp_jax.roofline.hardware import Hardware
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.ridge import ChunkRow, moe_intensity
from lp_jax.roofline.routing import PAPER_TABLE1_TARGETS, Routing, expected_active


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_intensity(
    shape: ModelShape,
    hardware: Sequence[Hardware],
    routings: Sequence[Routing],
    path: str | Path,
    max_tokens: int = 65536,
) -> Path:
    plt = _pyplot()
    tokens_T = np.unique(np.geomspace(1, max_tokens, 200).round())
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(tokens_T, moe_intensity(shape, tokens_T, exact=False), "k--", label="simple: k·T/E")
    for routing in routings:
        ax.plot(
            tokens_T,
            moe_intensity(shape, tokens_T, routing=routing),
            label=f"exact, {routing.label}",
        )
    colors = plt.cm.tab10(np.linspace(0, 1, max(len(hardware), 1)))
    for hw, color in zip(hardware, colors, strict=False):
        ax.axhline(
            hw.ridge_point,
            color=color,
            lw=0.8,
            ls=":",
            label=f"ridge {hw.name} ({hw.ridge_point:.0f})",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per layer step T")
    ax.set_ylabel("expert GEMM intensity (FLOP / HBM byte)")
    ax.set_title(f"{shape.name}: MoE intensity vs ridge points")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, plt, path)


def plot_chunk_bytes(shape: ModelShape, rows: Sequence[ChunkRow], path: str | Path) -> Path:
    plt = _pyplot()
    chunked = [r for r in rows if r.label.startswith("chunk")]
    layered = [r for r in rows if r.label.startswith("layered")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(
        [r.chunk for r in chunked],
        [r.expert_bytes / 1e9 for r in chunked],
        "o-",
        label="chunked prefill",
    )
    for r in layered:
        ax.axhline(r.expert_bytes / 1e9, color="C3", ls="--", label=r.label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("chunk size (tokens)")
    ax.set_ylabel("expert weight bytes loaded (GB)")
    prompt = max(r.chunk for r in rows)
    ax.set_title(f"{shape.name}: expert traffic for one {prompt}-token prompt")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, plt, path)


def plot_active_experts(
    shape: ModelShape,
    routings: Sequence[Routing],
    path: str | Path,
    max_batch: int = 512,
) -> Path:
    plt = _pyplot()
    batch_B = np.arange(1, max_batch + 1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for routing in routings:
        active_B = expected_active(routing, shape.num_experts, shape.top_k, batch_B)
        ax.plot(batch_B, 100.0 * active_B / shape.num_experts, label=routing.label)
    if (shape.num_experts, shape.top_k) == (128, 8):
        xs = [t for t, _ in PAPER_TABLE1_TARGETS]
        ys = [100.0 * f for _, f in PAPER_TABLE1_TARGETS]
        ax.plot(xs, ys, "k*", ms=10, label="paper Table 1")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (tokens per layer step)")
    ax.set_ylabel("activated experts (% of E)")
    ax.set_title(f"{shape.name}: E={shape.num_experts}, top-{shape.top_k}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
