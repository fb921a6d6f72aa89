"""The package's import structure: no cycle, no import from a lower floor to a higher one,
a scheduling core that loads without JAX, and policies that use only the scheduler's
public members. Every import counts: top-level, under TYPE_CHECKING, and inside
functions (issue #29), read from the source with `ast`, so nothing is run."""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lp_jax", "pallas_kernels", "checkpoints")

# A unit (a package or a module, longest prefix wins) may import its own modules and
# units on lower floors only.
FLOORS = {
    "pallas_kernels": 0,  # kernels and their references know nothing of the engine
    "lp_jax.quant": 1,  # weight formats: pallas_kernels' schemes, HF quantization_config
    "lp_jax.config": 2, "lp_jax.sharding": 2, "lp_jax.safetensors_io": 2,
    "lp_jax.progress": 2, "lp_jax.backend_select": 2, "lp_jax.version": 2,
    "lp_jax.paths": 2,  # where the package's files and the user cache are
    "lp_jax.structured": 2,  # grammar specs (core's SamplingParams holds one), llguidance
    "lp_jax.spec": 2,  # speculative_config and the n-gram drafter (the scheduler's)
    "lp_jax.core": 3,  # the pure-Python scheduling core
    "lp_jax.trace": 4,  # the decision trace: written by the engine and the simulator
    "lp_jax.models": 4,
    "lp_jax.loader_quant": 5,  # the loader's half of the formats: it builds the models' params
    "lp_jax.loader": 6, "lp_jax.roofline": 6, "checkpoints": 6,
    "lp_jax.executor": 7, "lp_jax.sim": 7,
    "lp_jax.engine": 8, "lp_jax.aot": 8,
    "lp_jax.engine_args": 9,  # the engine flags, generated from EngineConfig
    "lp_jax.aot.__main__": 10,  # the AOT command line takes the engine flags
    "lp_jax.engine.profile_latency": 10,  # a command line too
    "lp_jax.llm": 9, "lp_jax.server": 9,
    "lp_jax.serve": 10, "lp_jax.demo": 10,
    "lp_jax.bench": 11,  # benchmarks and the load generator use everything
    "lp_jax.cli": 12,  # `lp`: every command
    "lp_jax": 12,  # the package's face: LLM and SamplingParams, lazily
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in its source."""
    graph = defaultdict(set)
    for mod, path in MODULES.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                           for a in node.names]
            for t in targets:
                dep = _resolve(t)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def unit(mod: str) -> str:
    best = max((u for u in FLOORS if mod == u or mod.startswith(u + ".")), key=len,
               default=None)
    assert best is not None, f"{mod} is on no floor: add its unit to FLOORS"
    return best


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_cycle_check_sees_type_checking_and_local_imports(tmp_path, monkeypatch):
    """The control: a loop closed only by a TYPE_CHECKING import and a function-local one
    is found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n")
    b.write_text("def f():\n    import a\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {"a": a, "b": b})
    assert cycles(import_graph()) == [["a", "b"]]


def test_no_import_runs_up_a_floor():
    up = sorted(f"{m} -> {d} ({unit(m)}: {FLOORS[unit(m)]}, {unit(d)}: {FLOORS[unit(d)]})"
                for m, deps in import_graph().items() for d in deps
                if unit(m) != unit(d) and FLOORS[unit(d)] >= FLOORS[unit(m)])
    assert up == []


def test_the_core_imports_without_jax():
    """Every module of lp_jax.core loads with jax, jaxlib and flax blocked."""
    core = sorted(m for m in MODULES if m == "lp_jax.core" or m.startswith("lp_jax.core."))
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'jaxlib', 'flax'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {core!r}:\n"
        "    __import__(m)\n"
        "assert not any(k.split('.')[0] in ('jax', 'jaxlib', 'flax') for k in sys.modules)\n"
        "print(len(sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(core) >= 15


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in [
    *(ROOT / "lp_jax/core/policies").glob("*.py"), ROOT / "lp_jax/sim/muxwise.py"]))
def test_policies_use_only_public_scheduler_members(path):
    """A policy sees the scheduler through the members policies/base.py lists."""
    bad = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            v = node.value
            name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(
                v, ast.Attribute) else None
            if name in ("sched", "s") and not node.attr.startswith("__"):
                bad.append(f"line {node.lineno}: {name}.{node.attr}")
    assert bad == []
