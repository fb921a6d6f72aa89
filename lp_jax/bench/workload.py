"""Workloads for lp-bench: a thin layer over `lp_jax.sim.workload`, plus prompts.

The length models, the arrival process and the trace loader are the simulator's, so for the
same seed lp-bench sends what the simulator simulates: before `--max-*-len` fitting,
`build_workload(length_model=m, rate=r, seed=s, ...)` has the lengths and arrival times of
`lp_jax.sim.synthesize(m, n, r, cv=cv, seed=s)`.

Length models (prompt tokens, output tokens; lp_jax/sim/workload.py has their derivations):
- `sharegpt`: `SHAREGPT_8K`, the Layered Prefill paper's ShareGPT-8k chat workload, sampled
  by interpolating its quantile table (every 5%); prompt and output lengths independent.
  Prompts 1 to 8141 tokens (median 1730), outputs 2 to 1024 (median 415).
- `arxiv`: `ARXIV_PAPER`, the paper's arXiv summarization workload (whole articles):
  prompts lognormal with median 7000 and sigma 0.3, clipped to [2048, 16384] (5-95%: about
  4.3k-11.5k); outputs lognormal with median 200 and sigma 0.35, clipped to [32, 512].
- `arxiv-4k`, `azure-conv`: (prompt, output) pairs resampled from the bundled traces (the
  <=4k-token arXiv file and the Azure 2023 conversation trace, lp_jax/sim/data/); lengths
  only, arrivals come from --arrival (pass a file as --trace to replay its arrival times).
- `fixed`: every request has --prompt-len and --output-len tokens.
- a trace file (--trace): CSV or JSONL read by `lp_jax.sim.workload.load_trace`, one request
  per row, with a prompt length column (prompt_len, num_prefill_tokens, input_len or
  prompt_tokens), an output length column (output_len, num_decode_tokens, output_tokens,
  max_tokens or completion_tokens) and optionally a time column in seconds (timestamp,
  arrived_at, arrival_time, arrival or time). When every row has a time the trace's own
  arrivals are replayed in time order (times --time-scale), else --request-rate applies.
  Optional columns slo_class (or class / task / task_type), ttft_slo_ms / tbt_slo_ms (or
  _s) ride on each request as `slo_class` / `ttft_slo_ms` / `tbt_slo_ms`: the objectives
  are sent in the request body, the class with --send-slo-class. docs/trace_format.md
  documents the format.

`--max-prompt-len` / `--max-output-len` fit a model to a small model's context: with
`--length-mode scale` (the default) every length is multiplied by max_len / (the model's
largest length: `max_lengths`, or the trace's largest), which keeps the shape of the
distribution; with `clip` lengths are capped. Lengths are at least 1.

Arrivals: the simulator's gamma renewal process with mean gap 1/rate, first request at t=0.
`poisson` is exponential gaps (CV 1); `gamma` has shape `burstiness` (gap CV
1/sqrt(burstiness): < 1 is burstier than Poisson, > 1 smoother). Rate `inf` sends
everything at t=0.

Multi-SLO (`--workload multi-slo`, `build_multi_slo_workload`): FlowPrefill's setting, a
mix of task classes each with its own prompt lengths and latency objectives. A class is
`NAME:PROMPT_LEN:TTFT_MS[:TBT_MS][:WEIGHT]` (`parse_slo_class`); each request draws its
class by weight and its prompt length from a lognormal whose mean is the class's PROMPT_LEN
(sigma `length_sigma`), times `length_scale`, clipped to [1, max_prompt_len]; outputs are
`output_len` tokens. The default mix, `QWEN_TRACE_CLASSES`, has the mean prompt lengths of
FlowPrefill's QwenTrace classes (chat 590, web_search 5976, summarisation 6833 tokens);
image_understanding's length, every class's TTFT objective and the equal weights are not in
the paper and are ASSUMED. Each request carries its objectives (times `slo_scale`) as
`ttft_slo_ms` / `tbt_slo_ms`, which any lp-serve takes without configuration.

Multi-turn chat (`--workload multi-turn`, `build_multi_turn_workload`): conversations start
at the arrival process's times; turn k of a conversation is sent `turn_gap` seconds after
turn k - 1 (open loop: it does not wait for the answer) and resends the whole history, a
shared system prompt of `system_len` tokens, then user turns of `user_len` tokens each
followed by an assistant turn of `output_len` tokens, and the new user turn. The client
does not send back the answers it got: the assistant turns are random tokens of the same
length, so a server with prefix caching hits the previous turn's prompt, and not the
previous answer it generated (a lower bound on a real chat's hits). A conversation ends
after `turns` turns or before its prompt would exceed `max_prompt_len`.

Prompts: `token-ids` sends `prompt` as a list of random token ids in [0, vocab_size)
(exact lengths; /v1/completions only); `text` sends random text: with --tokenizer, random
token ids decoded to text (close to the intended length), otherwise random common words
(about one token each for typical BPE vocabularies; approximate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lp_jax.sim import workload as sim
from lp_jax.sim.workload import LengthModel, TraceRow, load_trace, synthesize

__all__ = ["LENGTH_MODELS", "MULTI_SLO", "MULTI_TURN", "QWEN_TRACE_CLASSES", "FixedLengths",
           "RequestSpec", "SLOClass", "arrival_cv", "arrival_times", "build_multi_slo_workload",
           "build_multi_turn_workload", "build_workload", "fit_lengths", "load_trace",
           "make_prompt", "parse_slo_class", "resolve_length_model", "slo_classes_config"]

LENGTH_MODELS = ("sharegpt", "arxiv", "arxiv-4k", "azure-conv", "fixed")
MULTI_SLO = "multi-slo"
MULTI_TURN = "multi-turn"

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
    slo_class: str | None = None  # multi-slo: the request's class
    ttft_slo_ms: float | None = None  # its objectives, sent in the request body
    tbt_slo_ms: float | None = None


@dataclass(frozen=True, slots=True)
class FixedLengths:
    """Every request has `prompt_len` prompt and `output_len` output tokens."""

    name: str
    prompt_len: int
    output_len: int

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return np.full(n, self.prompt_len, np.int64), np.full(n, self.output_len, np.int64)

    @property
    def max_lengths(self) -> tuple[int, int]:
        return self.prompt_len, self.output_len


def resolve_length_model(name: str, *, prompt_len: int = 128,
                         output_len: int = 128) -> LengthModel:
    """`fixed` (with these lengths) or any of the simulator's `length_model` names."""
    if name == "fixed":
        return FixedLengths("fixed", prompt_len, output_len)
    try:
        return sim.length_model(name)
    except KeyError:
        raise ValueError(f"unknown length model {name!r}; expected {LENGTH_MODELS} or "
                         "--trace") from None


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


