"""Program counts and start-up: the row-bucket scheme against the one it replaced.

Counts need no compile: they follow from the engine arguments. The old scheme (before
step.py) compiled one program per (group start or None, group size, prefill bucket,
decode bucket) over every group any reachable G splits the layers into; its enumeration
is re-stated below, from the old `ModelRunner.reachable_keys`. The new one compiles one
program per row bucket. Then, unless --no-startup, default-argument engines of each
policy start one after another in this process on the tiny model (max_model_len 4096),
and their start-up compiles and seconds are printed.

    python launch/bench_programs.py [--no-startup]
"""

from __future__ import annotations

import argparse
import time

from lp_jax.aot import load_config
from lp_jax.core.config import SchedulerConfig
from lp_jax.core.layer_groups import num_layer_groups, split_layers
from lp_jax.core.policies import POLICIES
from lp_jax.core.programs import step_buckets


def _pow2(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return (*out, hi)


def old_program_count(policy: str, L: int, budget: int, max_num_seqs: int, *,
                      uniform: bool = True, layer_groups="paper", max_layer_groups=16) -> int:
    """Programs the pre-step.py runner compiled at default buckets."""
    decode = _pow2(1, max_num_seqs)
    keys = {(0, 0, 0, B) for B in decode}
    prev = 0
    for T in _pow2(min(16, budget), budget):
        ranges = [(0, L)]
        if policy == "layered":
            gs = sorted({num_layer_groups(n, layer_groups, max_layer_groups=max_layer_groups,
                                          num_layers=L) for n in (prev + 1, T)})
            ranges = sorted({r for g in range(gs[0], gs[-1] + 1) for r in split_layers(L, g)})
        for a, b in ranges:
            static = a == 0 or b == L or not uniform
            keys |= {(a if static else None, b - a, T, B) for B in (0, *decode)}
        prev = T
    return len(keys)


def counts(preset: str, max_model_len: int = 4096) -> list[tuple]:
    cfg = load_config(preset)
    L = cfg.num_hidden_layers
    rows = []
    for policy in ("orca", "chunked", "layered"):
        for seqs in (32, 64, 128):
            sc = SchedulerConfig(policy=POLICIES[policy], num_layers=L,
                                 max_model_len=max_model_len, page_size=16, num_pages=1,
                                 vocab_size=cfg.vocab_size, max_num_seqs=seqs)
            budget, prefill = sc.max_num_batched_tokens, sc.policy.max_prefill_tokens(sc)
            new = len(step_buckets(sc))
            rows.append((preset, L, policy, budget, seqs,
                         old_program_count(policy, L, prefill, seqs), new))
    return rows


def startup(log=print):
    from checkpoints.make_tiny import ensure_tiny
    from lp_jax import LLM

    path = ensure_tiny(preset="tiny")
    engines = []
    for kw in ({"scheduling": "orca"}, {"scheduling": "chunked"}, {"scheduling": "layered"},
               {"scheduling": "layered", "max_num_batched_tokens": 256},
               {"scheduling": "flowprefill", "max_num_batched_tokens": 256}):
        t = time.perf_counter()
        llm = LLM(str(path), compilation_cache_dir=None, log=None, **kw)
        s = llm.stats()
        log(f"| {kw} | {s['programs']} | {s['startup_compilations']} | "
            f"{time.perf_counter() - t:.1f} | {s['compile_seconds']:.1f} |")
        engines.append(llm)  # all alive at once, as a long-running process would hold them


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-startup", action="store_true")
    args = ap.parse_args(argv)
    print("| model | L | policy | budget | max_num_seqs | programs before | programs now |\n"
          "|---|---|---|---|---|---|---|")
    for preset in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        for row in counts(preset):
            print("| " + " | ".join(str(x) for x in row) + " |")
    if not args.no_startup:
        print("\ntiny model (8 layers), default arguments, engines started in a row:\n"
              "| engine | programs | start-up compiles | start-up s | compile s |\n"
              "|---|---|---|---|---|")
        startup()


if __name__ == "__main__":
    main()
