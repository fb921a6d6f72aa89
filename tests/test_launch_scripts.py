"""Every launch/ script still imports: benchmarks are run by hand, rarely, so a renamed
module would otherwise go unnoticed until someone needs the figure (bench_programs.py
once imported POLICIES from a module that no longer had it). Importing runs nothing:
each script does its work under `if __name__ == "__main__"`."""

import os
import pathlib

import pytest
from conftest import launch_module

LAUNCH = pathlib.Path(__file__).resolve().parents[1] / "launch"
SCRIPTS = sorted(p for p in LAUNCH.glob("*.py") if p.name != "__init__.py")


def test_scripts_found():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_imports(path):
    assert 'if __name__ == "__main__"' in path.read_text(), f"{path.name} runs on import"
    before = dict(os.environ)
    module = launch_module(path.stem)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
    # importing a script must not change what later tests in this process run (an
    # LP_JAX_PALLAS_INTERPRET set at import once put a worker's kernels in interpret mode)
    # (libtpu's and the GPU client's own variables, set by what the script imports, do not
    # change what runs on CPU)
    changed = {k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)
               and (k.startswith(("LP_", "JAX_")) or k == "XLA_FLAGS")}
    assert not changed, f"{path.name} sets {sorted(changed)} on import"


def test_bench_serving_passes_lp_serve_flags_it_accepts():
    """bench_serving.py starts lp-serve as a subprocess, where a flag lp-serve dropped would
    only show as a server that never becomes healthy."""
    from lp_jax.serve import build_parser

    bench = launch_module("bench_serving")
    for name, flags in bench.POLICIES.items():
        args = build_parser().parse_args(["--port", "1", *bench.SERVER_FLAGS, *flags])
        assert args.scheduling == name
