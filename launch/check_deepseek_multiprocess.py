"""DeepSeek-V3 on one engine over two processes (jax.distributed, gloo, 4 CPU devices
each): greedy tokens against transformers' golden ones, run once and recorded in
docs/benchmarks/deepseek.md (too slow for CI: two engines compile in each process).

    python launch/check_deepseek_multiprocess.py

Each process builds a chunked (host plan channel) and then a layered (device broadcast)
engine on tiny-deepseek over a (2, 4) expert x tensor mesh spanning both processes: the
routed experts over all 8 devices, the latent projections split by head over the 4
tensor devices of a process, the latent pool whole on every device (it has no head
axis). The leader writes the tokens; this script compares them with
tests/golden/tiny-deepseek.npz and prints one line per policy. Exit 0 when all match.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEW_TOKENS = 8
POLICIES = (("chunked", "host"), ("layered", "device"))
ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(36,),
                   layer_groups=2, max_model_len=80)


def _prompts():
    import numpy as np

    golden = np.load(ROOT / "tests" / "golden" / "tiny-deepseek.npz")
    return ([golden[f"prompt_{i}"].tolist() for i in range(3)],
            [golden[f"greedy_{i}"][:NEW_TOKENS].tolist() for i in range(3)])


def worker(model_dir: str, out_path: str):
    """One process of the engine (LP_PROCESS_ID etc. set by the parent)."""
    from lp_jax import LLM, SamplingParams

    prompts, _ = _prompts()
    results = {}
    for policy, transport in POLICIES:
        llm = LLM(model_dir, scheduling=policy, mesh_shape=(2, 4), plan_channel=transport,
                  log=None, **ENGINE_ARGS)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        if llm.is_leader:
            stats = llm.stats()
            experts = llm.engine.runner.state["model"]["layers"]["mlp"]["experts_gate_up_proj"]
            results[policy] = {
                "tokens": [o.token_ids for o in outs],
                "compilations_after_warmup": stats["compilations_after_warmup"],
                "expert_devices": len(experts[...].sharding.device_set)}
        llm.shutdown()
    if results:
        Path(out_path).write_text(json.dumps(results))


def main() -> int:
    from checkpoints.make_tiny import ensure_tiny
    from lp_jax.bench.processes import free_port, process_env

    model_dir = str(ensure_tiny(preset="tiny-deepseek"))
    _, golden = _prompts()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tokens.json"
        procs = []
        for pid in (0, 1):
            env = process_env(pid, 2, port, cpu_devices=4)
            env["PYTHONPATH"] = str(ROOT)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", model_dir, str(out)], env=env,
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=1200)[0] for p in procs]
        if any(p.returncode for p in procs):
            for pid, log in enumerate(logs):
                print(f"--- process {pid} (exit {procs[pid].returncode}) ---\n{log[-4000:]}")
            return 1
        results = json.loads(out.read_text())
    ok = True
    for policy, _ in POLICIES:
        r = results[policy]
        match = r["tokens"] == golden
        ok &= match and r["compilations_after_warmup"] == 0
        print(f"{policy}: 2 processes x 4 CPU devices, mesh (2, 4), experts on "
              f"{r['expert_devices']} devices: {NEW_TOKENS} greedy tokens x 3 prompts "
              f"{'equal' if match else 'DIFFER from'} transformers' golden; "
              f"compilations after warm-up {r['compilations_after_warmup']}")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:4])
    else:
        sys.exit(main())
