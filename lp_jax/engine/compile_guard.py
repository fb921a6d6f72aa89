"""Counts XLA compilations process-wide, so serving can prove it compiles nothing.

JAX reports every backend compilation as a monitoring event; we listen to it once
and keep a counter. The engine counts the compiles that happen inside `step()`;
any is a bug (a shape bucket missing from warm-up, or stray jnp work on the host
path) and shows up in `stats()["compilations_after_warmup"]`. The count is
process-wide, so steps must not overlap with compiles on other threads.
"""

from __future__ import annotations

import threading

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration: float, **_):
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def install():
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def compilations() -> int:
    """Backend compilations in this process since `install()`."""
    return _count
