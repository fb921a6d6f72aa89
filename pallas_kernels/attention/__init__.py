"""Paged attention over the shared KV-cache layout (see ref.py) with a backend switch.

Entry points: `write_kv`, `ragged_paged_attention` (prefill and decode tokens of a
ragged batch), `decode_attention` (one token per sequence). Backends:

* "xla": the plain-JAX reference (ref.py), also the CPU path;
* "tpu": our Pallas Mosaic TPU kernel (tpu.py), one ragged kernel for prefill,
  decode and mixed batches, reading the [P, S, 2K, H] pool in place;
* "tpu_jax": JAX's shipped Pallas Mosaic ragged paged attention (tpu_jax.py), for
  A/B runs on a TPU; it cannot run in jax 0.11.2's interpreter, so it is checked
  here only for its arguments and its lowering, never numerically;
* "gpu": our Pallas Triton kernels (gpu.py) that read the same layout in place;
* "auto": "tpu" on TPU, "gpu" on GPU, "xla" elsewhere (`platform.target_platform()`:
  the host's backend, or the target of an ahead-of-time compile).

Attention sinks and sliding windows (GPT-OSS; `sinks_N=` [N], `sliding_window=` an int
or a traced int32 scalar, <= 0 full; see ref.py) run on "xla", "tpu" and "gpu": the
kernels take them as extra operands only when given (the window as a runtime scalar,
so sliding and full layers share one program), and skip the pages wholly before a
query block's window. "tpu_jax" (JAX's shipped kernel) has neither and raises
ValueError.

Every backend takes the pool as [P, S, 2K, H] or packed [P, S, K, 2H] (ref.py; the
form "tpu" needs for head_dim 64): "tpu" and "xla" read a packed pool as it is, "gpu"
and "tpu_jax" through its [P, S, 2K, H] view (a free reshape on a GPU).

FP8 pool (kv_cache_dtype "fp8"; ref.py): a float8_e4m3fn pool with per-layer `k_scale` /
`v_scale` (floats or traced float32 scalars, None: 1.0) that `write_kv` divides by and
the backends multiply by on load. "xla", "tpu" and "gpu" read it; "tpu_jax" raises
ValueError. A 16-bit pool never takes scales (they are dropped here, so its
kernels keep exactly their plain operands).

A kernel backend raises ValueError, naming the failed constraint, for inputs it
does not support (e.g. TPU needs head_dim % 128 == 0 or, for 64, a packed pool; GPU
needs power-of-two head_dim and page size); it never falls back silently. Asking for
"tpu" or "gpu" on another platform is an error unless interpret mode is on.

Interpret mode (tests, CPU debugging): inside `with interpret_mode():` (or after
`set_interpret_mode(True)`, or with LP_JAX_PALLAS_INTERPRET=1 in the environment)
the "tpu" and "gpu" backends run their Pallas kernels in the Pallas interpreter
on whatever platform is present: GPU kernels in the HLO interpreter, the TPU
kernel in the TPU interpreter (`pltpu.InterpretParams()`). The flag is read when the entry point is
traced, so enter it before tracing (jit) a caller. "auto" still resolves by
platform, so on CPU it stays "xla"; name the backend to interpret a kernel.
"""

from __future__ import annotations

import contextlib
import contextvars

from pallas_kernels.attention import gpu as _gpu
from pallas_kernels.attention import tpu as _tpu
from pallas_kernels.attention import tpu_jax as _tpu_jax
from pallas_kernels.attention.ref import (
    is_fp8,
    is_packed,
    ref_decode_attention,
    ref_ragged_paged_attention,
    unpacked,
    write_kv,
)
from pallas_kernels.platform import target_platform

BACKENDS = ("auto", "xla", "tpu", "tpu_jax", "gpu")
_KERNELS = {"tpu": _tpu, "tpu_jax": _tpu_jax, "gpu": _gpu}  # backend -> kernel module

# None: follow $LP_JAX_PALLAS_INTERPRET, read at trace time (as pallas_kernels.moe does).
_INTERPRET = contextvars.ContextVar("lp_jax_pallas_interpret", default=None)


@contextlib.contextmanager
def interpret_mode(enabled: bool = True):
    """Runs the "tpu"/"gpu" attention kernels in the Pallas interpreter inside the block."""
    token = _INTERPRET.set(enabled)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def set_interpret_mode(enabled: bool) -> None:
    """Process-wide (current context) version of `interpret_mode`."""
    _INTERPRET.set(enabled)


