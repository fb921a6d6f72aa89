"""OpenAI request validation and response bodies.

Every field is checked here with its type and range, so a bad request becomes a 4xx with an
OpenAI-style error body, `{"error": {"message", "type", "param", "code"}}`, and only
well-formed `SamplingParams` reach the engine. Unknown fields are ignored, as OpenAI-compatible
servers do; fields the engine cannot honour (best_of, suffix, a tool_choice without tools) are
rejected with a message that says so, as is a completions batch that
mixes text and token ids.

Structured outputs (`parse_structured`) come as OpenAI's `response_format` (json_object,
json_schema), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object), or
the `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields vLLM 0.12
removed, read as aliases; its other guided_* fields are refused. One source per request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from lp_jax.core.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from lp_jax.core.slo import SLO
from lp_jax.server import tools
from lp_jax.server.chat import RESERVED
from lp_jax.structured.params import StructuredOutputsParams

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 512
_INT64 = 2 ** 63
MAX_SLO_MS = 86_400_000.0  # one day, as lp_jax.core.slo: more is a unit mistake
MAX_SLO_CLASS_LEN = 64
SLO_FIELDS = ("slo_class", "ttft_slo_ms", "tbt_slo_ms")
DEFAULT_MAX_N = 16  # choices per prompt (`n`); the server's `max_n` sets it
MAX_BATCH_PROMPTS = 256  # prompts in one /v1/completions request
# Scored prompt entries a request may ask for (`prompt_logprob_entries`); the server's
# `max_prompt_logprob_entries` sets it. 200,000 is a 9,500-token prompt with 20
# alternatives, about 12 MB of JSON; 256 prompts of 500 tokens with 20 are 2.7 million.
DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES = 200_000
# Sequences one request may run (its prompts x n); the server's `max_request_seqs` sets
# it. 256 lets any batch of single samples through (MAX_BATCH_PROMPTS) and n = 16 on 16
# prompts; each sequence is a full output in the response, and those past the engine's
# slots only wait.
DEFAULT_MAX_REQUEST_SEQS = 256
# Log-probability entries one response may carry, prompt and generated together
# (`logprob_entries`); the server's `max_logprob_entries` sets it. 400,000 is the scored
# prompt's cap and as much again for the output, about 24 MB of JSON: 16 samples of 1,100
# tokens with 20 alternatives each, or 256 short answers of 70 tokens.
DEFAULT_MAX_LOGPROB_ENTRIES = 400_000


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class _Constant(str):
    """NaN, Infinity or -Infinity where the body had it: found, then rejected by name."""


def _reject_constant(body, first: _Constant):
    """A 400 for a body with NaN or +-Infinity, naming the top-level field that holds one
    (Python clients write float("nan") as a bare NaN, which JSON does not allow)."""
    if isinstance(body, dict):
        for name, v in body.items():
            if isinstance(v, _Constant):
                raise bad(f"'{name}' is {v}, which is not valid JSON (numbers must be "
                          "finite)", name)
    raise bad(f"request body is not valid JSON: {first} is not a JSON value")


def parse_json(raw: bytes) -> dict:
    """The request body as a dict; 400 for anything else (NaN/Infinity included, naming the
    top-level field that holds one).

    The body is parsed as JSON whatever its Content-Type (`curl -d` labels a JSON body as a
    form), so a body that is not JSON is a 400, never a 415."""
    constants: list[_Constant] = []

    def constant(name):
        constants.append(_Constant(name))
        return constants[-1]

    try:
        body = json.loads(raw, parse_constant=constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise bad(f"request body is not valid JSON: {exc}") from None
    if constants:
        _reject_constant(body, constants[0])
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool)) and math.isfinite(x)


def get_int(body, name, default=None, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and abs(v) < _INT64:
        v = int(v)  # 5.0 is an int to JSON
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {json.dumps(v)[:80]}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad(f"'{name}' must be in {rng}, got {v}", name)
    return v


def get_num(body, name, default, lo=None, hi=None, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(f"'{name}' must be a finite number, got {json.dumps(v)[:80]}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        left = "(" if lo_open else "["
        raise bad(f"'{name}' must be in {left}{lo}, {hi}], got {v}", name)
    return float(v)


def get_bool(body, name, default):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {json.dumps(v)[:80]}", name)
    return v


def utf8_len(s: str, name: str) -> int:
    """UTF-8 size of `s`; a 400 for a lone UTF-16 surrogate (valid as a JSON escape, but
    not text: it cannot be tokenized or echoed back)."""
    try:
        return len(s.encode())
    except UnicodeEncodeError:
        raise bad(f"'{name}' contains a lone UTF-16 surrogate", name) from None


def unsupported(name: str, what: str) -> APIError:
    return bad(f"'{name}' is not supported by this server: {what}", name)


@dataclass
class GenerationRequest:
    """A validated completion or chat request, prompt not yet tokenized."""

    kind: str  # "completion" or "chat"
    model: str
    prompt: str | list[int] | None = None  # completions: the first (or only) prompt
    prompts: list | None = None  # completions: every prompt of a batch, in choice order
    messages: list[dict] | None = None  # chat
    add_generation_prompt: bool = True
    max_tokens: int | None = None  # None: fill the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    # The SLO fields the request gave ("slo_class", "ttft_slo_ms", "tbt_slo_ms"), checked for
    # type and range; the server resolves them against the engine's classes into `slo`.
    slo_fields: dict | None = None
    slo: SLO | None = None  # the engine's SLO; None: best-effort
    prompt_bytes: int = 0  # UTF-8 size of the prompt text (chat: of the messages)
    logprobs: int | None = None  # top alternatives per token; None: no log-probabilities
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt starts each choice's text (and logprobs)
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's log-probabilities
    structured: StructuredOutputsParams | None = None  # the output's format, if constrained
    chat_template_kwargs: dict | None = None  # chat: more variables for the template
    tools: list | None = None  # chat: function tools, for the template (tools.py)
    tool_choice: str | dict = "none"
    parallel_tool_calls: bool = True
    structured_param: str | None = None  # the field it came from (a 400 names it)

    def scored_prompt(self) -> int | None:
        """The engine's prompt_logprobs: as asked, or the completion's `logprobs` when it
        echoes the prompt (its tokens are then scored too, as OpenAI's legacy API)."""
        k = self.prompt_logprobs
        if self.echo and self.kind == "completion" and self.logprobs is not None:
            k = max(k or 0, self.logprobs)
        return k

    def sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        top_k = -1 if self.top_k == 0 or self.top_k >= vocab_size else self.top_k
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias or ())):
            outside = sorted(t for t in ids if t >= vocab_size)
            if outside:
                raise bad(f"'{name}' ids {outside[:5]} outside the vocabulary [0, "
                          f"{vocab_size})", name)
        if self.min_tokens > max_tokens:
            raise bad(f"'min_tokens' ({self.min_tokens}) is more than the completion's "
                      f"{max_tokens} tokens", "min_tokens")
        try:
            return SamplingParams(
                temperature=self.temperature, top_k=top_k, top_p=self.top_p, seed=self.seed,
                max_tokens=max_tokens, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=self.logprobs, min_tokens=self.min_tokens,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias or (),
                n=self.n, prompt_logprobs=self.scored_prompt(),
                structured_outputs=self.structured,
            )
        except ValueError as exc:  # its message starts with the field's name
            name = str(exc).split(" ")[0]
            if name == "min_tokens" and self.structured is not None:
                name = self.structured_param
            raise bad(str(exc), name if name in (*SamplingParams.__slots__,
                                                 self.structured_param) else None) from None