def arrival_cv(process: str, burstiness: float = 1.0) -> float:
    """The gap CV of lp-bench's `--arrival` / `--burstiness` (gamma shape 1/CV^2)."""
    if process == "poisson":
        return 1.0
    if process == "gamma":
        if not (burstiness > 0 and math.isfinite(burstiness)):
            raise ValueError(f"burstiness must be finite and > 0, got {burstiness}")
        return 1.0 / math.sqrt(burstiness)
    raise ValueError(f"arrival process must be poisson or gamma, got {process!r}")


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")


def arrival_times(n: int, rate: float, rng: np.random.Generator, *, process: str = "poisson",
                  burstiness: float = 1.0) -> np.ndarray:
    """`lp_jax.sim.workload.arrival_times` (first at 0); rate inf sends all at t=0."""
    cv = arrival_cv(process, burstiness)
    _check_rate(rate)
    if math.isinf(rate):
        return np.zeros(n)
    return sim.arrival_times(n, rate, rng, cv)


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


def _from_trace(rows: list[TraceRow], num_requests: int | None, rate: float, seed: int,
                process: str, burstiness: float, time_scale: float):
    if not rows:
        raise ValueError("the trace has no rows")
    timed = all(r.timestamp is not None for r in rows)
    if timed:
        rows = sorted(rows, key=lambda r: r.timestamp)
    p = np.array([r.prompt_len for r in rows], np.int64)
    o = np.array([r.output_len for r in rows], np.int64)
    n = len(rows) if num_requests is None else min(num_requests, len(rows))
    if timed:
        t = np.array([r.timestamp for r in rows[:n]], np.float64)
        times = (t - t[0]) * time_scale
    else:  # the arrival stream of lp_jax.sim.workload.trace_requests
        times = arrival_times(n, rate, np.random.default_rng([seed, 0]), process=process,
                              burstiness=burstiness)
    return p[:n], o[:n], times, int(p.max()), int(o.max()), rows[:n]


