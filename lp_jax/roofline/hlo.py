"""A reader of XLA's optimized HLO text: computations, instructions, shapes and the
Python function each instruction came from.

Design note. `compiled.as_text()` is the program as it will run: fused, partitioned
per device (SPMD), with its layouts. This module only parses it; what an instruction
costs is `compiled.py`'s business. An instruction keeps its result type (a shape or a
tuple of shapes), its opcode, its operands (by name, resolved within the computation),
the computations it calls (`calls=`, `body=`, `branch_computations=`, ...), and the
raw attribute text, from which callers read what they need (`dim_labels`,
`custom_call_target`, ...). The module's stack-frame table maps an instruction's
`stack_frame_id` to the chain of Python functions that emitted it.
"""

from __future__ import annotations

import dataclasses
import math
import re

ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
            "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
            "s4": 0.5, "u4": 0.5, "token": 0}
_SHAPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")
_CALLED = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_FRAME = re.compile(r"stack_frame_id=(\d+)")


_SHAPE_LAYOUT = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^}]*\})?")


def shapes(type_text: str) -> list[tuple[float, str]]:
    """(bytes, memory space) of each shape in a type; the space is the layout's S(n), ""
    for the default (HBM)."""
    out = []
    for dt, dims, layout in _SHAPE_LAYOUT.findall(type_text):
        space = re.search(r"S\(\d+\)", layout or "")
        out.append((ITEMSIZE.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d),
                    space.group(0) if space else ""))
    return out


def shape_bytes(type_text: str, hbm_only: bool = False) -> float:
    """Bytes of a shape or tuple of shapes ("bf16[64,512]{1,0}", "(s32[], f32[8])");
    hbm_only: only those in the default memory space (on TPU, S(1) is VMEM, S(2) SMEM)."""
    return sum(n for n, space in shapes(type_text) if not hbm_only or not space)


def dims_of(type_text: str) -> tuple[int, ...]:
    """The dimensions of the first shape in type_text."""
    m = _SHAPE.search(type_text)
    return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # the result type text
    opcode: str
    operands: list[str]
    args: str  # the text inside the operand parentheses ("0" for parameter(0))
    attrs: str  # everything after the operand list
    called: list[str]
    root: bool = False

    @property
    def bytes(self) -> float:
        return shape_bytes(self.type)

    @property
    def elements(self) -> int:
        return math.prod(dims_of(self.type))

    @property
    def frame(self) -> int | None:
        m = _FRAME.search(self.attrs)
        return int(m.group(1)) if m else None

    def attr(self, key: str) -> str | None:
        """A simple attribute's value: key="text" or key=token."""
        m = re.search(rf'\b{re.escape(key)}=("([^"]*)"|[^,\s}}]+)', self.attrs)
        return None if m is None else (m.group(2) if m.group(2) is not None else m.group(1))


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]

    @property
    def root(self) -> Instr:
        return next(i for i in self.instrs.values() if i.root)


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str
    functions: dict[int, tuple[str, ...]]  # stack frame id -> its functions, innermost first

    def functions_of(self, instr: Instr) -> tuple[str, ...]:
        return self.functions.get(instr.frame, ()) if instr.frame is not None else ()


def _split_type(rest: str) -> tuple[str, str]:
    """'(a, b{..}) opcode(...)' or 'bf16[..]{..} opcode(...)' -> (type, the rest)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch in "{["
        depth -= ch in "}]"
        if ch == " " and depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    type_text, rest = _split_type(m.group(3))
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    depth, end = 0, len(rest)
    for i in range(paren, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            end = i
            break
    operands = re.findall(r"%([\w.\-]+)", rest[paren:end])
    attrs = rest[end + 1:]
    called = [c for _, c in _CALLED.findall(attrs)]
    for group in _BRANCHES.findall(attrs):
        called += re.findall(r"%([\w.\-]+)", group)
    return Instr(m.group(2), type_text, opcode, operands, rest[paren + 1:end], attrs, called,
                 bool(m.group(1)))


def _stack_frames(lines: list[str]) -> dict[int, tuple[str, ...]]:
    """The FileNames / FunctionNames / FileLocations / StackFrames tables at the top."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is None or not line.strip():
            if line.startswith(("%", "ENTRY")):
                break
            continue
        head, _, rest = line.partition(" ")
        if head.isdigit():
            current[int(head)] = rest.strip().strip('"')
    names = tables.get("FunctionNames", {})
    loc_fn = {i: int(re.search(r"function_name_id=(\d+)", t).group(1))
              for i, t in tables.get("FileLocations", {}).items()
              if "function_name_id=" in t}
    frames = {}
    for i, t in tables.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", t)
        parent = re.search(r"parent_frame_id=(\d+)", t)
        frames[i] = (int(loc.group(1)) if loc else 0, int(parent.group(1)) if parent else 0)
    out = {}
    for i in frames:
        chain, seen, f = [], set(), i
        while f in frames and f not in seen:
            seen.add(f)
            loc, parent = frames[f]
            chain.append(names.get(loc_fn.get(loc, -1), "?"))
            f = parent
        out[i] = tuple(chain)
    return out


# A Pallas call's kernel_metadata may span lines (JSON, one field a line): joined onto
# its instruction's line, so a continuation line's "}" never reads as a computation's end.
_KERNEL_METADATA = re.compile(r"kernel_metadata=\{[^{}]*\}")


def parse(text: str) -> Module:
    text = _KERNEL_METADATA.sub(lambda m: m.group(0).replace("\n", " "), text)
    lines = text.splitlines()
    comps: dict[str, Computation] = {}
    entry, current = None, None
    for line in lines:
        header = _HEADER.match(line)
        if header:
            current = Computation(header.group(2), {})
            comps[current.name] = current
            if header.group(1):
                entry = current.name
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current.instrs[instr.name] = instr
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry, _stack_frames(lines))
