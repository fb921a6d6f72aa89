"""Workloads for lp-bench: request lengths, arrival times and prompts.

Length models (prompt tokens, output tokens):
- `sharegpt`: the ShareGPT-8k chat workload of the Layered Prefill paper, sampled by
  interpolating its quantile table (every 5%, from /work/shared/data/traces/README.md);
  prompt and output lengths are drawn independently (their correlation is 0.04).
  Prompts 1 to 8141 tokens (median 1730), outputs 2 to 1024 (median 415).
- `arxiv`: the paper's arXiv summarization workload, whole articles: prompts uniform in
  [6000, 8000] tokens, outputs normal with mean 200 and s.d. 40, clipped to [100, 300].
  (The ≤4k-filtered arXiv CSV in the traces folder is shorter than the paper's; load it
  with --trace if that is what you want.)
- `fixed`: every request has --prompt-len and --output-len tokens.
- a trace file (--trace): CSV or JSONL, one request per row, with a prompt length column
  (prompt_len, num_prefill_tokens, input_len or prompt_tokens), an output length column
  (output_len, num_decode_tokens, output_tokens or completion_tokens) and optionally a
  timestamp column in seconds (timestamp, arrived_at, arrival_time); with timestamps the
  trace's own arrivals are replayed (times --time-scale), else --request-rate applies.

`--max-prompt-len` / `--max-output-len` fit a model to a small model's context: with
`--length-mode scale` (the default) every length is multiplied by max_len / (the model's
largest length), which keeps the shape of the distribution; with `clip` lengths are
capped. Lengths are at least 1.

Arrivals: `poisson` (exponential gaps, mean 1/rate) or `gamma` (gamma gaps with shape
`burstiness` and the same mean: burstiness < 1 is burstier than Poisson, > 1 smoother).
Rate `inf` sends everything at t=0.

Prompts: `token-ids` sends `prompt` as a list of random token ids in [0, vocab_size)
(exact lengths; /v1/completions only); `text` sends random text: with --tokenizer, random
token ids decoded to text (close to the intended length), otherwise random common words
(about one token each for typical BPE vocabularies; approximate).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QUANTILES = np.arange(0, 101, 5, dtype=np.float64)
SHAREGPT_PROMPT = np.array([1, 29, 74, 180, 382, 580, 777, 973, 1203, 1457, 1730, 2060, 2401,
                            2799, 3235, 3734, 4278, 4918, 5696, 6563, 8141], np.float64)
SHAREGPT_OUTPUT = np.array([2, 44, 84, 130, 181, 228, 271, 312, 346, 381, 415, 453, 493, 534,
                            581, 628, 683, 754, 834, 920, 1024], np.float64)
ARXIV_PROMPT = (6000, 8000)
ARXIV_OUTPUT = (200.0, 40.0, 100, 300)  # mean, s.d., min, max

LENGTH_MODELS = ("sharegpt", "arxiv", "fixed")

_PROMPT_COLS = ("prompt_len", "num_prefill_tokens", "input_len", "prompt_tokens")
_OUTPUT_COLS = ("output_len", "num_decode_tokens", "output_tokens", "completion_tokens")
_TIME_COLS = ("timestamp", "arrived_at", "arrival_time")

_WORDS = ("the of and to in is that it for as with was on be by at this from or an are not "
          "have which one but all were they we there their been has more if will would about "
          "time can so what out up other into only new some could these two may first then "
          "any like now over such our man me even most made after also did many before must "
          "through back years where much your way well down should because each just those "
          "people how too little state good very make world still own see men work long get "
          "here between both life being under never day same another know while last might "
          "great old year off come since against go came right used take three").split()


@dataclass
class RequestSpec:
    index: int
    arrival: float  # seconds after the start of the run
    prompt_len: int
    output_len: int
    prompt: list[int] | str | None = None


@dataclass
class Trace:
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    timestamps: np.ndarray | None


def load_trace(path) -> Trace:
    """Reads a CSV or JSONL trace (see the module docstring for the columns)."""
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows")

    def column(names, required=True):
        for name in names:
            if name in rows[0]:
                try:
                    return np.array([float(r[name]) for r in rows])
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{path}: bad value in column {name!r}: {exc}") from None
        if required:
            raise ValueError(f"{path}: needs one of the columns {names}; has {list(rows[0])}")
        return None

    prompts = column(_PROMPT_COLS)
    outputs = column(_OUTPUT_COLS)
    times = column(_TIME_COLS, required=False)
    if np.any(prompts < 1) or np.any(outputs < 1):
        raise ValueError(f"{path}: lengths must be >= 1")
    if times is not None:
        order = np.argsort(times, kind="stable")
        prompts, outputs, times = prompts[order], outputs[order], times[order] - times[order][0]
    return Trace(prompts.astype(np.int64), outputs.astype(np.int64), times)


def sample_lengths(model: str, n: int, rng: np.random.Generator, *, prompt_len: int = 128,
                   output_len: int = 128) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(prompt lengths, output lengths, the model's max prompt, its max output)."""
    if model == "sharegpt":
        p = np.interp(rng.uniform(0, 100, n), QUANTILES, SHAREGPT_PROMPT)
        o = np.interp(rng.uniform(0, 100, n), QUANTILES, SHAREGPT_OUTPUT)
        return np.rint(p), np.rint(o), SHAREGPT_PROMPT[-1], SHAREGPT_OUTPUT[-1]
    if model == "arxiv":
        lo, hi = ARXIV_PROMPT
        mean, sd, omin, omax = ARXIV_OUTPUT
        p = rng.integers(lo, hi + 1, n).astype(np.float64)
        o = np.clip(np.rint(rng.normal(mean, sd, n)), omin, omax)
        return p, o, float(hi), float(omax)
    if model == "fixed":
        return (np.full(n, float(prompt_len)), np.full(n, float(output_len)),
                float(prompt_len), float(output_len))
    raise ValueError(f"unknown length model {model!r}; expected {LENGTH_MODELS} or --trace")


