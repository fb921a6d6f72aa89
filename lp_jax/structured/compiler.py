"""Grammars from StructuredOutputsParams, compiled once per spec against the model's tokens.

`GrammarCompiler` builds llguidance's tokenizer (its token trie) once from the model's
tokenizer.json, on a background thread started at construction: 1.4-3.5 s at a 152k
vocabulary, which start-up does not wait for (the first grammar does), and a tokenizer
llguidance cannot read makes every grammar a ValueError, never a failed start. It covers
the model's vocabulary (`n_vocab` = config vocab_size, so ids past the tokenizer's, the
padding rows of the embedding, are never allowed), with the model's eos ids as the
tokens that end a finished grammar. `compile(spec)` turns a spec into an
llguidance grammar and a matcher in its start state, kept in an LRU cache keyed by the
spec's canonical text; `matcher(spec)` hands each sequence a copy of it (microseconds,
where compiling a schema takes a millisecond or more). A spec that does not compile
raises ValueError naming the problem (the server's 400), and is not cached.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from lp_jax.structured.params import StructuredOutputsParams

# JSON without free whitespace (params.py): bounded output for a bounded schema.
JSON_DEFAULTS = {"whitespace_flexible": False}
CACHE_SIZE = 256  # compiled grammars kept (start-state matchers; a few KB to MBs each)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (not yet checked): its own, or with a `frame`, a
    top-level grammar of two, the frame first (it starts) and the spec's own as `body`,
    which the frame names as `@body`."""
    body = _own_grammar(spec)
    if spec.frame is None:
        return body
    inner = json.loads(body)["grammars"] if body.lstrip().startswith("{") else \
        [{"lark_grammar": body}]
    if len(inner) != 1:
        raise ValueError("a framed grammar must be a single grammar")
    return json.dumps({"grammars": [{"name": "frame", "lark_grammar": spec.frame},
                                    {**inner[0], "name": "body"}]})


def _own_grammar(spec: StructuredOutputsParams) -> str:
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = json.loads(spec.json) if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":  # one Lark alternative per string (a JSON string is a Lark literal)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        lark = llguidance.gbnf_to_lark.any_to_lark(spec.grammar)  # Lark passes through
    except Exception as exc:  # noqa: BLE001 - the converter raises bare Exceptions
        raise ValueError(f"structured_outputs.grammar is not a Lark or GBNF grammar: "
                         f"{exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids,
                 cache_size: int = CACHE_SIZE):
        self._tokenizer = self._tokenizer_error = None
        args = (str(tokenizer_json), vocab_size, sorted(eos_token_ids))
        self._loading = threading.Thread(target=self._load_tokenizer, args=args, daemon=True,
                                         name="llguidance-tokenizer")
        self._loading.start()
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles on its worker threads
        self.stats = {"compiled": 0, "cache_hits": 0}

    def _load_tokenizer(self, path: str, vocab_size: int, eos: list[int]):
        try:
            self._tokenizer = llguidance.LLTokenizer(path, n_vocab=vocab_size, eos_token=eos)
        except Exception as exc:  # noqa: BLE001 - reported to every grammar request
            self._tokenizer_error = f"{type(exc).__name__}: {exc}"

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, once built; ValueError if it could not be."""
        self._loading.join()
        if self._tokenizer is None:
            raise ValueError("structured outputs are unavailable: llguidance cannot read this "
                             f"model's tokenizer.json ({self._tokenizer_error})")
        return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The start-state matcher of spec's grammar; ValueError if it does not compile."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return hit
        try:
            text = grammar_text(spec)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{spec.kind}: {exc}") from None
        m = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: "
                             f"{m.get_error().strip()}")
        with self._lock:
            self._cache[key] = m
            self.stats["compiled"] += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher of spec's grammar for one sequence."""
        return self.compile(spec).deep_copy()
