"""The plan channel's cost per step: "host" (TCP) against "device" (broadcast_one_to_all),
side by side in one run, on one engine spread over 2 local processes.

    python launch/bench_multihost.py [--cpu-devices 4] [--steps 48] [--out runs/multihost]

For each transport, two processes (launch/multihost.py's environment) build the same
engine on a (2, cpu_devices) expert x tensor mesh over both, run a warm-up request,
then `--seqs` greedy requests of `--steps` tokens. The leader reports, per step: bytes
sent, the leader's time inside the channel (encode excluded; for "device" this includes
waiting for the followers to enter the broadcast), and the wall time per engine step.
The figures go to OUT/results.json and are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lp_jax.bench.processes import free_port, process_env  # noqa: E402


def worker(args) -> None:
    from lp_jax import LLM, SamplingParams

    llm = LLM(None, scheduling=args.scheduling, mesh_shape=(2, args.cpu_devices),
              plan_channel=args.transport, max_num_seqs=max(4, args.seqs),
              max_num_batched_tokens=64, token_buckets=(8, 72), compilation_cache_dir=None,
              log=None)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=greedy)  # warm
    if not llm.is_leader:
        return
    before = llm.stats()
    prompts = [[7 + i, 11, 13, 17, 19, 23, 29, 31] for i in range(args.seqs)]
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        max_tokens=args.steps, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    after = llm.stats()
    steps = after["plan_channel"]["steps_sent"] - before["plan_channel"]["steps_sent"]
    ch0, ch1 = before["plan_channel"], after["plan_channel"]
    result = {
        "transport": args.transport, "steps": steps,
        "bytes_per_step": (ch1["bytes_per_step"] * ch1["steps_sent"]
                           - ch0["bytes_per_step"] * ch0["steps_sent"]) / steps,
        "channel_ms_per_step": (ch1["send_ms_per_step"] * ch1["steps_sent"]
                                - ch0["send_ms_per_step"] * ch0["steps_sent"]) / steps,
        "wall_ms_per_step": 1e3 * wall / steps,
    }
    llm.shutdown()
    Path(args.result).write_text(json.dumps(result))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--scheduling", default="chunked")
    ap.add_argument("--out", default="runs/multihost")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--transport", default="host", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for transport in ("host", "device"):
        port, result = free_port(), out / f"{transport}.json"
        cmd = [sys.executable, __file__, "--worker", "--transport", transport,
               "--result", str(result), "--cpu-devices", str(args.cpu_devices),
               "--steps", str(args.steps), "--seqs", str(args.seqs),
               "--scheduling", args.scheduling]
        procs = [subprocess.Popen(cmd, env=process_env(pid, 2, port, args.cpu_devices),
                                  cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
        errs = [p.communicate(timeout=1200)[1] for p in procs]
        if any(p.returncode for p in procs):
            print(f"{transport}: exit codes {[p.returncode for p in procs]}\n{errs[0][-2000:]}")
            return 1
        results.append(json.loads(result.read_text()))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"{'transport':10} {'steps':>6} {'bytes/step':>11} {'channel ms/step':>16} "
          f"{'wall ms/step':>13}")
    for r in results:
        print(f"{r['transport']:10} {r['steps']:>6} {r['bytes_per_step']:>11,.0f} "
              f"{r['channel_ms_per_step']:>16.3f} {r['wall_ms_per_step']:>13.1f}")
    host, device = results
    channel = device["channel_ms_per_step"] / host["channel_ms_per_step"]
    wall = device["wall_ms_per_step"] / host["wall_ms_per_step"]
    print(f"device / host: channel {channel:.1f}x, wall {wall:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
