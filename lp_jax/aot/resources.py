"""What each compiled GPU kernel costs the SM: registers, spills, stack, shared memory,
threads and grid, read from the compilers' own reports.

Three sources, all written during a compile on this host (`lp_jax.aot`, the tests):

* Mosaic GPU kernels (the MoE): with MOSAIC_GPU_DUMP_TO=DIR and MOSAIC_GPU_DUMP_PTXAS=1
  (read at every kernel compile) Mosaic writes per kernel `body_N.ptxas`, the `ptxas -v`
  report it compiled with, and `body_N.before_layout_inference.txt`, whose `gpu.launch`
  gives grid, threads and dynamic shared memory and whose kernel arguments give the
  operand shapes. It also writes a ~30 MB pass log per kernel: `collect` deletes those.
  The DIR must exist (else Mosaic prints everything to stdout).
* XLA's kernels and Pallas Triton kernels (the attention): the per-compile options of
  `xla_dump_options` (so each program dumps to its own directory) make XLA write its
  PTX (`xla_dump_emitter_re=ptx`: only the PTX, not the Triton pass dumps, which would
  make the compile 5x slower) and `thunk_sequence.txt`, whose kernel thunks carry grid,
  threads and shared memory. XLA keeps no ptxas report, so `ptxas -v` runs here on the
  dumped PTX (the same sm_90a target, the same ptxas).

`ptxas_report` parses a `ptxas -v` listing into one record per entry function;
`collect` merges a dump directory into {kernel: record}. A kernel is "ours" if Pallas
named it (Mosaic GPU kernels, `lp_paged_*`): the audit fails on spills or stack there.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_NOTE = re.compile(r"\((C\d{4})\)[^\n]*function '([^']+)'")
OUR_KERNELS = ("mosaic_gpu", "lp_paged", "tile_gmm")  # name fragments of Pallas kernels


def ptxas_report(text: str) -> dict[str, dict]:
    """{entry function: {arch, registers, barriers, static_smem, stack, spill_stores,
    spill_loads, notes}} from `ptxas -v` output. notes: ptxas's Cxxxx codes that name
    the function (C7519: warpgroup.arrive injected to free registers for the WGMMAs)."""
    out, current = {}, None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault(m.group(1), {"arch": m.group(2), "notes": []})
        elif current is None:
            continue
        elif m := _PROPS.search(line):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif m := _USED.search(line):
            current.update(registers=int(m.group(1)), barriers=int(m.group(2) or 0),
                           static_smem=int(m.group(3) or 0))
    for m in _NOTE.finditer(text):
        if m.group(2) in out and m.group(1) not in out[m.group(2)]["notes"]:
            out[m.group(2)]["notes"].append(m.group(1))
    return out


def run_ptxas(ptxas: str, ptx: Path, arch: str = "sm_90a") -> dict[str, dict]:
    """ptxas -v on one PTX file (its report, parsed); the cubin is thrown away."""
    proc = subprocess.run([ptxas, f"-arch={arch}", "-v", str(ptx), "-o", "/dev/null"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed on {ptx.name}: {proc.stderr[-1000:]}")
    return ptxas_report(proc.stdout + proc.stderr)


def is_ours(name: str) -> bool:
    return any(tag in name for tag in OUR_KERNELS)


_THUNK = re.compile(r"\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]"
                    r"\s+shared_memory: (\d+) bytes")
_LAUNCH = re.compile(r"gpu\.launch .*? in \(%\w+ = %c(\d+), %\w+ = %c(\d+), %\w+ = %c(\d+)\) "
                     r"threads\(.*?\) in \(%\w+ = %c(\d+), %\w+ = %c(\d+), %\w+ = %c(\d+)\)"
                     r"(?: dynamic_shared_memory_size %c(\d+))?")
_KERNEL_ARG = re.compile(r"to memref<([^>]*)> \{mosaic_gpu\.from_kernel_arg_idx = (\d+)")


def xla_dump_options(directory: Path) -> dict:
    """Per-compile XLA options: dump this compile's PTX and thunk sequence to directory,
    at XLA's default optimisation level whatever XLA_FLAGS says (`make test` compiles
    XLA:CPU programs at -O0 for speed; the resources reported must be the real ones)."""
    return {"xla_dump_to": str(directory), "xla_dump_emitter_re": "ptx",
            "xla_backend_optimization_level": 3}


@contextlib.contextmanager
def mosaic_dumps(directory: Path):
    """Mosaic GPU writes each kernel's ptxas report and launch into directory."""
    directory.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS")}
    os.environ.update(MOSAIC_GPU_DUMP_TO=str(directory), MOSAIC_GPU_DUMP_PTXAS="1")
    try:
        yield directory
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def thunk_kernels(text: str) -> dict[str, dict]:
    """{kernel: {grid, threads, shared_bytes}} of a thunk_sequence.txt (a kernel launched
    by several thunks, e.g. inside and outside a loop, is listed once)."""
    out = {}
    for m in _THUNK.finditer(text):
        v = [int(x) for x in m.groups()[1:]]
        out.setdefault(m.group(1), {"grid": v[0:3], "threads": v[3:6], "shared_bytes": v[6]})
    return out


