"""The audit of an ahead-of-time lowered program: no weight copies, a donated KV pool,
no spilling kernel of ours, and a program that fits its GPU.

Rules (a violation fails `python -m lp_jax.aot`, naming the program and the op):

1. No value has the shape of one layer's expert weights ([E, D, 2F] or [E, F, D], global
   or per device), anywhere in the StableHLO or (TPU) the optimized HLO. The MoE kernels
   take the whole stacked parameter plus a layer index and address the layer themselves;
   a slice of that shape is a copy of one layer's experts (1.2 GB for Qwen3-30B-A3B).
   Expert biases (GPT-OSS: [E, 2F], [E, D], 0.5 MB a layer) are neither checked nor
   listed: a copy costs nothing, and with E = 32 their shape is also a 32-row tile of
   activations.
   Quantized experts (int8 / fp8 stacked [L, E, ...] plus scales, issue 31): no 16- or
   32-bit float value has the shape of the whole stacked experts or of one layer of them
   (`dequantised_copies`), in the StableHLO or the optimized HLO. The kernels convert
   weight tiles on chip; such a value is a dequantised copy in HBM (for one layer of
   Qwen3-30B-A3B 1.2 GB in bfloat16, twice the int8 bytes it replaces). The scales
   ([L, E, k, n] float32, named "*scale*") are not expert weights.
   A draft model (an MTP layer, `--speculative-config`) is a stack of one layer: its
   experts are [1, E, a, b] arguments, which the MoE kernels reshape (a bitcast) to
   [E, a, b], one layer's shape. With one, those shapes are not flagged in the
   StableHLO, and in the optimized HLO only an unfused instruction that makes a new
   buffer of one layer's shape is (a slice, a copy, a fusion: `layer_copy`'s rule),
   not a view of an argument.
2. The KV pool argument is donated and aliased to an output.
3. TPU, decode-sized programs (at most max_num_seqs rows; under data-parallel attention
   the rows of all ranks, R N for bucket N): temporary bytes stay below
   one layer's expert bytes per device, so a step cannot be hiding a copy of a layer.
   Larger programs hold activations that grow with their rows (8,224 prefill rows of
   Qwen3-30B-A3B: ~0.8 GiB), beyond one layer's experts on an 8-way expert mesh; their
   temporaries are reported, and rule 1 still holds for them.
4. TPU: no copy of the KV pool in the optimized HLO (`pool_copies`: a copy whose result
   has the pool's per-device element count, in any shape). A step writes a few rows
   into the donated pool in place; a copy inside the layer loop moves the whole pool in
   every layer of every step. The rule counts ops, not bytes, so it holds for a pool of
   any size (temporaries alone cannot tell a small pool's copy from a prefill's
   activations). XLA:CPU once copied the pool in the 1-row program: its single-row write
   became a fused dynamic-update-slice rooted in a bitcast, which XLA does not update in
   place (tests/test_program_memory.py).

5. Compiled programs: the KV pool is aliased to an output (memory_analysis's alias bytes
   cover the pool), not only marked donated in the StableHLO.
6. cuda compiles: none of our kernels (Mosaic GPU, Pallas Triton) spills registers or
   uses a stack frame (ptxas's report, `resources.py`); and weights + KV pool + the
   program's temporaries (all its arguments, its outputs not aliased to one, and its
   temporaries) fit in HBM x the memory fraction JAX's allocator is given.

Listed, not violations: XLA ops that take a one-layer slice of another stacked parameter
(attention projections, norms, the router). XLA may address those in place (TPU operand
fusion, GPU dynamic-slice fusion) or copy them; on TPU the temporaries in rule 3 say which.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import jax

_TENSOR = re.compile(r"tensor<([0-9x]+)x([a-z0-9]+)>")
_HLO_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]+)\]")
_PALLAS_CALLS = ("tpu_custom_call", "mosaic_gpu", "__gpu$xla.gpu.triton")


def _slice_shapes(build) -> tuple[set, dict, set]:
    """(expert slice shapes, {shape: parameter} of other stacked parameters' slices), each
    as both the global and the per-device one-layer shape; and the shapes, stacked and
    one layer, global and per device, of quantized (8-bit) expert weights, and for packed
    MXFP4 also those shapes with K rows, which a dequantised copy has."""
    experts, others, quantized = set(), {}, set()
    leaves = jax.tree_util.tree_flatten_with_path(build.args[0])[0]
    L = build.model_config.num_hidden_layers
    q = build.model_config.quantization
    pack = 1 if q is None else q.scheme.pack
    for path, x in leaves:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if x.ndim < 2 or "layers" not in name:
            continue
        local = x.sharding.shard_shape(x.shape)
        # one layer, squeezed or as the [1, ...] a dynamic_slice produces
        shapes = {s for one in (x.shape[1:], local[1:]) for s in (tuple(one), (1, *one))}
        if "experts_" in name:
            if x.ndim >= 4 and "scale" not in name:  # [L, E, a, b]; not biases or scales
                experts |= shapes
                if x.dtype.itemsize == 1:
                    quantized |= shapes | {tuple(x.shape), tuple(local)}
                    if pack > 1:  # MXFP4's bytes hold K/2 rows: the dequantised K rows
                        quantized |= {(*s[:-2], s[-2] * pack, s[-1])
                                      for s in shapes | {tuple(x.shape), tuple(local)}}
        elif x.shape[0] <= L and x.ndim >= 3:  # [L, a, b]: one layer is a matrix
            short = name.split("/")[-2] if "/" in name else name
            for s in shapes:
                others[s] = "|".join(sorted({*others.get(s, "").split("|"), short} - {""}))
    return experts, others, quantized


def _draft_expert_shapes(build) -> set:
    """The shapes a draft model's own experts take whole (an MTP layer: [1, E, a, b],
    global and per device), and as the [1 * E, a, b] the MoE kernels reshape a stack to
    (a bitcast): one layer's shapes that are no slice of the target's. Empty without a
    draft."""
    draft = build.draft_args[0].state if getattr(build, "draft_args", ()) else {}
    shapes = set()
    for path, x in jax.tree_util.tree_flatten_with_path(draft)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "experts_" in name and x.ndim >= 4 and "scale" not in name:
            for whole in (tuple(x.shape), tuple(x.sharding.shard_shape(x.shape))):
                shapes |= {whole, (whole[0] * whole[1], *whole[2:])}
    return shapes


_FLOAT_TYPES = ("bf16", "f16", "f32")  # StableHLO and HLO spell these alike


def dequantised_copies(text: str, shapes) -> list[str]:
    """The lines of a StableHLO or HLO text that hold a bf16 / f16 / f32 value of one of
    `shapes` (those of quantized expert weights: a dequantised copy of them)."""
    shapes = {tuple(s) for s in shapes}
    found = []
    for line in text.splitlines():
        vals = [(m.group(2), _dims(m.group(1))) for m in _TENSOR.finditer(line)]
        vals += [(m.group(1), _dims(m.group(2))) for m in _HLO_SHAPE.finditer(line)]
        if any(t in _FLOAT_TYPES and d in shapes for t, d in vals):
            found.append(line.strip()[:160])
    return found


# Optimized-HLO ops that make no HBM copy of their operand: entry and branch parameters,
# tuples and their elements, views, and async copies into another memory space
# (copy-start / copy-done: a prefetch, S(1) in the layout).
_NO_NEW_BUFFER = {"parameter", "get-tuple-element", "tuple", "bitcast", "copy-start",
                  "copy-done"}
_OPCODE = re.compile(r" = (?:\(.*?\)|\S+) ([a-z][a-z0-9-]*)\(")


def layer_copy(line: str, others: dict) -> str | None:
    """The parameter (`others`: {one-layer shape: name}) of which an unfused optimized-HLO
    instruction is a new buffer shaped like one layer, or None (parameters, tuples, views
    and async prefetches make no new HBM bytes)."""
    result = _HLO_SHAPE.search(line.split(" = ", 1)[1]) if " = " in line else None
    if result is None or _dims(result.group(2)) not in others:
        return None
    return None if _opcode(line) in _NO_NEW_BUFFER else others[_dims(result.group(2))]


def _opcode(line: str) -> str | None:
    """An optimized-HLO instruction's opcode (after its result type, tuple or not)."""
    m = _OPCODE.search(line)
    return m.group(1) if m else None


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.replace(",", "x").split("x") if d)


