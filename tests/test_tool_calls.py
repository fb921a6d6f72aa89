"""Tool calls and reasoning for both families (issue #32), with nothing compiled.

- GPT-OSS harmony answers are parsed from token ids (lp_jax/server/harmony.py), on a tiny
  GPT-OSS directory whose tokenizer has harmony's markers as special tokens
  (checkpoints/make_tiny.py `write_harmony_variant`).
- Forced calls (tool_choice "required" / named) stream OpenAI's deltas: a first one with
  index, id, type, name and arguments "", then argument fragments; they reassemble to the
  non-streamed call. Their grammars are exercised by random walks through llguidance's
  masks on the host, and end to end by an engine on `MaskedFakeExecutor`: the fake
  executor (tests/fake_executor.py) whose constrained rows take a token their grammar
  allows, from the engine's own bitmask path (LLMEngine -> StructuredOutputs.fill), so the
  scheduler's hold of constrained rows, preemption and layered prefill are checked too.
- Auto calls stream the same deltas, once a call's arguments open a JSON object; a
  malformed one is content whole, and streamed stays the call it went out as. They,
  reasoning, malformed output and harmony stop strings (on the content only) go through
  the official openai client against lp-serve on the mock engine, whose tokens are
  scripted.
- response_format on GPT-OSS (the whole harmony answer constrained, so it reaches the
  final channel): random walks through its masks here, temperature-1 samples of the
  tiny model in test_chat_harmony.py.
"""

from __future__ import annotations

import json
import re

import numpy as np
import openai
import pytest
from conftest import TIME, WEATHER
from fake_executor import FakeExecutor
from tokenizers import Tokenizer

from checkpoints.make_tiny import ensure_tiny, write_harmony_variant
from lp_jax import LLM, SamplingParams
from lp_jax.executor import compile_guard
from lp_jax.server import OpenAIServer, ServerThread
from lp_jax.server.harmony import HarmonyParser, Piece, final_channel_grammar, harmony_tokens
from lp_jax.server.protocol import parse_messages
from lp_jax.server.tools import ToolCallParser, harmony_tool_grammar, split_calls, tool_grammar
from lp_jax.structured.compiler import GrammarCompiler
from lp_jax.structured.params import StructuredOutputsParams as SO

TOOLS = [WEATHER, TIME]
MSGS = [{"role": "user", "content": "Weather in Oslo?"}]


def valid_args(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return list(args) == ["city"] and isinstance(args["city"], str) \
            and 1 <= len(args["city"]) <= 5
    return name == "get_time" and list(args) == ["zone"] and type(args["zone"]) is int \
        and -12 <= args["zone"] <= 12


@pytest.fixture(scope="module")
def hdir(tmp_path_factory):
    return write_harmony_variant(tmp_path_factory.mktemp("tiny-gpt-oss-harmony"))


@pytest.fixture(scope="module")
def htok(hdir):
    return Tokenizer.from_file(str(hdir / "tokenizer.json"))


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def chunked(rng, ids):
    cuts = sorted(int(x) for x in rng.integers(0, len(ids) + 1, size=rng.integers(0, 8)))
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]


def reassemble(deltas: list[dict]) -> list[tuple]:
    """(index, id, name, arguments) per call from streamed tool-call deltas, checking
    OpenAI's shape: the first delta of an index has id, type and name, later ones not."""
    calls: dict[int, list] = {}
    for d in deltas:
        fn = d["function"]
        if d["index"] not in calls:
            assert d["type"] == "function" and d["id"].startswith("call_") and fn["name"]
            calls[d["index"]] = [d["index"], d["id"], fn["name"], fn.get("arguments", "")]
        else:
            assert "id" not in d and "name" not in fn, d
            calls[d["index"]][3] += fn["arguments"]
    return [tuple(c) for c in calls.values()]


CALL = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Oslo"}<|call|>')
THINK = "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant"


# ---------------------------------------------------------------- harmony, host side
@pytest.mark.parametrize("text, tools, want", [
    (THINK + CALL, True, ("The user wants weather.", None, [("get_weather", '{"city":"Oslo"}')])),
    (THINK + "<|channel|>final<|message|>Sunny.<|return|>", True,
     ("The user wants weather.", "Sunny.", [])),
    ("<|channel|>final<|message|>Hi<|return|>", False, (None, "Hi", [])),
    # a recipient before the channel is a call too
    ("<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
     '{"zone":1}<|call|>', True, (None, None, [("get_time", '{"zone":1}')])),
    # malformed: invalid JSON, unterminated, no tools, a non-function recipient, no body
    (CALL.replace('"Oslo"}', "Oslo"), True, (None, '{"city":Oslo', [])),
    (CALL[:-len("<|call|>")], True, (None, '{"city":"Oslo"}', [])),
    (CALL, False, (None, '{"city":"Oslo"}', [])),
    ("<|channel|>commentary to=browser.search<|message|>{}<|call|>", True, (None, "{}", [])),
    ("<|channel|>final", True, (None, "final", [])),
    # commentary without a recipient (a preamble) is content; two calls, then parallel off
    ("<|channel|>commentary<|message|>Looking.<|end|><|start|>assistant" + CALL, True,
     (None, "Looking.", [("get_weather", '{"city":"Oslo"}')])),
], ids=["think-call", "think-final", "final", "recipient-first", "bad-json", "unterminated",
        "no-tools", "other-recipient", "no-body", "preamble"])
