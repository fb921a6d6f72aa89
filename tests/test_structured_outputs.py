"""Structured outputs (issue #32): with random weights every constrained output is valid.

The tiny model's weights are random, so only the grammar's bitmask keeps its samples in
the language: many samples at temperature 1, each ending with `stop` (eos after the
grammar completes) and parsing, is a test that fails the moment the mask is wrong, late
by a token, or applied to the wrong row. Schemas are bounded (string lengths, number
ranges, no free whitespace) and max_tokens is above the longest valid output. The engine
is the run's shared chunked one (conftest.py), so this file compiles no program of its own.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import TIME, WEATHER
from pydantic import BaseModel, Field

from lp_jax import SamplingParams
from lp_jax.executor import compile_guard
from lp_jax.executor.plan_channel import StepCodec
from lp_jax.executor.sampler import apply_bitmask
from lp_jax.executor.step import StepSpec, empty_inputs
from lp_jax.structured.params import StructuredOutputsParams as SO
from lp_jax.structured.params import mask_words

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
LARK = 'start: "(" num ("," num){0,3} ")"\nnum: /[0-9]{1,2}/'
PROMPT = [1, 2, 3, 4, 5, 6]


def valid_person(obj) -> bool:
    """SCHEMA, checked by hand (no jsonschema dependency)."""
    return (isinstance(obj, dict) and list(obj) == ["name", "age", "ok"]
            and isinstance(obj["name"], str) and 1 <= len(obj["name"]) <= 6
            and type(obj["age"]) is int and 0 <= obj["age"] <= 99
            and isinstance(obj["ok"], bool))


@pytest.fixture(scope="module")
def llm(engines):
    llm = engines("chunked")
    assert llm.engine.structured is not None
    yield llm
    assert not llm.engine.has_unfinished()


def samples(llm, spec, n=24, max_tokens=120, **kw):
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=max_tokens,
                             structured_outputs=spec, **kw) for i in range(n)]
    return [o.outputs[0] for o in llm.generate(prompt_token_ids=[PROMPT] * n,
                                               sampling_params=params)]


def assert_clean(llm):
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished()
    assert stats["free_pages"] == stats["total_pages"]
    assert stats["structured_outputs"]["live"] == 0  # every matcher released


# ------------------------------------------------------------------ host side only
def test_params_validation():
    assert SO(json=SCHEMA).json == json.dumps(SCHEMA, separators=(",", ":"))  # key order kept
    assert SO(json=json.dumps(SCHEMA)) == SO(json=SCHEMA)
    assert SO(choice=["a", "b"]).choice == ("a", "b")
    hash(SamplingParams(structured_outputs={"regex": "a+"}))  # stays a hashable value
    for bad, match in [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                       ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "schema"),
                       ({"choice": []}, "choice"), ({"choice": "ab"}, "list of strings"),
                       ({"regex": ""}, "regex"), ({"whitespace_pattern": " "}, "not supported")]:
        with pytest.raises(ValueError, match=match):
            SO.from_dict(bad)
    SO.from_dict({"regex": "a", "grammar": None, "disable_fallback": False})  # vLLM's defaults
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+"))
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")


def test_compiler_caches_and_names_the_problem(tiny_dir):
    from lp_jax.structured.compiler import GrammarCompiler

    c = GrammarCompiler(tiny_dir / "tokenizer.json", 512, [511, 509])
    first = c.compile(SO(json=SCHEMA))
    assert c.compile(SO(json=json.dumps(SCHEMA))) is first  # compiled once per schema
    assert c.stats == {"compiled": 1, "cache_hits": 1}
    for spec, match in [(SO(json={"type": "objekt"}), "(?s)json does not compile: .*objekt"),
                        (SO(regex="a(b"), "(?s)regex does not compile: .*unclosed group"),
                        (SO(grammar="start: foo\nfoo: bar"), "unknown name"),
                        (SO(json={"type": "string", "pattern": "(("}), "json")]:
        with pytest.raises(ValueError, match=match):
            c.compile(spec)
    assert c.stats["compiled"] == 1  # failures are not cached


def test_an_unreadable_tokenizer_refuses_grammars_and_nothing_else(tmp_path):
    from lp_jax.structured.compiler import GrammarCompiler

    (tmp_path / "tokenizer.json").write_text("{}")
    c = GrammarCompiler(tmp_path / "tokenizer.json", 512, [511])  # does not raise
    with pytest.raises(ValueError, match="structured outputs are unavailable"):
        c.compile(SO(regex="a+"))


def test_apply_bitmask_matches_the_bit_layout():
    """Bit v % 32 of word v // 32 (llguidance's layout); all-ones rows pass through, and
    logit columns past the mask's words are never allowed."""
    rng = np.random.default_rng(0)
    S, V = 3, 70
    logits = rng.normal(size=(S, V + 5)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, size=(S, mask_words(V)), dtype=np.int64).astype(np.int32)
    mask[1] = -1
    out = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
    for s in range(S):
        for v in range(V + 5):
            allowed = v < 32 * mask.shape[1] and bits[s, v]
            assert out[s, v] == (logits[s, v] if allowed else -np.inf), (s, v)