def fit_lengths(lengths: np.ndarray, model_max: float, max_len: int | None,
                mode: str = "scale") -> np.ndarray:
    lengths = np.asarray(lengths, np.float64)
    if max_len is not None and model_max > max_len:
        if mode == "scale":
            lengths = np.rint(lengths * (max_len / model_max))
        elif mode == "clip":
            lengths = np.minimum(lengths, max_len)
        else:
            raise ValueError(f"length mode must be scale or clip, got {mode!r}")
    return np.maximum(lengths, 1).astype(np.int64)


def arrival_times(n: int, rate: float, rng: np.random.Generator, *, process: str = "poisson",
                  burstiness: float = 1.0) -> np.ndarray:
    """Arrival offsets in seconds; the first request arrives after one gap (0 if rate=inf)."""
    if n == 0:
        return np.zeros(0)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return np.zeros(n)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif process == "gamma":
        if not burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    else:
        raise ValueError(f"arrival process must be poisson or gamma, got {process!r}")
    return np.cumsum(gaps)


def make_prompt(length: int, rng: np.random.Generator, *, kind: str = "token-ids",
                vocab_size: int = 500, tokenizer=None) -> list[int] | str:
    if kind == "token-ids":
        return rng.integers(0, vocab_size, length).tolist()
    if kind == "text":
        if tokenizer is not None:
            ids = rng.integers(0, min(vocab_size, tokenizer.get_vocab_size()), length).tolist()
            return tokenizer.decode(ids)
        return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), length))
    raise ValueError(f"prompt kind must be token-ids or text, got {kind!r}")


def build_workload(*, num_requests: int | None, rate: float, seed: int = 0,
                   length_model: str = "sharegpt", trace=None, process: str = "poisson",
                   burstiness: float = 1.0, time_scale: float = 1.0,
                   max_prompt_len: int | None = None, max_output_len: int | None = None,
                   length_mode: str = "scale", prompt_len: int = 128, output_len: int = 128,
                   prompt_kind: str = "token-ids", vocab_size: int = 500,
                   tokenizer=None) -> list[RequestSpec]:
    """The requests of one run, with prompts, sorted by arrival."""
    rng = np.random.default_rng(seed)
    if trace is not None:
        tr = trace if isinstance(trace, Trace) else load_trace(trace)
        n = len(tr.prompt_lens) if num_requests is None else min(num_requests,
                                                                 len(tr.prompt_lens))
        p, o = tr.prompt_lens[:n], tr.output_lens[:n]
        pmax, omax = float(tr.prompt_lens.max()), float(tr.output_lens.max())
        if tr.timestamps is not None:
            times = tr.timestamps[:n] * time_scale
        else:
            times = arrival_times(n, rate, rng, process=process, burstiness=burstiness)
    else:
        n = 100 if num_requests is None else num_requests
        p, o, pmax, omax = sample_lengths(length_model, n, rng, prompt_len=prompt_len,
                                          output_len=output_len)
        times = arrival_times(n, rate, rng, process=process, burstiness=burstiness)
    p = fit_lengths(p, pmax, max_prompt_len, length_mode)
    o = fit_lengths(o, omax, max_output_len, length_mode)
    prompt_rng = np.random.default_rng([seed, 1])
    return [RequestSpec(i, float(times[i]), int(p[i]), int(o[i]),
                        make_prompt(int(p[i]), prompt_rng, kind=prompt_kind,
                                    vocab_size=vocab_size, tokenizer=tokenizer))
            for i in range(n)]
