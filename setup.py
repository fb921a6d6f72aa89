"""The wheel's layout: the repository's top-level `checkpoints/` and `pallas_kernels/` go
inside the package, as lp_jax.checkpoints and lp_jax.pallas_kernels.

The source tree keeps them top-level (they are the design's own folders, and the code
imports them as `checkpoints` and `pallas_kernels`), but a wheel that installed those
names would put a generic `checkpoints` package into every user's site-packages, where
it shadows or is shadowed by the user's own. So build_py, after copying the sources,
moves the two folders under lp_jax/ and re-roots the imports of every copied module
(`from pallas_kernels.moe import x` -> `from lp_jax.pallas_kernels.moe import x`). Files
that find data beside themselves look in both places (lp_jax/paths.py). An editable
install (`pip install -e .`) copies nothing and keeps the source layout.
"""

import re
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

NESTED = ("checkpoints", "pallas_kernels")
# An import statement that names one of them at the top level, at a line's start (so
# not inside a docstring's prose); the re-rooted form no longer matches, so a second
# build of the same tree changes nothing.
_IMPORT = re.compile(r"^(\s*(?:from|import)\s+)(" + "|".join(NESTED) + r")\b", re.M)


# `import pallas_kernels.moe` binds the name `pallas_kernels`, which no re-rooting keeps.
_BARE = re.compile(r"^\s*import\s+(?:" + "|".join(NESTED) + r")\b[\w.]*\s*(?:#.*)?$", re.M)


def reroot_imports(source: str, name: str = "<source>") -> str:
    if m := _BARE.search(source):
        raise ValueError(f"{name}: {m.group().strip()!r} cannot be re-rooted for the wheel; "
                         "write `from ... import ...` or `import ... as ...`")
    return _IMPORT.sub(r"\1lp_jax.\2", source)


class BuildPyNested(build_py):
    def run(self):
        editable = getattr(self, "editable_mode", False)
        lib = Path(self.build_lib)
        if not editable:  # start clean: no module deleted from the sources survives here
            shutil.rmtree(lib, ignore_errors=True)
        super().run()
        if editable:
            return
        for name in NESTED:
            src, dst = lib / name, lib / "lp_jax" / name
            if src.is_dir():
                shutil.rmtree(dst, ignore_errors=True)
                shutil.move(src, dst)
        for path in (lib / "lp_jax").rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            new = reroot_imports(text, str(path))
            if new != text:
                path.write_text(new, encoding="utf-8")


class BdistWheelNested(bdist_wheel):
    def egg2dist(self, egginfo_path, distinfo_path):
        """The metadata's top-level names are the wheel's: lp_jax alone."""
        super().egg2dist(egginfo_path, distinfo_path)
        top = Path(distinfo_path) / "top_level.txt"
        if top.exists():
            top.write_text("lp_jax\n")


setup(cmdclass={"build_py": BuildPyNested, "bdist_wheel": BdistWheelNested})