def test_plan_channel_sends_constrained_rows_only():
    spec = StepSpec(num_layers=2, hidden_size=8, page_size=4, pages_per_seq=4, max_num_seqs=4,
                    hidden_rows=8, buckets=(4, 16), vocab_size=100)
    codec = StepCodec(spec)
    free, masked = empty_inputs(spec, 16), empty_inputs(spec, 16)
    free["sampling"]["bitmask_SW"] = None
    mask = np.full((4, 4), -1, np.int32)
    mask[2] = [5, 0, 7, 1]
    masked["sampling"]["bitmask_SW"] = mask
    a = codec.encode(1, 0, [(16, free)])
    b = codec.encode(2, 1, [(16, masked)])
    assert len(b) - len(a) == 4 + 4 * 4  # one row index and its four words
    assert codec.decode(a)[2][0][1]["sampling"]["bitmask_SW"] is None
    np.testing.assert_array_equal(codec.decode(b)[2][0][1]["sampling"]["bitmask_SW"], mask)
    assert len(b) <= codec.max_message_bytes()


def test_the_scheduler_holds_a_constrained_decode_while_its_token_is_on_device():
    """The plan made ahead (overlapped scheduling) skips the constrained sequence, whose
    next mask needs the pending token, and keeps the free one."""
    from lp_jax.core.plan import StepResult
    from lp_jax.core.scheduler import Scheduler
    from lp_jax.core.sequence import Sequence
    from tests.conftest import make_sched_cfg

    sched = Scheduler(make_sched_cfg("orca"))
    free = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=8))
    bound = Sequence(1, [1, 2, 3], SamplingParams(max_tokens=8,
                                                   structured_outputs=SO(regex="a+")))
    sched.add(free)
    sched.add(bound)
    p0 = sched.schedule(0.0)
    assert {c.seq.seq_id for c in p0.prefill} == {0, 1}
    p1 = sched.schedule(0.0)  # planned while p0 runs
    assert [s.seq_id for s in p1.decode] == [0]
    sched.commit(p0, StepResult(tokens={0: 7, 1: 8}), 0.0)
    sched.commit(p1, StepResult(tokens={0: 9}), 0.0)
    p2 = sched.schedule(0.0)  # its token committed: it decodes again
    assert sorted(s.seq_id for s in p2.decode) == [0, 1]


# ------------------------------------------------------------------- the engine
def test_json_schema_samples_are_valid(llm):
    compiles = compile_guard.compilations()
    programs = set(llm.engine.runner.programs)
    outs = samples(llm, SO(json=SCHEMA))
    texts = [o.text for o in outs]
    assert all(o.finish_reason == "stop" for o in outs), texts
    assert all(valid_person(json.loads(t)) for t in texts), texts
    assert len(set(texts)) > len(texts) // 2  # temperature 1: the samples differ
    assert compile_guard.compilations() == compiles  # nothing compiled while serving
    assert set(llm.engine.runner.programs) == programs == set(llm.engine.runner.spec.buckets)
    assert_clean(llm)


