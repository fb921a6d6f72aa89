"""n-gram (or EAGLE-3, or MTP) speculation against plain decoding, in one run.

    python -m lp_jax.bench.speculative [--num-speculative-tokens 3] [--max-tokens 96]
    python -m lp_jax.bench.speculative --method eagle3
    python -m lp_jax.bench.speculative --method mtp

With `--method eagle3` the draft is a random EAGLE-3 head for the model
(checkpoints/make_tiny_eagle3.py, aux layers (0, L // 2, L - 1)): its drafts are
almost never accepted, so the run measures what the head costs (programs, compile
time, memory, time per token), not what it gains. With `--method mtp` the model is
tiny-deepseek-mtp (checkpoints/make_tiny_mtp.py: random weights, MLA and MoE, one random
next-token layer) instead of the demo model, for the same reason.

Each prompt is the start of one of Aesop's fables and then its first words again, so
the demo model (checkpoints/train_demo.py, which knows the fables by heart) continues
a text its prompt already holds: the case prompt lookup is for. The same prompts run
greedily on two engines, without speculation and with n-gram drafts, after one warm
run each; printed: whether the tokens agree, acceptance per draft position (accepted /
drafts, vLLM's definition), the mean tokens a speculating step yields, engine steps
per generated token and wall time per generated token (median of --repeats runs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

FABLES = ("The Lion and the Mouse", "The North Wind and the Sun", "The Crow and the Pitcher")


def fable_prompts(passage: int = 12, words: int = 3) -> list[str]:
    """Each fable's first `passage` words, a blank line, then its first `words` words
    again. Short: the demo model was trained on 64-token windows."""
    text = (Path(__file__).resolve().parents[2] / "checkpoints/data/aesop_townsend.txt"
            ).read_text()
    blocks = [b.strip() for b in text.split("\n\n")]
    out = []
    for title in FABLES:
        body = " ".join(blocks[blocks.index(title) + 1].split())
        w = body.split()
        out.append(f"{' '.join(w[:passage])}\n\n{' '.join(w[:words])}")
    return out


def measure(llm, prompts, params, repeats: int) -> dict:
    """One warm run, then `repeats` timed runs: the median wall time, and the engine's
    counters over the last run (the same in every run: greedy)."""
    llm.generate(prompts, params)
    times = []
    for _ in range(repeats):
        before = llm.engine.stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
        after = llm.engine.stats()
    d = {k: after[k] - before.get(k, 0) for k in after
         if k.startswith(("iterations", "spec_decode")) and isinstance(after[k], int)}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"outs": [o.outputs[0].token_ids for o in outs], "tokens": tokens,
            "steps": d["iterations"] - d["iterations_idle"],
            "seconds": statistics.median(times), "d": d}


def main(argv=None) -> int:
    from lp_jax.core.sampling_params import SamplingParams
    from lp_jax.llm import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=("ngram", "eagle3", "mtp"), default="ngram")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompt-lookup-max", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=20)
    ap.add_argument("--scheduling", default="layered")
    # a step samples at most max_num_seqs rows: 3 sequences x (k + 1) rows must fit
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs (median)")
    for name, default in (("presence", 0.0), ("frequency", 0.0), ("repetition", 1.0)):
        ap.add_argument(f"--{name}-penalty", type=float, default=default)
    args = ap.parse_args(argv)
    prompts = fable_prompts()
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                             presence_penalty=args.presence_penalty,
                             frequency_penalty=args.frequency_penalty,
                             repetition_penalty=args.repetition_penalty)]
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max}
    engine = dict(scheduling=args.scheduling, max_num_seqs=args.max_num_seqs,
                  max_model_len=512, async_scheduling=not args.no_async_scheduling, log=None)
    if args.method == "eagle3":
        spec = {"method": "eagle3", "model": random_head(),
                "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "mtp":
        from checkpoints.make_tiny_mtp import ensure_tiny_mtp

        spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
        engine.update(model=str(ensure_tiny_mtp("tiny-deepseek-mtp")), max_model_len=256)
    llms = (LLM(**engine), LLM(**engine, speculative_config=spec))
    base = measure(llms[0], prompts, params * len(prompts), args.repeats)
    fast = measure(llms[1], prompts, params * len(prompts), args.repeats)
    k, d = args.num_speculative_tokens, fast["d"]
    drafts = d.get("spec_decode_num_drafts", 0)
    print(f"prompts: {len(prompts)} fables (their first 12 words, then their first 3 "
          "again), greedy, "
          f"penalties (presence, frequency, repetition) {args.presence_penalty}, "
          f"{args.frequency_penalty}, {args.repetition_penalty}, "
          f"max_tokens {args.max_tokens}, {args.scheduling}, max_num_seqs "
          f"{args.max_num_seqs}, async_scheduling {engine['async_scheduling']}; "
          f"speculative_config {spec}")
    print(f"same tokens as without speculation: {fast['outs'] == base['outs']}")
    for name, llm in zip(("without", args.method), llms, strict=True):
        st = llm.stats()
        print(f"{name:>8}: {st['programs']} programs, {st['startup_compilations']} start-up "
              f"compilations, {st['compile_seconds']:.1f} s compiling, memory (MB) "
              f"{ {k: round(v / 1e6, 3) for k, v in llm.engine.runner.memory().items()} }")
    for name, r in (("without", base), (args.method, fast)):
        print(f"{name:>8}: {r['tokens']} tokens in {r['steps']} steps "
              f"({r['steps'] / r['tokens']:.3f} steps per token), "
              f"{1e3 * r['seconds'] / r['tokens']:.2f} ms per token (median of "
              f"{args.repeats} runs)")
    if drafts:
        per_pos = [d.get(f"spec_decode_num_accepted_tokens_pos_{i}", 0) / drafts
                   for i in range(k)]
        print(f"drafts {drafts}, draft tokens {d['spec_decode_num_draft_tokens']}, accepted "
              f"{d['spec_decode_num_accepted_tokens']}; acceptance per position "
              f"{[round(x, 3) for x in per_pos]}; tokens per speculating step "
              f"{1 + d['spec_decode_num_accepted_tokens'] / drafts:.2f}")
    return 0


def random_head() -> str:
    """A random EAGLE-3 head for the demo model, in a temporary directory."""
    import json
    import tempfile

    from checkpoints.make_tiny_eagle3 import write_eagle3_dir
    from checkpoints.train_demo import ensure_demo

    target = ensure_demo()
    L = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    return str(write_eagle3_dir(tempfile.mkdtemp(prefix="eagle3_head_"), target,
                                aux_layer_ids=(0, L // 2, L - 1)))


if __name__ == "__main__":
    raise SystemExit(main())
