"""The roofline of the compiled programs of an AOT run (`python -m lp_jax.roofline --aot DIR`).

Design note. `python -m lp_jax.aot` writes each program's optimized HLO
(program_N.hlo.txt) beside summary.json. XLA's own `cost_analysis()` counts the layer
loop once (a 3-layer and a 6-layer program report the same flops) and a Pallas call
only as far as its `pl.CostEstimate` declares (none on GPU), so this module reads the
HLO itself:

    HLO text -> hlo.parse -> walk: one record (class, flops, HBM bytes, link bytes) per op
      outside the layer loop      counted once per call
      the layer loop's body       counted once per layer the call runs
      Pallas custom calls         costed by pallas_kernels/cost.py, by kernel name
    -> time per op = max(flops / (peak x eff_compute), bytes / (HBM bw x eff_mem),
                         link bytes / (link bw / 2 x eff_mem)), summed over ops
    -> compared with cost_model.model_step_cost on the same shapes

Rules, stated in the output: the layer loop is the top-level while loop that costs
most; another while loop counts the trips XLA knows (`known_trip_count`, or a condition
`counter < constant`: a `lax.map` over query blocks), else, in the paged attention
functions, the pages of the assumed context (the XLA attention's walk over a sequence's
pages), else one trip; a
conditional costs its costliest branch (the MoE branch, the ragged attention path,
sampling), except:
* prompt scoring (`_score_prompt`, off unless a request asks for prompt
  log-probabilities), which costs its skip branch;
* the layer kind: a model with dense and MoE layers (DeepSeek-V3's first three) picks
  the kind in the loop body by the layer index (`_moe` or the dense `_swiglu`); the
  body is costed once for each kind and counted per layer of that kind;
* latent attention (MLA) takes no branch: every step runs the absorbed form, the MLA
  kernel on TPU and GPU (costed as every Pallas call, at the program's rows, prefill
  rows included), XLA's reference elsewhere (`*paged_attention` functions, classed as
  attention). A Pallas call's cost is
`cost.estimate(kernel, ...)` at the program's rows: uniform routing over the experts,
and every sequence at one context length after the step, the new rows spread evenly
over min(rows, max_num_seqs) sequences. The attention kernels walk only the pages
below each sequence's run-time length, which no static reading can see, so the
context is an input (`--context-len`, default max_model_len: a full page table); the
analytic model takes the same contexts, and the tables state them.

A GEMM handed to cuBLAS (`__cublas$...` custom calls) is costed as the dot it is.

Bytes: an op moves its operands and result, except that an in-place update moves its
update, and an operand that a fusion only slices or gathers from (stacked layer weights,
the embedding), directly or in a fusion nested in it, moves the slice. A collective
sends its operands over the links (an all-gather: its result), also inside a fusion:
XLA:TPU writes a reduce-scatter as a fusion of an all-reduce and its slice. An
all-reduce is charged its operands on one direction of the links; a reduce-scatter,
an all-gather and an all-to-all half of their buffer, as a ring moves them (`_sent`). Every
asynchronous copy (copy-start, slice-start) moves its bytes, a cross-program prefetch
and its end-of-program copy both: the second lets the next call of the same program skip
the first, but a call after another program's does not, so a call is charged both.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

from lp_jax.roofline import hlo
from lp_jax.roofline.cost_model import StepTokens, layer_cost, model_step_cost
from lp_jax.roofline.hardware import Hardware, get_hardware
from lp_jax.roofline.model_shape import ModelShape
from pallas_kernels import cost

EFF_COMPUTE = 0.6  # ASSUMED until fitted on the H200
EFF_MEM = 0.8  # ASSUMED until fitted on the H200
FLAG_ABOVE = 0.10  # differences to the analytic model above this are explained
# Pallas custom-call targets in optimized HLO (Mosaic GPU's is "mosaic_gpu_v2" there)
PALLAS_TARGETS = ("tpu_custom_call", "mosaic_gpu", "mosaic_gpu_v2", "__gpu$xla.gpu.triton")
# Query rows (block_q x query heads per KV head) per work item of the attention
# kernels: attention/tpu.py DEFAULT_BLOCK_ROWS, attention/gpu.py PREFILL_BLOCK_ROWS. The
# GPU prefill kernel's is read from each program's call instead (`prefill_block_q`), so
# that a program compiled with other tiles is costed at its own.
BLOCK_ROWS = {cost.TPU_ATTENTION: 256, cost.TPU_JAX_ATTENTION: 256,
              cost.GPU_PREFILL_ATTENTION: 256}
SKIPPED_FUNCTIONS = ("_score_prompt",)  # conditionals that cost their skip branch
MLA_KERNELS = (cost.TPU_MLA_DECODE, cost.GPU_MLA_DECODE)  # attention, not "attention"-named
MOE_FUNCTIONS, DENSE_MLP_FUNCTIONS = ("._moe",), ("._swiglu",)  # the layer-kind branches
ATTENTION_FUNCTIONS = ("paged_attention",)  # XLA attention (the refs, MLA's included)
SAMPLING_FUNCTIONS = ("sample", "logits", "penal", "logprob", "apply_bias")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id", "copy-done", "slice-done", "opt-barrier", "add-dependency",
         "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done",
         "send-done", "recv-done", "domain", "call-update", "call-done", "async-update"}
_COLLECTIVES = {"all-reduce", "all-reduce-start", "all-gather", "all-gather-start",
                "reduce-scatter", "all-to-all", "collective-permute",
                "collective-permute-start", "ragged-all-to-all"}
_ARITH = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "exponential",
          "log", "tanh", "logistic", "rsqrt", "sqrt", "power", "negate", "abs", "compare",
          "select", "exponential-minus-one", "log-plus-one", "erf", "cosine", "sine"}
_SLICING = {"dynamic-slice", "slice", "gather"}
CLASSES = ("attention", "experts", "dense matmuls", "logits/sampling", "collectives",
           "other")
# What explains a class's gap to the analytic model (cost_model.py).
WHY = {
    "attention": "attention runs on every device of the expert axis (the formula splits "
                 "tokens over ep) and cost.py reads whole pages of every sequence's "
                 "context",
    "experts": "the MoE kernels' cost.py estimates (uniform routing) against the "
               "formula's expert GEMMs",
    "dense matmuls": "q/k/v/o, router and dense-MLP matmuls as compiled: float32 "
                     "accumulation outputs, layouts, replicated rows",
    "logits/sampling": "sampling: the LM head over every sampled row in float32, "
                       "penalties, top-k/top-p and the token draw, which the formula "
                       "reduces to one bf16 LM head",
    "collectives": "expert-parallel dispatch and tensor-parallel all-reduces as "
                   "compiled (the formula overlaps them with compute)",
    "other": "ops the formula leaves out: norms, rotary, routing layout and the sorted / "
             "gathered copy of x, KV writes, elementwise ops over the padded row bucket",
}
# Latent attention's gap: every step runs the absorbed form (the MLA kernel), N (2A + R)
# multiply-adds a (query row, key) pair; the formula costs a prefilling sequence's chunk
# expanded, kv_b_proj once a key then N (H + R + O) a pair, which is cheaper above
# A (H + O) / (2A - H - O) rows a sequence (171 for DeepSeek-V3) on a long context, twice
# that for a whole prompt (causal: half the pairs), and dearer below.
WHY_MLA = {"attention": "MLA: every row runs absorbed (the MLA kernel, cost.py); the formula "
                        "costs a sequence's prefill rows in the cheaper form: expanded once a "
                        "key (kv_b_proj) and then per head above about A (H + O) / (2A - H "
                        "- O) rows a sequence on a long context (171 for DeepSeek-V3), "
                        "absorbed below"}


@dataclasses.dataclass
class Op:
    cls: str
    flops: float = 0.0
    bytes: float = 0.0
    link_bytes: float = 0.0
    kernel: str | None = None  # a Pallas kernel's name

    def seconds(self, hw: Hardware, eff_compute: float, eff_mem: float) -> float:
        link = 0.5 * hw.interconnect_bw * eff_mem
        return max(self.flops / (hw.peak_flops * eff_compute),
                   self.bytes / (hw.hbm_bw * eff_mem),
                   self.link_bytes / link if self.link_bytes and link > 0 else 0.0)


@dataclasses.dataclass(frozen=True)
class Program:
    """What the kernel estimates need of one program: its shapes and mesh."""

    rows: int
    seqs: int
    pages_per_seq: int
    page_size: int
    tp: int
    ep: int
    shape: ModelShape
    context_len: int  # keys per sequence after the step, assumed (<= pages_per_seq * S)


def kernel_cost(name: str, p: Program, block_q: int | None = None) -> cost.KernelCost:
    """`cost.estimate(name, ...)` at the program's rows, per device: uniform routing over
    the experts (a device holds 1/ep of them and their rows), every sequence at
    p.context_len keys. block_q: an attention kernel's query tokens per work item as
    the program has them (None: BLOCK_ROWS over the query heads a KV head)."""
    s, b = p.shape, p.shape.dtype_bytes
    if name in (cost.TPU_ATTENTION, cost.TPU_JAX_ATTENTION, cost.GPU_DECODE_ATTENTION,
                cost.GPU_PREFILL_ATTENTION):
        tokens = p.seqs if name == cost.GPU_DECODE_ATTENTION else p.rows
        heads, kv_heads = max(s.num_q_heads // p.tp, 1), max(s.num_kv_heads // p.tp, 1)
        if block_q is None:
            block_q = max(1, BLOCK_ROWS.get(name, 1) // (heads // kv_heads))
        return cost.estimate(
            name, tokens=tokens, seqs=p.seqs, pages_per_seq=p.pages_per_seq,
            page_size=p.page_size, heads=heads, kv_heads=kv_heads, head_dim=s.head_dim,
            q_itemsize=b, kv_itemsize=b, context_len=p.context_len, block_q=block_q)
    if name in (cost.TPU_MLA_DECODE, cost.GPU_MLA_DECODE):  # s.mla_ranks: (Q, A, R, O)
        _, A, R, _ = s.mla_ranks
        return cost.estimate(name, tokens=p.rows, seqs=p.seqs,
                             context=p.context_len,
                             heads=max(s.num_q_heads // p.tp, 1), latent_dim=A, rope_dim=R,
                             q_itemsize=b, kv_itemsize=b)
    glu = "gate_up" in name
    F = s.expert_width // p.tp
    k, n = (s.hidden_size, F) if glu else (F, s.hidden_size)
    c = cost.estimate(name, tokens=p.rows, top_k=s.top_k, experts=s.num_experts, k=k, n=n,
                      glu=glu, lhs_itemsize=b, w_itemsize=b, out_itemsize=b)
    return cost.KernelCost(*(round(v / p.ep) for v in dataclasses.astuple(c)))


def prefill_block_q(instr: hlo.Instr, p: Program) -> int | None:
    """The GPU prefill kernel's query tokens per work item, read from the call: its first
    operand holds one meta row per item, ceil(T / block_q) + B of them (attention/gpu.py
    `_prefill_items`), B the page table's rows (the second operand), T the program's
    rows. None when no power of two fits (BLOCK_ROWS is taken then)."""
    constraints = instr.attrs.split("operand_layout_constraints={", 1)
    dims = [hlo.dims_of(t) for t in constraints[-1].split("}, ")[:2]]
    if len(constraints) < 2 or len(dims) < 2 or len(dims[0]) != 2 or len(dims[1]) != 2:
        return None
    items, seqs = dims[0][0], dims[1][0]
    block_q = 1
    while block_q <= p.rows:
        if math.ceil(p.rows / block_q) + seqs == items:
            return block_q
        block_q *= 2
    return None


def kernel_name(instr: hlo.Instr, p: Program) -> str:
    """The cost.py name of a Pallas custom call: its instruction name, op_name or
    backend_config; a GPU MoE kernel (`mosaic_gpu`, unnamed) by its weight operand
    ([G, D, 2F]: gate/up, [G, F, D]: down)."""
    head = instr.name + " " + (instr.attr("op_name") or "")
    for text in (head, instr.attrs):
        found = [n for n in cost.ESTIMATES if n in text]
        if found:
            return max(found, key=len)
    if (instr.attr("custom_call_target") or "").startswith("mosaic_gpu"):
        return cost.GPU_MOE_GATE_UP if _last_dim_is_2f(instr, p) else cost.GPU_MOE_DOWN
    raise KeyError(f"Pallas call {instr.name} names no kernel of pallas_kernels/cost.py")


def _last_dim_is_2f(instr: hlo.Instr, p: Program) -> bool:
    constraints = instr.attrs.split("operand_layout_constraints={", 1)[-1]
    dims = [hlo.dims_of(t) for t in constraints.split("}, ")]
    return any(len(d) == 3 and d[-1] == 2 * p.shape.expert_width // p.tp for d in dims)


def _conv_macs_per_output(comp: hlo.Computation, ins: hlo.Instr) -> int:
    """Multiply-adds per output element of a convolution: the input features times, per
    spatial dimension, the window positions that can land on the input. XLA:TPU writes
    some einsums as a convolution whose window (128, padded 127 on each side) slides over
    a spatial dimension of size 1: one position of it is real, not 128. A batched einsum
    (MLA's per-head "tnh,anh->tna") becomes a window of 128 over an input dilated by 128
    (`lhs_dilate`): a window covers ceil(size / dilation) real positions, here one."""
    lhs = hlo.dims_of(comp.instrs[ins.operands[0]].type)
    rhs = hlo.dims_of(comp.instrs[ins.operands[1]].type)
    lhs_labels, rest = (ins.attr("dim_labels") or "bf_io->bf").split("_", 1)
    rhs_labels = rest.split("->")[0]
    window = re.search(r"window=\{size=([\dx]+)", ins.attrs)
    sizes = [int(w) for w in window.group(1).split("x")] if window else []
    dilated = re.search(r"lhs_dilate=([\dx]+)", ins.attrs)
    dilation = [int(d) for d in dilated.group(1).split("x")] if dilated else [1] * len(sizes)
    macs = rhs[rhs_labels.index("i")] if "i" in rhs_labels else 1
    for k, label in enumerate(lhs_labels):
        if label.isdigit() and int(label) < len(sizes):
            j = int(label)
            macs *= min(-(-sizes[j] // dilation[j]), lhs[k])
    return macs


def _is_cublas(ins: hlo.Instr) -> bool:
    """A GEMM that XLA:GPU calls cuBLAS for (Triton GEMMs off, or the autotuner's pick)."""
    return ins.opcode == "custom-call" and (ins.attr("custom_call_target") or "").startswith(
        "__cublas$")


def _scaled(ops: list[Op], trips: int) -> list[Op]:
    """ops run `trips` times, as one op each."""
    if trips == 1:
        return ops
    return [dataclasses.replace(op, flops=op.flops * trips, bytes=op.bytes * trips,
                                link_bytes=op.link_bytes * trips) for op in ops]


class Walker:
    """Costs one module's ops (see the module docstring for the rules)."""

    def __init__(self, module: hlo.Module, p: Program, hw: Hardware, eff_compute: float,
                 eff_mem: float):
        self.m, self.p, self.hw = module, p, hw
        self.eff = (eff_compute, eff_mem)
        self.vocab_dev = p.shape.vocab_size // p.tp
        self.hbm_only = hw.name.startswith("TPU")  # VMEM / SMEM buffers are no HBM traffic
        self.estimates: dict[str, cost.KernelCost] = {}  # each Pallas kernel's, as costed
        self.layer_kind = "moe"  # which branch of a layer-kind conditional is costed

    def hbm(self, type_text: str) -> float:
        return hlo.shape_bytes(type_text, self.hbm_only)

    def seconds(self, ops) -> float:
        return sum(op.seconds(self.hw, *self.eff) for op in ops)

    def split(self) -> tuple[list[Op], list[Op]]:
        """(outside the layer loop, the layer loop's body once)."""
        loops: dict[str, list[Op]] = {}
        outside = self.walk(self.m.computations[self.m.entry], loops, top=True)
        if not loops:
            raise ValueError("no while loop in the program: no layer loop to split off")
        body = max(loops, key=lambda k: self.seconds(loops[k][1]) * loops[k][0])
        for name, (trips, ops) in loops.items():
            if name != body:
                outside += _scaled(ops, trips)
        return outside, loops[body][1]

    def _trips(self, ins: hlo.Instr, body: hlo.Computation) -> int:
        """Trips counted for a loop that is not the layer loop (module docstring)."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
        if known:
            return int(known.group(1))
        cond = self.m.computations[ins.attr("condition").lstrip("%")]
        bound = cond.instrs.get(cond.root.operands[-1]) if cond.root.operands else None
        if (cond.root.opcode == "compare" and "direction=LT" in cond.root.attrs
                and bound is not None and bound.opcode == "constant"):
            return int(bound.args)  # XLA:TPU records no trip count: `i < n` from 0
        if any(f in fn for i in body.instrs.values() for fn in self.m.functions_of(i)[:1]
               for f in ATTENTION_FUNCTIONS):
            return math.ceil(self.p.context_len / self.p.page_size)
        return 1

    def walk(self, comp: hlo.Computation, loops: dict, top: bool) -> list[Op]:
        ops: list[Op] = []
        for ins in comp.instrs.values():
            if ins.opcode == "while":
                body_comp = self.m.computations[ins.attr("body").lstrip("%")]
                body = self.walk(body_comp, loops, top=False)
                if top:
                    loops[ins.name] = (self._trips(ins, body_comp), body)
                else:
                    ops += _scaled(body, self._trips(ins, body_comp))
            elif ins.opcode == "conditional":
                ops += self._branch(ins, loops, top)
            elif ins.opcode in ("call", "async-start", "call-start") and ins.called:
                ops += self.walk(self.m.computations[ins.called[0]], loops, top)
            else:
                op = self.op(comp, ins)
                if op is not None:
                    ops.append(op)
        return ops

    def split_kinds(self) -> tuple[list[Op], dict[str, list[Op]]]:
        """(outside the layer loop, {layer kind: the loop's body once}): kinds "moe" and
        "dense" for a model with both, else the one kind its layers have."""
        s = self.p.shape
        kinds = [k for k, n in (("moe", s.num_moe_layers), ("dense", s.dense_layers_count))
                 if n]
        bodies = {}
        for kind in kinds:
            self.layer_kind = kind
            outside, bodies[kind] = self.split()
        return outside, bodies

    def _branch(self, ins: hlo.Instr, loops: dict, top: bool) -> list[Op]:
        branches = []
        for name in ins.called:
            inner: dict[str, tuple[int, list[Op]]] = {}
            ops = self.walk(self.m.computations[name], inner, top)
            ops += [op for trips, loop in inner.values() for op in _scaled(loop, trips)]
            branches.append((self.seconds(ops), ops, name))
        if any(self._calls(name, SKIPPED_FUNCTIONS) for *_, name in branches):
            return min(branches, key=lambda b: b[0])[1]
        moe = [b for b in branches if self._calls(b[2], MOE_FUNCTIONS)]
        dense = [b for b in branches if b not in moe and self._calls(b[2], DENSE_MLP_FUNCTIONS)]
        if moe and dense:
            branches = moe if self.layer_kind == "moe" else dense
        return max(branches, key=lambda b: b[0])[1]

    def _calls(self, comp_name: str, functions, seen=None) -> bool:
        """Whether an instruction of comp_name (or what it calls) comes from `functions`."""
        seen = set() if seen is None else seen
        if comp_name in seen:
            return False
        seen.add(comp_name)
        for ins in self.m.computations[comp_name].instrs.values():
            if any(f in fn for fn in self.m.functions_of(ins)[:1] for f in functions):
                return True
            if any(self._calls(c, functions, seen) for c in ins.called):
                return True
        return False

    def op(self, comp: hlo.Computation, ins: hlo.Instr) -> Op | None:
        if ins.opcode in _FREE:
            return None
        operand_bytes = [self._bytes_of(comp, o) for o in ins.operands]
        if ins.opcode == "custom-call":
            target = ins.attr("custom_call_target")
            if target in PALLAS_TARGETS:
                name = kernel_name(ins, self.p)
                block_q = (prefill_block_q(ins, self.p)
                           if name == cost.GPU_PREFILL_ATTENTION else None)
                c = kernel_cost(name, self.p, block_q)
                cls = "attention" if "attention" in name or name in MLA_KERNELS else "experts"
                self.estimates[name] = c
                return Op(cls, c.flops, c.bytes_accessed, kernel=name)
            if target == "AllocateBuffer":
                return None
        if ins.opcode in _COLLECTIVES:
            return Op("collectives", 0.0, sum(operand_bytes) + self.hbm(ins.type),
                      self._sent(comp, ins))
        if ins.opcode == "fusion":
            sent = self._fused_sent(self.m.computations[ins.called[0]])
            if sent:  # XLA:TPU's reduce-scatter: a fusion around an all-reduce and a slice
                return Op("collectives", 0.0, self._fusion_bytes(comp, ins), sent)
        if ins.opcode in ("copy-start", "slice-start"):  # a DMA, e.g. a prefetch to VMEM
            parts = hlo.shapes(ins.type)
            size, dest = parts[0] if ins.opcode == "copy-start" else parts[1]
            src_hbm = sum(operand_bytes) > 0
            return Op("other", 0.0, size * (src_hbm + (not dest or not self.hbm_only)))
        flops, has_dot = self._flops(comp, ins)
        if ins.opcode == "fusion":
            moved = self._fusion_bytes(comp, ins)
        elif ins.opcode == "dynamic-update-slice":
            moved = 2 * operand_bytes[1]
        elif ins.opcode == "scatter":
            moved = 2 * operand_bytes[-1] + sum(operand_bytes[1:-1])
        elif ins.opcode in _SLICING:
            moved = (operand_bytes[0] > 0) * ins.bytes + self.hbm(ins.type) + sum(
                operand_bytes[1:])
        elif _is_cublas(ins):  # its result, not the scratch workspace beside it
            size, space = hlo.shapes(ins.type)[0]
            moved = sum(operand_bytes) + (0.0 if self.hbm_only and space else size)
        else:
            moved = sum(operand_bytes) + self.hbm(ins.type)
        return Op(self._class(ins, has_dot), flops, moved)

    @staticmethod
    def _sent(comp: hlo.Computation, ins: hlo.Instr, scatter: bool = False) -> float:
        """Link bytes of a collective, in the units `Op.seconds` charges on one direction
        of the links: an all-reduce of B bytes costs B (a bidirectional ring sends
        (n - 1) / n B each way). A ring all-reduce is a reduce-scatter then an
        all-gather, so a reduce-scatter of B (`scatter`: an all-reduce whose result the
        fusion around it only slices, as XLA:TPU writes one) and an all-gather to B each
        cost B / 2, and an all-to-all of B (each device keeps 1/n, the rest go out over
        both directions; its hops on a torus not counted) B / 2 as well. A
        collective-permute sends its B to one peer, one way; a ragged all-to-all is
        charged its whole input buffer (its sizes are known only at run time)."""
        op = ins.opcode.removesuffix("-start")
        if op == "all-gather":  # its result; "-start" also carries the operand
            return max(n for n, _ in hlo.shapes(ins.type)) / 2
        operands = ins.operands[:1] if op == "ragged-all-to-all" else ins.operands  # its input
        sent = sum(hlo.shape_bytes(comp.instrs[o].type) for o in operands
                   if o in comp.instrs)
        halved = op in ("reduce-scatter", "all-to-all", "ragged-all-to-all") or (
            op == "all-reduce" and scatter)
        return sent / 2 if halved else sent

    def _fused_sent(self, fused: hlo.Computation) -> float:
        """Link bytes of the collectives inside a fusion (and fusions nested in it)."""
        sliced = {i.operands[0] for i in fused.instrs.values()
                  if i.opcode == "dynamic-slice" and i.operands}
        sent = 0.0
        for inner in fused.instrs.values():
            if inner.opcode in _COLLECTIVES:
                sent += self._sent(fused, inner, scatter=inner.name in sliced)
            elif inner.opcode == "fusion":
                sent += self._fused_sent(self.m.computations[inner.called[0]])
        return sent

    def _class(self, ins: hlo.Instr, has_dot: bool) -> str:
        fn = (self.m.functions_of(ins) or ("",))[0]
        if any(f in fn for f in SAMPLING_FUNCTIONS) or (
                has_dot and self.vocab_dev in hlo.dims_of(ins.type)):
            return "logits/sampling"
        if any(f in name for name in self.m.functions_of(ins) for f in ATTENTION_FUNCTIONS):
            return "attention"
        return "dense matmuls" if has_dot else "other"

    def _bytes_of(self, comp: hlo.Computation, name: str) -> float:
        ins = comp.instrs.get(name)
        return self.hbm(ins.type) if ins is not None else 0.0

    def _flops(self, comp: hlo.Computation, ins: hlo.Instr) -> tuple[float, bool]:
        if ins.opcode == "fusion":
            fused = self.m.computations[ins.called[0]]
            total, dot = 0.0, False
            for inner in fused.instrs.values():
                f, d = self._flops(fused, inner)
                total, dot = total + f, dot or d
            # a matrix-vector product (one row) XLA writes as multiply + reduce
            dot = dot or any(i.opcode == "reduce" and fused.instrs.get(i.operands[0]) is not None
                             and fused.instrs[i.operands[0]].opcode == "multiply"
                             for i in fused.instrs.values())
            return total, dot
        if ins.opcode == "dot":
            lhs = hlo.dims_of(comp.instrs[ins.operands[0]].type)
            contracting = [int(d) for d in (ins.attr("lhs_contracting_dims") or "{}")
                           .strip("{}").split(",") if d]
            return 2.0 * ins.elements * math.prod(lhs[d] for d in contracting), True
        if ins.opcode == "convolution":
            return 2.0 * ins.elements * _conv_macs_per_output(comp, ins), True
        if _is_cublas(ins):  # a GEMM XLA:GPU hands to cuBLAS: (result, workspace)
            lhs = hlo.dims_of(comp.instrs[ins.operands[0]].type)
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
            contracting = [int(d.strip('" ')) for d in (m.group(1) if m else "").split(",")
                           if d.strip('" ')]
            return 2.0 * ins.elements * math.prod(lhs[d] for d in contracting), True
        if ins.opcode in _ARITH:
            return float(ins.elements), False
        if ins.opcode == "reduce":
            return float(math.prod(hlo.dims_of(comp.instrs[ins.operands[0]].type))), False
        return 0.0, False

    def _fusion_bytes(self, comp: hlo.Computation, ins: hlo.Instr) -> float:
        fused = self.m.computations[ins.called[0]]
        params = {i.name: int(i.args) for i in fused.instrs.values() if i.opcode == "parameter"}
        users: dict[str, list[hlo.Instr]] = {n: [] for n in params}
        for inner in fused.instrs.values():
            for o in inner.operands:
                if o in users:
                    users[o].append(inner)
        root = fused.root
        outs = ([fused.instrs[o] for o in root.operands] if root.opcode == "tuple" else [root])
        in_place, written = set(), 0.0
        for out in outs:
            if out.opcode in ("dynamic-update-slice", "scatter") and out.operands[0] in params:
                in_place.add(out.operands[0])
                update = fused.instrs[out.operands[1 if out.opcode != "scatter" else -1]]
                written += self.hbm(update.type) if self.hbm(out.type) else 0.0
            else:
                written += self.hbm(out.type)
        read = 0.0
        for name, index in params.items():
            if name in in_place:
                continue
            outer = self._bytes_of(comp, ins.operands[index]) if index < len(ins.operands) else 0
            sliced = self._sliced_read(fused, name, users[name]) if outer else None
            read += outer if sliced is None else min(sliced, outer)
        return read + written

    def _sliced_read(self, fused: hlo.Computation, name: str, uses) -> float | None:
        """Bytes read of a fusion parameter that is only sliced or gathered from (directly,
        through bitcasts, or inside a nested fusion, as XLA:TPU nests the dynamic-slice
        of a stacked weight in the fusion of its dot); None if some use reads it whole."""
        if not uses:
            return None
        total = 0.0
        for u in uses:
            if u.opcode in _SLICING and u.operands[0] == name:
                total += u.bytes
                continue
            if u.opcode == "bitcast":
                inner_uses = [i for i in fused.instrs.values() if u.name in i.operands]
                inner = self._sliced_read(fused, u.name, inner_uses)
            elif u.opcode == "fusion" and u.operands.count(name) == 1:
                nested = self.m.computations[u.called[0]]
                index = u.operands.index(name)
                param = next((i for i in nested.instrs.values()
                              if i.opcode == "parameter" and int(i.args) == index), None)
                inner = None if param is None else self._sliced_read(
                    nested, param.name,
                    [i for i in nested.instrs.values() if param.name in i.operands])
            else:
                inner = None
            if inner is None:
                return None
            total += inner
        return total


@dataclasses.dataclass
class Part:
    """Summed cost of a list of ops, by class."""

    flops: float
    bytes: float
    link_bytes: float
    seconds: float
    by_class: dict[str, float]  # seconds

    @classmethod
    def of(cls, ops: list[Op], hw, eff_compute, eff_mem) -> Part:
        by_class = dict.fromkeys(CLASSES, 0.0)
        for op in ops:
            by_class[op.cls] += op.seconds(hw, eff_compute, eff_mem)
        return cls(sum(o.flops for o in ops), sum(o.bytes for o in ops),
                   sum(o.link_bytes for o in ops), sum(by_class.values()), by_class)


def step_tokens(p: Program) -> StepTokens:
    """The analytic model's step for a program's rows, as cost.py's kernels assume it:
    every sequence at p.context_len keys, the rows spread over min(rows, max_num_seqs)
    sequences."""
    ctx = p.context_len
    if p.rows <= p.seqs:
        return StepTokens(decode_seqs=p.rows, decode_context=ctx)
    chunk = p.rows // p.seqs
    return StepTokens(prefill_tokens=chunk * p.seqs, prefill_seqs=p.seqs,
                      prefill_past=max(ctx - chunk, 0))


ANALYTIC_CLASSES = {"qkv_proj": "dense matmuls", "o_proj": "dense matmuls",
                    "router": "dense matmuls", "dense_mlp": "dense matmuls",
                    "shared_experts": "dense matmuls",
                    "attn_prefill": "attention", "attn_decode": "attention",
                    "experts": "experts", "lm_head": "logits/sampling"}


def _by_class(ops, hw: Hardware, eff_compute: float, eff_mem: float) -> dict[str, float]:
    by_class = dict.fromkeys(CLASSES, 0.0)
    for op in ops:
        cls = ANALYTIC_CLASSES.get(op.name, "other")
        by_class[cls] += Op(cls, op.flops + op.pad_flops, op.bytes,
                            op.comm_bytes).seconds(hw, eff_compute, eff_mem)
    return by_class


def analytic(p: Program, hw: Hardware, eff_compute: float, eff_mem: float
             ) -> tuple[float, dict[str, float], dict[str, float]]:
    """(outside-loop seconds, {layer kind: seconds of one layer of that kind}, seconds by
    class for a call through every layer) of cost_model.model_step_cost, at the same
    efficiencies."""
    s, step = p.shape, step_tokens(p)
    total = model_step_cost(s, step, tp=p.tp, ep=p.ep, logits_tokens=p.seqs)
    by_class = _by_class(total.ops, hw, eff_compute, eff_mem)
    per_layer = {}
    for kind, moe in (("moe", True), ("dense", False)):
        layer = next((i for i in range(s.num_layers) if s.is_moe_layer(i) == moe), None)
        if layer is not None:
            one = layer_cost(s, step, layer=layer, tp=p.tp, ep=p.ep)
            per_layer[kind] = sum(_by_class(one.ops, hw, eff_compute, eff_mem).values())
    return by_class["logits/sampling"], per_layer, by_class


def target_hardware(target: str) -> Hardware:
    """The roofline table's entry for an AOT run's target chip name."""
    for alias in ("h200", "h100"):
        if alias in target.lower():
            return get_hardware(alias)
    return get_hardware(target)


def program_of(summary: dict, rows: int, context_len: int | None = None) -> Program:
    """A program of an AOT run's summary.json; context_len as `_program`."""
    shape_d = dict(summary["model_shape"])
    for key in ("dense_layers", "sliding_layers"):
        shape_d[key] = tuple(shape_d[key])
    return _program(ModelShape(**shape_d), summary["config"], rows, context_len)


def _program(shape: ModelShape, cfg: dict, rows: int, context_len: int | None = None
             ) -> Program:
    """context_len: the keys per sequence the estimates assume (None: max_model_len).
    Raises ValueError outside 1..max_model_len."""
    _, ep, tp = cfg["mesh_shape"]
    ctx = cfg["max_model_len"] if context_len is None else context_len
    if not 1 <= ctx <= cfg["max_model_len"]:
        raise ValueError(f"context length {ctx} is outside 1..max_model_len "
                         f"({cfg['max_model_len']}) of the compiled programs")
    return Program(rows=rows, seqs=min(rows, cfg["max_num_seqs"]),
                   pages_per_seq=math.ceil(cfg["max_model_len"] / cfg["page_size"]),
                   page_size=cfg["page_size"], tp=tp, ep=ep, shape=shape, context_len=ctx)


def kernel_estimates(hlo_text: str, model_cfg, aot_cfg, rows: int) -> list[dict]:
    """The Pallas calls of one program's optimized HLO (lp_jax.aot records them): each
    kernel's count and its cost.py estimate per call at these rows, per device."""
    p = _program(ModelShape.from_model_config(model_cfg, model_cfg.model_type),
                 dataclasses.asdict(aot_cfg), rows)
    module, counts, costs = hlo.parse(hlo_text), {}, {}
    for comp in module.computations.values():
        for ins in comp.instrs.values():
            if ins.opcode == "custom-call" and ins.attr("custom_call_target") in PALLAS_TARGETS:
                name = kernel_name(ins, p)
                counts[name] = counts.get(name, 0) + 1
                block_q = (prefill_block_q(ins, p)
                           if name == cost.GPU_PREFILL_ATTENTION else None)
                costs[name] = kernel_cost(name, p, block_q)
    return [{"kernel": name, "calls_in_hlo": n, **dataclasses.asdict(costs[name]),
             "assumes": "uniform routing, a full page table (every sequence at "
                        "max_model_len)"}
            for name, n in sorted(counts.items())]


@dataclasses.dataclass
class ProgramRoofline:
    rows: int
    layers: int
    outside: Part
    body: Part  # one layer (a MoE layer in a model with both kinds)
    kernels: dict[str, cost.KernelCost]  # per call, the ones of one layer and outside
    analytic_outside_s: float
    analytic_layer_s: dict[str, float]  # {"moe" / "dense": one layer of that kind}
    analytic_by_class: dict[str, float]
    xla_flops: float | None  # cost_analysis(): the layer loop counted once
    dense_body: Part | None = None  # one dense layer, in a model with both kinds
    dense_layers: int = 0

    @property
    def bodies(self) -> dict[str, tuple[int, Part]]:
        """{layer kind: (layers of that kind, one layer's cost)}."""
        if self.dense_body is None:
            return {"moe" if "moe" in self.analytic_layer_s else "dense": (self.layers, self.body)}
        return {"moe": (self.layers - self.dense_layers, self.body),
                "dense": (self.dense_layers, self.dense_body)}

    @property
    def call_s(self) -> float:
        return self.outside.seconds + sum(n * b.seconds for n, b in self.bodies.values())

    @property
    def analytic_s(self) -> float:
        return sum(self.analytic_by_class.values())

    @property
    def by_class(self) -> dict[str, float]:
        return {c: self.outside.by_class[c] + sum(n * b.by_class[c]
                                                  for n, b in self.bodies.values())
                for c in CLASSES}


def program_roofline(hlo_text: str, summary: dict, rows: int, *, hw: Hardware | None = None,
                     eff_compute: float = EFF_COMPUTE, eff_mem: float = EFF_MEM,
                     xla_flops: float | None = None, context_len: int | None = None
                     ) -> ProgramRoofline:
    hw = hw or target_hardware(summary["target"])
    p = program_of(summary, rows, context_len)
    walker = Walker(hlo.parse(hlo_text), p, hw, eff_compute, eff_mem)
    outside, bodies = walker.split_kinds()
    kernels = {op.kernel: walker.estimates[op.kernel]
               for op in outside + [o for b in bodies.values() for o in b] if op.kernel}
    a_out, a_layer, a_cls = analytic(p, hw, eff_compute, eff_mem)
    part = functools.partial(Part.of, hw=hw, eff_compute=eff_compute, eff_mem=eff_mem)
    both = len(bodies) == 2
    return ProgramRoofline(rows, summary["num_layers"], part(outside),
                           part(bodies["moe"] if "moe" in bodies else bodies["dense"]),
                           kernels, a_out, a_layer, a_cls, xla_flops,
                           dense_body=part(bodies["dense"]) if both else None,
                           dense_layers=p.shape.dense_layers_count if both else 0)


def read_aot(out_dir: Path, *, eff_compute: float = EFF_COMPUTE, eff_mem: float = EFF_MEM,
             context_len: int | None = None) -> tuple[dict, Hardware, list[ProgramRoofline]]:
    """Every program of an AOT run, costed with each sequence at context_len keys (None:
    max_model_len)."""
    out_dir = Path(out_dir)
    summary = json.loads((out_dir / "summary.json").read_text())
    if "model_shape" not in summary:
        raise ValueError(f"{out_dir}/summary.json predates the compiled roofline: rerun "
                         "python -m lp_jax.aot")
    hw = target_hardware(summary["target"])
    rooflines = []
    for prog in summary["programs"]:
        name = prog.get("optimized_hlo_file")
        if not name:
            raise ValueError(f"program {prog['rows']} has no optimized HLO (mode "
                             f"{summary['mode']!r}: an export compiles nothing)")
        xla = (prog.get("cost_analysis") or {}).get("flops")
        rooflines.append(program_roofline((out_dir / name).read_text(), summary, prog["rows"],
                                          hw=hw, eff_compute=eff_compute, eff_mem=eff_mem,
                                          xla_flops=xla, context_len=context_len))
    return summary, hw, rooflines