def build_workload(*, num_requests: int | None, rate: float, seed: int = 0,
                   length_model: str | LengthModel = "sharegpt",
                   trace: str | Path | list[TraceRow] | None = None,
                   process: str = "poisson", burstiness: float = 1.0,
                   time_scale: float = 1.0, max_prompt_len: int | None = None,
                   max_output_len: int | None = None, length_mode: str = "scale",
                   prompt_len: int = 128, output_len: int = 128,
                   prompt_kind: str = "token-ids", vocab_size: int = 500,
                   tokenizer=None) -> list[RequestSpec]:
    """The requests of one run, with prompts, sorted by arrival.

    `trace` is a path or the rows `load_trace` returned; `length_model` a name from
    LENGTH_MODELS or a model with `sample` and `max_lengths`.
    """
    _check_rate(rate)
    if trace is not None:
        rows = load_trace(trace) if isinstance(trace, str | Path) else list(trace)
        p, o, times, pmax, omax, rows = _from_trace(rows, num_requests, rate, seed, process,
                                                    burstiness, time_scale)
    else:
        model = (resolve_length_model(length_model, prompt_len=prompt_len,
                                      output_len=output_len)
                 if isinstance(length_model, str) else length_model)
        n = 100 if num_requests is None else num_requests
        finite = math.isfinite(rate)
        reqs = synthesize(model, n, rate if finite else 1.0, cv=arrival_cv(process, burstiness),
                          seed=seed)
        p = np.array([r.prompt_len for r in reqs], np.int64)
        o = np.array([r.output_len for r in reqs], np.int64)
        times = np.array([r.arrival for r in reqs]) if finite else np.zeros(n)
        pmax, omax = model.max_lengths
        rows = None
    p = fit_lengths(p, pmax, max_prompt_len, length_mode)
    o = fit_lengths(o, omax, max_output_len, length_mode)
    prompt_rng = np.random.default_rng([seed, 2])  # [seed, 0] and [seed, 1]: arrivals, lengths
    specs = [RequestSpec(i, float(times[i]), int(p[i]), int(o[i]),
                         make_prompt(int(p[i]), prompt_rng, kind=prompt_kind,
                                     vocab_size=vocab_size, tokenizer=tokenizer))
             for i in range(len(p))]
    for spec, row in zip(specs, rows or (), strict=False):  # a trace's class and objectives
        spec.slo_class, spec.ttft_slo_ms, spec.tbt_slo_ms = (row.slo_class, row.ttft_slo_ms,
                                                             row.tbt_slo_ms)
    return specs