def prompt_logprob_entries(req: GenerationRequest, prompt_lens: list[int]) -> int:
    """Log-probability entries a request's scored prompts hold: for each engine request
    (every prompt, `n` times), a row per prompt token of the token and its `k` top
    alternatives (k: `prompt_logprobs`, or `logprobs` with `echo`). 0 if none is scored."""
    k = req.scored_prompt()
    return 0 if k is None else sum(prompt_lens) * req.n * (k + 1)


def output_logprob_entries(req: GenerationRequest, max_tokens: list[int]) -> int:
    """Log-probability entries a request's outputs may hold at most: for each sample of
    each prompt, a row per generated token (up to that prompt's `max_tokens`) of the token
    and its `k` top alternatives (k: `logprobs` / chat's `top_logprobs`). 0 if none."""
    k = req.logprobs
    return 0 if k is None else sum(max_tokens) * req.n * (k + 1)


def parse_slo_fields(body: dict) -> dict | None:
    """The request's latency objectives, as `LLMEngine.add_request(slo=...)` takes them:
    `ttft_slo_ms` / `tbt_slo_ms` in (0, one day] and `slo_class`, a class name. None when
    the request sets none. Whether the class exists is the engine's to say (`resolve_slo`)."""
    fields = {}
    for name in ("ttft_slo_ms", "tbt_slo_ms"):
        v = get_num(body, name, None, lo=0.0, hi=MAX_SLO_MS, lo_open=True)
        if v is not None:
            fields[name] = v
    cls = body.get("slo_class")
    if cls is not None:
        if not isinstance(cls, str) or not cls or len(cls) > MAX_SLO_CLASS_LEN:
            raise bad(f"'slo_class' must be a non-empty string of at most {MAX_SLO_CLASS_LEN} "
                      f"characters, got {json.dumps(cls)[:80]}", "slo_class")
        utf8_len(cls, "slo_class")
        fields["slo_class"] = cls
    return fields or None