@pytest.mark.parametrize("spec, check", [
    (SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
    (SO(choice=CHOICES), lambda t: t in CHOICES),
    (SO(grammar=LARK), lambda t: re.fullmatch(r"\(\d{1,2}(,\d{1,2}){0,3}\)", t)),
], ids=["regex", "choice", "lark"])
def test_regex_choice_and_grammar_samples_are_valid(llm, spec, check):
    outs = samples(llm, spec, n=16, max_tokens=40)
    assert all(o.finish_reason == "stop" and check(o.text) for o in outs), \
        [(o.finish_reason, o.text) for o in outs]
    assert_clean(llm)


def test_free_rows_beside_constrained_ones_are_unchanged(llm):
    """A free request's seeded tokens are the same alone and beside constrained ones (the
    mask touches only its own rows; the free row keeps decoding every step)."""
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[[9, 8, 7]], sampling_params=free)[0]
    bound = SamplingParams(temperature=1.0, seed=1, max_tokens=120,
                           structured_outputs=SO(json=SCHEMA))
    mixed = llm.generate(prompt_token_ids=[[9, 8, 7], PROMPT, PROMPT],
                         sampling_params=[free, bound, bound])
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert all(valid_person(json.loads(o.outputs[0].text)) for o in mixed[1:])
    assert_clean(llm)


def test_bad_schema_is_refused_and_the_engine_keeps_serving(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="structured_outputs.json does not compile"):
        engine.add_request(PROMPT, SamplingParams(structured_outputs=SO(json={"type": 5})))
    assert_clean(llm)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=50,
                                                    structured_outputs=SO(json=SCHEMA)))
    engine.step()
    engine.step()
    assert engine.abort(rid)  # aborted mid-way: matcher and pages released
    while engine.has_unfinished():
        engine.step()
    assert_clean(llm)
    out = samples(llm, SO(choice=CHOICES), n=2, max_tokens=10)
    assert all(o.text in CHOICES for o in out)


def test_a_grammar_can_start_after_a_token_sequence(llm, tiny_dir):
    """start_after (the end of a reasoning block): the output is free until those ids,
    then follows the grammar. A logit bias forces the trigger token first; the digits
    after it are the grammar's."""
    t = 100  # not a digit, not eos
    sp = SamplingParams(temperature=1.0, max_tokens=20, logit_bias={t: 100.0},
                        structured_outputs=SO(regex="[0-9]{3}", start_after=(t,)))
    for o in llm.generate(prompt_token_ids=[PROMPT] * 4, sampling_params=sp):
        ids = o.outputs[0].token_ids
        assert ids[0] == t and o.outputs[0].finish_reason == "stop", ids
        assert re.fullmatch("[0-9]{3}", llm.engine.tokenizer.decode(ids[1:])), ids
    assert_clean(llm)
    from tokenizers import Tokenizer

    from lp_jax.server.reasoning import grammar_after

    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    spec = SO(regex="a")
    assert grammar_after(spec, tok, "<|im_start|>assistant\n") is spec  # no block opened
    opened = grammar_after(spec, tok, "<|im_start|>assistant\n<think>\n")
    assert tok.decode(list(opened.start_after)) == "</think>"


# ------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(llm):
    from lp_jax.server import OpenAIServer, ServerThread

    assert llm.engine.reset_prefix_cache()
    # With Qwen3's reasoning parser on: outputs that open no <think> block stay content.
    st = ServerThread(OpenAIServer(llm.engine, served_model_names=["tiny"],
                                   reasoning_parser="qwen3")).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=6)
    age: int = Field(ge=0, le=99)
    ok: bool


MSGS = [{"role": "user", "content": "Who?"}]