def test_harmony_parser_any_chunking(htok, text, tools, want):
    """The whole answer and the streamed pieces (any split of the ids) agree; reasoning,
    content and calls land where they belong, and malformed calls stay content."""
    marks = harmony_tokens(htok)
    ids = ids_of(htok, text)
    rng = np.random.default_rng(0)
    for trial in range(30):
        p = HarmonyParser(htok, marks, tools=tools)
        r = c = ""
        deltas = []
        for part in (chunked(rng, ids) if trial else [ids]):
            got = p.push(part)
            r, c, deltas = r + got.reasoning, c + got.content, deltas + got.tool_calls
        got = p.finish()
        r, c, deltas = r + got.reasoning, c + got.content, deltas + got.tool_calls
        reasoning, content, calls = p.message()
        assert (reasoning, content) == want[:2]
        assert [(x["function"]["name"], x["function"]["arguments"]) for x in calls] == want[2]
        assert (r or None, c) == (want[0], want[1] or "")
        assert [(n, a) for _, _, n, a in reassemble(deltas)] == want[2]
        assert [i for i, *_ in reassemble(deltas)] == list(range(len(want[2])))


def test_harmony_text_without_headers_streams_as_content(htok):
    """Output with no harmony (no <|message|> within MAX_HEADER_TOKENS) is content,
    streamed as it comes rather than held to the end."""
    from lp_jax.server.harmony import MAX_HEADER_TOKENS

    text = "The weather this week has been strange. " * 12
    ids = ids_of(htok, text)
    assert len(ids) > 2 * MAX_HEADER_TOKENS
    p = HarmonyParser(htok, harmony_tokens(htok), tools=True)
    early = "".join(p.push([t]).content for t in ids[: 2 * MAX_HEADER_TOKENS])
    rest = p.push(ids[2 * MAX_HEADER_TOKENS:]).content + p.finish().content
    assert early and early + rest == text and p.message() == (None, text, [])


def test_harmony_parallel_and_forced_fragments(htok):
    marks = harmony_tokens(htok)
    two = ids_of(htok, CALL + "<|start|>assistant" + CALL.replace("Oslo", "Rome"))
    for parallel, n in [(True, 2), (False, 1)]:
        p = HarmonyParser(htok, marks, tools=True, parallel=parallel)
        p.push(two)
        p.finish()
        assert [c["function"]["arguments"] for c in p.message()[2]] == \
            ['{"city":"Oslo"}', '{"city":"Rome"}'][:n]
    # forced: a first delta at the header, then fragments; cut short it stays a call
    p = HarmonyParser(htok, marks, tools=True, forced=True)
    deltas = [d for t in ids_of(htok, CALL)[:-3] for d in p.push([t]).tool_calls]
    deltas += p.finish().tool_calls
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(deltas) > 3 and all(set(d) == {"index", "function"} for d in deltas[1:])
    (call,) = p.message()[2]
    assert reassemble(deltas) == [(0, call["id"], "get_weather", call["function"]["arguments"])]
    args = call["function"]["arguments"]
    assert args and '{"city":"Oslo"}'.startswith(args) and args != '{"city":"Oslo"}'


def test_qwen3_forced_calls_stream_fragments_any_chunking():
    text = ('<tool_call>\n{"name":"get_weather","arguments":{"city":"a\\"}b"}}\n</tool_call>'
            '<tool_call>\n{"name":"get_time","arguments":{"zone":-3}}\n</tool_call>')
    _, whole = split_calls(text, forced=True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == \
        [("get_weather", '{"city":"a\\"}b"}'), ("get_time", '{"zone":-3}')]
    rng = np.random.default_rng(2)
    for _ in range(40):
        cuts = sorted(int(x) for x in rng.integers(0, len(text) + 1, size=rng.integers(1, 12)))
        p, content, deltas = ToolCallParser(forced=True), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            c, d = p.push(text[a:b])
            content, deltas = content + c, deltas + d
        content += p.finish()
        assert content == ""
        assert [(n, a) for _, _, n, a in reassemble(deltas)] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    cut = text[: text.index('"city":"a') + 9]  # a forced call cut short (max_tokens) stays a call
    assert split_calls(cut, forced=True)[1][0]["function"]["arguments"] == \
        cut[cut.index('"arguments":') + len('"arguments":'):]
    assert split_calls(cut)[0] == cut  # auto: it is content
    _, one = split_calls(text, parallel=False)
    assert [c["function"]["name"] for c in one] == ["get_weather"]


QWEN_CALLS = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\\"}b"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": -3}}\n'
              "</tool_call>")
HARMONY_CALLS = [THINK + CALL, CALL + "<|start|>assistant" + CALL.replace("Oslo", "Rome"),
                 CALL.replace('{"city":"Oslo"}', ' \n{"city": "Oslo"} \n'),
                 "<|channel|>commentary<|message|>Looking.<|end|><|start|>assistant" + CALL]


