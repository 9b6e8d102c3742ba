"""Checks at the API boundary for the strings and numbers that name and order a request.

A request id and a tenant become dictionary keys, log lines, metric labels and (the tenant)
bytes of the prefix-cache key, so they must be text that encodes to UTF-8 (a lone surrogate,
legal in JSON and in Python strings, does not) and holds no control characters. Every check
raises `ValueError` naming the request and the value, before anything is queued.
"""

from __future__ import annotations

import math
import unicodedata

import numpy as np

MAX_NAME_CHARS = 256  # request ids and tenants
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def text_problem(text: str) -> str | None:
    """Why `text` cannot go through UTF-8 (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate {text[e.start]!r} at character {e.start}"
    return None


def name_problem(value: object, *, max_chars: int = MAX_NAME_CHARS) -> str | None:
    """Why `value` is not a usable name (a request id, a tenant), or None."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > max_chars:
        return f"has {len(value)} characters (at most {max_chars})"
    problem = text_problem(value)
    if problem is not None:
        return problem
    control = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        return f"holds the control character {control!r}"
    return None


def _shown(value: object) -> str:
    """A value for an error message: repr is safe for any string, surrogates included."""
    return f"{value!r:.80}"


def check_request_id(request_id: object) -> str:
    problem = name_problem(request_id)
    if problem is not None:
        raise ValueError(f"request_id {_shown(request_id)} {problem}")
    return request_id


def check_identity(request_id: object, *, tenant: object = None, priority: object = 0,
                   arrival_time: object = None, cache_salt: object = None) -> None:
    """Checks who sent a request and how it is ordered; raises ValueError naming the value."""
    check_request_id(request_id)
    for field, name in (("tenant", tenant), ("cache_salt", cache_salt)):
        problem = None if name is None else name_problem(name)
        if problem is not None:
            raise ValueError(f"request {request_id!r}: {field} {_shown(name)} {problem}")
    if (isinstance(priority, bool | np.bool_) or not isinstance(priority, int | np.integer)
            or not INT32_MIN <= priority <= INT32_MAX):
        raise ValueError(f"request {request_id!r}: priority must be an int32, got "
                         f"{_shown(priority)}")
    if arrival_time is not None and (
            isinstance(arrival_time, bool | np.bool_)
            or not isinstance(arrival_time, int | float | np.integer | np.floating)
            or not math.isfinite(arrival_time)):
        raise ValueError(f"request {request_id!r}: arrival_time must be a finite number of "
                         f"seconds, got {_shown(arrival_time)}")
