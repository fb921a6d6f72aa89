"""GPT-OSS's harmony chat format: the tiny checkpoints' chat_template.jinja rendered by the
server's sandboxed renderer, and /v1/chat/completions on the tiny GPT-OSS model."""

from __future__ import annotations

import datetime
import json
import re

import openai
import pytest
from tokenizers import Tokenizer

from checkpoints.make_tiny import HARMONY_TEMPLATE, ensure_tiny
from lp_jax.server import OpenAIServer, ServerThread
from lp_jax.server.chat import ChatFormatter, ChatTemplateError

CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What is prefill?"},
    {"role": "assistant", "content": " The first pass over the prompt. "},
    {"role": "user", "content": "And decode?"},
]


def expected(date: str) -> str:
    return (
        "<|start|>system<|message|>You are a helpful assistant.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Every assistant message names one."
        "<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer in one sentence.<|end|>"
        "<|start|>user<|message|>What is prefill?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The first pass over the prompt.<|end|>"
        "<|start|>user<|message|>And decode?<|end|>"
        "<|start|>assistant"
    )


# The two served tests' engine: one shape, so the second's programs come from the run's
# compilation cache. 16 sequences: the 16 samples of the response_format test decode in one
# wave (a decode step costs the 256-row program whatever the rows it fills).
HARMONY_ENGINE = dict(scheduling="chunked", max_num_seqs=16, max_model_len=512,
                      max_num_batched_tokens=256, token_buckets=(256,), backends="off")


@pytest.fixture(scope="module")
def gpt_oss_dir():
    return ensure_tiny(preset="tiny-gpt-oss")


def render_today(fmt, messages, **kw) -> tuple[str, set[str]]:
    """The rendering and the dates it may carry (the day may turn while it renders)."""
    before = datetime.date.today().isoformat()
    text = fmt.render(messages, **kw)
    return text, {before, datetime.date.today().isoformat()}


def test_tiny_gpt_oss_ships_the_harmony_template(gpt_oss_dir):
    assert (gpt_oss_dir / "chat_template.jinja").read_text() == HARMONY_TEMPLATE
    assert "chat_template" not in json.loads((gpt_oss_dir / "tokenizer_config.json").read_text())
    fmt = ChatFormatter.from_model_dir(gpt_oss_dir)
    text, dates = render_today(fmt, CONVERSATION)
    assert text in {expected(d) for d in dates}


def test_harmony_history_end_and_errors():
    fmt = ChatFormatter(HARMONY_TEMPLATE)
    text, _ = render_today(fmt, CONVERSATION[:3], add_generation_prompt=False)
    assert text.endswith("<|channel|>final<|message|>The first pass over the prompt.<|return|>")
    dev = [{"role": "developer", "content": "# Instructions\n\nBe terse."},
           {"role": "user", "content": "Hi"}]
    text, _ = render_today(fmt, dev)
    assert "<|start|>developer<|message|># Instructions\n\nBe terse.<|end|>" in text
    assert "<|start|>developer" not in render_today(fmt, CONVERSATION[1:2])[0]
    with pytest.raises(ChatTemplateError, match='role "tool" is not supported'):
        fmt.render([{"role": "tool", "content": "42"}])
    with pytest.raises(ChatTemplateError, match="must come first"):
        fmt.render(CONVERSATION[1:2] + CONVERSATION[:1])


def test_renderer_has_transformers_loop_controls_and_tojson():
    fmt = ChatFormatter(
        "{%- for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m | tojson(separators=(',', ':'), sort_keys=True) }}{% endfor %}")
    msgs = [{"role": "user", "content": "é"}] * 3
    assert fmt.render(msgs) == '{"content":"é","role":"user"}' * 2


