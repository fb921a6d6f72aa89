"""Plain-text tables for the roofline CLI.

Design note. Each `*_table` function returns (headers, rows) of already formatted
strings, and `render` lays them out in aligned columns; keeping the numbers apart from
printing lets tests read the same figures the CLI prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lp_jax.roofline import ep_comm
from lp_jax.roofline.hardware import Hardware
from lp_jax.roofline.knee import KneeResult
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.ridge import ChunkRow, compute_bound_tokens, layered_marginal_saving
from lp_jax.roofline.routing import Routing, expected_active

Table = tuple[list[str], list[list[str]]]


def render(title: str, table: Table) -> str:
    headers, rows = table
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [title, line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(out)


def _tokens(t: float) -> str:
    return "never" if math.isinf(t) else f"{math.ceil(t):,}"


def hardware_table(hardware: Sequence[Hardware]) -> Table:
    headers = [
        "hardware",
        "bf16 TFLOP/s",
        "HBM TB/s",
        "HBM GB",
        "on-chip MiB",
        "link GB/s",
        "ridge FLOP/B",
    ]
    rows = [
        [
            hw.name,
            f"{hw.peak_flops / 1e12:,.1f}",
            f"{hw.hbm_bw / 1e12:.3f}",
            f"{hw.hbm_bytes / 1e9:,.1f}",
            f"{hw.onchip_bytes / 2**20:,.0f}",
            f"{hw.interconnect_bw / 1e9:,.0f}",
            f"{hw.ridge_point:,.1f}",
        ]
        for hw in hardware
    ]
    return headers, rows


def compute_bound_table(
    shape: ModelShape,
    hardware: Sequence[Hardware],
    routings: Sequence[Routing],
    tp: int = 1,
    ep: int = 1,
) -> Table:
    simple = "ridge*E/k" if shape.expert_weight_itemsize == 2 else "ridge*E*w/(2k)"
    headers = ["hardware", "ridge", f"simple T* = {simple}"] + [
        f"exact T* ({r.label})" for r in routings
    ]
    rows = []
    for hw in hardware:
        exact = [compute_bound_tokens(shape, hw, routing=r, tp=tp, ep=ep) for r in routings]
        rows.append(
            [hw.name, f"{hw.ridge_point:,.1f}", _tokens(exact[0].simple_tokens)]
            + [_tokens(c.exact_tokens) for c in exact]
        )
    return headers, rows


def chunk_table(rows: Sequence[ChunkRow]) -> Table:
    headers = [
        "schedule",
        "iterations",
        "E_act/layer",
        "expert GB",
        "MoE ms (prompt)",
        "MoE ms (iteration)",
        "pad waste",
    ]
    body = [
        [
            r.label,
            str(r.iterations),
            f"{r.active_experts:.1f}",
            f"{r.expert_bytes / 1e9:,.1f}",
            f"{r.moe_seconds * 1e3:,.1f}",
            f"{r.step_moe_seconds * 1e3:,.2f}",
            f"{100 * r.pad_fraction:.1f}%",
        ]
        for r in rows
    ]
    return headers, body


def active_experts_table(
    shape: ModelShape, routings: Sequence[Routing], batches: Sequence[int]
) -> Table:
    headers = ["decode batch"] + [f"E_act {r.label}" for r in routings]
    rows = []
    for b in batches:
        cells = [str(b)]
        for r in routings:
            active = float(expected_active(r, shape.num_experts, shape.top_k, b))
            cells.append(f"{active:.1f} ({100 * active / shape.num_experts:.1f}%)")
        rows.append(cells)
    return headers, rows


def marginal_table(
    shape: ModelShape,
    routing: Routing,
    batches: Sequence[int],
    prompt_len: int,
    chunk: int,
    tp: int = 1,
    ep: int = 1,
) -> Table:
    headers = ["decode batch", f"chunked-{chunk} GB", "layered GB", "saved GB", "saved"]
    rows = []
    for b in batches:
        s = layered_marginal_saving(
            shape, b, prompt_len=prompt_len, chunk=chunk, routing=routing, tp=tp, ep=ep
        )
        rows.append(
            [
                str(b),
                f"{s.chunked_bytes / 1e9:,.2f}",
                f"{s.layered_bytes / 1e9:,.2f}",
                f"{s.saved_bytes / 1e9:,.2f}",
                f"{100 * s.saved_fraction:.1f}%",
            ]
        )
    return headers, rows


def knee_table(result: KneeResult) -> Table:
    headers = ["tokens", "ms", "GFLOP/s", "GB/s", "of max FLOP/s"]
    peak = result.max_flops_per_s
    rows = [
        [
            str(p.tokens),
            f"{p.seconds * 1e3:.3f}",
            f"{p.flops_per_s / 1e9:,.2f}",
            f"{p.bytes_per_s / 1e9:,.2f}",
            f"{100 * p.flops_per_s / peak:.0f}%",
        ]
        for p in result.points
    ]
    return headers, rows


_SCHEME_SHORT = {"allreduce": "AR", "all_to_all": "A2A"}


def ep_bytes_table(shape: ModelShape, eps: Sequence[int], tokens: Sequence[int]) -> Table:
    """Bytes one device sends per MoE layer: all-reduce vs all_to_all, and `auto`'s pick."""
    d, k = shape.hidden_size, shape.top_k
    headers = ["ep", "T", "allreduce KiB", "a2a ragged KiB", "a2a capacity KiB", "ragged/AR"]
    headers.append("auto")
    rows = []
    for ep in eps:
        for t in tokens:
            ar = ep_comm.allreduce_bytes(t, d, ep)
            ragged = ep_comm.comm_bytes("all_to_all", t, d, k, ep, act_bytes=shape.dtype_bytes)
            capacity = ep_comm.comm_bytes(
                "all_to_all", t, d, k, ep, act_bytes=shape.dtype_bytes, transport="capacity"
            )
            pick = ep_comm.choose_dispatch(t, d, k, ep, act_bytes=shape.dtype_bytes)
            rows.append(
                [
                    str(ep),
                    f"{t:,}",
                    f"{ar / 2**10:,.0f}",
                    f"{ragged / 2**10:,.0f}",
                    f"{capacity / 2**10:,.0f}",
                    f"{ragged / ar:.2f}" if ar else "-",
                    _SCHEME_SHORT[pick],
                ]
            )
    return headers, rows


