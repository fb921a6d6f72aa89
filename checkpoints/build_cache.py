"""Building a generated model directory in lp_jax's cache: made beside its target and
renamed into place, so concurrent callers never see half a model; a directory is rebuilt
when its stamp (the generator's source hash) differs, and one this generator did not
make is never removed."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .make_tiny import STAMP_FILE


def ensure_built(out: Path, want: str, write: Callable[[Path], None], maker: str) -> Path:
    """out, written by write(tmp_dir) first if its stamp is not `want` (write leaves the
    stamp file). maker names the generator in the refusal to replace a foreign dir."""
    stamp = out / STAMP_FILE
    fresh = lambda: stamp.exists() and stamp.read_text().strip() == want
    if fresh():
        return out
    if out.exists():
        if not stamp.exists():
            raise FileExistsError(f"{out} exists and was not made by {maker}")
        shutil.rmtree(out)  # a stale build of ours
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        os.rename(tmp, out)
    except OSError:
        if not fresh():
            raise  # else another process finished first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
