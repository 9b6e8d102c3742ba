"""Batch input lines: one JSON object per line, parsed and checked at the boundary.

A line holds `id`, exactly one prompt source (`prompt` text, `messages` for the chat template,
`prompt_ids`, or `record` with an optional `instruction`: a table row rendered as
"field: value" lines), sampling fields (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`stop_token_ids`, `ignore_eos`) and optionally `score`: continuations (strings or id lists)
to score, or `next_top_k` (the k most likely next tokens), both without decoding. A bad line
raises `BadLine`, which names the id and the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

from kvjax.sampling import SamplingParams

_PROMPT_FIELDS = ("prompt", "messages", "prompt_ids", "record")
_SAMPLING_FIELDS = {"max_tokens": "max_new_tokens", "temperature": "temperature",
                    "top_p": "top_p", "top_k": "top_k", "seed": "seed",
                    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos"}
_OTHER_FIELDS = {"id", "score", "next_top_k", "instruction"}


class BadLine(ValueError):
    """An input line that cannot be served: `request_id` and `field` say which and where."""

    def __init__(self, request_id: str, field: str, message: str):
        super().__init__(f"request {request_id!r}, field {field!r}: {message}")
        self.request_id = request_id
        self.field = field


@dataclasses.dataclass
class BatchRequest:
    """One parsed input line.

    Attributes:
      request_id: the line's `id`.
      prompt_ids: the prompt's token ids ([T]).
      sampling: how to decode (ignored when `continuations` is set).
      continuations: token ids of each continuation to score (prefill-only), or None.
      next_top_k: how many most likely next tokens to return (prefill-only), or None.
      record: the table row the prompt was rendered from (field -> value), or None.
      instruction: the text before a record's fields.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    continuations: list[list[int]] | None = None
    next_top_k: int | None = None
    record: dict[str, str] | None = None
    instruction: str = ""

    @property
    def is_prefill_only(self) -> bool:
        """Scoring or a next-token distribution: one forward pass, no decode."""
        return self.continuations is not None or self.next_top_k is not None


def render_record(instruction: str, record: dict[str, str], fields: Sequence[str]) -> str:
    """The prompt text of a table row: the instruction, then one "field: value" line per field
    in `fields` order (the order decides which rows share a prefix)."""
    return instruction + "".join(f"\n{f}: {record[f]}" for f in fields) + "\n"


def line_id(line: str, line_number: int) -> str:
    """The id a line is reported under: its `id` if it parses, else `line:<n>`."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return f"line:{line_number}"
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and rid else f"line:{line_number}"


def parse_line(line: str, line_number: int, encode: Callable[[str], list[int]],
               chat: Callable[[list], list[int]]) -> BatchRequest:
    """Parses one JSONL line; raises `BadLine` naming the id and field at fault.

    Args:
      encode: text -> token ids (raises ValueError without a tokenizer).
      chat: chat messages -> token ids under the model's template.
    """
    rid = line_id(line, line_number)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadLine(rid, "<json>", f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadLine(rid, "<json>", f"a line must be a JSON object, got {type(obj).__name__}")
    if not isinstance(obj.get("id"), str) or not obj["id"]:
        raise BadLine(rid, "id", f"must be a non-empty string, got {obj.get('id')!r:.80}")
    unknown = set(obj) - set(_PROMPT_FIELDS) - set(_SAMPLING_FIELDS) - _OTHER_FIELDS
    if unknown:
        raise BadLine(rid, sorted(unknown)[0], f"unknown field; known: "
                      f"{sorted({*_PROMPT_FIELDS, *_SAMPLING_FIELDS, *_OTHER_FIELDS})}")
    sources = [f for f in _PROMPT_FIELDS if f in obj]
    if len(sources) != 1:
        raise BadLine(rid, "prompt", f"give exactly one of {_PROMPT_FIELDS}, got {sources}")
    request = _prompt(rid, sources[0], obj, encode, chat)
    request.sampling = _sampling(rid, obj)
    if "score" in obj:
        request.continuations = _continuations(rid, obj["score"], encode)
    if "next_top_k" in obj:
        k = obj["next_top_k"]
        if "score" in obj or not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise BadLine(rid, "next_top_k", f"must be an int >= 1 on a line without `score`, "
                          f"got {k!r:.80}")
        request.next_top_k = k
    return request


def _call(rid: str, field: str, fn, *args):
    """fn(*args), with a ValueError or TypeError re-raised as `BadLine` on `field`."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as e:
        raise BadLine(rid, field, str(e)) from None


def _prompt(rid: str, source: str, obj: dict, encode, chat) -> BatchRequest:
    value = obj[source]
    if source == "prompt_ids":
        return BatchRequest(rid, _ids(rid, source, value), SamplingParams())
    if source == "messages":
        if not isinstance(value, list) or not value:
            raise BadLine(rid, source, "must be a non-empty list of {role, content} objects")
        return BatchRequest(rid, _call(rid, source, chat, value), SamplingParams())
    if source == "prompt":
        if not isinstance(value, str) or not value:
            raise BadLine(rid, source, f"must be non-empty text, got {value!r:.80}")
        return BatchRequest(rid, _call(rid, source, encode, value), SamplingParams())
    instruction = obj.get("instruction", "")
    if not isinstance(value, dict) or not value or not isinstance(instruction, str):
        raise BadLine(rid, source, "must be a non-empty object of field -> value, with a "
                      "text `instruction`")
    record = {str(k): str(v) for k, v in value.items()}
    text = render_record(instruction, record, list(record))
    return BatchRequest(rid, _call(rid, source, encode, text), SamplingParams(),
                        record=record, instruction=instruction)


def _ids(rid: str, field: str, value) -> list[int]:
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise BadLine(rid, field, f"must be a non-empty list of int token ids >= 0, "
                      f"got {value!r:.80}")
    return value


def _sampling(rid: str, obj: dict) -> SamplingParams:
    kwargs = {name: obj[key] for key, name in _SAMPLING_FIELDS.items() if key in obj}
    if "stop_token_ids" in kwargs and isinstance(kwargs["stop_token_ids"], list):
        kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        field = next((k for k, n in _SAMPLING_FIELDS.items() if str(e).startswith(n)), "sampling")
        raise BadLine(rid, field, str(e)) from None


def _continuations(rid: str, value, encode) -> list[list[int]]:
    if not isinstance(value, list) or not value:
        raise BadLine(rid, "score", "must be a non-empty list of continuations (text or ids)")
    return [_call(rid, "score", encode, c) if isinstance(c, str) else _ids(rid, "score", c)
            for c in value]
