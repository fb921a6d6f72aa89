"""One data-parallel engine's greedy tokens against the single-device model's, for a tiny
preset on this host's simulated CPU devices (the models tests/test_data_parallel.py does
not run, for its time budget).

    python launch/dp_parity.py PRESET DP TP POLICY
    python launch/dp_parity.py tiny-deepseek 4 1 layered

Prints EQUAL or the two token lists, the pool's sharding, stats()["data_parallel"],
compiles while serving, and free / total pages at the end. Exit status 1 unless equal,
nothing compiled while serving and every page free.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 311, 64, 128, 9], list(range(1, 21)),
           [7, 7, 1, 2, 3], [300, 200, 100, 50, 25, 12, 6, 3]]
NEW_TOKENS = 6


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    preset, dp, tp, policy = argv[0], int(argv[1]), int(argv[2]), argv[3]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX loads: 8 CPU devices
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()
    from checkpoints.make_tiny import ensure_tiny
    from lp_jax import LLM, SamplingParams
    from lp_jax.loader import load_model
    from lp_jax.models.backends import KernelBackends
    from lp_jax.models.simple import greedy_generate

    path = ensure_tiny(preset=preset)
    rows = max(map(len, PROMPTS))
    model = load_model(path)
    want = [greedy_generate(model, p, NEW_TOKENS, backends=KernelBackends(
        moe="xla", attention="xla"), prefill_rows=rows,
        num_pages=-(-(rows + NEW_TOKENS) // 16)) for p in PROMPTS]
    llm = LLM(str(path), data_parallel_size=dp, tensor_parallel_size=tp,
              enable_expert_parallel=True, scheduling=policy, max_num_seqs=4,
              max_model_len=64, max_num_batched_tokens=32, token_buckets=(36,),
              kv_pages=8 * dp, backends="off", log=None)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=(
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)))]
    s = llm.stats()
    ok = (got == want and s["compilations_after_warmup"] == 0
          and s["free_pages"] == s["total_pages"])
    print(preset, f"dp {dp} tp {tp}", policy, "EQUAL" if got == want else f"{got} != {want}",
          "pool", llm.engine.runner.kv_pages.sharding.spec, s["data_parallel"],
          "compiles while serving", s["compilations_after_warmup"],
          "free pages", s["free_pages"], "of", s["total_pages"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