def test_auto_calls_stream_any_chunking_equal_to_the_whole(htok):
    """tool_choice auto, streamed: a well-formed call goes out as a first delta and
    argument fragments, which (any split of the stream) reassemble to the call the whole
    answer makes, with the same content; both families."""
    marks = harmony_tokens(htok)
    rng = np.random.default_rng(9)
    for text in HARMONY_CALLS:
        ids = ids_of(htok, text)
        whole = HarmonyParser(htok, marks, tools=True)
        whole.push(ids)
        whole.finish()
        reasoning, content, calls = whole.message()
        assert calls
        for _ in range(10):
            p, got = HarmonyParser(htok, marks, tools=True, stream=True), Piece()
            for part in chunked(rng, ids):
                got += p.push(part)
            got += p.finish()
            assert (got.reasoning or None, got.content) == (reasoning, content or "")
            streamed = reassemble(got.tool_calls)
            assert [(n, a) for _, _, n, a in streamed] == \
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            assert [i for i, *_ in streamed] == list(range(len(calls)))
        p = HarmonyParser(htok, marks, tools=True, stream=True)
        one = [d for t in ids for d in p.push([t]).tool_calls]
        assert one and len(one) > 2 * len(calls)  # token by token: fragments
    content, calls = split_calls(QWEN_CALLS)
    assert content == "Let me check.\n" and len(calls) == 2  # the newline between blocks
    for _ in range(20):
        p, c, deltas = ToolCallParser(stream=True), "", []
        for a, b in zip(*_cuts(rng, len(QWEN_CALLS)), strict=True):
            dc, dd = p.push(QWEN_CALLS[a:b])
            c, deltas = c + dc, deltas + dd
        c += p.finish()
        assert c == content
        assert [(n, a) for _, _, n, a in reassemble(deltas)] == \
            [(x["function"]["name"], x["function"]["arguments"]) for x in calls]
    p = ToolCallParser(stream=True)
    assert len([d for ch in QWEN_CALLS for d in p.push(ch)[1]]) > 2 * len(calls)


@pytest.mark.parametrize("text, args", [
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}\n</tool_call>', '{"zone": 1}'),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": 1', '{"zone": 1'),
    ('<tool_call>\n{"name": "get_time", "arguments": 1}\n</tool_call>', None),
], ids=["invalid-json", "unterminated", "not-an-object"])
def test_qwen3_malformed_auto_call_after_its_header_went_out(text, args):
    """Whole, a malformed block is content. Streamed, a block whose arguments opened a
    JSON object has gone out as a call: it stays one, its arguments as the model wrote
    them (and the rest of the block is dropped). Arguments that are no object wait for
    the block's end, then go as the whole answer has them (a call here: `1`)."""
    whole = split_calls(text)
    p = ToolCallParser(stream=True)
    content, deltas = "", []
    for ch in text:
        dc, dd = p.push(ch)
        content, deltas = content + dc, deltas + dd
    content += p.finish()
    got = [(n, a) for _, _, n, a in reassemble(deltas)]
    if args is None:
        assert len(deltas) == 1 and whole[0] is None and content == ""
        assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]]
    else:
        assert whole == (text, [])
        assert content == "" and got == [("get_time", args)]


def random_walk(m, rng, words, prefer, limit=400) -> list[int]:
    """Tokens through a matcher's masks: a "model" that picks any allowed token, a
    preferred (special) one a third of the time."""
    ids, mask = [], np.zeros(words, np.int32)
    while not m.is_stopped() and len(ids) < limit:
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        sp = [a for a in allowed if a in prefer]
        t = int(rng.choice(sp)) if sp and rng.random() < 0.33 else int(rng.choice(allowed))
        assert m.consume_token(t)
        ids.append(t)
    return ids


def test_harmony_forced_grammar_random_walks_are_valid_calls(hdir, htok):
    """Every walk through the required / named harmony grammar's masks is (after any
    analysis) exactly one well-formed call, parsed from its ids by the harmony parser."""
    marks = harmony_tokens(htok)
    c = GrammarCompiler(hdir / "tokenizer.json", 512, [marks.ret, marks.call])
    prefer = {marks.end, marks.call, marks.ret}
    rng = np.random.default_rng(3)
    for choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        m0, names = c.compile(harmony_tool_grammar(TOOLS, choice)), set()
        for _ in range(12):
            ids = random_walk(m0.deep_copy(), rng, 16, prefer)
            assert ids[-1] == marks.call, ids
            p = HarmonyParser(htok, marks, tools=True, forced=True)
            p.push(ids)
            p.finish()
            reasoning, content, (call,) = p.message()
            fn = call["function"]
            assert content is None and valid_args(fn["name"], fn["arguments"]), fn
            names.add(fn["name"])
        assert names == ({"get_weather", "get_time"} if choice == "required" else {"get_time"})
    assert harmony_tool_grammar(TOOLS, "auto") is None