def test_server_chat_parse_and_json_schema_streamed_and_not(client):
    for seed in range(4):
        done = client.chat.completions.parse(model="tiny", messages=MSGS, response_format=Person,
                                             max_tokens=120, temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(done.choices[0].message.parsed, Person)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    kw = dict(model="tiny", messages=MSGS, response_format=rf, max_tokens=120,
              temperature=1.0, seed=11)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full and valid_person(json.loads(full))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_server_completions_regex_choice_and_aliases(client):
    is_regex, is_choice = (lambda t: re.fullmatch(REGEX, t)), (lambda t: t in CHOICES)
    for extra, check in [({"structured_outputs": {"regex": REGEX}}, is_regex),
                         ({"structured_outputs": {"choice": CHOICES}}, is_choice),
                         ({"guided_choice": CHOICES}, is_choice),
                         ({"guided_regex": REGEX}, is_regex)]:
        resp = client.completions.create(model="tiny", prompt="x", max_tokens=40, n=3,
                                         temperature=1.0, seed=5, extra_body=extra)
        assert all(c.finish_reason == "stop" and check(c.text) for c in resp.choices), extra
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    resp = client.completions.create(model="tiny", prompt="x", max_tokens=120, temperature=1.0,
                                     seed=2, extra_body={"response_format": rf})
    assert valid_person(json.loads(resp.choices[0].text))


def test_server_reasoning_split_streamed_and_not(client):
    """A forced `<think>...</think>answer` shape (a regex) splits into reasoning_content /
    reasoning and content, the same streamed and not."""
    kw = dict(model="tiny", messages=MSGS, max_tokens=60, temperature=1.0,
              extra_body={"structured_outputs": {"regex": "<think>[a-z]{2,8}</think>[a-z]{2,8}"}})
    for seed in range(3):
        msg = client.chat.completions.create(seed=seed, **kw).choices[0].message
        assert re.fullmatch("[a-z]{2,8}", msg.reasoning_content), msg
        assert msg.reasoning == msg.reasoning_content and re.fullmatch("[a-z]{2,8}", msg.content)
        chunks = list(client.chat.completions.create(seed=seed, stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) \
            == msg.reasoning_content
        assert "".join(d.content or "" for d in deltas) == msg.content


def test_server_tool_round_trip_streamed_and_not(client):
    """A named or required tool_choice forces a well-formed call (the grammar); the call
    comes back as OpenAI's tool_calls with finish_reason tool_calls, the streamed deltas
    reassemble to it, and the call and the tool's answer go back through the template."""
    kw = dict(model="tiny", messages=MSGS, max_tokens=100, temperature=1.0,
              tools=[WEATHER, TIME], parallel_tool_calls=False)
    for seed, choice in [(0, {"type": "function", "function": {"name": "get_weather"}}),
                         (1, "required"), (2, "required")]:
        done = client.chat.completions.create(seed=seed, tool_choice=choice, **kw).choices[0]
        assert done.finish_reason == "tool_calls", done
        (call,) = done.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
        assert (1 <= len(args["city"]) <= 5 if call.function.name == "get_weather"
                else -12 <= args["zone"] <= 12)
        if seed == 0:
            assert call.function.name == "get_weather"
        chunks = list(client.chat.completions.create(seed=seed, tool_choice=choice,
                                                     stream=True, **kw))
        streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls
                                                              or [])]
        # OpenAI's deltas: index, id, type and name first (arguments ""), then fragments
        first, *rest = streamed
        assert (first.index, first.id, first.function.name, first.function.arguments) == \
            (0, first.id, call.function.name, "") and first.id.startswith("call_")
        assert rest and all(t.index == 0 and t.id is None and t.function.name is None
                            for t in rest)
        assert "".join(t.function.arguments for t in rest) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    back = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model="tiny", messages=back, max_tokens=4,
                                            tools=[WEATHER, TIME], tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_server_malformed_tool_calls_degrade_to_content(client):
    """tool_choice auto: a block that is not a call (forced by a regex here), or an
    unterminated one, comes back as plain content with finish_reason stop, never an error;
    a well-formed one the model wrote is a call."""
    for regex, calls in [("<tool_call>[a-z]{3}</tool_call>", 0), ("<tool_call>[a-z]{3}", 0),
                         ('<tool_call>\\{"name": "get_time", "arguments": \\{\\}\\}'
                          "</tool_call>", 1)]:
        for stream in (False, True):
            resp = client.chat.completions.create(
                model="tiny", messages=MSGS, max_tokens=60, tools=[WEATHER, TIME],
                stream=stream, extra_body={"structured_outputs": {"regex": regex}})
            if stream:
                chunks = [c for c in resp if c.choices]
                text = "".join(c.choices[0].delta.content or "" for c in chunks)
                got = len({t.index for c in chunks for t in c.choices[0].delta.tool_calls or []})
                reason = chunks[-1].choices[0].finish_reason
            else:
                msg = resp.choices[0].message
                text, got, reason = msg.content or "", len(msg.tool_calls or []), \
                    resp.choices[0].finish_reason
            assert got == calls and reason == ("tool_calls" if calls else "stop"), (regex, text)
            if not calls:
                assert re.fullmatch(regex, text), text


