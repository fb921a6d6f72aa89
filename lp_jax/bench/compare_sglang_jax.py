"""lp_jax's compiled programs beside sglang-jax's, on one basis, per device.

Design note. Both engines are compiled here, compile-only, for the same TPU slice and
the same shapes (`launch/compare_sglang_jax.py` drives the compiles), and this module
reads the optimized HLO of both with lp_jax's own reader (`roofline/hlo.py`) and op
coster (`roofline/compiled.Walker`). Three rules put the two on one basis:

- Per layer: each engine is compiled with 1 and 2 decoder layers. sglang-jax unrolls
  its layers in Python: one layer costs T(2) - T(1), outside the layers T(1) - layer.
  lp_jax runs its layers in a loop over stacked weights: one layer is the 2-layer
  program's loop body, outside is the rest of that program (`per_layer` says why the
  1-layer program is not used there). Both are one layer as a program of two or more
  layers runs it.
- Pallas calls: XLA counts a Pallas call as its `pl.CostEstimate` declares, and the two
  engines declare differently (sglang-jax's ragged paged attention v3 declares nothing,
  its `gmm_v2` every routed row and the whole expert stack). Here every Pallas call of
  both engines is costed by `pallas_kernels/cost.py` at the same shapes: a MoE grouped
  matmul under uniform routing (a device holds its share of the experts and of their
  rows: lp_jax's as `compiled.kernel_cost` has it for its mesh, sglang-jax's the `g`
  experts its gmm call names), an attention call over a full page table (every sequence
  at max_model_len).
- Sampling: lp_jax's step program samples; sglang-jax samples in a second program
  (`jitted_sampler`), which is compiled too and added outside the layers.

Costs are per device, in HBM bytes, flops and interconnect bytes, and a predicted time
at the roofline's assumed efficiencies (`compiled.EFF_COMPUTE`, `EFF_MEM`): a like-for-
like reading of compiled programs, not a measurement.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from lp_jax.roofline import compiled, hlo
from lp_jax.roofline.hardware import Hardware
from lp_jax.roofline.model_shape import ModelShape
from pallas_kernels import cost

SHAPES = (("decode", 8), ("decode", 64), ("decode", 128), ("prefill", 512))
# sglang-jax's Pallas kernels, by the names their pallas_call gives them
_GMM = re.compile(r"\bgmm(?:_v2)?-g_(\d+)-m_(\d+)-k_(\d+)-n_(\d+)")
_RPA = re.compile(r"\bRPA([dpm])\w*-p_\d+")  # its decode / prefill / mixed case


@dataclasses.dataclass
class TaggedOp(compiled.Op):
    tag: str = ""  # a collective's opcode or a Pallas call's kernel name


def program(mode: str, tokens: int, shape: ModelShape, *, max_model_len: int,
            page_size: int, tp: int, ep: int) -> compiled.Program:
    """The shapes both engines' Pallas calls are costed at: a decode step of `tokens`
    sequences, or one prompt of `tokens` rows. tp, ep: lp_jax's mesh axes (its
    `--tensor-parallel-size 8 --enable-expert-parallel` is tp 8, ep 1: the experts are
    split over the tensor axis)."""
    return compiled.Program(rows=tokens, seqs=tokens if mode == "decode" else 1,
                            pages_per_seq=-(-max_model_len // page_size),
                            page_size=page_size, tp=tp, ep=ep, shape=shape,
                            context_len=max_model_len)  # a full page table, for both


def sglang_kernel(ins: hlo.Instr) -> tuple[str, dict] | None:
    """(kind, dims) of a sglang-jax Pallas call: ("gmm", {g, m, k, n}) or
    ("rpa", {case}), case "d", "p" or "m"."""
    text = ins.name + " " + ins.attrs
    m = _GMM.search(text)
    if m:
        return "gmm", dict(zip("gmkn", map(int, m.groups()), strict=True))
    m = _RPA.search(text)
    if m:
        return "rpa", {"case": m.group(1)}
    return None


class BasisWalker(compiled.Walker):
    """compiled.Walker with sglang-jax's kernels costed by cost.py, and every collective
    and Pallas call tagged so that they can be counted.

    sglang-jax's attention is three Pallas calls per layer (decode, prefill and mixed
    cases), each running its share of the batch's sequences; the layer's whole attention
    (one cost.py estimate) is charged to the case that runs this program's batch: decode
    for a decode step, prefill (else mixed) for a prompt. A Pallas call that neither
    engine's estimates name (sglang-jax's router top-k) moves its operands and result."""

    def __init__(self, module: hlo.Module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        cases = {found[1]["case"] for comp in module.computations.values()
                 for ins in comp.instrs.values()
                 if (found := sglang_kernel(ins)) is not None and found[0] == "rpa"}
        decode = self.p.seqs == self.p.rows
        self.attention_case = "d" if decode else ("p" if "p" in cases else "m")

    def op(self, comp: hlo.Computation, ins: hlo.Instr) -> compiled.Op | None:
        if (ins.opcode == "custom-call"
                and ins.attr("custom_call_target") in compiled.PALLAS_TARGETS):
            found = sglang_kernel(ins)
            if found is not None:
                return self._sglang(*found)
            try:
                compiled.kernel_name(ins, self.p)
            except KeyError:
                moved = sum(self._bytes_of(comp, o) for o in ins.operands) + self.hbm(ins.type)
                name = re.sub(r"\.\d+$", "", ins.name)
                return TaggedOp("other", 0.0, moved, kernel=name, tag=name)
        op = super().op(comp, ins)
        if op is None:
            return None
        tag = op.kernel or (ins.opcode if ins.opcode in compiled._COLLECTIVES else "")
        if op.cls == "collectives" and ins.opcode == "fusion":  # XLA:TPU's reduce-scatter
            tag = "reduce-scatter"  # (compiled.Walker: a fused all-reduce and its slice)
        return TaggedOp(**dataclasses.asdict(op), tag=tag)

    def _sglang(self, kind: str, dims: dict) -> TaggedOp:
        p, s = self.p, self.p.shape
        if kind == "rpa":
            name = f"sglang rpa_v3 ({dims['case']})"
            if dims["case"] != self.attention_case:
                return TaggedOp("attention", kernel=name, tag=name)
            c = compiled.kernel_cost(cost.TPU_ATTENTION, p)
            return TaggedOp("attention", c.flops, c.bytes_accessed, kernel=name, tag=name)
        b = s.dtype_bytes
        c = cost.moe_matmul(tokens=p.rows, top_k=s.top_k, experts=s.num_experts, k=dims["k"],
                            n=dims["n"], glu=False, lhs_itemsize=b, w_itemsize=b,
                            out_itemsize=b)
        share = dims["g"] / s.num_experts  # the device's experts, and their rows
        return TaggedOp("experts", c.flops * share, c.bytes_accessed * share,
                        kernel="sglang gmm", tag="sglang gmm")


@dataclasses.dataclass
class Tally:
    """Summed costs of some ops: totals, seconds by class, and counts / bytes by tag."""

    flops: float = 0.0
    bytes: float = 0.0
    link_bytes: float = 0.0
    seconds: float = 0.0
    by_class: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(compiled.CLASSES, 0.0))
    calls: dict = dataclasses.field(default_factory=dict)  # tag -> count
    tag_bytes: dict = dataclasses.field(default_factory=dict)  # tag -> interconnect bytes

    @classmethod
    def of(cls, ops, hw: Hardware, times: float = 1.0) -> Tally:
        t = cls()
        for op in ops:
            s = op.seconds(hw, compiled.EFF_COMPUTE, compiled.EFF_MEM)
            t.flops, t.bytes = t.flops + times * op.flops, t.bytes + times * op.bytes
            t.link_bytes += times * op.link_bytes
            t.seconds += times * s
            t.by_class[op.cls] += times * s
            tag = getattr(op, "tag", "")
            if tag:
                t.calls[tag] = t.calls.get(tag, 0) + times
                t.tag_bytes[tag] = t.tag_bytes.get(tag, 0) + times * op.link_bytes
        return t

    def combine(self, other: Tally, k: float = 1.0) -> Tally:
        """self + k * other."""
        keys = lambda a, b: set(a) | set(b)  # noqa: E731
        return Tally(self.flops + k * other.flops, self.bytes + k * other.bytes,
                     self.link_bytes + k * other.link_bytes, self.seconds + k * other.seconds,
                     {c: self.by_class[c] + k * other.by_class[c] for c in compiled.CLASSES},
                     {t: self.calls.get(t, 0) + k * other.calls.get(t, 0)
                      for t in keys(self.calls, other.calls)},
                     {t: self.tag_bytes.get(t, 0) + k * other.tag_bytes.get(t, 0)
                      for t in keys(self.tag_bytes, other.tag_bytes)})


def program_parts(hlo_text: str, p: compiled.Program, hw: Hardware, *, layer_loop: bool
                  ) -> tuple[Tally, Tally | None]:
    """(outside the layer loop, the loop's body once) of one program. layer_loop: the
    program runs its layers in a while loop (lp_jax); otherwise (sglang-jax's unrolled
    layers, its sampler) every loop counts one trip and there is no body: (all, None)."""
    w = BasisWalker(hlo.parse(hlo_text), p, hw, compiled.EFF_COMPUTE,
                    compiled.EFF_MEM)
    if layer_loop:
        outside, body = w.split()
        return Tally.of(outside, hw), Tally.of(body, hw)
    return Tally.of(w.walk(w.m.computations[w.m.entry], {}, top=False), hw), None


@dataclasses.dataclass
class Compiled:
    """One engine's compile of one shape at one layer count: its programs' HLO texts
    (with whether each runs a layer loop), compile seconds and memory analysis."""

    engine: str
    layers: int
    mode: str
    tokens: int
    hlo_texts: list  # [(text, layer_loop)]
    compile_s: float
    argument_bytes: int
    temp_bytes: int


def split(c: Compiled, p: compiled.Program, hw: Hardware) -> tuple[Tally, Tally | None]:
    """(outside, one layer's loop body or None) over all of a compile's programs."""
    outside, body = Tally(), None
    for text, loop in c.hlo_texts:
        o, b = program_parts(text, p, hw, layer_loop=loop)
        outside = outside.combine(o)
        body = b if body is None else (body if b is None else body.combine(b))
    return outside, body


def per_layer(one: Compiled, two: Compiled, p: compiled.Program, hw: Hardware) -> dict:
    """One layer and outside the layers (Tallies), argument bytes of each, and the 2-layer
    compile's temporaries and compile seconds.

    Unrolled layers: one layer = T(2) - T(1), outside = T(1) - one layer. A layer loop:
    the 2-layer program's loop body and the rest of it, which is the same difference
    had the 1-layer program the same body; it does not (XLA compiles a one-trip loop
    over a one-layer weight stack differently), so the 1-layer program is read only for
    its argument bytes."""
    outside2, body2 = split(two, p, hw)
    if body2 is not None:
        layer, outside = body2, outside2
    else:
        t1 = split(one, p, hw)[0]
        layer = outside2.combine(t1, -1.0)
        outside = t1.combine(layer, -1.0)
    return {"layer": layer, "outside": outside,
            "argument_layer": two.argument_bytes - one.argument_bytes,
            "argument_outside": 2 * one.argument_bytes - two.argument_bytes,
            "temp": two.temp_bytes, "compile_s": two.compile_s}


def load_lp_jax(aot_dirs: dict[int, Path]) -> list[Compiled]:
    """lp_jax's compiles from `python -m lp_jax.aot` runs, one directory per layer count."""
    out = []
    for layers, d in aot_dirs.items():
        summary = json.loads((Path(d) / "summary.json").read_text())
        for prog in summary["programs"]:
            text = (Path(d) / prog["optimized_hlo_file"]).read_text()
            mode = "prefill" if prog["rows"] > summary["config"]["max_num_seqs"] else "decode"
            out.append(Compiled("lp_jax", layers, mode, prog["rows"], [(text, True)],
                                prog["compile_s"], prog["memory"]["argument"],
                                prog["memory"]["temp"]))
    return out


def load_sglang(out_dir: Path) -> list[Compiled]:
    """sglang-jax's compiles from `launch/sglang_jax_compile.py`'s summary.json: its model
    program first, its sampler second."""
    out_dir = Path(out_dir)
    summary = json.loads((out_dir / "summary.json").read_text())
    out = []
    for prog in summary["programs"]:
        parts = [prog["model"], prog["sampler"]]
        out.append(Compiled(
            "sglang-jax", prog["layers"], prog["mode"], prog["tokens"],
            [((out_dir / part["hlo"]).read_text(), False) for part in parts],
            sum(part["compile_s"] for part in parts), prog["model"]["memory"]["argument"],
            max(part["memory"]["temp"] for part in parts)))
    return out


def compare(compiles: list[Compiled], shape: ModelShape, hw: Hardware, *, max_model_len: int,
            page_size: int, tp: int, ep: int) -> list[dict]:
    """For each shape that both engines compiled at 1 and 2 layers: {'mode', 'tokens',
    engine: per_layer(...)}."""
    index = {(c.engine, c.mode, c.tokens, c.layers): c for c in compiles}
    out = []
    for mode, tokens in SHAPES:
        p = program(mode, tokens, shape, max_model_len=max_model_len, page_size=page_size,
                    tp=tp, ep=ep)
        row = {"mode": mode, "tokens": tokens, "num_layers": shape.num_layers}
        for engine in ("lp_jax", "sglang-jax"):
            one, two = index.get((engine, mode, tokens, 1)), index.get((engine, mode, tokens, 2))
            if one is not None and two is not None:
                row[engine] = per_layer(one, two, p, hw)
        if "lp_jax" in row and "sglang-jax" in row:
            out.append(row)
    return out


def _calls(t: Tally, collectives: bool) -> str:
    tags = sorted(k for k, n in t.calls.items()
                  if round(n) and (k in compiled._COLLECTIVES) == collectives)
    if collectives:
        return ", ".join(f"{k} {t.calls[k]:.0f} ({t.tag_bytes[k] / 2**10:,.0f} KiB)"
                         for k in tags) or "none"
    return ", ".join(f"{k} {t.calls[k]:.0f}" for k in tags) or "none"


def quantities(r: dict) -> list[tuple[str, float | str, float | str]]:
    """(name, lp_jax, sglang-jax) of one shape's comparison."""
    a, b = r["lp_jax"], r["sglang-jax"]
    mib, mflop = 2**20, 1e6
    rows = []
    for part in ("layer", "outside"):
        label = "per layer" if part == "layer" else "outside the layers"
        rows += [(f"HBM MiB {label}", a[part].bytes / mib, b[part].bytes / mib),
                 (f"MFLOP {label}", a[part].flops / mflop, b[part].flops / mflop),
                 (f"predicted us {label}", a[part].seconds * 1e6, b[part].seconds * 1e6),
                 (f"interconnect KiB {label}", a[part].link_bytes / 2**10,
                  b[part].link_bytes / 2**10)]
    n = r["num_layers"]
    rows.append((f"predicted ms per step, {n} layers",
                 (a["outside"].seconds + n * a["layer"].seconds) * 1e3,
                 (b["outside"].seconds + n * b["layer"].seconds) * 1e3))
    rows += [("argument MiB per layer", a["argument_layer"] / mib, b["argument_layer"] / mib),
             ("argument MiB outside", a["argument_outside"] / mib, b["argument_outside"] / mib),
             ("temporaries MiB (2 layers)", a["temp"] / mib, b["temp"] / mib),
             ("collectives per layer", _calls(a["layer"], True), _calls(b["layer"], True)),
             ("Pallas calls per layer", _calls(a["layer"], False), _calls(b["layer"], False)),
             ("compile s (2 layers)", a["compile_s"], b["compile_s"])]
    for cls in compiled.CLASSES:
        rows.append((f"  us per layer: {cls}", a["layer"].by_class[cls] * 1e6,
                     b["layer"].by_class[cls] * 1e6))
    return rows


def render(rows: list[dict]) -> str:
    """A markdown table per shape: lp_jax, sglang-jax and their ratio."""
    lines = []
    for r in rows:
        lines += [f"\n{r['mode']} {r['tokens']} rows, per device\n",
                  "| quantity | lp_jax | sglang-jax | lp_jax / sglang-jax |",
                  "| --- | ---: | ---: | ---: |"]
        for name, x, y in quantities(r):
            if isinstance(x, str):
                lines.append(f"| {name} | {x} | {y} | |")
                continue
            ratio = f"{x / y:.2f}" if abs(y) > 1e-9 else "n/a"
            lines.append(f"| {name} | {x:,.1f} | {y:,.1f} | {ratio} |")
    return "\n".join(lines)