FORMATS = [  # (a bounded format, a check of the final channel's text)
    (SO(json={"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}),
     lambda t: list(json.loads(t)) == ["n"] and 0 <= json.loads(t)["n"] <= 99),
    (SO(regex="[a-c]{2,4}/[0-9]"), lambda t: re.fullmatch("[a-c]{2,4}/[0-9]", t)),
    (SO(choice=["red", "blue"]), lambda t: t in ("red", "blue")),
    (SO(grammar='start: "(" /[0-9]{1,2}/ ")"'), lambda t: re.fullmatch(r"\(\d{1,2}\)", t)),
]


def test_harmony_final_channel_grammar_random_walks_reach_the_final_channel(hdir, htok):
    """response_format on GPT-OSS: every walk through the grammar's masks is an optional
    analysis message, no longer than half of max_tokens, then the final channel with the
    format's text, ended by <|return|>; a bad format still names its own field."""
    marks = harmony_tokens(htok)
    c = GrammarCompiler(hdir / "tokenizer.json", 512, [marks.ret, marks.call])
    prefer = {marks.ret, marks.start, marks.channel, marks.message}  # <|end|>: rarely
    rng = np.random.default_rng(8)
    for spec, check in FORMATS:
        m0, thoughts = c.compile(final_channel_grammar(spec, max_tokens=40)), []
        for _ in range(6):
            ids = random_walk(m0.deep_copy(), rng, 16, prefer)
            assert ids[-1] == marks.ret, htok.decode(ids, skip_special_tokens=False)
            p = HarmonyParser(htok, marks)
            p.push(ids)
            p.finish()
            reasoning, content, calls = p.message()
            assert check(content) and not calls, (spec.kind, content)
            if reasoning is not None:
                thoughts.append(ids.index(marks.end) - ids.index(marks.message) - 1)
        # walks with and without an analysis message, whose text stops at 20 tokens
        assert 0 < len(thoughts) < 6 and max(thoughts) == 20, thoughts
    with pytest.raises(ValueError, match="structured_outputs.json does not compile"):
        c.compile(final_channel_grammar(SO(json={"type": 7}), 40))


# ------------------------------------------- forced calls end to end, fake executor
def masked_executor(prefer: frozenset):
    class MaskedFakeExecutor(FakeExecutor):
        """FakeExecutor whose constrained rows sample from their grammar's bitmask, as
        the model runner builds it (StructuredOutputs.fill, the engine's matchers): an
        allowed token that depends on the request's seed (else its id) and position, a
        preferred one a third of the time, so a seeded request repeats its tokens."""

        structured = None  # LLMEngine attaches its grammar engine here

        def dispatch(self, plan, prev=None):
            handle = super().dispatch(plan, prev)
            rows = [(s, i) for i, s in enumerate(plan.sampling_seqs)
                    if s.sampling_params.structured_outputs is not None]
            if not rows:
                return handle
            for s, _ in rows:  # the scheduler holds these out while a token is pending
                assert s.num_pending_tokens == 0, s.seq_id
            mask = np.full((len(plan.sampling_seqs), self.structured.words), -1, np.int32)
            self.structured.fill([(s.seq_id, i) for s, i in rows], mask)
            tokens = handle.collect().tokens
            for s, i in rows:
                allowed = np.flatnonzero(np.unpackbits(mask[i].view(np.uint8),
                                                       bitorder="little"))
                allowed = allowed[allowed < self.vocab_size]
                seed = s.sampling_params.seed
                h = (7919 * (s.seq_id if seed is None else seed) + 104729 * s.num_tokens
                     + 13) % 1000003
                sp = [a for a in allowed if a in prefer]
                if sp and h % 3 == 0:
                    tokens[s.seq_id] = int(sp[h % len(sp)])
                else:
                    tokens[s.seq_id] = int(allowed[h % len(allowed)])
            return handle

    return MaskedFakeExecutor


@pytest.fixture(autouse=True)
def _nothing_compiles():
    compile_guard.install()
    before = compile_guard.compilations()
    yield
    assert compile_guard.compilations() == before, "a test of tool calls compiled"


def fake_server(model_dir, prefer, max_model_len=512, **kw):
    llm = LLM(model=str(model_dir), max_num_seqs=4, max_model_len=max_model_len, log=None,
              scheduling="chunked", max_num_batched_tokens=64,
              executor=masked_executor(frozenset(prefer)), **kw)
    return llm, ServerThread(OpenAIServer(llm.engine, served_model_names=["m"])).start()


def client_of(st):
    return openai.OpenAI(base_url=f"{st.url}/v1", api_key="unused", max_retries=0, timeout=60)


def streamed_calls(chunks) -> list[tuple]:
    deltas = [t.model_dump(exclude_none=True) for c in chunks if c.choices
              for t in (c.choices[0].delta.tool_calls or [])]
    return reassemble(deltas), len(deltas)


@pytest.mark.parametrize("family", ["gpt-oss", "qwen3"])
def test_forced_calls_stream_fragments_equal_to_the_whole_call(family, hdir):
    """tool_choice required / named through lp-serve: a well-formed call (the grammar),
    finish_reason tool_calls, streamed as a first delta and argument fragments that
    reassemble to the non-streamed call; then the call and the tool's answer go back
    through the chat template."""
    if family == "gpt-oss":
        marks = harmony_tokens(Tokenizer.from_file(str(hdir / "tokenizer.json")))
        model_dir, prefer, context = hdir, {marks.end, marks.call}, 2048  # tools: long prompt
    else:
        model_dir, prefer, context = ensure_tiny(preset="tiny"), {509, 511}, 512
    llm, st = fake_server(model_dir, prefer, context)
    try:
        client = client_of(st)
        kw = dict(model="m", messages=MSGS, max_tokens=200, tools=TOOLS)
        for seed, choice in [(0, "required"), (1, "required"),
                             (2, {"type": "function", "function": {"name": "get_weather"}})]:
            done = client.chat.completions.create(seed=seed, tool_choice=choice, **kw)
            ch = done.choices[0]
            assert ch.finish_reason == "tool_calls", ch
            (call,) = ch.message.tool_calls
            assert valid_args(call.function.name, call.function.arguments), call
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            chunks = list(client.chat.completions.create(seed=seed, tool_choice=choice,
                                                         stream=True, **kw))
            (got,), n = streamed_calls(chunks)
            assert got[0] == 0 and got[2:] == (call.function.name, call.function.arguments)
            assert n > 2  # fragments, not one delta
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        back = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        answer = client.chat.completions.create(model="m", messages=back, max_tokens=4,
                                                tools=TOOLS, tool_choice="none")
        assert answer.choices[0].finish_reason in ("stop", "length")
        prompt = st.server.chat.render(parse_messages(back)[0], tools=TOOLS)
        assert "sunny" in prompt  # the tiny Qwen3 template renders no tools or calls
        if family == "gpt-oss":
            assert f"to=functions.{call.function.name} <|constrain|>json" in prompt
            assert f"<|start|>functions.{call.function.name} to=assistant" in prompt
        assert answer.usage.prompt_tokens == len(ids_of(llm.engine.tokenizer, prompt))
    finally:
        st.stop()
    s = llm.engine.stats()
    assert s["structured_outputs"]["live"] == 0 and s["free_pages"] == s["total_pages"]


# ----------------------------- constrained rows under preemption and layered prefill
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "string", "maxLength": 4},
                         "b": {"type": "integer", "minimum": 0, "maximum": 999}}}


