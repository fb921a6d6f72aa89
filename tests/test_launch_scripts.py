"""Every launch/ script still imports: benchmarks are run by hand, rarely, so a renamed
module would otherwise go unnoticed until someone needs the figure (bench_programs.py
once imported POLICIES from a module that no longer had it). Importing runs nothing:
each script does its work under `if __name__ == "__main__"`."""

import importlib.util
import pathlib
import sys

import pytest

LAUNCH = pathlib.Path(__file__).resolve().parents[1] / "launch"
SCRIPTS = sorted(p for p in LAUNCH.glob("*.py"))


def test_scripts_found():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_imports(path):
    assert 'if __name__ == "__main__"' in path.read_text(), f"{path.name} runs on import"
    spec = importlib.util.spec_from_file_location(f"launch_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