def test_chat_completion_on_tiny_gpt_oss(gpt_oss_dir):
    from lp_jax.engine.config import EngineConfig
    from lp_jax.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(gpt_oss_dir), **HARMONY_ENGINE), log=None)
    st = ServerThread(OpenAIServer(engine, served_model_names=["tiny-gpt-oss"]))
    st.start()
    try:
        client = openai.OpenAI(base_url=f"{st.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        resp = client.chat.completions.create(
            model="tiny-gpt-oss", messages=CONVERSATION, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True})
    finally:
        st.stop()
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 6 and resp.choices[0].message.content
    tok = Tokenizer.from_file(str(gpt_oss_dir / "tokenizer.json"))
    _, dates = render_today(ChatFormatter(HARMONY_TEMPLATE), CONVERSATION)
    lengths = {len(tok.encode(expected(d), add_special_tokens=False).ids) for d in dates}
    assert resp.usage.prompt_tokens in lengths  # the harmony prompt, not ChatML


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "today's weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_harmony_tools_calls_and_tool_messages():
    """Tools in the developer message and the system message's commentary rule; an
    assistant's calls (after its analysis) as commentary messages to functions.NAME ending
    in <|call|>; each tool answer named by its tool_call_id (else the last call)."""
    from lp_jax.server.protocol import parse_messages

    fmt = ChatFormatter(HARMONY_TEMPLATE)
    calls = [{"id": f"call_{n}", "type": "function",
              "function": {"name": n, "arguments": json.dumps(a)}}
             for n, a in [("get_weather", {"city": "Oslo"}), ("get_time", {})]]
    msgs, _ = parse_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Ask the tools.",
         "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_get_time", "content": "noon"},
        {"role": "tool", "tool_call_id": "call_get_weather", "content": "sunny"},
        {"role": "tool", "content": "late"}])
    text, _ = render_today(fmt, msgs, tools=[WEATHER, TIME])
    system, developer = text.split("<|end|>")[:2]
    assert system.endswith("Calls to these tools must go to the commentary channel: "
                           "'functions'.")
    assert developer == (
        "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// today's weather\ntype get_weather = (_: " + json.dumps(WEATHER["function"][
            "parameters"]) + ") => any;\n\ntype get_time = (_: {\"type\": \"object\"}) => "
        "any;\n\n} // namespace functions")
    assert text.endswith(
        "<|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Ask the tools.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Oslo"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
        "<|message|>{}<|call|>"
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>noon<|end|>"
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny"
        "<|end|>"
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>late<|end|>"
        "<|start|>assistant")
    plain, _ = render_today(fmt, CONVERSATION)  # without tools: as before
    assert "# Tools" not in plain and "Calls to these tools" not in plain


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_response_format_on_harmony_always_reaches_the_final_channel(tmp_path):
    """GPT-OSS with response_format, random weights at temperature 1: the grammar holds
    the whole answer to harmony's shape (an optional analysis message of about half of
    max_tokens, then the final channel), so every sample finishes with `stop` and the
    schema's JSON as its content, streamed as not. The longest valid answer fits in
    max_tokens: the analysis header and its text (about 50 tokens: random walks through
    the grammar's masks take at most 58), then <|end|> to <|return|> (at most 35). The
    engine has the shapes of test_chat_completion_on_tiny_gpt_oss: its programs come from
    the run's compilation cache."""
    from checkpoints.make_tiny import write_harmony_variant
    from lp_jax.engine.config import EngineConfig
    from lp_jax.engine.llm_engine import LLMEngine

    hdir = write_harmony_variant(tmp_path / "tiny-gpt-oss-harmony")
    engine = LLMEngine(EngineConfig(model=str(hdir), **HARMONY_ENGINE), log=None)
    st = ServerThread(OpenAIServer(engine, served_model_names=["m"])).start()
    try:
        client = openai.OpenAI(base_url=f"{st.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        kw = dict(model="m", messages=CONVERSATION[1:2], temperature=1.0, max_tokens=100,
                  response_format=rf)
        resp = client.chat.completions.create(n=16, seed=3, **kw)
        reasoned = 0
        for ch in resp.choices:
            assert ch.finish_reason == "stop", ch
            obj = json.loads(ch.message.content)
            assert list(obj) == ["name", "age"], ch
            assert re.fullmatch("[a-z]{1,6}", obj["name"]) and 0 <= obj["age"] <= 99, obj
            reasoned += getattr(ch.message, "reasoning_content", None) is not None
        assert reasoned and len({c.message.content for c in resp.choices}) > 8
        # seeded sample i uses seed + i: streamed alone, sample 0 again
        chunks = [c for c in client.chat.completions.create(seed=3, stream=True, **kw)
                  if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
            resp.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert st.engine_call(lambda e: e.stats())["compilations_after_warmup"] == 0
    finally:
        st.stop()