@pytest.mark.parametrize("policy, kw", [
    ("layered", dict(scheduling="layered", layer_groups=2, max_num_batched_tokens=64)),
    ("layered-preemptible", dict(scheduling="layered", preemptible=True, layer_groups=4,
                                 max_num_batched_tokens=256)),
    ("flowprefill", dict(scheduling="flowprefill", preemption_granularity="layer",
                         max_num_batched_tokens=256)),
    ("chunked-recompute", dict(scheduling="chunked", max_num_batched_tokens=32, kv_pages=20)),
])
def test_constrained_rows_under_preemption_and_layered_prefill(policy, kw):
    """JSON-schema rows beside free ones under layered prefill, preemptible batches (the
    urgent constrained arrivals pause a long prefill), FlowPrefill and KV-pressure
    recompute, overlapped: every constrained output is valid and ends with stop, every
    free one has its fake tokens, nothing leaks."""
    from fake_executor import fake_token

    llm = LLM(model=str(ensure_tiny(preset="tiny")), max_num_seqs=4, max_model_len=256,
              log=None, executor=masked_executor(frozenset({509, 511})), **kw)
    eng = llm.engine
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 500, int(rng.integers(20, 150))).tolist() for _ in range(10)]
    prompts[0] = rng.integers(0, 500, 240).tolist()  # a long prefill, paused by the urgent
    bound = SamplingParams(max_tokens=60, structured_outputs=SO(json=SCHEMA))
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    ids, outs, step = {}, {}, 0
    while len(outs) < len(prompts):
        if step < len(prompts):  # one arrival a step: prefills overlap decodes
            ids[eng.add_request(prompts[step], bound if step % 2 else free,
                                priority=-(step % 2))] = step
        for out in eng.step():
            if out.finished:
                outs[ids[out.request_id]] = out
        step += 1
        assert step < 3000
    for i, out in outs.items():
        if i % 2:
            assert out.finish_reason == "stop", out.text
            obj = json.loads(eng.tokenizer.decode(out.token_ids))
            assert list(obj) == ["a", "b"] and len(obj["a"]) <= 4 and 0 <= obj["b"] <= 999
        else:
            rid = next(r for r, k in ids.items() if k == i)
            assert out.token_ids == [fake_token(rid, len(prompts[i]) + j, 512)
                                     for j in range(12)]
    s = eng.stats()
    assert s["free_pages"] == s["total_pages"] and s["structured_outputs"]["live"] == 0
    assert s["overlapped_steps"] > 0
    if policy == "chunked-recompute":
        assert s["preemptions"] > 0
    if policy in ("layered-preemptible", "flowprefill"):
        assert s["prefill_pauses"] > 0, s


# ------------------------------------------------ auto calls on the mock, scripted
class Script:
    """The mock engine's tokens: each new request takes the next script, then eos."""

    def __init__(self, eos: int):
        self.eos, self.queue, self.of = eos, [], {}

    def __call__(self, seq_id: int, i: int) -> int:
        if seq_id not in self.of:
            self.of[seq_id] = self.queue.pop(0)
        ids = self.of[seq_id]
        return ids[i] if i < len(ids) else self.eos


@pytest.fixture(scope="module")
def mock(hdir, htok):
    from lp_jax.server.mock import MockEngine

    marks = harmony_tokens(htok)
    script = Script(marks.ret)
    engine = MockEngine(model_dir=hdir, eos_token_id=marks.ret, max_model_len=1024,
                        token_fn=script)
    st = ServerThread(OpenAIServer(engine, served_model_names=["m"])).start()
    yield st, script, marks
    st.stop()