def audit_program(rec: dict, build, cfg=None) -> dict:
    """Checks one lowered program (a record from `lp_jax.aot.lower_program`; cfg, the
    AotConfig, gives the cuda target and memory fraction). Returns {"violations": [...],
    "listed": {...}}."""
    experts, others, quantized = _slice_shapes(build)
    draft = _draft_expert_shapes(build)
    violations, slices, pallas = [], Counter(), Counter()
    for line in rec["stablehlo"].splitlines():
        shapes = {_dims(m.group(1)) for m in _TENSOR.finditer(line)}
        op = line.strip()[:160]
        bad = (shapes & experts) - draft
        if bad:
            violations.append(f"a value shaped like one layer's experts {sorted(bad)}: {op}")
        if "dynamic_slice" in line:
            for s in shapes & set(others):
                slices[others[s]] += 1
        for call in _PALLAS_CALLS:
            if f"@{call}" in line:
                pallas[call] += 1
    hlo = rec.get("optimized_hlo")
    copies = Counter()
    if hlo:
        in_fusion = False
        for line in hlo.splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                name = line.split("(")[0]  # a computation's header
                in_fusion = "fused" in name or "fusion" in name
            shapes = {_dims(m.group(2)) for m in _HLO_SHAPE.finditer(line)}
            if draft:  # only new buffers: a draft's own stack shares one layer's shapes
                held = not in_fusion and layer_copy(line, dict.fromkeys(experts, "experts"))
            else:
                held = shapes & experts
            if held:
                violations.append(f"optimized HLO holds one layer's experts: {line.strip()[:160]}")
            copied = None if in_fusion else layer_copy(line, others)
            if copied:
                copies[copied] += 1
    if quantized:
        for text in (rec["stablehlo"], hlo or ""):
            violations += [f"a dequantised copy of the quantized experts: {op}"
                           for op in dequantised_copies(text, quantized)]
    violations += _check_donation(rec, build)
    if hlo:
        violations += _check_pool_copies(hlo, build)
    mem = rec.get("memory")
    limit = build.layer_expert_bytes_per_device
    # Decode-sized: the program's rows over all data ranks (N on each of R ranks).
    rows = build.spec.rows_for(rec["rows"])
    if mem and limit and rows <= build.spec.max_num_seqs and mem["temp"] >= limit:
        violations.append(f"temporaries {mem['temp'] / 2**20:.0f} MiB >= one layer's experts "
                          f"{limit / 2**20:.0f} MiB per device")
    violations += _check_compiled(rec, build, cfg)
    listed = {"sliced_for_xla_dots": dict(slices), "pallas_calls": dict(pallas)}
    if hlo:
        listed["materialized_layer_slices"] = dict(copies)  # TPU: what XLA did copy
    return {"violations": violations, "listed": listed}


