"""`make demo`: generate text with the embedded default model.

The default model is the tiny Qwen3-MoE checkpoint from checkpoints/make_tiny.py,
written on first use. Pass --model DIR for any Hugging Face Qwen3(-MoE) directory.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: tiny)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompt", action="append", default=None)
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer

    from checkpoints.make_tiny import ensure_tiny
    from lp_jax.loader import load_model
    from lp_jax.models.simple import greedy_generate

    model_dir = args.model or ensure_tiny()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json")
                                    if hasattr(model_dir, "joinpath") else
                                    f"{model_dir}/tokenizer.json")
    t0 = time.perf_counter()
    model = load_model(model_dir)
    print(f"loaded {model_dir} in {time.perf_counter() - t0:.2f} s")
    prompts = args.prompt or ["The engine serves", "Rain falls on the"]
    for prompt in prompts:
        ids = tokenizer.encode(prompt).ids
        t0 = time.perf_counter()
        out = greedy_generate(model, ids, args.max_tokens)
        dt = time.perf_counter() - t0
        print(f"{prompt!r} -> {tokenizer.decode(out)!r}  ({len(out)} tokens, {dt:.2f} s)")


if __name__ == "__main__":
    main()
