"""What a request constrains its output to: vLLM's `StructuredOutputsParams` shape.

Exactly one of `json` (a JSON schema, as a dict or its text), `json_object` (any JSON
object), `regex`, `choice` (one of a list of strings) or `grammar` (Lark or GBNF). A
frozen value object, checked here for shape only; whether the schema or grammar compiles
is the compiler's to say (compiler.py), where the tokenizer is known. The schema is kept
as compact JSON text in its own key order (properties are generated in that order), so
equal schemas share one compiled grammar and the value stays hashable like the rest of
SamplingParams.

JSON is generated compact (no whitespace between tokens, llguidance's
`whitespace_flexible: false`) unless the schema's own `x-guidance` options say otherwise:
with free whitespace, a model (a random one above all) may emit spaces forever.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 4096
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar of 1 MiB of text; more is not a format
MAX_TRIGGER = 16  # token ids of a start_after sequence


def mask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row: bit v % 32 of word v // 32 allows token v."""
    return -(-vocab_size // 32)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # Token ids after which the grammar starts (the end of a reasoning block: the server
    # sets Qwen3's `</think>` here, reasoning.py); the output is free until they appear.
    start_after: tuple[int, ...] = ()
    # A Lark grammar the spec's own grammar goes into, referenced there as `@body` (the
    # server puts GPT-OSS harmony's channels around an answer's format here, harmony.py).
    frame: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {given or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json))
        trigger = tuple(self.start_after)
        if len(trigger) > MAX_TRIGGER or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in trigger):
            raise ValueError(f"structured_outputs.start_after must be at most {MAX_TRIGGER} "
                             f"token ids, got {_short(self.start_after)}")
        object.__setattr__(self, "start_after", trigger)
        for name in ("regex", "grammar", "frame"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or len(v) > MAX_SPEC_CHARS):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string of "
                                 f"at most {MAX_SPEC_CHARS} characters, got {_short(v)}")
        if self.choice is not None:
            c = self.choice
            if (isinstance(c, str | bytes) or not hasattr(c, "__iter__")):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got "
                                 f"{_short(c)}")
            c = tuple(c)
            if not c or len(c) > MAX_CHOICES or not all(isinstance(x, str) and x for x in c):
                raise ValueError(f"structured_outputs.choice must be 1 to {MAX_CHOICES} "
                                 f"non-empty strings, got {_short(list(c))}")
            object.__setattr__(self, "choice", c)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, str]:
        """(kind, canonical text, frame): equal specs compile to the same grammar."""
        k = self.kind
        v = getattr(self, k)
        return (k, "" if k == "json_object" else _json.dumps(v) if k == "choice" else v,
                self.frame or "")

    @classmethod
    def from_dict(cls, d: dict) -> StructuredOutputsParams:
        """From a request's `structured_outputs` object. vLLM's other options (and any
        unknown key) are refused by name when set, and pass when null or false."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {_short(d)}")
        unknown = sorted(k for k, v in d.items() if k not in KINDS and v not in (None, False))
        if unknown:
            raise ValueError(f"structured_outputs fields {unknown} are not supported; it "
                             f"takes {', '.join(KINDS)}")
        return cls(**{k: v for k, v in d.items() if k in KINDS and v is not None})


def _canonical_schema(schema) -> str:
    """A JSON schema (a dict or its text) as compact JSON text, keys in their order."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} "
                             "characters")
        try:
            schema = _json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got "
                         f"{_short(schema)}")
    try:
        text = _json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json is not JSON-serializable: {exc}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters")
    return text


def _short(v) -> str:
    return repr(v)[:80]
