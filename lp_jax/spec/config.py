"""`speculative_config`, in vLLM's shape: a dict (or its JSON) on `LLM()` and
`lp-serve --speculative-config`, validated here once so every bad value gets one clear
error before anything is compiled.

    {"method": "ngram", "num_speculative_tokens": k,
     "prompt_lookup_min": n_min, "prompt_lookup_max": n_max}
    {"method": "eagle3", "model": "path/to/head", "num_speculative_tokens": k}
    {"method": "mtp", "num_speculative_tokens": k}       the checkpoint's next-token layer

`"num_speculative_tokens": "auto"` lets the engine choose k in [0, MAX_SPECULATIVE_TOKENS]
each step from a cost model and the acceptance it measures (auto.py).

A speculating sequence runs k + 1 verification rows per step (its last token and k
drafts), so k is bounded: MAX_SPECULATIVE_TOKENS keeps max_num_seqs x (k + 1) rows
within the decode buckets a default engine compiles.
"""

from __future__ import annotations

import dataclasses
import json

AUTO = "auto"
METHODS = ("ngram", "eagle3", "mtp")
# vLLM's other names of a method: "deepseek_mtp" is DeepSeek-V3's (and GLM-4.5's) MTP.
ALIASES = {"deepseek_mtp": "mtp"}
MAX_SPECULATIVE_TOKENS = 8
MAX_PROMPT_LOOKUP = 64  # n-gram lengths searched per step: a host-side scan each


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """n-gram speculation: draft up to `num_speculative_tokens` tokens by finding the
    sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
    earlier in its prompt and outputs, and copying what followed them. One of the two
    lookup bounds given sets both; neither gives [1, 3]."""

    method: str = "ngram"
    num_speculative_tokens: int | str = 3  # or AUTO
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # an EAGLE-3 head's directory (lp_jax/models/eagle3.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", ALIASES.get(self.method, self.method))
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of "
                             f"{[*METHODS, *ALIASES]}, got {self.method!r}")
        if (self.method == "eagle3") != isinstance(self.model, str):
            raise ValueError(f"speculative_config: method {self.method!r} takes "
                             + ("a draft 'model' path" if self.method == "eagle3"
                                else "no 'model' (MTP drafts are the served checkpoint's "
                                "own next-token layers)" if self.method == "mtp"
                                else "no 'model'") + f", got model={self.model!r}")
        k = self.num_speculative_tokens
        if k != AUTO and (not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}] or {AUTO!r}, got {k!r}")
        if k == AUTO and self.drafts_on_device:
            raise ValueError(f"num_speculative_tokens {AUTO!r} is for n-gram drafts: the "
                             f"{self.method} draft's chained steps are compiled for a fixed k")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _is_int(v) or not 1 <= v <= MAX_PROMPT_LOOKUP):
                raise ValueError(f"{name} must be an int in [1, {MAX_PROMPT_LOOKUP}] or "
                                 f"None, got {v!r}")
        if lo is None and hi is None:
            lo, hi = 1, 3
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min {lo} > prompt_lookup_max {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def drafts_on_device(self) -> bool:
        """Whether a draft model proposes inside the step program (EAGLE-3, MTP), its
        drafts arriving with the step's tokens, rather than the host (n-gram)."""
        return self.method in ("eagle3", "mtp")

    @property
    def is_auto(self) -> bool:
        """Whether k is chosen per step (auto.py) rather than fixed."""
        return self.num_speculative_tokens == AUTO

    @property
    def max_tokens(self) -> int:
        """The most drafts one sequence verifies in a step."""
        return MAX_SPECULATIVE_TOKENS if self.is_auto else self.num_speculative_tokens

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict of its fields, or that dict as JSON text;
        raises ValueError naming an unknown key or a bad value."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got "
                             f"{value!r}"[:160])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; valid: "
                             f"{sorted(known)}")
        return cls(**value)