# ------------------------------------------------------------------------ multi-turn chat
def build_multi_turn_workload(*, num_conversations: int, turns: int, rate: float,
                              seed: int = 0, system_len: int = 0, user_len: int = 64,
                              output_len: int = 64, turn_gap: float = 1.0,
                              process: str = "poisson", burstiness: float = 1.0,
                              max_prompt_len: int | None = None,
                              prompt_kind: str = "token-ids", vocab_size: int = 500,
                              tokenizer=None) -> list[RequestSpec]:
    """The requests of a multi-turn chat run, sorted by arrival (see the module
    docstring); `rate` is conversations per second.

    Streams of `np.random.default_rng([seed, i])`: 0 conversation starts, 2 prompt text."""
    _check_rate(rate)
    for name, v in (("num_conversations", num_conversations), ("turns", turns),
                    ("user_len", user_len), ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if system_len < 0 or not (math.isfinite(turn_gap) and turn_gap >= 0):
        raise ValueError(f"need system_len >= 0 and a finite turn_gap >= 0, got "
                         f"{system_len}, {turn_gap}")
    starts = arrival_times(num_conversations, rate, np.random.default_rng([seed, 0]),
                           process=process, burstiness=burstiness)
    rng = np.random.default_rng([seed, 2])
    text = prompt_kind == "text"

    def part(n: int):
        return make_prompt(n, rng, kind=prompt_kind, vocab_size=vocab_size,
                           tokenizer=tokenizer)

    def join(a, b):
        return (f"{a} {b}" if a else b) if text else a + b

    system = part(system_len) if system_len else ("" if text else [])
    turns_out = []  # (arrival, conversation, turn, prompt length, prompt)
    for c, start in enumerate(starts):
        history, length = system, system_len
        for k in range(turns):
            if max_prompt_len is not None and length + user_len > max_prompt_len:
                break
            prompt, length = join(history, part(user_len)), length + user_len
            turns_out.append((float(start) + k * turn_gap, c, k, length, prompt))
            history, length = join(prompt, part(output_len)), length + output_len
    turns_out.sort(key=lambda t: t[:3])
    return [RequestSpec(i, t, n, output_len, prompt)
            for i, (t, _, _, n, prompt) in enumerate(turns_out)]


# ------------------------------------------------------------------------ multi-SLO mix
@dataclass(frozen=True, slots=True)
class SLOClass:
    """A task class of the multi-SLO workload. `assumed` names the fields whose value is a
    guess rather than the paper's (the report marks them)."""

    name: str
    prompt_len: float  # mean prompt tokens
    ttft_ms: float
    tbt_ms: float | None = None
    weight: float = 1.0  # relative share of the requests
    assumed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or ":" in self.name or len(self.name) > 64:
            raise ValueError(f"a class name must be 1 to 64 characters without ':', got "
                             f"{self.name!r}")
        for field_ in ("prompt_len", "ttft_ms", "tbt_ms", "weight"):
            v = getattr(self, field_)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"class {self.name!r}: {field_} must be finite and > 0, "
                                 f"got {v}")

    def objectives(self, slo_scale: float = 1.0) -> tuple[float, float | None]:
        """(TTFT, TBT) objectives in ms, times `slo_scale`."""
        tbt = None if self.tbt_ms is None else self.tbt_ms * slo_scale
        return self.ttft_ms * slo_scale, tbt


_ASSUMED_SLO = ("ttft_ms", "weight")
# FlowPrefill's QwenTrace classes. Mean prompt lengths of chat, web_search and summarisation
# are the paper's; image_understanding's length, the TTFT objectives (tighter for the
# interactive classes) and the equal weights are ASSUMED.
QWEN_TRACE_CLASSES = (
    SLOClass("chat", 590, 250, assumed=_ASSUMED_SLO),
    SLOClass("web_search", 5976, 2000, assumed=_ASSUMED_SLO),
    SLOClass("summarisation", 6833, 4000, assumed=_ASSUMED_SLO),
    SLOClass("image_understanding", 1500, 1000, assumed=("prompt_len", *_ASSUMED_SLO)),
)


