"""Per-request sampling settings, shaped like vLLM's `SamplingParams`.

A frozen, slotted value object: every field is checked once, here, so the scheduler and the
sampler can trust it. Range checks that need the model (token ids against the vocabulary) are
done by the scheduler when the request is added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lp_jax.structured.params import StructuredOutputsParams

MAX_STOP_TOKEN_IDS = 64  # every sampled token is checked against them, like `stop` strings
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI's cap; the sampler's rows are this wide


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_k: int = -1  # -1 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus sampling
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # Log-probabilities of the raw model distribution (before penalties, bias and
    # temperature, as vLLM's default): the sampled token's and the top `logprobs` others.
    logprobs: int | None = None
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many outputs
    presence_penalty: float = 0.0  # vLLM's definitions; over output tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens
    # {token_id: bias} added to the logits; kept as sorted (id, bias) pairs (hashable).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities of every prompt token given the ones before it (the first has
    # none), with the top `prompt_logprobs` alternatives; the request then computes its
    # whole prompt (no prefix-cache hit), as vLLM's.
    prompt_logprobs: int | None = None
    # Independent samples of the prompt. The engine runs them as n sequences; the later
    # ones start once the first has prefilled, so they take its prompt pages from the
    # prefix cache. A seeded request's sample i uses seed + i.
    n: int = 1
    # The output's format (a JSON schema, a regex, a choice, a grammar; lp_jax/structured),
    # as vLLM's; a dict is read as StructuredOutputsParams' fields. Whether the schema
    # compiles is checked when the engine adds the request.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or an int >= 1, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        bad_stop = ValueError(
            f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}"
        )
        if isinstance(self.stop_token_ids, str | bytes):
            raise bad_stop
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise bad_stop from None
        for t in stop:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {t!r} in {stop}")
        if len(set(stop)) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(set(stop))}")
        # accept any sequence; a frozenset makes the per-token stop check O(1)
        object.__setattr__(self, "stop_token_ids", frozenset(stop))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 0.0, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            if not lo <= v <= hi or (name == "repetition_penalty" and v <= 0):
                rng = "> 0" if hi == math.inf else f"in [{lo}, {hi}]"
                raise ValueError(f"{name} must be {rng}, got {v}")
            object.__setattr__(self, name, float(v))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        so = self.structured_outputs
        if isinstance(so, dict):
            so = StructuredOutputsParams.from_dict(so)
            object.__setattr__(self, "structured_outputs", so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, "
                             f"got {so!r}"[:160])
        if so is not None and self.min_tokens:
            # min_tokens masks eos, which is all a finished grammar allows
            raise ValueError("min_tokens cannot be combined with structured_outputs: the "
                             "grammar decides where the output ends")

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the sequence's token counts (device state)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def samples(self) -> list[SamplingParams]:
        """The n one-sample params a request with these runs as: sample i is seeded
        seed + i (unseeded ones draw from their own sequence's stream)."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping or pairs."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(t, b) for t, b in items]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    for t, b in pairs:
        if not _is_int(t) or t < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
        if isinstance(b, bool) or not isinstance(b, int | float) or not math.isfinite(b):
            raise ValueError(f"logit_bias values must be finite numbers, got {b!r} for {t}")
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias has a token id twice")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(pairs)}")
    return tuple(sorted((t, float(b)) for t, b in pairs))
