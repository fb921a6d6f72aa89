"""What structured outputs cost on the host, per token, and what the engine pays per step.

    python -m lp_jax.bench.structured [--tokenizer PATH | --train-bpe DIR] [--engine]

Part 1 (grammar): for each tokenizer (the tiny model's 512 tokens, and a realistic one)
and each spec, walks `--tokens` random allowed tokens through a matcher and times the
two host halves of a constrained token: the bitmask fill of one row and the matcher
advance; then fills of `--rows` rows at once (llguidance's thread pool), each at new
states (every row takes a token between them: llguidance reuses a state's mask). No model or
tokenizer is downloaded: `--tokenizer` takes any local tokenizer.json, and `--train-bpe`
trains a 151,643-token byte-level BPE (Qwen3's size, padded to 151,936 like its embedding)
on the Python sources of this environment, in about a minute.

Part 2 (`--engine`): the tiny engine (the shared chunked shapes of tests/conftest.py)
decodes `--seqs` sequences free and then constrained, and reports per step the host
time, the exposed host time (host work not hidden behind a running step) and the wall
time per token. Constrained sequences sit out the step planned while their token is on
device (scheduler.py), so with only constrained rows every token's host work is exposed.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

import numpy as np

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 12}}}}
SPECS = {"json_schema": {"json": SCHEMA}, "json_object": {"json_object": True},
         "regex": {"regex": r"[A-Za-z ]{1,40}\.[0-9]{1,6}"}}
QWEN3_VOCAB = 151_936


QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_bpe(out_dir: Path, special_tokens=QWEN3_SPECIALS) -> Path:
    """A byte-level BPE of Qwen3's size on the local Python sources (tokenizers' trainer),
    with `special_tokens` as its specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = out_dir / "tokenizer.json"
    if out.is_file():
        return out
    files = sorted(glob.glob(f"{sys.prefix}/lib/python3*/site-packages/**/*.py", recursive=True))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(
        vocab_size=151_643, min_frequency=2, show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def grammar_costs(path: Path, vocab: int, eos: list[int], tokens: int, rows: int, seed=0):
    """{spec: fill (median, mean, p90) and advance us, one fill of `rows` rows, compile}.
    Tokens are drawn uniformly from the allowed ones: a harder walk than a model's (odd
    tokens keep the lexer in its widest states), so an upper estimate."""
    from lp_jax.structured.compiler import GrammarCompiler
    from lp_jax.structured.matchers import StructuredOutputs
    from lp_jax.structured.params import StructuredOutputsParams

    t0 = time.perf_counter()
    compiler = GrammarCompiler(path, vocab, eos)
    compiler.tokenizer  # noqa: B018 - waits for the background build
    print(f"  tokenizer {path} ({vocab} ids): {1e3 * (time.perf_counter() - t0):.0f} ms")
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in SPECS.items():
        spec = StructuredOutputsParams(**spec)
        so = StructuredOutputs(compiler)
        t0 = time.perf_counter()
        so.check(spec)
        compile_ms = 1e3 * (time.perf_counter() - t0)
        mask = np.full((rows, so.words), -1, np.int32)
        fill, adv, walked, sid = [], [], 0, 0
        while walked < tokens:
            so.add(sid, spec)
            for _ in range(200):
                t0 = time.perf_counter()
                so.fill([(sid, 0)], mask)
                t1 = time.perf_counter()
                allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8),
                                                       bitorder="little")[:vocab])
                tok = int(rng.choice(allowed))
                t2 = time.perf_counter()
                so.advance(sid, tok)
                fill.append(t1 - t0)
                adv.append(time.perf_counter() - t2)
                walked += 1
                if tok in eos:
                    break
            so.release(sid)
            sid += 1
        for r in range(rows):  # `rows` sequences at random depths of the grammar
            so.add(10_000 + r, spec)
            for _ in range(int(rng.integers(0, 20))):
                so.fill([(10_000 + r, 0)], mask)
                allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8),
                                                       bitorder="little")[:vocab])
                go_on = [t for t in allowed if t not in eos]
                if not go_on:
                    break
                so.advance(10_000 + r, int(rng.choice(go_on)))
        batch = []
        for _ in range(10):  # each fill at new states: every row then takes a token
            t0 = time.perf_counter()
            so.fill([(10_000 + r, r) for r in range(rows)], mask)
            batch.append(time.perf_counter() - t0)
            bits_RV = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            for r in range(rows):
                go_on = [t for t in np.flatnonzero(bits_RV[r]) if t not in eos]
                if go_on:
                    so.advance(10_000 + r, int(rng.choice(go_on)))
        r = out[name] = dict(fill_us=1e6 * float(np.median(fill)),
                             fill_mean_us=1e6 * float(np.mean(fill)),
                             fill_p90_us=1e6 * float(np.percentile(fill, 90)),
                             advance_us=1e6 * float(np.median(adv)),
                             batch_fill_us=1e6 * float(np.median(batch)), rows=rows,
                             compile_ms=compile_ms, tokens=walked, sequences=sid)
        print(f"  {name:12s} fill {r['fill_us']:7.1f} us (mean {r['fill_mean_us']:7.1f}, p90 "
              f"{r['fill_p90_us']:7.1f}), advance {r['advance_us']:5.1f} us, fill of {rows} "
              f"rows {r['batch_fill_us']:8.1f} us, compile {compile_ms:5.1f} ms  ({walked} "
              f"tokens, {sid} sequences)")
    return out


