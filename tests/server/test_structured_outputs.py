"""Structured outputs and tool calls through the official `openai` client against the server
on loopback: the output parses and validates against the schema (jsonschema), matches the
regex (re.fullmatch), is one of the choices or in the grammar's language; a forced tool call
comes back as `tool_calls` with the right name and valid arguments, streamed too; bad
constraints are 400s naming their field and the server keeps serving. One server on the tiny
model (a longer context, for the tools' system prompt), greedy requests only."""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import jsonschema
import openai
import pytest

from kvjax import Engine, EngineConfig
from kvjax.server import BackgroundServer, ServerConfig, protocol
from kvjax.server.structured import ToolCallStream, ToolPlan, chat_turns
from kvjax.testing import tiny_chat_model

pytest.importorskip("llguidance")

MODEL_NAME = "tiny"
CONFIG = EngineConfig(page_size=8, num_pages=160, max_num_seqs=4, max_num_batched_tokens=64,
                      max_prefill_chunk=32, min_chunk_bucket=32, max_prefill_seqs=1)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
ARGS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    model = tiny_chat_model()
    model = dataclasses.replace(model, config=dataclasses.replace(
        model.config, max_position_embeddings=1024))
    engine = Engine(model, CONFIG)
    engine.warmup()
    with BackgroundServer(engine, ServerConfig(model_name=MODEL_NAME)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=kwargs.pop(
        "messages", MESSAGES), temperature=0, max_tokens=kwargs.pop("max_tokens", 64), **kwargs)


def test_json_schema_output_validates(client):
    got = chat(client, n=2, logprobs=True, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    for choice in got.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert len(choice.logprobs.content) == got.usage.completion_tokens // 2


def test_json_object_streamed_on_completions(client):
    stream = client.completions.create(model=MODEL_NAME, prompt="JSON:", max_tokens=64,
                                       temperature=0, stream=True,
                                       extra_body={"response_format": {"type": "json_object"}})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, check", [
    (dict(guided_regex=r"[a-f]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-f]{3}-\d{2}", t)),
    (dict(guided_choice=["north", "south"]), lambda t: t in ("north", "south")),
    (dict(structured_outputs=dict(choice=["up", "down"])), lambda t: t in ("up", "down")),
    (dict(guided_grammar='root ::= "x" [0-9] | "y"'), lambda t: re.fullmatch(r"x\d|y", t)),
    (dict(guided_json=SCHEMA, stop=["}"], include_stop_str_in_output=True),
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
], ids=["regex", "choice", "structured_outputs", "grammar", "json_with_stop"])
def test_vllm_constraints(client, extra, check):
    got = chat(client, extra_body=extra)
    text = got.choices[0].message.content
    assert check(text), text


def check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), ARGS[call.function.name])


@pytest.mark.parametrize("tool_choice, name", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
], ids=["required", "named"])
def test_forced_tool_call(client, tool_choice, name):
    got = chat(client, tools=TOOLS, tool_choice=tool_choice)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call, name)
    # Streamed: one tool_calls delta carries the same call.
    chunks = list(chat(client, tools=TOOLS, tool_choice=tool_choice, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    [streamed] = [d.tool_calls for d in deltas if d.tool_calls]
    assert streamed[0].function.name == call.function.name
    assert streamed[0].function.arguments == call.function.arguments
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_history_is_accepted_and_none_answers_in_text(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    got = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert got.choices[0].message.tool_calls is None
    assert got.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}), "response_format"),
    (dict(guided_regex="[a-"), "guided_regex"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(guided_regex="a", guided_choice=["b"]), "guided_regex"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
], ids=["bad_schema", "bad_regex", "empty_choice", "two_constraints", "unknown_tool"])
def test_bad_constraints_are_400s_naming_the_field(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body=extra)
    error = e.value.body
    assert error["param"] == param or error["message"].startswith(param), error
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
    assert chat(client, max_tokens=2).choices[0].message.content is not None


def plan(tool_choice="auto") -> ToolPlan:
    body = protocol.ChatCompletionRequest.model_validate(
        dict(messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice))
    return ToolPlan.of(body)


CALL = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


@pytest.mark.parametrize("text, is_call", [
    (CALL, True), (f"  <tool_call>{CALL}</tool_call>\n", True), ("Hello", False),
    ('{"name": "rm", "arguments": {}}', False), ('{"name": "get_time"}', False),
    ("{not json", False)])
def test_auto_reply_parsing_whole_and_streamed(text, is_call):
    calls = plan().parse(text)
    assert (calls is not None) == is_call
    if is_call:
        assert calls[0]["function"]["name"] == "get_time"
        assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    # Streamed a few characters at a time: content passes through unless it may be a call.
    stream, content, last = ToolCallStream(plan()), "", None
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces):
        delta, last = stream.delta(piece, "stop" if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
    assert (last == "tool_calls") == is_call
    assert content == ("" if is_call else text)


def test_tools_are_rendered_into_the_system_prompt():
    turns = chat_turns([protocol.ChatMessage(role="system", content="Be brief.")] + [
        protocol.ChatMessage(role="user", content="hi")], plan())
    assert turns[0]["role"] == "system" and turns[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in turns[0]["content"]
    assert chat_turns([protocol.ChatMessage(role="user", content="hi")], plan("none")) == [
        dict(role="user", content="hi")]
