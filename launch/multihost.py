"""Start N local processes of one multi-process engine: a demo, or a test, on one machine.

    python launch/multihost.py -n 2 --cpu-devices 4
        # the demo on a (2, 4) expert x tensor mesh spanning 2 CPU processes
    python launch/multihost.py -n 2 --cpu-devices 4 -- \\
        python -m lp_jax.serve --mesh-shape 2,4 --port 8000
        # lp-serve: process 0 answers HTTP, process 1 runs its shards

Each process gets LP_NUM_PROCESSES, LP_PROCESS_ID and LP_COORDINATOR_ADDRESS (a free
port on 127.0.0.1), which the engine reads (lp_jax/executor/distributed.py); with
--cpu-devices, JAX_PLATFORMS=cpu and that many host devices per process. Output lines
are prefixed with [pK]. The exit status is the leader's. When the leader ends, the
followers get --grace seconds to end on their own (the leader's STOP), then are killed.

On a TPU pod slice nothing of this is needed: run the same command on every host (e.g.
`gcloud compute tpus tpu-vm ssh NAME --worker=all --command="lp-serve --mesh-shape ..."`);
JAX finds the other hosts itself.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_jax.bench.processes import free_port, process_env  # noqa: E402

DEMO = [sys.executable, "-m", "lp_jax.demo", "--mesh-shape", "2,4"]


def _pump(proc: subprocess.Popen, prefix: str):
    for line in proc.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--num-processes", type=int, default=2)
    ap.add_argument("--cpu-devices", type=int, default=None,
                    help="run on CPU with this many host devices per process")
    ap.add_argument("--port", type=int, default=None, help="coordinator port [default: free]")
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="after --: the command every process runs [default: the demo]")
    args = ap.parse_args(argv)
    command = [c for c in args.command if c != "--"] or DEMO
    port = args.port or free_port()
    procs = []
    for pid in range(args.num_processes):
        proc = subprocess.Popen(command, env=process_env(pid, args.num_processes, port,
                                                         args.cpu_devices),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=_pump, args=(proc, f"[p{pid}]"), daemon=True).start()
        procs.append(proc)
    try:
        rc = procs[0].wait()
    except KeyboardInterrupt:
        procs[0].terminate()
        rc = procs[0].wait()
    deadline = time.monotonic() + args.grace
    for proc in procs[1:]:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid, proc in enumerate(procs):
        print(f"[multihost] process {pid} exited with {proc.returncode}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