def mosaic_kernel(report: str, module: str, name: str) -> dict:
    """One Mosaic GPU kernel's record from its ptxas report and its dumped module."""
    (entry,) = ptxas_report(report).values()
    rec = {"source": "mosaic_gpu", **entry}
    if m := _LAUNCH.search(module):
        v = [int(x) if x else 0 for x in m.groups()]
        rec.update(grid=v[0:3], threads=v[3:6], shared_bytes=v[6])
    args = [(int(i), shape) for shape, i in _KERNEL_ARG.findall(module)]
    rec["operands"] = [shape for _, shape in sorted(dict(args).items())]
    weights = next((o for o in rec["operands"] if o.count("x") == 3), None)  # [G, K, N]
    return {"name": f"{name}[{weights}]" if weights else name, **rec}


def collect(xla_dir: Path | None, mosaic_dir: Path | None, ptxas: str,
            mosaic_names=None, xla_registers: bool = False) -> list[dict]:
    """Every kernel of one compile: XLA's and Triton's from xla_dir (launch from its thunk
    sequence; ptxas -v on the PTX files holding our Triton kernels, or on all of them
    with xla_registers, ~10 s more for a step program's ~100 XLA kernels), Mosaic GPU's
    from mosaic_dir (only the basenames in mosaic_names, if given). Each record: name, source
    (xla | triton | mosaic_gpu), ours, registers, spill_stores, spill_loads, stack,
    static_smem, barriers, notes, grid, threads, shared_bytes (dynamic shared memory;
    Mosaic) or the thunk's shared memory (XLA, Triton)."""
    kernels = []
    if xla_dir is not None and xla_dir.is_dir():
        launch = {}
        for path in sorted(xla_dir.glob("*thunk_sequence.txt")):
            if "after_thunk_passes" not in path.name:
                launch.update(thunk_kernels(path.read_text()))
        reported = {}
        for ptx in sorted(xla_dir.glob("*.ptx")):
            if xla_registers or any(tag in ptx.read_text() for tag in OUR_KERNELS):
                reported.update(run_ptxas(ptxas, ptx))
        for name in dict.fromkeys([*launch, *reported]):
            source = "triton" if is_ours(name) else "xla"
            kernels.append({"name": name, "source": source, **reported.get(name, {}),
                            **launch.get(name, {})})
    if mosaic_dir is not None and mosaic_dir.is_dir():
        for report in sorted(mosaic_dir.glob("*.ptxas"), key=_dump_order):
            base = report.name[:-len(".ptxas")]
            if mosaic_names is not None and base not in mosaic_names:
                continue
            module = mosaic_dir / f"{base}.before_layout_inference.txt"
            kernels.append(mosaic_kernel(report.read_text(),
                                         module.read_text() if module.is_file() else "",
                                         f"mosaic_gpu:{base}"))
        for log in mosaic_dir.glob("*.mlir-passes.log"):
            log.unlink()  # ~30 MB of pass-by-pass IR per kernel
    for k in kernels:
        k["ours"] = k["source"] != "xla"
    return kernels


def _dump_order(path: Path) -> tuple:
    m = re.search(r"_(\d+)\.ptxas$", path.name)
    return (path.name.split("_")[0], int(m.group(1)) if m else 0)


def mosaic_basenames(mosaic_dir: Path) -> set[str]:
    """The kernels dumped into mosaic_dir so far (to tell a later compile's apart)."""
    return {p.name[:-len(".ptxas")] for p in mosaic_dir.glob("*.ptxas")} if mosaic_dir.is_dir() \
        else set()


def problems(kernels: list[dict]) -> list[str]:
    """Our kernels' spills and stack use: each a violation of the audit."""
    out = []
    for k in kernels:
        if not k["ours"]:
            continue
        bad = {f: k.get(f, 0) for f in ("spill_stores", "spill_loads", "stack") if k.get(f)}
        if bad:
            out.append(f"kernel {k['name']} ({k['source']}) spills or uses stack: {bad}")
        if "registers" not in k:
            out.append(f"kernel {k['name']} ({k['source']}): no ptxas report")
    return out


def short(k: dict) -> str:
    """One line per kernel for logs and BENCHMARKS tables."""
    smem = k.get("shared_bytes", 0) + k.get("static_smem", 0)
    notes = f" ptxas {','.join(k['notes'])}" if k.get("notes") else ""
    return (f"{k['name']} ({k['source']}): {k.get('registers')} regs, "
            f"{k.get('threads', ['?'])[0]} threads, grid {k.get('grid')}, "
            f"{smem / 1024:.0f} KiB smem, spills {k.get('spill_stores', 0)}/"
            f"{k.get('spill_loads', 0)} B, stack {k.get('stack', 0)} B{notes}")