def ask(mock, text, *, stream, tools=TOOLS, **kw):
    st, script, marks = mock
    script.queue.append(ids_of(st.server.tokenizer, text))
    resp = client_of(st).chat.completions.create(
        model="m", messages=MSGS, max_tokens=200, stream=stream, tools=tools,
        extra_body={"stop_token_ids": [marks.call]}, **kw)
    if not stream:
        ch = resp.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        return (getattr(ch.message, "reasoning_content", None), ch.message.content, calls,
                ch.finish_reason)
    chunks = [c for c in resp if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    r = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    calls, _ = streamed_calls(chunks)
    return (r or None, "".join(d.content or "" for d in deltas) or None,
            [(n, a) for _, _, n, a in calls], chunks[-1].choices[0].finish_reason)


@pytest.mark.parametrize("text, want, streamed", [
    (THINK + CALL, ("The user wants weather.", None, [("get_weather", '{"city":"Oslo"}')],
                    "tool_calls"), None),
    (THINK + "<|channel|>final<|message|>It is sunny.<|return|>",
     ("The user wants weather.", "It is sunny.", [], "stop"), None),
    # invalid JSON: content; streamed, the call went out when its body opened a JSON
    # object, and stays a call with the text the model wrote as its arguments
    (CALL.replace('"Oslo"}', "Oslo"), (None, '{"city":Oslo', [], "stop"),
     (None, None, [("get_weather", '{"city":Oslo')], "tool_calls")),
    # cut short in its header: the plain text, as content (streamed too)
    (THINK + CALL[:40], ("The user wants weather.", "assistantcommentary to=functions.get_w",
                         [], "stop"), None),
    # cut short in its body (then eos): content; streamed, a call with what it has
    (CALL[: -len('"}<|call|>')], (None, '{"city":"Oslo', [], "stop"),
     (None, None, [("get_weather", '{"city":"Oslo')], "tool_calls")),
    # a body that does not open a JSON object never goes out as a call
    (CALL.replace('{"city":"Oslo"}', 'Oslo {"city":1}'), (None, 'Oslo {"city":1}', [], "stop"),
     None),
], ids=["call", "final", "bad-json", "cut-header", "cut-body", "not-an-object"])
def test_harmony_answers_through_the_openai_client(mock, text, want, streamed):
    """Auto tool choice on GPT-OSS harmony: reasoning, content and calls from the token
    ids, the same streamed and not, a streamed call in fragments; malformed calls are
    content, never an error (streamed: see `streamed`)."""
    assert ask(mock, text, stream=False) == want
    assert ask(mock, text, stream=True) == (streamed or want)


@pytest.fixture(scope="module")
def qwen_mock(tiny_dir):
    from lp_jax.server.mock import MockEngine

    script = Script(511)
    st = ServerThread(OpenAIServer(MockEngine(model_dir=tiny_dir, eos_token_id=511,
                                              max_model_len=512, token_fn=script),
                                   served_model_names=["m"])).start()
    yield st, script
    st.stop()


@pytest.mark.parametrize("family", ["gpt-oss", "qwen3"])
def test_auto_calls_stream_fragments_through_the_openai_client(family, mock, qwen_mock):
    """tool_choice auto through lp-serve: the model's two calls stream as OpenAI's deltas
    (per call a first delta with index, id, type, name, arguments "", then argument
    fragments) that reassemble to the non-streamed calls, content and finish_reason."""
    st, script = (mock[0], mock[1]) if family == "gpt-oss" else qwen_mock
    text = HARMONY_CALLS[1] if family == "gpt-oss" else QWEN_CALLS
    client = client_of(st)
    kw = dict(model="m", messages=MSGS, max_tokens=200, tools=TOOLS)
    script.queue.append(ids_of(st.server.tokenizer, text))
    done = client.chat.completions.create(**kw).choices[0]
    script.queue.append(ids_of(st.server.tokenizer, text))
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    calls, n = streamed_calls(chunks)
    assert [(i, name, a) for i, _, name, a in calls] == \
        [(i, c.function.name, c.function.arguments)
         for i, c in enumerate(done.message.tool_calls)] and len(calls) == 2
    assert n > 2 * len(calls)  # fragments, not one delta a call
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        (done.message.content or "")
    assert done.finish_reason == chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stop, want", [
    (["END"], ("Say END? Not yet.", "Sunny, ", [], "stop")),  # in both: the content's stops
    (["Not yet"], ("Say END? Not yet.", "Sunny, END of report.", [], "stop")),  # reasoning's
    (['"city"'], ("Say END? Not yet.", None, [("get_weather", '{"city":"Oslo"}')],
                  "tool_calls")),  # in a call's arguments
], ids=["content", "reasoning-only", "arguments-only"])
def test_harmony_stop_strings_match_the_content_only(mock, stop, want):
    """GPT-OSS: stop strings apply to what the user gets as content (the final channel),
    not to the analysis channel's reasoning or a call's arguments; streamed and not."""
    think = "<|channel|>analysis<|message|>Say END? Not yet.<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>Sunny, END of report.<|return|>"
    text = think + (CALL if want[2] else final)
    for stream in (False, True):
        assert ask(mock, text, stream=stream, stop=stop) == want, stream


def test_harmony_parallel_tool_calls_false_keeps_the_first(mock):
    two = CALL + "<|start|>assistant" + CALL.replace("Oslo", "Rome")
    st, script, _ = mock
    for parallel, n in [(True, 2), (False, 1)]:
        for stream in (False, True):
            script.queue.append(ids_of(st.server.tokenizer, two))
            resp = client_of(st).chat.completions.create(
                model="m", messages=MSGS, max_tokens=200, stream=stream, tools=TOOLS,
                parallel_tool_calls=parallel)  # <|call|> is no stop id here: both calls come
            if stream:
                calls, _ = streamed_calls([c for c in resp if c.choices])
                args = [a for *_, a in calls]
            else:
                args = [c.function.arguments for c in resp.choices[0].message.tool_calls]
            assert args == ['{"city":"Oslo"}', '{"city":"Rome"}'][:n], (parallel, stream)


