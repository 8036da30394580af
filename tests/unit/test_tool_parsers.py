"""Tool calls read out of a model's turn (rollout.tool_parser): hermes and llama3_json, into
the OpenAI API's shape; a malformed call comes back as plain content, never as a guess."""

import json

import pytest

from orchestrator.agents import tool_parsers


def _calls(calls):
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_reads_each_call_and_keeps_the_text_around_them_as_content():
    content, calls = tool_parsers.parse("hermes", 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "123*45"}}\n'
                                                  '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert content == "Let me compute."
    assert _calls(calls) == [("function", "calc", {"expression": "123*45"}), ("function", "now", {})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert tool_parsers.parse("hermes", '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>')[0] is None
    assert tool_parsers.parse("hermes", "\\boxed{5535}") == ("\\boxed{5535}", [])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "calc", "arguments": {bad json}}</tool_call>',
    '<tool_call>{"name": "calc", "arguments": {"x": 1}}',  # never closed
    '<tool_call>{"arguments": {"x": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>oops</tool_call>',  # one bad call spoils all
])
def test_a_malformed_hermes_call_is_plain_content(text):
    assert tool_parsers.parse("hermes", text) == (text, [])


def test_llama3_json_reads_one_or_several_objects_with_parameters_or_arguments():
    content, calls = tool_parsers.parse("llama3_json", ' {"name": "calc", "parameters": {"expression": "a;b}"}} ; '
                                                       '{"name": "b", "arguments": "{\\"x\\": 1}"}')
    assert content is None and _calls(calls) == [("function", "calc", {"expression": "a;b}"}), ("function", "b", {"x": 1})]
    for text in ("The answer is 3", '{"name": "calc", "parameters": {}} trailing words', '{"name": "calc", "parameters": {'):
        assert tool_parsers.parse("llama3_json", text) == (text, [])
