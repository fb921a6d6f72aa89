"""GLM-4.5's reasoning and tool-call formats (lp_jax/server/glm45_tools.py, reasoning.py):
whole and streamed a character at a time, arguments typed by the tool's schema, malformed
and unterminated blocks kept as content, parallel_tool_calls=false."""

import json

import pytest

from lp_jax.server import reasoning
from lp_jax.server.glm45_tools import Glm45ToolCallParser, split_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}, "opts": {"type": "object"}}}}}]
ANSWER = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York"
          "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>zip"
          "</arg_key>\n<arg_value>10001</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>"
          '{"unit": "C"}</arg_value>\n</tool_call>')
WANT = {"city": "New York", "days": 3, "zip": "10001", "opts": {"unit": "C"}}


def test_whole_answer_typed_by_the_schema():
    content, calls = split_calls(ANSWER, TOOLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == WANT
    # without the tools' schema every value that parses as JSON is read as JSON
    _, untyped = split_calls(ANSWER)
    assert json.loads(untyped[0]["function"]["arguments"])["zip"] == 10001


def test_streamed_a_character_at_a_time():
    p = Glm45ToolCallParser(stream=True, tools=TOOLS)
    content, deltas = "", []
    for ch in ANSWER + " Done.":
        c, d = p.push(ch)
        content, deltas = content + c, deltas + d
        if d:  # the call goes out whole when its block closes
            assert content == "Let me check."
    content += p.finish()
    assert content == "Let me check. Done."
    assert len(deltas) == 1 and deltas[0]["index"] == 0
    assert json.loads(deltas[0]["function"]["arguments"]) == WANT


@pytest.mark.parametrize("text", [
    "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
    "<tool_call>f\n<arg_key>a</arg_key>junk<arg_value>1</arg_value></tool_call>",
    "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>tail</tool_call>",
    "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>",  # unterminated
])
def test_malformed_blocks_stay_content(text):
    assert split_calls(text) == (text, [])


def test_parallel_false_keeps_the_first_call_and_names_without_args():
    two = "<tool_call>a\n</tool_call><tool_call>b\n</tool_call>"
    assert [c["function"]["name"] for c in split_calls(two)[1]] == ["a", "b"]
    _, one = split_calls(two, parallel=False)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in one] == [("a", "{}")]


def test_glm45_reasoning_parser():
    assert "glm45" in reasoning.PARSERS
    assert reasoning.split("<think>plan it</think>\n\nThe answer.") == ("plan it", "The answer.")
    assert reasoning.split("No block.") == (None, "No block.")
