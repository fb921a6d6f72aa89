"""Correction factors of the simulator's analytic cost model, read from compiled programs.

Design note (issue #26 §4). `python -m lp_jax.roofline --aot DIR` predicts each compiled
program's call time from its optimized HLO (lp_jax/roofline/compiled.py: per op
max(flops / (peak x eff_c), bytes / (bw x eff_m)), the layer-loop body times the layers,
Pallas calls by pallas_kernels/cost.py) and sets it beside the analytic model
(cost_model.model_step_cost) on the same shapes and at the same efficiencies. This module
turns those pairs into per-term factors that the simulator multiplies its op seconds by:

    AOT dir --compiled.read_aot--> per program (row bucket r), seconds by op class
      --> four terms, compiled and analytic seconds of a call through every layer:
          attention   the attention kernels           / analytic attn_prefill + attn_decode
          experts     the MoE kernels                 / analytic experts
          layer_rest  every other op inside the layer loop (dense matmuls, norms, rotary,
                      routing layout, KV writes, collectives) / analytic qkv, o_proj,
                      router, dense MLP
          outside     everything outside the layer loop (embedding, LM head, sampling)
                                                      / analytic lm_head
      --> JSON file (FORMAT; `write`) --> `CompiledCalibration.load`
      --> factor(term, rows): compiled / analytic, linear in log(rows) between the AOT
          buckets, the nearest bucket's outside them
      --> compiled_executor.CompiledCostExecutor scales each op of a step by its term's
          factor at the rows of its call.

Why `layer_rest` pools the non-kernel ops instead of keeping the reader's classes: the
class of a matmul depends on how the compiler wrote it. XLA:GPU writes a one-row matvec
as a multiply fusion plus a reduce fusion, which the reader files under "other" (H200,
one row: dense matmuls 0 ms, other 1.6 ms), so a per-class factor would be 0 at one
bucket and large at the next. The ops the formula leaves out sit between those matmuls and
scale with the same rows.

The efficiencies are those of the roofline run (compiled.EFF_COMPUTE / EFF_MEM, assumed
until fitted on a device): the factors are ratios at equal efficiencies, and
`calibration()` gives the simulator those efficiencies with the prior's overheads.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

from lp_jax.roofline.model_shape import ModelShape
from lp_jax.sim.calibration import GPU_PRIOR, Calibration

FORMAT = "lp_jax.compiled-calibration/1"
TERMS = ("attention", "experts", "layer_rest", "outside")
# The analytic model's ops (cost_model.py) and the term each belongs to.
OP_TERMS = {"attn_prefill": "attention", "attn_decode": "attention", "experts": "experts",
            "qkv_proj": "layer_rest", "o_proj": "layer_rest", "router": "layer_rest",
            "dense_mlp": "layer_rest", "shared_experts": "layer_rest", "lm_head": "outside"}
# The compiled reader's classes inside the layer loop that pool into layer_rest.
_REST_CLASSES = ("dense matmuls", "other", "collectives", "logits/sampling")
_ANALYTIC_REST = ("dense matmuls", "other", "collectives")
# Shape fields that must agree between the AOT run's model and the simulated one.
_SHAPE_KEYS = ("hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
               "vocab_size", "num_experts", "top_k", "expert_width", "dense_width")


@dataclass(frozen=True, slots=True)
class ProgramTerms:
    """One program's compiled and analytic seconds per term (a call through every layer)."""

    rows: int
    compiled_s: dict[str, float]
    analytic_s: dict[str, float]

    def factor(self, term: str) -> float:
        c, a = self.compiled_s[term], self.analytic_s[term]
        return c / a if a > 0 else 1.0


