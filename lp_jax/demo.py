"""`make demo`: serve a few prompts with layered prefill on the embedded default model.

The default model is the tiny Qwen3-MoE checkpoint from checkpoints/make_tiny.py,
written on first use (random weights, so the text is gibberish; the point is the
machinery). Pass --model DIR for any Hugging Face Qwen3(-MoE) directory.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: tiny)")
    parser.add_argument("--scheduling", default="layered",
                        choices=["orca", "chunked", "layered", "flowprefill"])
    parser.add_argument("--mesh-shape", default=None,
                        help="expert,tensor devices, e.g. 2,4 (several processes: see "
                             "launch/multihost.py)")
    parser.add_argument("--layer-groups", default="4",
                        help='"paper", "pow2" or a group count (default 4)')
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompt", action="append", default=None)
    args = parser.parse_args(argv)

    from lp_jax import LLM, SamplingParams

    groups = int(args.layer_groups) if args.layer_groups.isdigit() else args.layer_groups
    t0 = time.perf_counter()
    mesh = tuple(int(x) for x in args.mesh_shape.split(",")) if args.mesh_shape else None
    llm = LLM(args.model, scheduling=args.scheduling, layer_groups=groups, max_model_len=512,
              max_num_seqs=4, max_num_batched_tokens=512, token_buckets=(4, 64, 516),
              mesh_shape=mesh)
    if not llm.is_leader:  # a follower of a multi-process engine: it ran the leader's steps
        return
    print(f"engine ready in {time.perf_counter() - t0:.1f} s ({args.scheduling} scheduling)")
    prompts = args.prompt or ["The engine serves", "Rain falls on the", "Bake the bread"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for prompt, out in zip(prompts, llm.generate(prompts=prompts, sampling_params=params),
                           strict=True):
        m = out.metrics
        print(f"{prompt!r} -> {out.text!r}\n"
              f"    {len(out.token_ids)} tokens, finish={out.finish_reason}, "
              f"TTFT {m.ttft * 1e3:.1f} ms, E2E {m.e2e * 1e3:.1f} ms")
    s = llm.stats()
    print(f"iterations {s['iterations']} (prefill {s['iterations_prefill']}, hybrid "
          f"{s['iterations_hybrid']}, decode {s['iterations_decode']}), programs "
          f"{s['programs']}, compiles while serving {s['compilations_after_warmup']}, "
          f"expert bytes {s['expert_bytes_loaded']:,}")


if __name__ == "__main__":
    main()
