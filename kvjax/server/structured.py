"""Structured outputs and tool calls on the OpenAI endpoints: request fields -> a grammar, the
tools -> the prompt, the model's text -> OpenAI `tool_calls`.

Constraints (at most one per request): `response_format` (`json_object`, `json_schema`),
vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and its newer
`structured_outputs` object, and chat's `tool_choice` "required" or a named function. Each
becomes a `kvjax.grammar.Grammar` in the request's `SamplingParams`; the engine compiles it
(a bad one is a 400 naming the field) and masks the sampler with it.

Tool calls. Chat templates of the models kvjax embeds have no tools section, so the tools are
rendered into the system prompt (`TOOLS_PROMPT`, after any system message of the request) and
the model calls one by replying with one JSON object `{"name": ..., "arguments": {...}}`
(optionally inside `<tool_call>...</tool_call>`). "required" and a named function force that
reply with a grammar; "auto" parses the reply when it is such an object naming a tool; "none"
leaves the tools out of the prompt. A reply makes at most one call. Earlier turns are
rendered in the same format: an assistant turn's `tool_calls` as that JSON, a `tool` turn's
content as the tool's answer.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from typing import Any

from kvjax.grammar import JSON_OBJECT_SCHEMA, Grammar, GrammarKind
from kvjax.server import protocol

TOOLS_PROMPT = (
    "You can call these functions (JSON schemas of their arguments below). To call one, reply "
    "with only a JSON object {{\"name\": <function name>, \"arguments\": <arguments object>}}."
    "\n<tools>\n{tools}\n</tools>")


class ToolChoice(enum.Enum):
    NONE = "none"  # the tools are not offered
    AUTO = "auto"  # the model may call one; its reply is parsed
    REQUIRED = "required"  # the reply is a call of one of the tools (grammar)
    NAMED = "named"  # the reply is a call of the named tool (grammar)


def _constraints(body) -> list[tuple[str, Grammar]]:
    """(field, grammar) of every constraint the body sets; ValueError starting with the
    field's name when one is malformed."""
    found: list[tuple[str, Grammar]] = []
    fields = [name for name in ("response_format", "guided_json", "guided_regex",
                                "guided_choice", "guided_grammar", "structured_outputs")
              if getattr(body, name) not in (None, protocol.ResponseFormat(type="text"))]
    try:
        _collect(body, found)
    except ValueError as e:
        field = fields[len(found)] if len(found) < len(fields) else fields[-1]
        raise ValueError(f"{field}: {e}") from None
    return found


def _collect(body, found: list[tuple[str, Grammar]]) -> None:
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Grammar(GrammarKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA)))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format",
                      Grammar(GrammarKind.JSON_SCHEMA, json.dumps(rf.json_schema.schema_))))
    if body.guided_json is not None:
        found.append(("guided_json", _json_grammar(body.guided_json)))
    if body.guided_regex is not None:
        found.append(("guided_regex", Grammar(GrammarKind.REGEX, body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", Grammar.choice(body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", Grammar(GrammarKind.LARK, body.guided_grammar)))
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex),
                                     ("choice", so.choice), ("grammar", so.grammar),
                                     ("json_object", so.json_object)) if v not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and "
                             "json_object")
        kind, value = given[0]
        found.append(("structured_outputs", {
            "json": lambda: _json_grammar(value),
            "regex": lambda: Grammar(GrammarKind.REGEX, value),
            "choice": lambda: Grammar.choice(value),
            "grammar": lambda: Grammar(GrammarKind.LARK, value),
            "json_object": lambda: Grammar(GrammarKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA),
        }[kind]()))


