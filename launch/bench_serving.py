"""lp-bench against lp-serve: chunked against layered prefill, at two request rates.

Starts `lp-serve` on the embedded tiny model once per policy (loopback only), replays
the same ShareGPT-8k-like workload (lengths scaled under the model's context) with
`lp-bench` at each rate, stops the server, and prints both policies side by side.

    python launch/bench_serving.py [--rates 2,6] [--num-requests 80] [--out runs/bench_serving]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_jax.bench.processes import wait_healthy  # noqa: E402

# The server's flags for both policies; POLICIES adds each one's own.
SERVER_FLAGS = ["--max-model-len", "1152", "--max-num-seqs", "32"]
POLICIES = {
    "chunked": ["--scheduling", "chunked", "--max-num-batched-tokens", "512"],
    "layered": ["--scheduling", "layered", "--max-num-batched-tokens", "2048"],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="2,6")
    ap.add_argument("--num-requests", type=int, default=80)
    ap.add_argument("--port", type=int, default=18321)
    ap.add_argument("--out", default="runs/bench_serving")
    args = ap.parse_args(argv)
    out = Path(args.out)
    url = f"http://127.0.0.1:{args.port}"
    results = {}
    for name, flags in POLICIES.items():
        cmd = [sys.executable, "-m", "lp_jax.serve", "--port", str(args.port),
               *SERVER_FLAGS, *flags]
        print("$", " ".join(cmd[1:]), flush=True)
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            t = time.time()
            wait_healthy(url, server, timeout=600.0)
            print(f"[{name}] server healthy after {time.time() - t:.0f} s", flush=True)
            bench = [sys.executable, "-m", "lp_jax.bench", "--base-url", url,
                     "--workload", "sharegpt", "--max-prompt-len", "1024",
                     "--max-output-len", "64", "--num-requests", str(args.num_requests),
                     "--request-rate", args.rates, "--ttft-slo", "2.0", "--itl-slo", "0.5",
                     "--seed", "0", "--no-progress", "--scrape-metrics",
                     "--output-dir", str(out / name)]
            print("$", " ".join(bench[1:]), flush=True)
            subprocess.run(bench, check=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
        results[name] = json.loads((out / name / "results.json").read_text())
    (out / "comparison.json").write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results):
    rows = []
    for name, res in results.items():
        for run in res["runs"]:
            s = run["summary"]
            rows.append((run["request_rate"], name, s))
    keys = ("ttft_p50", "ttft_p99", "max_itl_p99", "itl_p99", "e2e_p50", "slo_attainment",
            "goodput", "num_failed")
    print("\n| rate (req/s) | policy | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for rate, name, s in sorted(rows, key=lambda r: (r[0], r[1])):
        cells = [f"{s[k]:.3g}" if isinstance(s.get(k), float) else str(s.get(k, "-"))
                 for k in keys]
        print(f"| {rate} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