def _crossover_cell(tokens: int | None) -> str:
    if tokens is None:
        return "none: AR"
    return "A2A always" if tokens == 1 else f"A2A > {tokens - 1:,}"


def ep_crossover_table(
    shape: ModelShape, eps: Sequence[int], hardware: Sequence[Hardware], transport: str
) -> Table:
    """Tokens per layer step above which all_to_all is faster, under the time model."""
    d, k = shape.hidden_size, shape.top_k
    links = [ep_comm.Link.from_hardware(hw) for hw in hardware]
    headers = ["ep", "bytes ratio T->inf", "torus hops"] + [
        f"{hw.name} ({link.step_latency_s * 1e6:g} us/step)"
        for hw, link in zip(hardware, links, strict=True)
    ]
    rows = []
    for ep in eps:
        big = 2**20 * ep  # large enough for padding not to matter
        ratio = ep_comm.comm_bytes(
            "all_to_all", big, d, k, ep, act_bytes=shape.dtype_bytes, transport=transport
        ) / ep_comm.allreduce_bytes(big, d, ep)
        cells = [
            _crossover_cell(
                ep_comm.crossover_tokens(
                    d, k, ep, link, act_bytes=shape.dtype_bytes, transport=transport
                )
            )
            for link in links
        ]
        hops = f"{ep_comm.mean_hops(ep, 'torus2d'):.2f}"
        rows.append([str(ep), f"{ratio:.2f}", hops] + cells)
    return headers, rows