def interpret_enabled() -> bool:
    enabled = _INTERPRET.get()
    if enabled is None:
        from pallas_kernels.moe import resolve_interpret

        return bool(resolve_interpret(None))
    return enabled


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = target_platform()
    return platform if platform in ("tpu", "gpu") else "xla"


def _kernel_backend(backend: str) -> tuple[str, bool]:
    """(resolved backend, interpret); raises if a kernel cannot run on this platform."""
    resolved = resolve_backend(backend)
    interpret = interpret_enabled()
    if resolved == "xla" or interpret:
        return resolved, interpret
    platform = target_platform()
    wanted = {"tpu": "tpu", "tpu_jax": "tpu", "gpu": "gpu"}[resolved]
    if platform != wanted:
        raise ValueError(
            f"attention backend {resolved!r} needs a {wanted.upper()} but the target platform "
            f"is {platform!r}; use backend='xla', or interpret_mode() to run the kernel in "
            "the Pallas interpreter")
    return resolved, interpret


def _extras(resolved: str, sinks_N, sliding_window, kv_pages, k_scale, v_scale) -> dict:
    """The sink / window / FP8-scale keyword arguments that were given (None ones are
    left out, so the kernels see exactly their plain call; the scales only with an FP8
    pool); raises for a backend without the feature."""
    extras = {k: v for k, v in (("sinks_N", sinks_N), ("sliding_window", sliding_window))
              if v is not None}
    if extras and resolved == "tpu_jax":
        raise ValueError(f"attention backend 'tpu_jax' has no {' / '.join(extras)} "
                         "support (GPT-OSS layers); use backend='tpu', 'gpu' or 'xla'")
    if is_fp8(kv_pages):
        if resolved == "tpu_jax":
            raise ValueError("attention backend 'tpu_jax' does not read an FP8 "
                             "(float8_e4m3fn) KV cache; use backend='tpu', 'gpu' or 'xla', "
                             "or kv_cache_dtype='auto'")
        extras |= {k: v for k, v in (("k_scale", k_scale), ("v_scale", v_scale))
                   if v is not None}
    return extras


def _pool_for(resolved: str, q_xNH, kv_pages):
    """The pool as `resolved` reads it: "gpu" and "tpu_jax" index [P, S, 2K, H] only."""
    if resolved in ("gpu", "tpu_jax") and is_packed(q_xNH, kv_pages):
        return unpacked(kv_pages)
    return kv_pages


def ragged_paged_attention(q_TNH, kv_pages_PSJH, query_start_B1, seq_lens_B, page_table_BC,
                           num_seqs, *, sm_scale, backend="auto", sinks_N=None,
                           sliding_window=None, k_scale=None, v_scale=None):
    """Causal attention of a ragged batch's tokens to their paged context (ref.py)."""
    resolved, interpret = _kernel_backend(backend)
    extras = _extras(resolved, sinks_N, sliding_window, kv_pages_PSJH, k_scale, v_scale)
    kv_pages_PSJH = _pool_for(resolved, q_TNH, kv_pages_PSJH)
    args = (q_TNH, kv_pages_PSJH, query_start_B1, seq_lens_B, page_table_BC, num_seqs)
    if resolved == "xla":
        return ref_ragged_paged_attention(*args, sm_scale=sm_scale, **extras)
    kernels = _KERNELS[resolved]
    return kernels.ragged_paged_attention(*args, sm_scale=sm_scale, interpret=interpret,
                                          **extras)


def decode_attention(q_BNH, kv_pages_PSJH, seq_lens_B, page_table_BC, *, sm_scale,
                     backend="auto", sinks_N=None, sliding_window=None, k_scale=None,
                     v_scale=None):
    """One query token per sequence; seq_len 0 sequences return zeros."""
    resolved, interpret = _kernel_backend(backend)
    extras = _extras(resolved, sinks_N, sliding_window, kv_pages_PSJH, k_scale, v_scale)
    kv_pages_PSJH = _pool_for(resolved, q_BNH, kv_pages_PSJH)
    args = (q_BNH, kv_pages_PSJH, seq_lens_B, page_table_BC)
    if resolved == "xla":
        return ref_decode_attention(*args, sm_scale=sm_scale, **extras)
    return _KERNELS[resolved].decode_attention(*args, sm_scale=sm_scale, interpret=interpret,
                                               **extras)


__all__ = [
    "BACKENDS",
    "write_kv",
    "is_fp8",
    "ragged_paged_attention",
    "decode_attention",
    "resolve_backend",
    "interpret_mode",
    "set_interpret_mode",
    "interpret_enabled",
]
