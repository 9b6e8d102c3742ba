"""Building the responses of the OpenAI-compatible endpoints: a whole completion or chat
completion, or its server-sent events, from the generations of one API request.

`ResponseBuilder` turns the `SampleDelta`s of each generation (`kvjax.server.serving`) into
choices: text or a chat message (or tool calls), logprobs objects and usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvjax.server import protocol
from kvjax.server.async_engine import RequestFailed
from kvjax.server.output import SampleDelta
from kvjax.server.structured import ToolCallStream, ToolPlan

logger = logging.getLogger("kvjax.server.serving")  # the endpoints' logger


async def merged(generations: Sequence
                  ) -> AsyncIterator[list[SampleDelta]]:
    """The deltas of several generations, as they come."""
    if len(generations) == 1:
        async for deltas in generations[0].deltas():
            yield deltas
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(generation) -> None:
        try:
            async for deltas in generation.deltas():
                await queue.put(deltas)
            await queue.put(None)
        except BaseException as e:  # Handed to the consumer, which re-raises it.
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(g)) for g in generations]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def wait_for_disconnect(raw: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next ASGI message
    is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class ResponseBuilder:
    """The responses of one served model.

    Attributes:
      config: the `ServerConfig` (the model name responses carry).
      token_text: a token id's text (logprob objects spell tokens with it).
    """

    def __init__(self, config, token_text: Callable[[int], str]):
        self.config = config
        self.token_text = token_text

    def spelling(self, body) -> Callable[[int], str]:
        """How logprob objects spell a token: its text, or "token_id:<id>" when asked."""
        return (lambda t: f"token_id:{t}") if body.return_tokens_as_token_ids else \
            self.token_text

    def logprobs(self, body, chat: bool, deltas: Sequence[SampleDelta]) -> dict | None:
        """The logprobs object of one choice over `deltas` (one sample's, in order)."""
        if not body.wants_logprobs:
            return None
        spell = self.spelling(body)
        ids = [t for d in deltas for t in d.token_ids]
        lps = [lp for d in deltas for lp in d.logprobs]
        tops = [t for d in deltas for t in (d.top_logprobs or [{}] * len(d.token_ids))]
        if chat:
            def entry(token, logprob):
                text = spell(token)
                return dict(token=text, logprob=logprob, bytes=list(text.encode()))

            return dict(content=[dict(entry(t, lp), top_logprobs=[
                entry(k, v) for k, v in top.items()]) for t, lp, top in zip(ids, lps, tops,
                                                                           strict=True)])
        return dict(tokens=[spell(t) for t in ids], token_logprobs=lps,
                    top_logprobs=[None if top is None else {spell(k): v for k, v in top.items()}
                                  for top in tops] if body.num_top_logprobs else None,
                    text_offset=[o for d in deltas for o in d.text_offsets])

    def usage(self, generations: Sequence) -> dict[str, Any]:
        return protocol.usage(sum(g.num_prompt_tokens for g in generations),
                              sum(g.num_completion_tokens for g in generations),
                              sum(g.num_cached_tokens for g in generations))

    async def complete(self, api_id: str, generations: list, chat: bool, body,
                        raw: Request, tools: ToolPlan | None) -> Response:
        per_choice: dict[int, list[SampleDelta]] = {}

        async def collect() -> None:
            async for deltas in merged(generations):
                for d in deltas:
                    per_choice.setdefault(d.index, []).append(d)

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(wait_for_disconnect(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            for generation in generations:
                generation.abort()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # The client is gone; nobody reads this.
        work.result()  # An engine failure surfaces here.
        choices = []
        for index in sorted(per_choice):
            deltas = per_choice[index]
            text = "".join(d.text for d in deltas)
            choice = dict(index=index, logprobs=self.logprobs(body, chat, deltas),
                          finish_reason=deltas[-1].finish_reason)
            if tools is not None:
                choice["message"], choice["finish_reason"] = tools.message(
                    text, choice["finish_reason"])
            elif chat:
                choice["message"] = dict(role="assistant", content=text)
            else:
                choice["text"] = text
                if body.prompt_logprobs is not None:  # vLLM's place: each choice
                    choice["prompt_logprobs"] = generations[index // body.n].prompt_logprobs
            choices.append(choice)
        extra = {}
        if chat and body.prompt_logprobs is not None:  # vLLM's place: the response
            extra["prompt_logprobs"] = generations[0].prompt_logprobs
        return JSONResponse(dict(
            id=api_id, object="chat.completion" if chat else "text_completion",
            created=protocol.now(), model=self.config.model_name, choices=choices,
            usage=self.usage(generations), **extra))

    async def sse(self, api_id: str, generations: list, chat: bool, body,
                   include_usage: bool, tools: ToolPlan | None) -> AsyncIterator[str]:
        created = protocol.now()
        kind = "chat.completion.chunk" if chat else "text_completion"
        held: dict[int, ToolCallStream] = {}

        def event(choices: list[dict], **extra) -> str:
            chunk = dict(id=api_id, object=kind, created=created,
                         model=self.config.model_name, choices=choices, **extra)
            return f"data: {json.dumps(chunk)}\n\n"

        try:
            if chat:
                yield event([dict(index=i, delta=dict(role="assistant", content=""),
                                  logprobs=None, finish_reason=None)
                             for i in range(len(generations) * body.n)])
            async for deltas in merged(generations):
                choices = []
                for d in deltas:
                    choice = dict(index=d.index, logprobs=self.logprobs(body, chat, [d]),
                                  finish_reason=d.finish_reason)
                    if tools is not None:
                        choice["delta"], choice["finish_reason"] = held.setdefault(
                            d.index, ToolCallStream(tools)).delta(d.text, d.finish_reason)
                    elif chat:
                        choice["delta"] = dict(content=d.text) if d.text or d.token_ids else {}
                    else:
                        choice["text"] = d.text
                    choices.append(choice)
                yield event(choices)
            if include_usage:
                yield event([], usage=self.usage(generations))
        except Exception as e:  # Headers are sent: the error goes in the stream.
            logger.exception("stream %s failed", api_id)
            message = str(e) if isinstance(e, RequestFailed) else "internal error"
            yield f"data: {json.dumps(protocol.error_body(message, type='server_error'))}\n\n"
        finally:
            for generation in generations:
                generation.abort()
        yield "data: [DONE]\n\n"