def test_server_parallel_tool_calls_false_keeps_the_first(client):
    """tool_choice auto with two calls written (forced by a regex): both come back, or with
    parallel_tool_calls false only the first, streamed and not."""
    one = '<tool_call>\\{"name": "get_time"\\}</tool_call>'  # short: no arguments ({})
    for parallel, n in [(True, 2), (False, 1)]:
        for stream in (False, True):
            resp = client.chat.completions.create(
                model="tiny", messages=MSGS, max_tokens=120, tools=[WEATHER, TIME],
                stream=stream, parallel_tool_calls=parallel, seed=n,
                extra_body={"structured_outputs": {"regex": one + one}})
            if stream:
                chunks = [c for c in resp if c.choices]
                calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
                reason = chunks[-1].choices[0].finish_reason
            else:
                calls, reason = resp.choices[0].message.tool_calls, resp.choices[0].finish_reason
            assert len(calls) == n and reason == "tool_calls", (parallel, stream, reason, calls)
            if stream:
                assert [c.index for c in calls] == list(range(n))
            assert all(json.loads(c.function.arguments) == {} for c in calls)


@pytest.mark.parametrize("choice", ["always", {"type": "function", "function": {"name": "nope"}},
                                    {"type": "function"}, 3])
def test_server_bad_tool_choice_is_400(client, choice):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4,
                                       tools=[WEATHER], tool_choice=choice)
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize("extra, param, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                 "schema": {"type": 7}}}},
     "response_format", "does not compile"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "removed"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format", "schema"),
], ids=["bad-schema", "bad-regex", "two-kinds", "backend", "guided-bad-json", "two-sources",
        "no-schema"])
def test_server_bad_formats_are_400_naming_the_field(client, extra, param, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8,
                                       extra_body=extra)
    assert e.value.param == param


def test_server_compiled_nothing_with_every_feature_on(server, llm):
    """After json schemas, regexes, choices, grammars, reasoning and tool calls were
    served: no compile while serving, one program per bucket, nothing left behind."""
    stats = server.engine_call(lambda e: e.stats())
    assert stats["compilations_after_warmup"] == 0
    assert stats["programs"] == len(llm.engine.runner.spec.buckets)
    assert stats["structured_outputs"]["live"] == 0
    assert stats["structured_outputs"]["filled"] > 0


# ------------------------------------------------- chat_template_kwargs (issue #32)
def test_chat_template_kwargs_reach_the_template(tiny_dir):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, say) become template
    variables through /tokenize and chat; the server's own variables cannot be replaced."""
    from lp_jax.server import OpenAIServer, ServerThread
    from lp_jax.server.mock import MockEngine
    from tests.test_server_input import post

    tmpl = ("{% for m in messages %}{{ m.get('reasoning_content', '') }}{{ m['content'] }}"
            "{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}")
    st = ServerThread(OpenAIServer(MockEngine(model_dir=tiny_dir, max_model_len=64),
                                   served_model_names=["mock"], chat_template=tmpl)).start()
    try:
        body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}]}
        off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
        plain = json.loads(post(st, "/tokenize", body)[1])["tokens"]
        status, data = post(st, "/tokenize", off)
        assert status == 200 and len(json.loads(data)["tokens"]) > len(plain)
        n = len(json.loads(data)["tokens"])
        status, data = post(st, "/v1/chat/completions", {**off, "max_tokens": 2})
        assert status == 200 and json.loads(data)["usage"]["prompt_tokens"] == n
        thought = {"model": "mock", "messages": [
            {"role": "assistant", "content": "hi", "reasoning": "because"}]}
        status, data = post(st, "/tokenize", thought)  # an earlier answer's reasoning
        assert len(json.loads(data)["tokens"]) > len(plain)
        for bad in ({"messages": []}, "x"):
            status, data = post(st, "/v1/chat/completions",
                                {**body, "chat_template_kwargs": bad})
            assert status == 400
            assert json.loads(data)["error"]["param"] == "chat_template_kwargs"
    finally:
        st.stop()


