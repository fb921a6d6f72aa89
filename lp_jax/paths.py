"""Where lp_jax finds its files and keeps its caches.

Two layouts hold the same code. A source checkout has `checkpoints/` and `pallas_kernels/`
beside `lp_jax/` (the repository's top-level folders); the wheel puts them inside
`lp_jax/`, so that an install adds no generic top-level name to site-packages (setup.py).
`bundled` finds either.

What lp_jax makes at run time (the demo and tiny models, the XLA compilation cache) goes
to the user cache directory, never into the package: $LP_JAX_CACHE_DIR if set, else
$XDG_CACHE_HOME/lp_jax, else ~/.cache/lp_jax. A source checkout's `make` targets and test
suite set LP_JAX_CACHE_DIR to the checkout's own `.cache/`, so that worktrees at different
commits never rebuild each other's models.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CACHE_ENV = "LP_JAX_CACHE_DIR"


def bundled(name: str) -> Path:
    """The folder `checkpoints` or `pallas_kernels`: inside the package (a wheel install)
    or beside it (a source checkout)."""
    inside = PACKAGE_DIR / name
    return inside if inside.is_dir() else PACKAGE_DIR.parent / name


def cache_dir() -> Path:
    """The root of lp_jax's caches, read from the environment at each call."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec ignores a relative path.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "lp_jax"


def models_dir() -> Path:
    """Where the generated models live, one directory each (demo, tiny, ...)."""
    return cache_dir() / "models"


def default_jax_cache_dir() -> str:
    """EngineConfig's default persistent compilation cache."""
    return str(cache_dir() / "jax_cache")


def no_tokenizer_reason(model_dir) -> str:
    """Why a model directory gives no tokenizer for text prompts, for the error a text
    prompt gets. lp_jax reads `tokenizer.json` only; a tiktoken tokenizer with custom code
    (Kimi-K2: `tiktoken.model` and `tokenization_kimi.py`) is named as such, since running
    a checkpoint's own Python is not something a server should do on its own. The message
    names the directory, not its path: the server sends it to clients."""
    where = Path(model_dir) if model_dir is not None else None
    ids = ("send token ids instead (prompt_token_ids; a list of ids as the server's "
           "prompt), or add a tokenizer.json to the model directory")
    if where is None:
        return f"a text prompt needs a tokenizer and this engine has no model directory: {ids}"
    custom = sorted(p.name for p in (*where.glob("*.tiktoken"), *where.glob("tiktoken.model"),
                                     *where.glob("tokenization_*.py")))
    if custom:
        return (f"{where.name}: the model's tokenizer is tiktoken with custom code "
                f"({', '.join(custom)}), and lp_jax reads only tokenizer.json: {ids}")
    return f"{where.name}: a text prompt needs the model's tokenizer.json, which is missing: {ids}"