def parse_slo_class(spec: str) -> SLOClass:
    """`NAME:PROMPT_LEN:TTFT_MS[:TBT_MS][:WEIGHT]`; an empty TBT_MS gives a weight without
    a TBT objective (`chat:590:250::2`)."""
    parts = spec.split(":")
    if not 3 <= len(parts) <= 5:
        raise ValueError(f"expected NAME:PROMPT_LEN:TTFT_MS[:TBT_MS][:WEIGHT], got {spec!r}")
    name, nums = parts[0], parts[1:] + [""] * (5 - len(parts))
    try:
        prompt_len, ttft, tbt, weight = (float(x) if x else None for x in nums)
    except ValueError:
        raise ValueError(f"class {spec!r}: PROMPT_LEN, TTFT_MS, TBT_MS and WEIGHT must be "
                         "numbers") from None
    if prompt_len is None or ttft is None:
        raise ValueError(f"class {spec!r}: PROMPT_LEN and TTFT_MS are required")
    return SLOClass(name, prompt_len, ttft, tbt, 1.0 if weight is None else weight)


def _check_classes(classes: Sequence[SLOClass]) -> None:
    if not classes:
        raise ValueError("the multi-slo workload needs at least one class")
    names = [c.name for c in classes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"SLO classes named twice: {dup}")


def _check_scale(name: str, v: float) -> None:
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v}")


def build_multi_slo_workload(classes: Sequence[SLOClass] = QWEN_TRACE_CLASSES, *,
                             num_requests: int | None, rate: float, seed: int = 0,
                             process: str = "poisson", burstiness: float = 1.0,
                             length_scale: float = 1.0, slo_scale: float = 1.0,
                             length_sigma: float = 0.25, max_prompt_len: int | None = None,
                             output_len: int = 128, prompt_kind: str = "token-ids",
                             vocab_size: int = 500, tokenizer=None) -> list[RequestSpec]:
    """The requests of one multi-SLO run, sorted by arrival (see the module docstring).

    Streams of `np.random.default_rng([seed, i])`: 0 arrivals (as `build_workload`), 1
    classes and lengths, 2 prompts, so a rate sweep replays the same requests."""
    _check_classes(classes)
    _check_rate(rate)
    _check_scale("length_scale", length_scale)
    _check_scale("slo_scale", slo_scale)
    if not (math.isfinite(length_sigma) and length_sigma >= 0):
        raise ValueError(f"length_sigma must be finite and >= 0, got {length_sigma}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    n = 100 if num_requests is None else num_requests
    times = arrival_times(n, rate, np.random.default_rng([seed, 0]), process=process,
                          burstiness=burstiness)
    rng = np.random.default_rng([seed, 1])
    weights = np.array([c.weight for c in classes], np.float64)
    cls_N = rng.choice(len(classes), size=n, p=weights / weights.sum())
    mean_N = np.array([c.prompt_len for c in classes])[cls_N] * length_scale
    # lognormal with mean `mean`: median mean * exp(-sigma^2 / 2)
    p_N = mean_N * np.exp(length_sigma * rng.standard_normal(n) - length_sigma ** 2 / 2)
    p_N = np.maximum(np.rint(p_N), 1)
    if max_prompt_len is not None:
        p_N = np.minimum(p_N, max_prompt_len)
    prompt_rng = np.random.default_rng([seed, 2])
    specs = []
    for i in range(n):
        c = classes[cls_N[i]]
        ttft, tbt = c.objectives(slo_scale)
        specs.append(RequestSpec(i, float(times[i]), int(p_N[i]), output_len,
                                 make_prompt(int(p_N[i]), prompt_rng, kind=prompt_kind,
                                             vocab_size=vocab_size, tokenizer=tokenizer),
                                 slo_class=c.name, ttft_slo_ms=ttft, tbt_slo_ms=tbt))
    return specs


def slo_classes_config(classes: Sequence[SLOClass], slo_scale: float = 1.0) -> dict:
    """The classes as `lp-serve --slo-classes` takes them (objectives times `slo_scale`)."""
    out = {}
    for c in classes:
        ttft, tbt = c.objectives(slo_scale)
        out[c.name] = {"ttft_ms": ttft} if tbt is None else {"ttft_ms": ttft, "tbt_ms": tbt}
    return out