def test_harmony_tools_reach_the_template_and_forced_choice_needs_a_grammar(mock):
    st, _, _ = mock
    prompt = st.server.chat.render(MSGS, tools=TOOLS)
    assert "type get_weather = (_: " in prompt and "'functions'" in prompt
    # The mock samples no grammar: a forced choice is refused as the engine refuses it.
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        client_of(st).chat.completions.create(model="m", messages=MSGS, max_tokens=4,
                                              tools=TOOLS, tool_choice="required")


def test_qwen3_grammars_compile_and_walk_to_calls(tiny_dir):
    """The Qwen3 forced grammar (parallel and not): random walks parse as calls."""
    c = GrammarCompiler(tiny_dir / "tokenizer.json", 512, [511, 509])
    rng = np.random.default_rng(4)
    for parallel in (True, False):
        m0 = c.compile(tool_grammar(TOOLS, "required", parallel))
        for _ in range(6):
            ids = random_walk(m0.deep_copy(), rng, 16, {509, 511})
            text = Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).decode(ids)
            content, calls = split_calls(text, forced=True, parallel=parallel)
            assert content is None and calls and (parallel or len(calls) == 1), text
            assert all(valid_args(x["function"]["name"], x["function"]["arguments"])
                       for x in calls)


def test_glm_grammar_walks_to_calls_typed_by_the_schema():
    """GLM-4.5's forced grammar: random walks parse (GLM's parser) as calls whose
    arguments satisfy the schema, required ones always there, optional ones sometimes."""
    from lp_jax.server.glm45_tools import split_calls as glm_split
    from lp_jax.server.glm45_tools import tool_grammar as glm_grammar

    tiny = ensure_tiny(preset="tiny-glm")
    c = GrammarCompiler(tiny / "tokenizer.json", 512, [511, 509])
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    opt = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["k"], "properties": {
            "k": {"enum": ["x", "yz"], "type": "string"}, "n": {"type": "boolean"}}}}}
    tools = [WEATHER, TIME, opt]
    rng = np.random.default_rng(5)
    seen = set()
    for parallel in (True, False):
        m0 = c.compile(glm_grammar(tools, "required", parallel))
        for _ in range(8):
            text = tok.decode(random_walk(m0.deep_copy(), rng, 16, {509, 511}))
            content, calls = glm_split(text, tools, parallel)
            assert content is None and calls and (parallel or len(calls) == 1), text
            for x in calls:
                name, args = x["function"]["name"], x["function"]["arguments"]
                if name == "pick":
                    a = json.loads(args)
                    assert a["k"] in ("x", "yz") and set(a) <= {"k", "n"}, args
                    assert type(a.get("n", True)) is bool
                    seen.add("n" in a)
                else:
                    assert valid_args(name, args), text
    assert seen == {True, False}  # the optional argument is optional

# ---------------------------------------------------- malformed output never raises
def test_random_output_never_raises_and_streams_as_it_parses_whole(htok):
    """Random harmony token ids (markers often) and random Qwen3 block text: no error,
    and any split of the stream gives the whole answer's reasoning, content and calls."""
    marks = harmony_tokens(htok)
    rng = np.random.default_rng(7)
    words = ids_of(htok, ' to=functions.get_weather commentary analysis final {"city":"x"}')
    for _ in range(150):
        ids = [int(rng.choice([*marks.ends, marks.start, marks.message, marks.channel,
                               marks.constrain])) if rng.random() < 0.3
               else int(rng.choice(words)) for _ in range(int(rng.integers(0, 40)))]
        for forced in (False, True):
            whole = HarmonyParser(htok, marks, tools=True, forced=forced)
            whole.push(ids)
            whole.finish()
            p = HarmonyParser(htok, marks, tools=True, forced=forced)
            got = Piece()
            for part in chunked(rng, ids):
                got += p.push(part)
            got += p.finish()
            reasoning, content, calls = whole.message()
            assert (got.reasoning or None, got.content) == (reasoning, content or "")
            assert [(n, a) for _, _, n, a in reassemble(got.tool_calls)] == \
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        # auto, streamed: every call the whole answer makes goes out, as it is (maybe
        # beside calls that went out before their body turned out malformed)
        p, got = HarmonyParser(htok, marks, tools=True, stream=True), Piece()
        for part in chunked(rng, ids):
            got += p.push(part)
        got += p.finish()
        streamed = [(n, a) for _, _, n, a in reassemble(got.tool_calls)]
        assert streamed == [(c["function"]["name"], c["function"]["arguments"])
                            for c in p.message()[2]]
        assert _subsequence(_pairs(HarmonyParser(htok, marks, tools=True), ids), streamed)
        assert (got.reasoning or None) == whole.message()[0]
    parts = ["<tool_call>", "</tool_call>", '{"name":', ' "get_time"', ',"arguments":', " ",
             "{", "}", '"', "\\", "1", "\n", "x"]
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(int(rng.integers(0, 25))))
        for forced in (False, True):
            for parallel in (False, True):
                content, calls = split_calls(text, forced, parallel)
                p, c, deltas = ToolCallParser(forced, parallel), "", []
                for a, b in zip(*_cuts(rng, len(text)), strict=True):
                    dc, dd = p.push(text[a:b])
                    c, deltas = c + dc, deltas + dd
                c += p.finish()
                assert c == (content or ""), (text, forced)
                assert [(n, a) for _, _, n, a in reassemble(deltas)] == \
                    [(x["function"]["name"], x["function"]["arguments"]) for x in calls]
            p, deltas = ToolCallParser(parallel=parallel, stream=True), []
            for a, b in zip(*_cuts(rng, len(text)), strict=True):
                deltas += p.push(text[a:b])[1]
            p.finish()
            streamed = [(n, a) for _, _, n, a in reassemble(deltas)]
            assert streamed == [(x["function"]["name"], x["function"]["arguments"])
                                for x in p.whole_calls()]
            strict = [(x["function"]["name"], x["function"]["arguments"])
                      for x in split_calls(text, False, parallel)[1]]
            if parallel:
                assert _subsequence(strict, streamed), (text, strict, streamed)
            else:  # the first call out, maybe one that turned out malformed
                assert len(streamed) <= 1 and bool(streamed) >= bool(strict), text


