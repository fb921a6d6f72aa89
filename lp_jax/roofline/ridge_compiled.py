"""The ridge recheck on compiled MoE-layer programs: at how many rows does a chip turn
compute-bound, read from the programs themselves (issue #26 §3)?

Design note. `launch/ridge_compiled.py` compiles one MoE layer of the engine (the MLP
half of a decoder layer: post-attention norm, float32 router, `model_moe_ffn` with the
platform's Pallas kernels, residual) for each chip over a row sweep. This module turns
each program's optimized HLO into one `LayerCost` and a sweep of them into the row count
where the program's intensity crosses the chip's ridge (peak FLOP/s over HBM bytes/s,
hardware.py). It is pure and host-only: HLO text in, numbers out.

    HLO text -> compiled.Walker (every op; a Pallas call as its cost estimate)
             -> LayerCost(rows, flops, bytes, weight_bytes)
    sweep of LayerCosts + ridge -> Crossing (log-log interpolation between samples)
                                -> BeyondSweep (past the last sample: linear extension)

Two intensities, both from the same compiled flops:
* flops / bytes: every HBM byte the program moves (the kernels' rows, weights and
  [R, F] intermediate, the router, the sorted or packed copy of x, the combine, the
  routing layout's metadata). This one decides whether the program is compute-bound;
  the kernels' own flops over their own bytes are kept beside it.
* flops / weight_bytes: the expert weights the kernels read, the paper's form of the
  argument (its simple intensity loads all E experts; here the E_act(T) active ones).

What is read from the compiled program and what is modelled: the ops outside the
kernels, their flops and bytes, are the HLO's. A Pallas call's cost depends on the
routing, a run-time value, so it is the kernel's cost estimate (pallas_kernels/cost.py,
by kernel name, as `compiled.kernel_cost` gives it): UNIFORM routing, every row real,
each active expert's weights read once; on TPU the kernels also declare it in the HLO
(`cost_estimate` in the custom call's backend_config), which `declared_kernel_cost`
reads as a cross-check. weight_bytes is that same model's weight term:
E * (1 - (1 - k/E)^T) active experts times one expert's gate/up and down bytes. The
router's [D, E] weight is left out of weight_bytes (0.5 MB against ~1.2 GB of experts)
and its flops (0.7% of the experts') stay in flops.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence

from lp_jax.roofline import hlo
from lp_jax.roofline.compiled import EFF_COMPUTE, EFF_MEM, PALLAS_TARGETS, Program, Walker
from lp_jax.roofline.hardware import Hardware
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.ridge import compute_bound_tokens
from lp_jax.roofline.routing import UNIFORM, ZipfRouting
from pallas_kernels import cost

PAPER_CHUNK = 512  # the paper's chunked-prefill chunk
# The paper's arXiv prompts, which layered prefill runs whole through each layer group:
# lp_jax/sim/workload.py ARXIV_PAPER (median 7000 tokens, 5-95%: 4.3k-11.4k).
ARXIV_MEDIAN, ARXIV_P5, ARXIV_P95 = 7000, 4300, 11400
_DECLARED = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"(\d+)",'
                       r'"bytes_accessed":"(\d+)"')


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCost:
    """One compiled MoE-layer program at `rows` rows, per device."""

    rows: int
    flops: float  # every op's flops, the Pallas calls as their cost estimates
    bytes: float  # every op's HBM bytes, likewise
    weight_bytes: float  # the expert weights the kernels read (uniform routing)
    kernel_flops: float = 0.0  # the Pallas calls' share of flops
    kernel_bytes: float = 0.0  # and of bytes

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        for name in ("flops", "bytes", "weight_bytes"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"LayerCost.{name} must be positive and finite, got {value}")

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def weight_intensity(self) -> float:
        return self.flops / self.weight_bytes

    @property
    def kernel_intensity(self) -> float | None:
        """The Pallas calls' own flops / bytes (None where none were recorded)."""
        return self.kernel_flops / self.kernel_bytes if self.kernel_bytes > 0 else None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def expert_weight_bytes(shape: ModelShape, rows: int) -> float:
    """The kernels' expert-weight reads at `rows` tokens under uniform routing: each
    active expert's gate/up [D, 2F] and down [F, D] once (cost.moe_matmul's model)."""
    active = cost.expected_experts(rows, shape.top_k, shape.num_experts)
    per_expert = 3 * shape.hidden_size * shape.expert_width * shape.expert_weight_itemsize
    return active * per_expert