def _json_grammar(schema: dict | str) -> Grammar:
    return Grammar(GrammarKind.JSON_SCHEMA, schema if isinstance(schema, str)
                   else json.dumps(schema))


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools and what it asks of them.

    Attributes:
      functions: the tools' function definitions, in request order.
      choice: `ToolChoice`; name: the function a NAMED choice forces.
    """

    functions: tuple[protocol.FunctionDef, ...]
    choice: ToolChoice
    name: str | None = None

    @classmethod
    def of(cls, body: protocol.ChatCompletionRequest) -> ToolPlan | None:
        """The request's plan (None without tools); ValueError starting with the field's
        name for tools that clash or a tool_choice that names none of them."""
        tc = body.tool_choice
        if not body.tools:
            if tc not in (None, "none"):
                raise ValueError("tool_choice: needs tools")
            return None
        functions = tuple(t.function for t in body.tools)
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
        if isinstance(tc, protocol.NamedToolChoice):
            if tc.function.name not in names:
                raise ValueError(f"tool_choice: names {tc.function.name!r}, which is not one "
                                 f"of the tools")
            return cls(functions, ToolChoice.NAMED, tc.function.name)
        return cls(functions, ToolChoice(tc or "auto"))

    @property
    def offered(self) -> tuple[protocol.FunctionDef, ...]:
        """The functions the model sees and may call."""
        if self.choice is ToolChoice.NONE:
            return ()
        if self.choice is ToolChoice.NAMED:
            return tuple(f for f in self.functions if f.name == self.name)
        return self.functions

    def grammar(self) -> Grammar | None:
        """The grammar a forced call (REQUIRED, NAMED) decodes under; None otherwise."""
        if self.choice not in (ToolChoice.REQUIRED, ToolChoice.NAMED):
            return None
        calls = [{"type": "object", "properties": {
            "name": {"const": f.name},
            "arguments": f.parameters or {"type": "object", "properties": {},
                                          "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False}
            for f in self.offered]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))

    def system_text(self) -> str:
        tools = "\n".join(json.dumps(dict(name=f.name, description=f.description or "",
                                          parameters=f.parameters or {"type": "object"}))
                          for f in self.offered)
        return TOOLS_PROMPT.format(tools=tools)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI `tool_calls` of a complete reply that calls one of the offered tools, else
        None (the reply is content)."""
        body = text.strip()
        if body.startswith("<tool_call>") and body.endswith("</tool_call>"):
            body = body[len("<tool_call>"):-len("</tool_call>")].strip()
        try:
            call = json.loads(body)
        except ValueError:
            return None
        names = {f.name for f in self.offered}
        if not (isinstance(call, dict) and set(call) == {"name", "arguments"}
                and call["name"] in names and isinstance(call["arguments"], dict)):
            return None
        return [dict(id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                     function=dict(name=call["name"], arguments=json.dumps(call["arguments"])))]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole reply's chat message and finish_reason: a call of a tool ("tool_calls"),
        or content as it is."""
        calls = self.parse(text) if finish_reason == "stop" else None
        if calls:
            return dict(role="assistant", content=None, tool_calls=calls), "tool_calls"
        return dict(role="assistant", content=text), finish_reason

    def may_call(self, text: str) -> bool:
        """Whether a reply starting with `text` may still turn out to be a call (streaming
        holds it back until it is complete)."""
        head = text.lstrip()
        if self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED):
            return True
        if self.choice is ToolChoice.NONE:
            return False
        tag = "<tool_call>"
        return not head or head[0] == "{" or head[:len(tag)] == tag[:len(head)]


GRAMMAR_ERRORS = tuple(f"invalid {k.value}:" for k in GrammarKind) + (
    "structured outputs need",)
"""How the engine's refusals of a grammar begin (after the request id)."""


def request_grammar(body, tools: ToolPlan | None) -> tuple[str, Grammar] | None:
    """The (field, grammar) a request decodes under, or None; ValueError naming the fields
    when it sets more than one constraint or one is malformed."""
    found = _constraints(body)
    forced = None if tools is None else tools.grammar()
    if forced is not None:
        found.append(("tool_choice", forced))
    if len(found) > 1:
        raise ValueError(f"{found[0][0]}: give one constraint at most, got "
                         f"{', '.join(f for f, _ in found)}")
    return found[0] if found else None


def chat_turns(messages: list[protocol.ChatMessage], tools: ToolPlan | None
               ) -> list[dict[str, str]]:
    """The template's turns: tools in the system prompt, tool calls and results as text."""
    turns = []
    for m in messages:
        text = m.text
        if m.tool_calls:
            calls = "\n".join(json.dumps(dict(name=c.function.name,
                                              arguments=_arguments(c.function.arguments)))
                              for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        turns.append(dict(role=m.role, content=text))
    if tools is not None and tools.offered:
        extra = tools.system_text()
        if turns[0]["role"] == "system":
            turns[0] = dict(role="system", content=f"{turns[0]['content']}\n\n{extra}")
        else:
            turns.insert(0, dict(role="system", content=extra))
    return turns


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # rendered as the string the client sent


class ToolCallStream:
    """One streamed choice of a request with tools: content passes through until it may be
    a call; a possible call is held back and, when the choice ends, sent as `tool_calls`
    (one delta, as OpenAI's stream sends a call's name with its first arguments fragment)
    or, if it is no call, as content."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""
        self.passing = False

    def push(self, text: str) -> str:
        """The content to send now for `text`."""
        if self.passing:
            return text
        self.held += text
        if self.plan.may_call(self.held):
            return ""
        self.passing, out, self.held = True, self.held, ""
        return out

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The chat delta for the choice's next `text`, and its finish_reason ("tool_calls"
        when it ends in a call)."""
        text = self.push(text)
        if finish_reason is None:
            return (dict(content=text) if text else {}), None
        held, self.held = self.held, ""
        calls = self.plan.parse(held) if held and finish_reason == "stop" else None
        if calls:
            return dict(tool_calls=[dict(c, index=i) for i, c in enumerate(calls)]), \
                "tool_calls"
        text += held
        return (dict(content=text) if text else {}), finish_reason