@dataclass(frozen=True)
class CompiledCalibration:
    """Per-term factors over the row buckets of one AOT run (one model, chip and mesh)."""

    model: str
    hardware: str  # the roofline table's name of the AOT target (Hardware.name)
    mesh: tuple[int, int, int]  # data, expert, tensor
    shape: dict[str, int]  # _SHAPE_KEYS of the AOT run's model
    eff_compute: float
    eff_mem: float
    programs: tuple[ProgramTerms, ...]
    source: str = ""

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "programs", tuple(sorted(self.programs, key=lambda p: p.rows)))
        object.__setattr__(self, "_cache", {})

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(p.rows for p in self.programs)

    def factor(self, term: str, rows: float) -> float:
        """compiled / analytic seconds of `term` at `rows`: linear in log(rows) between
        the two AOT buckets around it, the nearest bucket's outside them."""
        key = (term, rows)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if term not in TERMS:
            raise KeyError(f"unknown term {term!r}; terms are {TERMS}")
        r, ps = self.rows, self.programs
        if rows <= r[0]:
            f = ps[0].factor(term)
        elif rows >= r[-1]:
            f = ps[-1].factor(term)
        else:
            i = bisect.bisect_right(r, rows)
            lo, hi = ps[i - 1], ps[i]
            w = math.log(rows / lo.rows) / math.log(hi.rows / lo.rows)
            f = lo.factor(term) + w * (hi.factor(term) - lo.factor(term))
        self._cache[key] = f
        return f

    def calibration(self) -> Calibration:
        """The simulator's calibration under these factors: the roofline run's efficiencies
        (assumed) and the prior's per-iteration and per-layer overheads."""
        return Calibration(self.eff_compute, self.eff_mem, GPU_PRIOR.overhead_s,
                           GPU_PRIOR.layer_overhead_s,
                           f"compiled programs ({self.source}), efficiencies ASSUMED "
                           f"{self.eff_compute:g} / {self.eff_mem:g}, prior overheads")

    def check_matches(self, shape: ModelShape, hardware_name: str, tp: int, ep: int) -> None:
        """Refuse to apply factors measured on another model, chip or mesh."""
        theirs = {k: getattr(shape, k) for k in _SHAPE_KEYS}
        if theirs != self.shape:
            diff = {k: (self.shape.get(k), theirs[k]) for k in _SHAPE_KEYS
                    if self.shape.get(k) != theirs[k]}
            raise ValueError(f"compiled calibration of {self.model} does not fit "
                             f"{shape.name}: (file, simulated) differ in {diff}")
        if hardware_name != self.hardware:
            raise ValueError(f"compiled calibration is for {self.hardware}, the simulator "
                             f"runs {hardware_name}")
        if (ep, tp) != (self.mesh[1], self.mesh[2]):
            raise ValueError(f"compiled calibration is for expert {self.mesh[1]} x tensor "
                             f"{self.mesh[2]}, the simulator runs ep {ep} x tp {tp}")

    # ----------------------------------------------------------------- the file
    def to_json(self) -> dict:
        return {"format": FORMAT, "model": self.model, "hardware": self.hardware,
                "mesh": list(self.mesh), "shape": self.shape,
                "eff_compute": self.eff_compute, "eff_mem": self.eff_mem,
                "source": self.source,
                "programs": [{"rows": p.rows, "compiled_s": p.compiled_s,
                              "analytic_s": p.analytic_s} for p in self.programs]}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, d: dict, where: str = "compiled calibration") -> CompiledCalibration:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"{where}: not a compiled calibration (format {got!r}, "
                             f"expected {FORMAT!r}); write one with "
                             "launch/compiled_calibration.py --aot DIR")
        missing = [k for k in ("model", "hardware", "mesh", "shape", "eff_compute",
                               "eff_mem", "programs") if k not in d]
        if missing:
            raise ValueError(f"{where}: missing {missing}")
        try:
            programs = tuple(
                ProgramTerms(int(p["rows"]), {t: float(p["compiled_s"][t]) for t in TERMS},
                             {t: float(p["analytic_s"][t]) for t in TERMS})
                for p in d["programs"])
            mesh = tuple(int(v) for v in d["mesh"])
            shape = {k: int(d["shape"][k]) for k in _SHAPE_KEYS}
            return cls(str(d["model"]), str(d["hardware"]), mesh, shape,
                       float(d["eff_compute"]), float(d["eff_mem"]), programs,
                       str(d.get("source", where)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: malformed entry ({type(e).__name__}: {e}); each "
                             f"program needs rows and compiled_s / analytic_s for {TERMS}, "
                             f"the shape {_SHAPE_KEYS}") from None
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> CompiledCalibration:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"compiled calibration {path} does not exist; write it "
                                    "with launch/compiled_calibration.py --aot DIR --out FILE")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"compiled calibration {path} is not JSON: {e}") from None
        return cls.from_json(d, where=str(path))