def _pairs(parser, ids) -> list[tuple]:
    parser.push(ids)
    parser.finish()
    return [(c["function"]["name"], c["function"]["arguments"]) for c in parser.message()[2]]


def _subsequence(xs: list, ys: list) -> bool:
    it = iter(ys)
    return all(any(x == y for y in it) for x in xs)


def _cuts(rng, n):
    cuts = sorted(int(x) for x in rng.integers(0, n + 1, size=rng.integers(0, 6)))
    return [0, *cuts], [*cuts, n]


def test_tokenize_renders_the_tools_as_chat_does(mock):
    """/tokenize with tools counts the prompt a chat request with them runs."""
    from test_server_input import post

    st, script, marks = mock
    body = {"model": "m", "messages": MSGS, "tools": TOOLS}
    status, data = post(st, "/tokenize", body)
    n = json.loads(data)["count"]
    assert status == 200 and n > json.loads(post(st, "/tokenize", {**body, "tools": None})[1])[
        "count"]
    script.queue.append(ids_of(st.server.tokenizer, "<|channel|>final<|message|>ok<|return|>"))
    resp = client_of(st).chat.completions.create(model="m", messages=MSGS, max_tokens=8,
                                                 tools=TOOLS)
    assert resp.usage.prompt_tokens == n and resp.choices[0].message.content == "ok"
    status, data = post(st, "/tokenize", {**body, "tools": [{"type": "nope"}]})
    assert status == 400 and json.loads(data)["error"]["param"] == "tools"


# ------------------------------------------------ GLM-4.5's format in the chat path
GLM_CALLS = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a\"}b"
             "</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>zone</arg_key>\n"
             "<arg_value>-3</arg_value>\n</tool_call>")


def test_glm_tool_calls_through_the_server():
    """A GLM-4.5 checkpoint's calls through lp-serve in GLM's format, chosen from its
    config.json: forced ("required" / named: GLM's grammar, on the fake executor's masked
    sampling) and auto (the mock's scripted text), streamed equal to whole; a schema the
    forced grammar cannot express is a 400 naming the field, before anything compiles."""
    from lp_jax.server.mock import MockEngine

    glm_dir = ensure_tiny(preset="tiny-glm")
    llm, st = fake_server(glm_dir, {509, 511})
    try:
        assert st.server.tool_format == "glm45"
        client = client_of(st)
        kw = dict(model="m", messages=MSGS, max_tokens=200, tools=TOOLS)
        for seed, choice in [(0, "required"), (1, "required"),
                             (2, {"type": "function", "function": {"name": "get_time"}})]:
            done = client.chat.completions.create(seed=seed, tool_choice=choice, **kw)
            ch = done.choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
            assert ch.message.tool_calls, ch
            for call in ch.message.tool_calls:
                assert valid_args(call.function.name, call.function.arguments), call
            if isinstance(choice, dict):
                assert {c.function.name for c in ch.message.tool_calls} == {"get_time"}
            chunks = list(client.chat.completions.create(seed=seed, tool_choice=choice,
                                                         stream=True, **kw))
            got, _ = streamed_calls(chunks)
            assert [g[2:] for g in got] == [(c.function.name, c.function.arguments)
                                            for c in ch.message.tool_calls]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        pattern = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}}}
        with pytest.raises(openai.BadRequestError, match=r"properties\.s\.pattern") as e:
            client.chat.completions.create(model="m", messages=MSGS, max_tokens=8,
                                           tools=[pattern], tool_choice="required")
        assert e.value.body["param"] == "tools"
    finally:
        st.stop()
    s = llm.engine.stats()
    assert s["structured_outputs"]["live"] == 0 and s["free_pages"] == s["total_pages"]

    script = Script(511)
    st = ServerThread(OpenAIServer(MockEngine(model_dir=glm_dir, eos_token_id=511,
                                              max_model_len=512, token_fn=script),
                                   served_model_names=["m"])).start()
    try:
        client = client_of(st)
        script.queue.append(ids_of(st.server.tokenizer, GLM_CALLS))
        done = client.chat.completions.create(**kw).choices[0]
        want = [("get_weather", '{"city": "a\\"}b"}'), ("get_time", '{"zone": -3}')]
        assert [(c.function.name, c.function.arguments)
                for c in done.message.tool_calls] == want
        # the newline between the blocks is content, as Qwen3's
        assert done.message.content == "Let me check.\n" and done.finish_reason == "tool_calls"
        script.queue.append(ids_of(st.server.tokenizer, GLM_CALLS))
        chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        calls, _ = streamed_calls(chunks)
        assert [(n, a) for _, _, n, a in calls] == want
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me check.\n"
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        st.stop()