def declared_kernel_cost(hlo_text: str) -> list[cost.KernelCost]:
    """The `cost_estimate` each TPU Pallas call declares in the HLO's backend_config
    (what XLA:TPU's cost analysis and scheduler see); [] on GPU, whose lowerings drop it."""
    return [cost.KernelCost(int(f), int(t), int(b)) for f, t, b in _DECLARED.findall(hlo_text)]


def layer_cost(hlo_text: str, shape: ModelShape, rows: int, hw: Hardware) -> LayerCost:
    """The LayerCost of one compiled MoE-layer program (no layer loop: every op counted
    once; a while loop, if any, one trip as compiled.Walker counts nested ones)."""
    module = hlo.parse(hlo_text)
    program = Program(rows=rows, seqs=1, pages_per_seq=1, page_size=1, tp=1, ep=1, shape=shape,
                      context_len=1)
    walker = Walker(module, program, hw, EFF_COMPUTE, EFF_MEM)
    loops: dict[str, list] = {}
    ops = walker.walk(module.computations[module.entry], loops, top=True)
    ops += [op for _, body in loops.values() for op in body]  # (trips, ops): one trip
    kernels = [op for op in ops if op.kernel]
    if not kernels:
        raise ValueError(f"the {rows}-row program has no Pallas MoE call (targets "
                         f"{PALLAS_TARGETS}): not the engine's kernel path")
    return LayerCost(rows=rows, flops=sum(op.flops for op in ops),
                     bytes=sum(op.bytes for op in ops),
                     weight_bytes=expert_weight_bytes(shape, rows),
                     kernel_flops=sum(op.flops for op in kernels),
                     kernel_bytes=sum(op.bytes for op in kernels))


@dataclasses.dataclass(frozen=True, slots=True)
class Crossing:
    """Where a sweep's intensity first reaches the ridge."""

    ridge: float  # FLOP/B
    rows: float  # interpolated crossing; the first sample if that is already above; inf
    first_sampled: int | None  # the smallest sampled row count at or above the ridge
    max_intensity: float  # the highest intensity of the sweep
    max_rows: int  # the row count that reached it

    @property
    def crosses(self) -> bool:
        return math.isfinite(self.rows)


def crossing(rows: Sequence[int], intensity: Sequence[float], ridge: float) -> Crossing:
    """The row count at which `intensity` (FLOP/B at each sampled row count, rows
    increasing) first reaches `ridge`: interpolated linearly in log(rows) against
    log(intensity) between the last sample below and the first at or above; rows[0] if
    the first sample is already at or above (the crossing is then at most rows[0]);
    inf if no sample reaches it (the sweep never turns compute-bound)."""
    rows, intensity = list(rows), [float(v) for v in intensity]
    if len(rows) != len(intensity) or len(rows) < 2:
        raise ValueError(f"need >= 2 (rows, intensity) pairs of equal length, got "
                         f"{len(rows)} and {len(intensity)}")
    if any(r < 1 for r in rows) or any(b <= a for a, b in zip(rows, rows[1:], strict=False)):
        raise ValueError(f"rows must be positive and strictly increasing, got {rows}")
    if any(not (v > 0 and math.isfinite(v)) for v in intensity):
        raise ValueError(f"intensities must be positive and finite, got {intensity}")
    if not (ridge > 0 and math.isfinite(ridge)):
        raise ValueError(f"ridge must be positive and finite, got {ridge}")
    peak = max(range(len(rows)), key=lambda i: intensity[i])
    first = next((i for i, v in enumerate(intensity) if v >= ridge), None)
    if first is None:
        at = math.inf
    elif first == 0:
        at = float(rows[0])
    else:
        (r0, i0), (r1, i1) = (rows[first - 1], intensity[first - 1]), (rows[first],
                                                                        intensity[first])
        frac = (math.log(ridge) - math.log(i0)) / (math.log(i1) - math.log(i0))
        at = math.exp(math.log(r0) + frac * (math.log(r1) - math.log(r0)))
    return Crossing(ridge=ridge, rows=at, first_sampled=None if first is None else rows[first],
                    max_intensity=intensity[peak], max_rows=rows[peak])


