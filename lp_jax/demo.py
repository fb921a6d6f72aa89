"""`make demo`: a tiny Qwen3-MoE that has read Aesop, served by every scheduling policy.

The default model is checkpoints/train_demo.py's: two MoE layers trained on 25 of
Aesop's fables (Townsend's 1867 translation, shipped in checkpoints/data/) until it
knows them by heart, trained the first time (400 steps, about 60 CPU-seconds) and cached
in the user cache (lp_jax/paths.py). Its greedy continuation of a fable's first words is the
fable, so readable text means the engine computes what the model learnt.

Each policy (orca, chunked, layered, flowprefill) serves the same prompts greedily; the
demo prints the continuations once and checks that every policy produced the same
tokens, exiting 1 with the prompt and the policies that disagree if not. Pass --model
DIR for any Hugging Face Qwen3(-MoE) directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

POLICIES = ("orca", "chunked", "layered", "flowprefill")
PROMPTS = (
    "A Lion was awakened from sleep by",
    "The North Wind and the Sun disputed",
    "A Crow perishing with thirst",
)


def describe(model_dir: Path) -> str:
    """One line on what the model is, from config.json (and the demo's training.json)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    shape = (f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
             f"vocabulary {cfg['vocab_size']}")
    if cfg.get("num_experts"):
        shape += f", {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}"
    info_file = model_dir / "training.json"
    if not info_file.is_file():
        return f"model: {model_dir} ({cfg.get('model_type')}: {shape})"
    info = json.loads(info_file.read_text())
    return (f"model: a {cfg['model_type']} of {info['parameters']:,} parameters ({shape}), "
            f"trained here by checkpoints/train_demo.py on {info['text']} "
            f"({info['fables']} fables, {info['tokens']:,} tokens; {info['steps']} steps, "
            f"loss {info['first_loss']:.2f} -> {info['final_loss']:.2f}): it recites them")


def main(argv=None, prog: str = "lp-demo"):
    from lp_jax.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated scheduling policies to run and compare")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", action="append", default=None)
    # Several processes: launch/multihost.py.
    add_engine_args(parser.add_argument_group("engine (EngineConfig; docs/engine_args.md)"),
                    only=("model", "mesh_shape", "layer_groups"), defaults={"layer_groups": 2})
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if bad := sorted(set(policies) - set(POLICIES)):
        parser.error(f"unknown policies {bad}; choose from {list(POLICIES)}")

    from checkpoints.train_demo import ensure_demo
    from lp_jax.core.sampling_params import SamplingParams
    from lp_jax.llm import LLM

    model_dir = Path(args.model) if args.model else ensure_demo()
    print(describe(model_dir))
    groups, mesh = args.layer_groups, args.mesh_shape
    prompts = args.prompt or list(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results: dict[str, list] = {}
    llm = None
    for policy in policies:
        t0 = time.perf_counter()
        # Small engines of one program each: 68 rows, the 64-token budget plus the 4
        # decodes that orca and layered batch with it (a second, 4-row bucket for the
        # decodes would cost each policy's cold start another compile, 20 s here).
        llm = LLM(str(model_dir), scheduling=policy, layer_groups=groups, max_model_len=64,
                  max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(68,),
                  mesh_shape=mesh, log=None)
        if not llm.is_leader:  # a follower of a multi-process engine: it ran the leader's steps
            return
        ready = time.perf_counter() - t0
        results[policy] = llm.generate(prompts=prompts, sampling_params=params)
        served = time.perf_counter() - t0 - ready
        print(f"{policy:>11}: engine ready in {ready:.1f} s, {len(prompts)} prompts served "
              f"in {served:.2f} s")

    first = policies[0]
    print()
    for i, prompt in enumerate(prompts):
        out = results[first][i]
        print(f"{prompt!r}\n  -> {out.text!r}  ({len(out.token_ids)} tokens, "
              f"TTFT {out.metrics.ttft * 1e3:.0f} ms)")
    mismatches = [(prompts[i], [p for p in policies
                                if results[p][i].token_ids != results[first][i].token_ids])
                  for i in range(len(prompts))]
    mismatches = [(prompt, ps) for prompt, ps in mismatches if ps]
    s = llm.stats()
    print(f"\nlast engine ({policies[-1]}): iterations {s['iterations']} (prefill "
          f"{s['iterations_prefill']}, hybrid {s['iterations_hybrid']}, decode "
          f"{s['iterations_decode']}), programs {s['programs']}, compiles while serving "
          f"{s['compilations_after_warmup']}, expert bytes {s['expert_bytes_loaded']:,}")
    if mismatches:
        for prompt, ps in mismatches:
            print(f"MISMATCH: {prompt!r}: {', '.join(ps)} continued it differently from "
                  f"{first}", file=sys.stderr)
        sys.exit(1)
    print(f"the same greedy tokens from {', '.join(policies)}: OK")


if __name__ == "__main__":
    main()
