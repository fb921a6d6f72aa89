"""Per-request sampling settings, shaped like vLLM's `SamplingParams`.

A frozen, slotted value object: every field is checked once, here, so the scheduler and the
sampler can trust it. Range checks that need the model (token ids against the vocabulary) are
done by the scheduler when the request is added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_STOP_TOKEN_IDS = 64  # every sampled token is checked against them, like `stop` strings


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