def engine_costs(seqs: int, max_tokens: int, reps: int = 3):
    """Per device step: host and exposed host ms; per token: each kind of row's mean
    inter-token latency. Cases: all rows free, all constrained, half and half."""
    from checkpoints.make_tiny import ensure_tiny
    from lp_jax.core.sampling_params import SamplingParams
    from lp_jax.llm import LLM
    from lp_jax.structured.params import StructuredOutputsParams

    llm = LLM(model=str(ensure_tiny(preset="tiny")), max_num_seqs=4, max_model_len=256,
              log=None, scheduling="chunked", max_num_batched_tokens=16, token_buckets=(4, 16))
    # Exactly max_tokens letters and then an integer: every sample runs about as long.
    bounded = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
               "properties": {"a": {"type": "string", "minLength": max_tokens,
                                    "maxLength": max_tokens, "pattern": "^[a-z]+$"},
                              "b": {"type": "integer", "minimum": 0, "maximum": 9}}}
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens + 8, ignore_eos=True)
    bound = SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens + 16,
                           structured_outputs=StructuredOutputsParams(json=bounded))
    half = seqs // 2
    cases = {"free": [free] * seqs, "constrained": [bound] * seqs,
             "mixed": [free] * half + [bound] * (seqs - half)}
    prompts = [[1 + i, 2, 3, 4] for i in range(seqs)]
    rows = {}
    for rep in range(reps + 1):  # the first pass warms the host paths
        for name, params in cases.items():
            before = llm.engine.stats()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            after = llm.engine.stats()
            d = {k: after[k] - before[k] for k in ("iterations", "iterations_idle",
                                                    "host_seconds", "overlapped_host_seconds")}
            steps = d["iterations"] - d["iterations_idle"]
            itl = {"free": [], "constrained": []}
            for o, p in zip(outs, params, strict=True):
                itl["free" if p is free else "constrained"] += o.metrics.itls
            r = dict(device_steps=steps, idle_steps=d["iterations_idle"],
                     host_ms=1e3 * d["host_seconds"] / steps,
                     exposed_ms=1e3 * (d["host_seconds"] - d["overlapped_host_seconds"]) / steps,
                     **{f"itl_{k}_ms": 1e3 * float(np.mean(v)) for k, v in itl.items() if v})
            if rep:
                rows.setdefault(name, []).append(r)
    out = {}
    for name, rs in rows.items():
        r = out[name] = {k: float(np.median([x[k] for x in rs])) for k in rs[0]}
        itls = ", ".join(f"{k[4:-3]} rows {r[k]:.2f}" for k in r if k.startswith("itl_"))
        print(f"  {name:12s} {r['device_steps']:.0f} device + {r['idle_steps']:.0f} idle steps; "
              f"per device step host {r['host_ms']:.2f} ms, exposed {r['exposed_ms']:.2f} ms; "
              f"inter-token ms: {itls}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="a local tokenizer.json with a realistic vocabulary")
    ap.add_argument("--train-bpe", help="train a Qwen3-sized BPE into this directory first")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens walked per spec")
    ap.add_argument("--rows", type=int, default=32, help="rows of the batched fill")
    ap.add_argument("--engine", action="store_true", help="also the engine's per-step costs")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    from checkpoints.make_tiny import ensure_tiny

    results = {}
    tiny = ensure_tiny(preset="tiny") / "tokenizer.json"
    print("grammar cost per constrained token (median):")
    results["tiny"] = grammar_costs(tiny, 512, [511, 509], args.tokens, args.rows)
    big = args.tokenizer or (train_bpe(Path(args.train_bpe)) if args.train_bpe else None)
    if big:
        tj = json.loads(Path(big).read_text())
        vocab = max(QWEN3_VOCAB, len(tj["model"]["vocab"]) + len(tj.get("added_tokens", [])))
        eos = [t["id"] for t in tj.get("added_tokens", [])
               if t["content"] in ("<|im_end|>", "<|endoftext|>", "</s>")]
        results["large"] = grammar_costs(Path(big), vocab, eos, args.tokens, args.rows)
    if args.engine:
        print("engine (tiny model, chunked, CPU backend):")
        results["engine"] = engine_costs(args.seqs, args.max_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
