"""Profile the engine's step latency: `python -m lp_jax.engine.profile_latency --out FILE`.

Runs waves of prompts of many sizes (then a few decodes each) through a real engine; the
scheduler's estimator (lp_jax/core/latency.py) learns from every measured step, and the
fitted model is written for `EngineConfig.latency_model` / `lp-serve --latency-model`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from lp_jax.core.latency import FEATURES, LatencyModel, profile_prompts
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.engine.config import EngineConfig
from lp_jax.engine.llm_engine import LLMEngine


def profile_engine(engine, *, output_tokens: int = 8, seed: int = 0) -> LatencyModel:
    """Runs waves of prompts of many sizes (then a few decodes each) through an engine;
    its scheduler's estimator learns from every measured step. Returns the estimator."""
    cfg, rng = engine.scheduler.config, np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    waves = profile_prompts(cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs,
                            rng)
    for wave in waves:  # solo: a prefill batch, then its decodes
        for n in wave:
            engine.add_request(rng.integers(0, cfg.vocab_size, n).tolist(), params)
        while engine.has_unfinished():
            engine.step()
    # Contention: prompts of each size arriving while a decode batch runs.
    long_out = dataclasses.replace(params, max_tokens=4 * output_tokens)
    for decodes in sorted({max(1, cfg.max_num_seqs // 4), max(1, cfg.max_num_seqs // 2)}):
        for n in sorted({w[0] for w in waves}):
            for _ in range(decodes):
                engine.add_request(rng.integers(0, cfg.vocab_size, 8).tolist(), long_out)
            for _ in range(3):
                engine.step()
            engine.add_request(rng.integers(0, cfg.vocab_size, n).tolist(), params)
            while engine.has_unfinished():
                engine.step()
    model = engine.scheduler.latency
    model.source = f"profiled ({cfg.name}, {len(waves)} waves)"
    return model


def main(argv=None) -> None:
    from lp_jax.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser(
        prog="python -m lp_jax.engine.profile_latency",
        description="Profile the engine's step latency and write a fitted estimator "
                    "(EngineConfig.latency_model / lp-serve --latency-model).")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--output-tokens", type=int, default=8, help="decode steps per request")
    p.add_argument("--waves-seed", "--seed", dest="waves_seed", type=int, default=0,
                   help="seed of the prompt waves")
    names = add_engine_args(
        p.add_argument_group("engine (EngineConfig; docs/engine_args.md)"),
        only=("model", "scheduling", "preemption_granularity", "max_model_len",
              "max_num_batched_tokens", "max_num_seqs", "load_format"),
        defaults={"scheduling": "flowprefill"})
    args = p.parse_args(argv)
    engine = LLMEngine(EngineConfig(**engine_kwargs(args, names)))
    model = profile_engine(engine, output_tokens=args.output_tokens, seed=args.waves_seed)
    model.save(args.out)
    print(json.dumps({"out": args.out, **model.error(),
                      "coef": dict(zip(FEATURES, model.to_dict()["coef"], strict=True))},
                     indent=1))


if __name__ == "__main__":
    main()