def _common(body: dict, req: GenerationRequest) -> None:
    req.n = get_int(body, "n", 1, lo=1)  # the server checks its maximum
    if body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "vLLM v1 dropped it; use 'n'")
    req.prompt_logprobs = get_int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    req.presence_penalty = get_num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)
    req.frequency_penalty = get_num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)
    req.repetition_penalty = get_num(body, "repetition_penalty", 1.0, lo=0.0, hi=100.0,
                                     lo_open=True)
    req.min_tokens = get_int(body, "min_tokens", 0, lo=0, hi=2 ** 31 - 1)
    req.logit_bias = parse_logit_bias(body)
    req.temperature = get_num(body, "temperature", 1.0, lo=0.0, hi=100.0)
    req.top_p = get_num(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    req.top_k = get_int(body, "top_k", -1, lo=-1, hi=_INT64 - 1)
    # any int64: the sampler keys on all 64 bits (seed mod 2**64), so no two collide
    req.seed = get_int(body, "seed", None, lo=-_INT64, hi=_INT64 - 1)
    req.priority = get_int(body, "priority", 0, lo=-(2 ** 31), hi=2 ** 31 - 1)
    req.slo_fields = parse_slo_fields(body)
    req.ignore_eos = get_bool(body, "ignore_eos", False)
    req.stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not req.stream:
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        req.include_usage = get_bool(opts, "include_usage", False)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                or len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in stop)):
            raise bad(f"'stop' must be a non-empty string or a list of at most "
                      f"{MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LEN} "
                      "characters", "stop")
        for s in stop:
            utf8_len(s, "stop")
        req.stop = tuple(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
                or not all(_is_int(t) and 0 <= t < _INT64 for t in ids)):
            raise bad(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} "
                      "non-negative integers", "stop_token_ids")
        req.stop_token_ids = frozenset(ids)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model:
        utf8_len(model, "model")
    req.model = model or ""
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user")
    req.structured, req.structured_param = parse_structured(body)


GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def parse_structured(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output format and the field that gave it; (None, None) if free."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = body.get("structured_outputs")
    if so is not None:
        try:
            found.append(("structured_outputs", StructuredOutputsParams.from_dict(so)))
        except (TypeError, ValueError) as exc:
            raise bad(str(exc), "structured_outputs") from None
    for name in sorted(k for k in body if k.startswith("guided_") and body[k] is not None):
        if name not in GUIDED_ALIASES:
            raise unsupported(name, "vLLM 0.12 removed the guided_* fields; this server "
                              f"reads {', '.join(GUIDED_ALIASES)} as aliases of "
                              "'structured_outputs' and has no other")
        try:
            spec = StructuredOutputsParams(**{GUIDED_ALIASES[name]: body[name]})
        except (TypeError, ValueError) as exc:
            raise bad(str(exc).replace(f"structured_outputs.{GUIDED_ALIASES[name]}", name),
                      name) from None
        found.append((name, spec))
    if len(found) > 1:
        names = [n for n, _ in found]
        raise bad(f"give one output format, not {len(names)}: {', '.join(names)}", names[1])
    return (found[0][1], found[0][0]) if found else (None, None)


def _response_format(rf) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (None), json_object, or json_schema."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or "
                  "{'type': 'json_schema', 'json_schema': {...}}, got "
                  f"{json.dumps(rf)[:80]}", "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or js.get("schema") is None:
        raise bad("'response_format' of type json_schema needs 'json_schema': {'name': ..., "
                  "'schema': {...}}", "response_format")
    try:
        return StructuredOutputsParams(json=js["schema"])
    except ValueError as exc:
        raise bad(str(exc).replace("structured_outputs.json", "response_format.json_schema"
                                   ".schema"), "response_format") from None


def parse_logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, at most MAX_LOGIT_BIAS."""
    lb = body.get("logit_bias")
    if lb is None or lb == {}:
        return None
    if not isinstance(lb, dict) or len(lb) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids",
                  "logit_bias")
    out = {}
    for k, v in lb.items():
        key = k.strip() if isinstance(k, str) else ""
        # ASCII digits only: str.isdigit also takes "²" (int() refuses it) and "١٢" / "１"
        # (int() reads them as 12 and 1), which no client means as a token id.
        if not (key.isascii() and key.isdigit()) or len(key) > 18:
            raise bad(f"'logit_bias' keys must be token ids in ASCII decimal digits, got "
                      f"{json.dumps(k)[:40]}", "logit_bias")
        if not _is_num(v) or not -100 <= v <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got "
                      f"{json.dumps(v)[:40]} for {key}", "logit_bias")
        if int(key) in out:
            raise bad(f"'logit_bias' has token id {int(key)} twice", "logit_bias")
        out[int(key)] = float(v)
    return out


def parse_completion(body: dict) -> GenerationRequest:
    req = GenerationRequest(kind="completion", model="")
    _common(body, req)
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    prompt = body["prompt"]
    batch = (isinstance(prompt, list) and bool(prompt)
             and all(isinstance(p, str | list) for p in prompt))
    prompts = prompt if batch else [prompt]
    if batch and len({type(p) for p in prompts}) > 1:
        raise bad("'prompt' must be a batch of strings or a batch of token id lists, not "
                  "both", "prompt")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise bad(f"'prompt' may hold at most {MAX_BATCH_PROMPTS} prompts, got {len(prompts)}",
                  "prompt")
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad("'prompt' must not be empty", "prompt")
            req.prompt_bytes = max(req.prompt_bytes, utf8_len(p, "prompt"))
        elif not (isinstance(p, list) and p and all(_is_int(t) for t in p)):
            raise bad("'prompt' must be a non-empty string, a non-empty list of token ids, "
                      "or a list of those", "prompt")
    req.prompt, req.prompts = prompts[0], prompts
    req.max_tokens = get_int(body, "max_tokens", None, lo=1)
    req.logprobs = get_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    req.echo = get_bool(body, "echo", False)
    if body.get("suffix") not in (None, ""):
        raise unsupported("suffix", "insertion is not implemented")
    return req


def parse_messages(msgs) -> tuple[list[dict], int]:
    """Chat `messages` as the template takes them, and their UTF-8 size."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out, size = [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"messages[{i}].role must be a non-empty string", "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                if (not isinstance(part, dict) or part.get("type") != "text"
                        or not isinstance(part.get("text"), str)):
                    raise unsupported("messages", f"messages[{i}]: only text content parts")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")
        msg = {"role": role, "content": content}
        name = m.get("name")
        if isinstance(name, str):
            msg["name"] = name
        calls = m.get("tool_calls")
        if calls is not None:  # an earlier answer's calls, as the template reads them
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise bad(f"messages[{i}].tool_calls must be a list of function calls",
                          "messages")
            msg["tool_calls"] = [{**c, "function": _call_function(c["function"])}
                                 for c in calls]
        if isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        # an earlier answer's reasoning, under either name: templates read reasoning_content
        thought = m.get("reasoning_content", m.get("reasoning"))
        if thought is not None:
            if not isinstance(thought, str):
                raise bad(f"messages[{i}].reasoning_content must be a string", "messages")
            msg["reasoning_content"] = thought
        size += sum(utf8_len(v, "messages") if isinstance(v, str) else len(json.dumps(v))
                    for v in msg.values())
        out.append(msg)
    return out, size


def _call_function(f: dict) -> dict:
    """A message's call as templates read it: `arguments` as an object (Qwen3's template
    writes it with tojson); a string that is not JSON stays a string."""
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": f["name"], "arguments": args}


def parse_chat(body: dict) -> GenerationRequest:
    req = GenerationRequest(kind="chat", model="")
    _common(body, req)
    req.messages, req.prompt_bytes = parse_messages(body.get("messages"))
    req.add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    req.chat_template_kwargs = parse_template_kwargs(body)
    req.echo = get_bool(body, "echo", False)  # vLLM's: the last message, if the assistant's
    mct = get_int(body, "max_completion_tokens", None, lo=1)
    mt = get_int(body, "max_tokens", None, lo=1)
    req.max_tokens = mct if mct is not None else mt
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if get_bool(body, "logprobs", False):
        req.logprobs = top or 0
    elif top is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    try:
        req.tools, req.tool_choice, req.parallel_tool_calls = tools.parse_tools(body)
    except tools.ToolsError as exc:
        raise bad(str(exc), exc.param) from None
    if req.tools is not None:
        forced = tools.tool_grammar(req.tools, req.tool_choice, req.parallel_tool_calls)
        if forced is not None:  # "required" or a named function: the grammar makes the call
            if req.structured is not None:
                raise bad(f"'tool_choice' {json.dumps(req.tool_choice)[:60]} and "
                          f"'{req.structured_param}' both fix the output; give one",
                          "tool_choice")
            req.structured, req.structured_param = forced, "tool_choice"
    return req


def parse_template_kwargs(body: dict) -> dict | None:
    """vLLM's `chat_template_kwargs`: an object of extra template variables (Qwen3's
    `enable_thinking`, say), none of them one the server sets itself."""
    kw = body.get("chat_template_kwargs")
    if kw is None or kw == {}:
        return None
    if not isinstance(kw, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    taken = sorted(set(kw) & set(RESERVED))
    if taken:
        raise bad(f"'chat_template_kwargs' cannot set {taken}: the server sets them",
                  "chat_template_kwargs")
    return kw


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object. `cached_tokens`: prompt tokens served from the prefix cache,
    reported as prompt_tokens_details.cached_tokens; None (an engine without a prefix
    cache): no details, as vLLM without them."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out
