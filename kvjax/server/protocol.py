"""The OpenAI wire format: request bodies (validated strictly), responses, stream chunks, errors.

Request models forbid unknown fields and coerce nothing (a string is never read as a number,
a bool never as an int), so every malformed body fails validation with the field's path.
Extensions beyond OpenAI's schema follow vLLM's names: `top_k`, `min_p`, `min_tokens`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`,
`include_stop_str_in_output`, `return_tokens_as_token_ids`, and the structured-output fields
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`
(`kvjax.server.structured` turns them, `response_format` and chat's `tools` into a grammar).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from kvjax.validation import name_problem, text_problem

# OpenAI allows up to 20 top logprobs in chat (`top_logprobs`) and 5 in completions
# (`logprobs`); vLLM allows 20 in both, as here.
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


def _first_bad_text(value: Any) -> str | None:
    """Why a string in `value` (a string, or lists and dicts of them) cannot be read as
    text, or None."""
    if isinstance(value, str):
        return text_problem(value)
    if isinstance(value, list | tuple):
        return next(filter(None, map(_first_bad_text, value)), None)
    if isinstance(value, dict):
        return _first_bad_text(list(value.keys()) + list(value.values()))
    return None


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    @pydantic.field_validator("*", mode="after")
    @classmethod
    def _utf8_text(cls, value):
        """Every string field is text: a lone surrogate ("\\ud800", legal JSON) is refused
        here, naming its field, instead of failing in the tokenizer or a cache key."""
        problem = _first_bad_text(value)
        if problem is not None:
            raise ValueError(f"not valid text: {problem}")
        return value


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk carries the usage, with no choices


JsonSchema = dict[str, Any]


class JsonSchemaSpec(_Strict):
    """`response_format.json_schema` (OpenAI's): the schema travels as `schema`."""

    name: str = "response"
    description: str | None = None
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = pydantic.ConfigDict(populate_by_name=True)


class ResponseFormat(_Strict):
    """`response_format`: free text, any JSON object, or JSON valid under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @pydantic.model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is needed with type json_schema, and only then")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: JsonSchema | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # (kvjax's JSON is compact anyway)

    model_config = pydantic.ConfigDict(populate_by_name=True)


class _SamplingFields(_Strict):
    """Fields completions and chat share."""

    model: str | None = None  # None: the served model
    temperature: float | None = Field(None, ge=0.0)  # None: OpenAI's default, 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the request's tenant, where the server lets clients name it
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM's; 1.0: off
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's
    min_tokens: int = Field(0, ge=0)  # vLLM's: EOS and stop tokens masked until then
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: per prompt
    # token its logprob and rank, with the top-N there
    cache_salt: str | None = None  # vLLM's: pages shared by the requests naming this salt
    return_tokens_as_token_ids: bool = False  # logprob tokens spelled "token_id:<id>"
    skip_special_tokens: bool = True  # leave special tokens out of the output text
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | str | None = None  # vLLM's guided decoding fields
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @pydantic.field_validator("user", "cache_salt")
    @classmethod
    def _user_is_a_name(cls, value):
        problem = None if value is None else name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @pydantic.field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt alone
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # top-N per token
    echo: bool = False  # the prompt comes first in each choice (with its logprobs)

    @pydantic.field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One message for any wrong shape, instead of one per member of the union."""
        def is_ids(x):
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(value, str) or is_ids(value) or (isinstance(value, list) and value and (
                all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value))):
            return value
        raise ValueError("must be a string, a list of int token ids, a list of strings or a "
                         "list of lists of int token ids")

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @pydantic.model_validator(mode="after")
    def _check(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is needed (only an assistant turn with tool_calls "
                             "may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: JsonSchema | None = None  # None: no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context length
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a reply makes at most one call

    @pydantic.model_validator(mode="after")
    def _check(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a text prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # (the BOS, for a model that prepends one)
    add_generation_prompt: bool = True  # with messages
    return_token_strs: bool = False

    @pydantic.model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# ----------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts prefix-cache hits."""
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
                prompt_tokens_details=dict(cached_tokens=cached_tokens))


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": dict(message=message, type=type, param=param, code=code)}


def validation_error_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error JSON for pydantic's errors: names the first failing field, its value and
    the problem."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        problem = (first.get("ctx") or {}).get("error", "invalid JSON")
        return error_body(f"the request body is not valid JSON: {problem} (at character "
                          f"{first.get('loc', ('', '?'))[-1]})")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # The top-level field; the full location (union members included) goes in the message.
    param = loc[0] if loc else None
    shown = repr(first.get("input"))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    where = ".".join(loc) if loc else "the request body"
    message = f"{where}: {first.get('msg', 'invalid value')} (got {shown})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more problem(s)"
    return error_body(message, param=param)