@dataclasses.dataclass(frozen=True, slots=True)
class BeyondSweep:
    """The last two samples' trend, for a sweep that ends below the ridge."""

    asymptote: float  # dflops / dbytes between the last two samples: I as rows -> inf
    rows: float  # where flops and bytes, extended linearly, reach the ridge (inf: never)


def beyond_sweep(costs: Sequence[LayerCost], ridge: float, *, weight: bool = False
                 ) -> BeyondSweep:
    """Extends flops and bytes (or weight bytes) linearly from the last two samples.
    Once every expert is active both grow linearly in the rows, so the intensity tends
    to the marginal dflops / dbytes; the crossing of the extension is
    r1 + (ridge * b1 - f1) * (r1 - r0) / (df - ridge * db), never if the asymptote is at or below
    the ridge. An extrapolation, not a compiled figure (inf for the weight bytes once
    they stop growing: then the intensity grows without bound and the crossing is
    r1 * ridge / I(r1), returned as such)."""
    if len(costs) < 2:
        raise ValueError("need at least two samples to extend")
    if not (ridge > 0 and math.isfinite(ridge)):
        raise ValueError(f"ridge must be positive and finite, got {ridge}")
    a, b = sorted(costs, key=lambda c: c.rows)[-2:]
    moved = (lambda c: c.weight_bytes) if weight else (lambda c: c.bytes)
    df, db = b.flops - a.flops, moved(b) - moved(a)
    if db <= 0:  # bytes no longer grow: intensity ~ flops, linear in rows
        return BeyondSweep(math.inf, max(b.rows, b.rows * ridge * moved(b) / b.flops))
    asymptote = df / db
    if asymptote <= ridge:
        return BeyondSweep(asymptote, math.inf)
    per_row = (df - ridge * db) / (b.rows - a.rows)  # d(flops - ridge * bytes) / d rows
    return BeyondSweep(asymptote, b.rows + max((ridge * moved(b) - b.flops) / per_row, 0.0))


def sweep_crossings(costs: Sequence[LayerCost], hw: Hardware) -> dict[str, Crossing]:
    """{"all bytes", "weight bytes"[, "kernels"]} crossings of one chip's sweep; "kernels":
    the Pallas calls' flops over their own bytes (weights, routed rows in and out, the
    [R, F] intermediate), where every sample recorded them."""
    costs = sorted(costs, key=lambda c: c.rows)
    rows = [c.rows for c in costs]
    out = {"all bytes": crossing(rows, [c.intensity for c in costs], hw.ridge_point),
           "weight bytes": crossing(rows, [c.weight_intensity for c in costs],
                                    hw.ridge_point)}
    if all(c.kernel_intensity for c in costs):
        out["kernels"] = crossing(rows, [c.kernel_intensity for c in costs], hw.ridge_point)
    return out


def formula_knees(shape: ModelShape, hw: Hardware) -> dict[str, float]:
    """ridge.compute_bound_tokens on the same shape: the paper's simple T* (all E
    experts, no activations), and the exact crossing (E_act(T) experts plus routed rows)
    under uniform routing (the kernels' model) and Zipf routing fitted to the paper's
    Table 1 (BENCHMARKS' formats table)."""
    uniform = compute_bound_tokens(shape, hw, routing=UNIFORM)
    zipf = compute_bound_tokens(shape, hw, routing=ZipfRouting())
    return {"simple": uniform.simple_tokens, "exact uniform": uniform.exact_tokens,
            "exact zipf": zipf.exact_tokens}


def _interp_intensity(costs: Sequence[LayerCost], rows: float, attr: str) -> float | None:
    """An intensity at `rows`, log-log interpolated within the sweep (None outside)."""
    costs = sorted(costs, key=lambda c: c.rows)
    for a, b in zip(costs, costs[1:], strict=False):
        if a.rows <= rows <= b.rows:
            ia, ib = getattr(a, attr), getattr(b, attr)
            frac = math.log(rows / a.rows) / math.log(b.rows / a.rows)
            return math.exp(math.log(ia) + frac * math.log(ib / ia))
    return None


def _knee_text(value: float) -> str:
    return f"{value:,.0f}" if math.isfinite(value) else "never"


