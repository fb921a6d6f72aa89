"""Counts XLA compilations process-wide, so serving can prove it compiles nothing.

JAX reports every backend compilation as a monitoring event; we listen to it once
and keep a counter. The engine counts the compiles that happen inside `step()`;
any is a bug (a shape bucket missing from warm-up, or stray jnp work on the host
path) and shows up in `stats()["compilations_after_warmup"]`. The count is
process-wide, so steps must not overlap with compiles on other threads.

A program served from the persistent compilation cache counts as a compilation too:
it is still a program the warm-up did not hold, and on a cold cache (a new machine, a
new jax) it would compile for real. JAX times the whole request, cache lookup included,
under `_COMPILE_EVENT` (pxla's `_cached_compilation` wraps `compile_or_get_cached`), so
one event is recorded per program whether it was compiled or read back; `cache_hits()`
counts the read-backs among them. `tests/test_compile_guard.py` checks both, so a JAX
that moved the event inside the real compile would fail there, not silently here.
"""

from __future__ import annotations

import threading

from jax import monitoring

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_hits = 0
_installed = False


def _on_duration(event: str, duration: float, **_):
    global _count
    if event == _COMPILE_EVENT:
        with _lock:
            _count += 1


def _on_event(event: str, **_):
    global _hits
    if event == _CACHE_HIT_EVENT:
        with _lock:
            _hits += 1


def install():
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_on_duration)
            monitoring.register_event_listener(_on_event)
            _installed = True


def compilations() -> int:
    """Programs compiled or read from the persistent cache in this process since
    `install()`."""
    return _count


def cache_hits() -> int:
    """Of `compilations()`, those read back from the persistent compilation cache."""
    return _hits