def _check_compiled(rec: dict, build, cfg) -> list[str]:
    """Rules 5 and 6: the pool aliased in the compiled program; our kernels' spills and
    stack; the program's bytes against HBM x the memory fraction (cuda)."""
    from lp_jax.aot.resources import problems

    mem, out = rec.get("memory"), []
    if mem is None:
        return out
    kv = build.kv_bytes_per_device
    if mem["alias"] < kv:
        out.append(f"the KV pool ({kv / 2**20:.0f} MiB) is not aliased to an output: "
                   f"{mem['alias'] / 2**20:.0f} MiB of aliases")
    out += problems(rec.get("kernels") or [])
    if cfg is not None and cfg.platform == "cuda":
        from lp_jax.aot.chips import chip

        name, hbm = chip(cfg)
        need = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
        if need > hbm * cfg.memory_fraction:
            out.append(f"weights + KV + temporaries {need / 1e9:.2f} GB > {hbm / 1e9:.1f} GB "
                       f"HBM of a {name} x memory fraction {cfg.memory_fraction}")
    return out


_HLO_COPY = re.compile(r"^\s*(?:ROOT )?%\S+ = [a-z]+[0-9]*\[([0-9,]*)\]\S* copy\(")


def pool_copies(hlo: str, pool_elements: int) -> list[str]:
    """The copies in an optimized HLO text whose result has `pool_elements` elements (the
    KV pool per device, in its own shape or a reshaped one)."""
    return [line.strip()[:160] for line in hlo.splitlines()
            if (m := _HLO_COPY.match(line)) and math.prod(_dims(m.group(1))) == pool_elements]


def _check_pool_copies(hlo: str, build) -> list[str]:
    kv = build.args[1]
    elements = math.prod(kv.sharding.shard_shape(kv.shape))
    return [f"a copy of the KV pool: {op}" for op in pool_copies(hlo, elements)]


def _check_donation(rec: dict, build) -> list[str]:
    """The main function's KV-pool argument carries a donation / output alias."""
    kv = build.args[1]
    want = "x".join(str(d) for d in kv.shape)
    text = rec["stablehlo"]
    start = text.find("func.func public @main(")
    header = text[start : text.find("{\n", start)] if start >= 0 else ""
    for arg in re.split(r", %arg", header):
        if f"tensor<{want}x" in arg:
            if "tf.aliasing_output" in arg or "jax.buffer_donor" in arg:
                return []
            return [f"the KV pool argument (tensor<{want}x...>) is not donated: {arg[:200]}"]
    return [f"no KV pool argument of shape {kv.shape} in main()"]


def describe(summary: dict) -> str:
    """A short text report of a run's audit."""
    lines = []
    for p in summary["programs"]:
        listed = p["listed"]
        copies = listed.get("materialized_layer_slices")
        lines.append(f"rows {p['rows']}: pallas calls {listed['pallas_calls']}, "
                     f"XLA dots on sliced weights {listed['sliced_for_xla_dots']}"
                     + ("" if copies is None else f", of which materialized {copies}"))
    if summary.get("our_kernels"):
        lines.append(f"our kernels, compiled for one {summary['target']}:")
        lines += [f"  {k['kernel']} ({k['source']}): {k['registers']} registers, "
                  f"{k['threads'][0]} threads, {(k['shared_bytes'] or 0) / 1024:.0f} KiB shared, "
                  f"spills {k['spill_stores']} B, stack {k['stack']} B"
                  + (f", ptxas {','.join(k['notes'])}" if k.get("notes") else "")
                  + f"; grids {k['grids'][:3]}{' ...' if len(k['grids']) > 3 else ''}; "
                  f"rows {k['programs']}" for k in summary["our_kernels"]]
    v = summary["violations"]
    lines.append(f"audit: {'PASS' if not v else f'{len(v)} violations'}")
    lines += [f"  {x}" for x in v[:50]]
    return "\n".join(lines)