def _crossing_text(costs: Sequence[LayerCost], hw: Hardware, weight: bool) -> str:
    """The sweep's crossing; past the sweep, its linear extension's (or never)."""
    cross = sweep_crossings(costs, hw)["weight bytes" if weight else "all bytes"]
    if cross.crosses:
        return f"{cross.rows:,.0f}"
    top = max(c.rows for c in costs)
    ext = beyond_sweep(costs, hw.ridge_point, weight=weight)
    if math.isfinite(ext.rows):
        return f"> {top:,} (extended: ~{ext.rows:,.0f})"
    return f"never (asymptote {ext.asymptote:.0f} < ridge)"


def markdown_table(results: dict[str, dict]) -> str:
    """One row per chip: ridge, compiled crossings (past the sweep: the linear extension
    of its last two samples), the program's asymptotic intensity, the formula's knees and
    the intensity at the paper's 512-token chunk and at the arXiv median prompt (a
    whole-prompt layer group) as fractions of the ridge. results[chip] = {"hardware":
    Hardware, "costs": [LayerCost, ...], "knees": formula_knees(...)}."""
    lines = ["| chip | ridge FLOP/B | compiled: flops / all bytes | asymptote dF/dB | "
             "compiled: kernels alone | compiled: flops / weight bytes | formula exact | "
             "formula simple | I(512) / ridge | I(7000) / ridge |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        hw, costs, knees = r["hardware"], r["costs"], r["knees"]
        at = [_interp_intensity(costs, n, "intensity") for n in (PAPER_CHUNK, ARXIV_MEDIAN)]
        frac = [f"{v / hw.ridge_point:.2f}" if v else "-" for v in at]
        asymptote = beyond_sweep(costs, hw.ridge_point).asymptote
        kernels = sweep_crossings(costs, hw).get("kernels")
        kernels_text = "-" if kernels is None else (
            f"{kernels.rows:,.0f}" if kernels.crosses
            else f"never (<= {max(c.rows for c in costs):,})")
        lines.append(
            f"| {name} | {hw.ridge_point:.1f} | {_crossing_text(costs, hw, False)} | "
            f"{asymptote:.0f} | {kernels_text} | {_crossing_text(costs, hw, True)} | "
            f"{_knee_text(knees['exact uniform'])} | "
            f"{knees['simple']:,.0f} | {frac[0]} | {frac[1]} |")
    return "\n".join(lines)


def intensity_table(results: dict[str, dict]) -> str:
    """Intensity (flops / all bytes) per row count and chip, and the share of the bytes
    that the Pallas calls move (the rest: router, sorted / gathered x, combine)."""
    chips = list(results)
    rows = sorted({c.rows for r in results.values() for c in r["costs"]})
    by = {name: {c.rows: c for c in r["costs"]} for name, r in results.items()}
    lines = ["| rows | " + " | ".join(f"{n} I (kernel bytes %)" for n in chips) + " |",
             "|---:|" + "---:|" * len(chips)]
    for n in rows:
        cells = []
        for name in chips:
            c = by[name].get(n)
            cells.append("-" if c is None else
                         f"{c.intensity:.1f} ({100 * c.kernel_bytes / c.bytes:.0f}%)")
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_json(results: dict[str, dict]) -> str:
    """The sweep and its crossings as JSON (what launch/ridge_compiled.py writes)."""
    out = {}
    for name, r in results.items():
        hw = r["hardware"]
        out[name] = {
            "hardware": hw.name, "ridge": hw.ridge_point,
            "knees": {k: v if math.isfinite(v) else None for k, v in r["knees"].items()},
            "costs": [c.to_json() for c in sorted(r["costs"], key=lambda c: c.rows)],
            "crossings": {k: dataclasses.asdict(v) | {"rows": v.rows if v.crosses else None}
                          for k, v in sweep_crossings(r["costs"], hw).items()},
            "beyond_sweep": {
                k: {"asymptote": None if math.isinf(e.asymptote) else e.asymptote,
                    "rows": None if math.isinf(e.rows) else e.rows}
                for k, e in (("all bytes", beyond_sweep(r["costs"], hw.ridge_point)),
                             ("weight bytes", beyond_sweep(r["costs"], hw.ridge_point,
                                                           weight=True)))},
        }
    return json.dumps(out, indent=1)
