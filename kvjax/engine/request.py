"""Requests as the engine takes them: the request types (kvjax.scheduler.request) and batch
submission."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from kvjax.sampling import SamplingParams
from kvjax.scheduler.request import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SeqStatus,
    Sequence,
    WeightUpdatePolicy,
)

__all__ = ["CompletionOutput", "FinishReason", "RequestOutput", "SeqStatus", "Sequence",
           "WeightUpdatePolicy", "submit_all"]


def submit_all(add_request: Callable[[str, Seq[int], SamplingParams], object],
               prompts: Seq[Seq[int]], sampling: SamplingParams | Seq[SamplingParams] | None,
               id_prefix: str, now: float) -> tuple[list[str], dict[str, RequestOutput]]:
    """Adds each prompt as request `{id_prefix}-{i}`; an invalid one fails alone.

    `sampling` is one SamplingParams for all prompts (None: the defaults) or one per prompt.
    Returns the request ids in prompt order and, for the prompts `add_request` refused with a
    ValueError, their finished outputs with `error` set (arrival time `now`).
    """
    if sampling is None or isinstance(sampling, SamplingParams):
        sampling = [sampling or SamplingParams()] * len(prompts)
    ids, failed = [], {}
    for i, (prompt, params) in enumerate(zip(prompts, sampling, strict=True)):
        request_id = f"{id_prefix}-{i}"
        ids.append(request_id)
        try:
            add_request(request_id, prompt, params)
        except ValueError as e:
            failed[request_id] = RequestOutput(
                request_id=request_id, outputs=[], finished=True,
                prompt_ids=list(prompt) if isinstance(prompt, Seq) else [],
                arrival_time=now, error=str(e))
    return ids, failed
