"""Every repository path, relative link and `python -m` module that the docs name exists.

The pages checked are README.md, BENCHMARKS.md and docs/**/*.md, except docs/history/, which keeps
earlier pages verbatim, stale paths included. Four things in a page are recognised:

- a markdown link `[text](target)` whose target is not a URL or an anchor: resolved against the
  page's own folder, as a renderer does;
- a path under one of the repository's top-level folders (`lp_jax/models/stacked.py`, `launch/`),
  anywhere in the text, code blocks included: resolved against the repository root;
- any other file path (`executor/step.py`, `moe/tpu.py`, `grafana/lp_jax.json`): it must exist
  beside the page, or under the root, `lp_jax/`, `pallas_kernels/` or `docs/`;
- `python -m NAME` with NAME in lp_jax or pallas_kernels: the module must exist.

Glob characters in a path (`gpu_targets/*.txtpb`) are matched with glob. Pure Python, no JAX.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_DIRS = ("lp_jax", "pallas_kernels", "checkpoints", "launch", "tests", "docs", ".ci")
PACKAGE_ROOTS = ("", "lp_jax/", "pallas_kernels/", "docs/")
# Where the tools write: nothing there is in the repository.
OUTPUT_DIRS = ("runs",)
# Written on first use (make_tiny.py, train_demo.py), never committed.
GENERATED = ("checkpoints/tiny",)
# Files of other repositories, named for reference.
OTHER_PROJECTS = ("vllm", "sglang", "jax", "flax")
FILE_SUFFIXES = ("py", "md", "json", "sh", "txtpb", "toml", "jinja", "txt")

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_TOP_PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(map(re.escape, TOP_DIRS))
                       + r")/[\w.*/-]*)")
_SHORT_FILE = re.compile(r"(?<![\w./~$:-])([A-Za-z_][\w-]*(?:/[\w.*-]+)+\.(?:"
                         + "|".join(FILE_SUFFIXES) + r"))(?![\w/])")
_MODULE = re.compile(r"python -m ((?:lp_jax|pallas_kernels)(?:\.\w+)*)")


def doc_pages(root: Path = ROOT) -> list[Path]:
    docs = root / "docs"
    pages = [root / "README.md", root / "BENCHMARKS.md"]
    pages += sorted(p for p in docs.rglob("*.md") if "history" not in p.relative_to(docs).parts)
    return [p for p in pages if p.exists()]


def _exists(path: Path) -> bool:
    text = str(path)
    if any(c in text for c in "*?["):
        return bool(glob.glob(text))
    return path.exists()


def _module_exists(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def missing_references(text: str, page: Path, root: Path = ROOT) -> list[str]:
    """The references in `text` (the contents of `page`) that name nothing in `root`."""
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not _exists(page.parent / path):
            missing.append(f"link {target}")
    top_paths = set()
    for raw in _TOP_PATH.findall(text):
        path = raw.rstrip(".")
        top_paths.add(path)
        if not path.startswith(GENERATED) and not _exists(root / path):
            missing.append(f"path {path}")
    skip = TOP_DIRS + OUTPUT_DIRS + OTHER_PROJECTS
    for raw in _SHORT_FILE.findall(text):
        if raw in top_paths or raw.split("/", 1)[0] in skip:
            continue
        places = [page.parent / raw] + [root / (prefix + raw) for prefix in PACKAGE_ROOTS]
        if not any(_exists(p) for p in places):
            missing.append(f"file {raw}")
    for name in _MODULE.findall(text):
        if not _module_exists(name, root):
            missing.append(f"module {name}")
    return list(dict.fromkeys(missing))


def test_every_path_link_and_module_in_the_docs_exists():
    pages = doc_pages()
    assert ROOT / "README.md" in pages and len(pages) > 3
    problems = []
    for page in pages:
        for ref in missing_references(page.read_text(encoding="utf-8"), page):
            problems.append(f"{page.relative_to(ROOT)}: {ref}")
    assert not problems, "stale references in the docs:\n" + "\n".join(problems)


def test_stale_references_are_caught():
    page = ROOT / "docs" / "example.md"
    stale = (
        "The self-test is `lp_jax/engine/kernel_check.py`; see [the page](nowhere.md), "
        "`executor/no_such_file.py`, and run `python -m lp_jax.no_such_tool`."
    )
    assert missing_references(stale, page) == [
        "link nowhere.md",
        "path lp_jax/engine/kernel_check.py",
        "file executor/no_such_file.py",
        "module lp_jax.no_such_tool",
    ]
    fine = (
        "The self-test is `lp_jax/executor/kernel_check.py` (`executor/step.py`, `moe/tpu.py`); "
        "see [the glossary](glossary.md#letters), [vLLM](https://docs.vllm.ai), "
        "`lp_jax/aot/gpu_targets/*.txtpb`, `grafana/lp_jax.json`, and run `python -m lp_jax.aot` "
        "or `python -m lp_jax.engine.profile_latency`; output goes to runs/aot/x.json."
    )
    assert missing_references(fine, page) == []


def test_history_pages_are_not_checked():
    assert not any("history" in p.parts for p in doc_pages())


def test_every_launch_script_is_cited():
    """launch/ keeps the studies the docs cite (or the Makefile runs); a probe nothing cites
    belongs in git history, not in the tree a newcomer reads."""
    cited = "\n".join(p.read_text(encoding="utf-8") for p in doc_pages())
    cited += (ROOT / "Makefile").read_text(encoding="utf-8")
    scripts = [p for p in (ROOT / "launch").iterdir()
               if p.suffix in (".py", ".sh") and p.name != "__init__.py"]
    assert len(scripts) > 10
    uncited = sorted(p.name for p in scripts if f"launch/{p.name}" not in cited)
    assert not uncited, f"launch/ scripts no page cites: {uncited}"
