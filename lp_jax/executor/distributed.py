"""Multi-process start-up: one SPMD engine over the devices of several processes.

Every process (one per host on a TPU pod slice or a GPU node) calls
`jax.distributed.initialize` through `initialize()` below, builds the same global mesh
over `jax.devices()` (all processes' devices) and compiles the same step programs.
Process 0 is the *leader*: it runs the scheduler, the tokenizer and the server, and
sends each step's inputs to the others, the *followers*, over a plan channel
(plan_channel.py); every process then runs the same compiled calls on its own shards.
Followers serve no HTTP and hold no request state.

Where the arguments come from, first match wins:

1. explicit arguments (`EngineConfig.num_processes` / `process_id` /
   `coordinator_address`, the `--num-processes` ... flags of lp-serve);
2. the environment: LP_NUM_PROCESSES, LP_PROCESS_ID, LP_COORDINATOR_ADDRESS;
3. a cluster JAX detects on its own: a multi-host Cloud TPU slice (its worker list) or a
   SLURM job with more than one task. `jax.distributed.initialize()` then fills in
   everything (JAX's cluster detection, not ours).

Nothing of the above: a single process, and none of this runs.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax

ENV_NUM_PROCESSES = "LP_NUM_PROCESSES"
ENV_PROCESS_ID = "LP_PROCESS_ID"
ENV_COORDINATOR = "LP_COORDINATOR_ADDRESS"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    process_id: int
    num_processes: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


SINGLE = ProcessInfo(0, 1)


def _cluster_detected() -> bool:
    """A multi-process cluster JAX can configure itself: SLURM with several tasks, or a
    Cloud TPU VM that is one worker of several (JAX asks the TPU metadata)."""
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return True
    try:
        from jax._src.clusters import cloud_tpu_cluster as tpu

        if not tpu.running_in_cloud_tpu_vm:
            return False
        return any(env.is_env_present() and env.get_process_count() > 1
                   for env in (tpu.GceTpuCluster, tpu.GkeTpuCluster))
    except Exception:  # noqa: BLE001 - detection is best effort; flags always work
        return False


def resolve(num_processes: int | None = None, process_id: int | None = None,
            coordinator_address: str | None = None) -> dict | None:
    """The arguments for jax.distributed.initialize, or None for a single process.
    Raises ValueError for an incomplete or inconsistent set."""
    env = os.environ
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = int(env[ENV_NUM_PROCESSES])
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id = int(env[ENV_PROCESS_ID])
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
    given = (num_processes, process_id, coordinator_address)
    if all(v is None for v in given):
        return {} if _cluster_detected() else None
    if num_processes == 1 and coordinator_address is None:
        return None
    if any(v is None for v in given):
        raise ValueError(
            "a multi-process engine needs num_processes, process_id and coordinator_address "
            f"(flags or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID} / {ENV_COORDINATOR}); got "
            f"num_processes={num_processes}, process_id={process_id}, "
            f"coordinator_address={coordinator_address}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is not in [0, {num_processes})")
    if ":" not in coordinator_address:
        raise ValueError(f"coordinator_address must be host:port, got {coordinator_address!r}")
    return {"num_processes": num_processes, "process_id": process_id,
            "coordinator_address": coordinator_address}


def initialize(num_processes: int | None = None, process_id: int | None = None,
               coordinator_address: str | None = None) -> ProcessInfo:
    """Starts JAX's distributed runtime once per process (later calls reuse it) and
    returns this process's role. On CPU the collectives go through gloo."""
    if jax.distributed.is_initialized():
        return ProcessInfo(jax.process_index(), jax.process_count())
    args = resolve(num_processes, process_id, coordinator_address)
    if args is None:
        return SINGLE
    # Only the CPU client reads this (XLA:CPU's cross-process collectives); harmless on
    # GPU and TPU, and it must be set before the backends start.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)
    return ProcessInfo(jax.process_index(), jax.process_count())


def fatal(message: str, code: int = 3):
    """Ends this process now with one line of its own: used when a peer is gone, so the
    process does not hang in a collective (or wait for JAX's heartbeat to abort it)."""
    role = "leader" if jax.process_index() == 0 else f"follower {jax.process_index()}"
    sys.stderr.write(f"lp_jax {role}: {message}\n")
    sys.stderr.flush()
    os._exit(code)