def _check(c: CompiledCalibration) -> None:
    if not c.programs:
        raise ValueError("a compiled calibration needs at least one program")
    rows = [p.rows for p in c.programs]
    if len(set(rows)) != len(rows) or min(rows) < 1:
        raise ValueError(f"program rows must be distinct and >= 1, got {rows}")
    if len(c.mesh) != 3 or min(c.mesh) < 1:
        raise ValueError(f"mesh must be (data, expert, tensor) >= 1, got {c.mesh}")
    for name in ("eff_compute", "eff_mem"):
        v = getattr(c, name)
        if not (math.isfinite(v) and 0 < v <= 1):
            raise ValueError(f"{name} must be in (0, 1], got {v}")
    for p in c.programs:
        for t in TERMS:
            cs, an = p.compiled_s[t], p.analytic_s[t]
            if not (math.isfinite(cs) and math.isfinite(an) and cs >= 0 and an >= 0):
                raise ValueError(f"rows {p.rows}, {t}: seconds must be finite and >= 0, "
                                 f"got compiled {cs}, analytic {an}")
            if an == 0 and cs > 0:
                raise ValueError(f"rows {p.rows}, {t}: compiled {cs} s against no analytic "
                                 "seconds: no factor to scale by")


# --------------------------------------------------------------- from an AOT run
def terms_of(roofline) -> ProgramTerms:
    """A compiled.ProgramRoofline's four terms (module note)."""
    out, a = roofline.outside.by_class, roofline.analytic_by_class

    def layers(classes) -> float:  # every layer of every kind (dense and MoE bodies)
        return sum(n * body.by_class[c] for n, body in roofline.bodies.values()
                   for c in classes)

    compiled = {"attention": layers(["attention"]), "experts": layers(["experts"]),
                "layer_rest": layers(_REST_CLASSES), "outside": sum(out.values())}
    analytic = {"attention": a["attention"], "experts": a["experts"],
                "layer_rest": sum(a[c] for c in _ANALYTIC_REST),
                "outside": a["logits/sampling"]}
    return ProgramTerms(roofline.rows, compiled, analytic)


def from_aot(out_dir: str | Path, *, eff_compute: float | None = None,
             eff_mem: float | None = None) -> CompiledCalibration:
    """The calibration of an AOT run's programs (`python -m lp_jax.aot ... --out DIR`)."""
    from lp_jax.roofline import compiled

    ec = compiled.EFF_COMPUTE if eff_compute is None else eff_compute
    em = compiled.EFF_MEM if eff_mem is None else eff_mem
    summary, hw, rooflines = compiled.read_aot(Path(out_dir), eff_compute=ec, eff_mem=em)
    shape = {k: int(summary["model_shape"][k]) for k in _SHAPE_KEYS}
    mesh = tuple(int(v) for v in summary["config"]["mesh_shape"])
    return CompiledCalibration(summary["model"], hw.name, mesh, shape, ec, em,
                               tuple(terms_of(r) for r in rooflines),
                               f"python -m lp_jax.roofline --aot {out_dir}")


def describe(c: CompiledCalibration) -> str:
    """The factors per bucket, one line each."""
    head = (f"{c.model} on {c.hardware}, mesh {c.mesh}, efficiencies ASSUMED "
            f"{c.eff_compute:g} / {c.eff_mem:g}")
    lines = [head, f"{'rows':>6} | " + " | ".join(f"{t:>10}" for t in TERMS)]
    for p in c.programs:
        lines.append(f"{p.rows:>6} | " + " | ".join(f"{p.factor(t):10.3f}" for t in TERMS))
    return "\n".join(lines)


__all__ = ["FORMAT", "OP_TERMS", "TERMS", "CompiledCalibration", "ProgramTerms", "describe",
           "from_aot", "terms_of"]