# ------------------------------------------------------- reasoning split (issue #32)
@pytest.mark.parametrize("text, opened, want", [
    ("<think>abc</think>\n\nanswer", False, ("abc", "answer")),
    ("  <think>a</thinkish</think>b", False, ("a</thinkish", "b")),
    ("plain answer", False, (None, "plain answer")),
    ("<think>never closed", False, ("never closed", "")),
    ("inside</think>out", True, ("inside", "out")),
    ("<thin", False, (None, "<thin")),
])
def test_think_splitter_any_chunking(text, opened, want):
    from lp_jax.server.reasoning import ThinkSplitter, split

    assert split(text, opened) == want
    rng = np.random.default_rng(0)
    for _ in range(50):  # streamed in random pieces: the same split
        cuts = sorted(rng.integers(0, len(text) + 1, size=rng.integers(0, 6)))
        s, r, c = ThinkSplitter(opened), "", ""
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            dr, dc = s.push(text[a:b])
            r, c = r + dr, c + dc
        dr, dc = s.finish()
        assert (r + dr, c + dc) == (want[0] or "", want[1])


def test_lp_serve_takes_a_reasoning_parser():
    from lp_jax.serve import build_parser
    from lp_jax.server import OpenAIServer
    from lp_jax.server.mock import MockEngine

    assert build_parser().parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert build_parser().parse_args([]).reasoning_parser is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        OpenAIServer(MockEngine(), reasoning_parser="deepseek")
    args = build_parser().parse_args(["--reasoning-parser", "glm45", "--tool-call-parser",
                                      "glm45"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("glm45", "glm45")
    assert build_parser().parse_args([]).tool_call_parser is None  # the model's format
    assert OpenAIServer(MockEngine()).tool_format == "qwen3"
    assert OpenAIServer(MockEngine(), tool_call_parser="glm45").tool_format == "glm45"
    with pytest.raises(ValueError, match="tool_call_parser"):
        OpenAIServer(MockEngine(), tool_call_parser="hermes")



@pytest.mark.parametrize("text, want_content, names", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, ["f"]),
    ('ok <tool_call>{"name": "f"}</tool_call> and <tool_call>{"name": "g", "arguments": {}}'
     '</tool_call>', "ok  and ", ["f", "g"]),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"name": "f"', '<tool_call>{"name": "f"', []),  # unterminated: content
    ("<tool_ca", "<tool_ca", []),
])
def test_tool_call_parser_any_chunking(text, want_content, names):
    from lp_jax.server.tools import ToolCallParser, split_calls

    content, calls = split_calls(text)
    assert content == want_content and [c["function"]["name"] for c in calls] == names
    rng = np.random.default_rng(1)
    for _ in range(50):
        cuts = sorted(rng.integers(0, len(text) + 1, size=rng.integers(0, 6)))
        p, c, got = ToolCallParser(), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            dc, done = p.push(text[a:b])
            c, got = c + dc, got + done
        c += p.finish()
        assert c == (want_content or "") and [x["function"]["name"] for x in got] == names


def test_parallel_tool_grammar_compiles(tiny_dir):
    from lp_jax.server.tools import tool_grammar
    from lp_jax.structured.compiler import GrammarCompiler

    c = GrammarCompiler(tiny_dir / "tokenizer.json", 512, [511, 509])
    for parallel in (True, False):
        c.compile(tool_grammar([WEATHER, TIME], "required", parallel))
    assert tool_grammar([WEATHER], "auto", True) is None
