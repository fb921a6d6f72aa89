"""Local processes for benchmarks and tests: a free port, a multi-process engine's
environment, and waiting for a server's /health.

launch/ scripts and tests start servers and multi-process engines on one machine; these
three helpers are what they share. Standard library only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(pid: int, n: int, port: int, cpu_devices: int | None) -> dict:
    """The environment of process `pid` of an `n`-process engine coordinated on `port`.

    With `cpu_devices`, the process runs on the CPU with that many host devices (any
    inherited device-count flag is replaced)."""
    env = dict(os.environ, LP_NUM_PROCESSES=str(n), LP_PROCESS_ID=str(pid),
               LP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", PYTHONUNBUFFERED="1")
    if cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        inherited = [f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(
            [f"--xla_force_host_platform_device_count={cpu_devices}", *inherited])
    return env


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Return once `url`/health answers 200; SystemExit if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("server did not become healthy")
