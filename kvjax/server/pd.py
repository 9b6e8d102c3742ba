"""Prefill/decode disaggregation between server processes: the two operator endpoints.

    POST /pd/prefill/completions, /pd/prefill/chat/completions   (on a prefill replica)
      body: a /v1 completions or chat body (one prompt, n=1, no cache_salt)
      -> the prompt is run for one token; the answer is a KV frame (below): the first token,
         the prompt's full KV pages (every page leaf, so quantized states travel as codes and
         scales) and the provenance fingerprint they were computed under.
    POST /pd/decode                                             (on a decode replica)
      body: such a frame
      -> the pages are imported into this replica's prefix cache (provenance checked: a
         mismatch is a 400 naming both fingerprints), pinned, and the request in the frame is
         served as a normal completions or chat request (streamed or not); its admission
         finds the imported pages as a prefix hit, so it computes only the tokens after the
         prompt's last full page. The answer is exactly a colocated server's: the decode
         replica samples the first token itself from the exact KV (under greedy decoding it
         is the prefill's first token; seeded sampling draws the colocated server's stream).

The routes live outside /v1 (a router calls them, not clients) and need an API key wherever
/v1 does; the request's tenant (its key's, and the one it names where allowed) must be the
same on both replicas, since it is part of the provenance. A router
(`kvjax.router.http`) calls the first on a prefill replica and forwards its bytes to the second
on a decode replica.

A KV frame (version 1), little-endian:

    b"KVPD" | uint32 version | uint32 header length h | h bytes of JSON header | arrays

The header holds `endpoint` ("completions" or "chat"), `request` (the client's JSON body),
`prompt_ids`, `first_token`, `provenance` (hex), `page_size`, `num_pages`, `kv_bytes` and
`arrays`: per page leaf its `dtype` (a numpy name), `shape` (`[L, num_pages, ...]`) and
`offset` (bytes after the header); each array is C-ordered, little-endian.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pydantic
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvjax.engine import kv_transfer
from kvjax.engine.engine import Engine
from kvjax.server import protocol
from kvjax.server.async_engine import AsyncEngine
from kvjax.server.serving import ApiError, OpenAIServing

FRAME_MAGIC = b"KVPD"
FRAME_VERSION = 1
_PREFIX = struct.Struct("<4sII")
CONTENT_TYPE = "application/x-kvjax-kv-frame"
IMPORTED_TOKENS_HEADER = "x-kvjax-imported-tokens"  # prompt tokens whose pages came in


def encode_frame(header: dict[str, Any], arrays: Sequence[np.ndarray]) -> bytes:
    """A KV frame of `header` (JSON-able) and `arrays` (see the module docstring)."""
    specs, offset = [], 0
    for a in arrays:
        specs.append(dict(dtype=a.dtype.name, shape=list(a.shape), offset=offset))
        offset += a.nbytes
    text = json.dumps(dict(header, version=FRAME_VERSION, arrays=specs)).encode()
    parts = [_PREFIX.pack(FRAME_MAGIC, FRAME_VERSION, len(text)), text]
    parts += [np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes() for a in arrays]
    return b"".join(parts)


def decode_header(frame: bytes) -> dict[str, Any]:
    """A KV frame's JSON header; ValueError when the bytes are not a version-1 frame."""
    if len(frame) < _PREFIX.size:
        raise ValueError(f"a KV frame needs at least {_PREFIX.size} bytes, got {len(frame)}")
    magic, version, size = _PREFIX.unpack_from(frame)
    if magic != FRAME_MAGIC:
        raise ValueError(f"not a KV frame (magic {magic!r})")
    if version != FRAME_VERSION:
        raise ValueError(f"KV frame version {version} is not supported (this server reads "
                         f"version {FRAME_VERSION})")
    try:
        header = json.loads(frame[_PREFIX.size:_PREFIX.size + size])
    except ValueError:
        raise ValueError("the KV frame's header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("the KV frame's header is not a JSON object")
    return header


def decode_frame(frame: bytes) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A KV frame's header and arrays (views of `frame`); ValueError when malformed."""
    header = decode_header(frame)
    start = _PREFIX.size + _PREFIX.unpack_from(frame)[2]
    arrays = []
    try:
        for spec in header["arrays"]:
            dtype = np.dtype(spec["dtype"]).newbyteorder("<")
            shape = tuple(int(d) for d in spec["shape"])
            count = int(np.prod(shape))
            begin = start + int(spec["offset"])
            if begin + count * dtype.itemsize > len(frame):
                raise ValueError(f"KV frame array of shape {list(shape)} runs past its end")
            arrays.append(np.frombuffer(frame, dtype, count, begin).reshape(shape))
    except (KeyError, TypeError) as e:
        raise ValueError(f"the KV frame's header lacks a field or has a wrong one: {e!r}"
                         ) from None
    return header, arrays


class PDEndpoints:
    """The prefill and decode endpoints over one AsyncEngine (see the module docstring).

    Attributes:
      engine: the AsyncEngine; engine state is touched only through its `call`.
      importers: per served route, the PageImporter (made on the engine thread at first use).
      exporters: per served route, the PageExporter (made on the engine thread at first use).

    A route's first prefill (first import) compiles the transfer programs for every padded
    page count on the engine thread, so later requests compile nothing.
    """

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.importers: dict[str | None, kv_transfer.PageImporter] = {}
        self.exporters: dict[str | None, kv_transfer.PageExporter] = {}

    def _model_engine(self, serving: OpenAIServing) -> Engine:
        return self.engine.engine.models()[serving.route]

    async def prefill(self, serving: OpenAIServing, body, raw: Request, *, chat: bool
                      ) -> Response:
        """Runs the prompt for one token and answers with its KV frame."""
        engine = self._model_engine(serving)
        try:
            kv_transfer.check_transferable(engine, "prefill")
        except ValueError as e:
            raise ApiError(400, f"this replica cannot prefill for another: {e}") from None
        request, out = await serving.prefill_only(body, raw, chat=chat)

        def export() -> tuple[list[np.ndarray], bytes]:
            exporter = self.exporters.get(serving.route)
            if exporter is None:
                exporter = self.exporters[serving.route] = kv_transfer.PageExporter(engine)
                exporter.warmup()
            staged, num = exporter.export_prefix(request.prompt_ids, request.tenant)
            arrays = [] if staged is None else [np.asarray(a[:, :num]) for a in staged]
            return arrays, engine.provenance(request.tenant)

        arrays, provenance = await self.engine.call(export, asyncio.get_running_loop())
        header = dict(
            endpoint="chat" if chat else "completions", request=json.loads(await raw.body()),
            prompt_ids=request.prompt_ids, first_token=out.outputs[0].token_ids[0],
            provenance=provenance.hex(), page_size=engine.config.page_size,
            num_pages=arrays[0].shape[1] if arrays else 0,
            kv_bytes=sum(a.nbytes for a in arrays))
        return Response(encode_frame(header, arrays), media_type=CONTENT_TYPE)

    async def decode(self, servings_for, raw: Request) -> Response:
        """Imports a frame's pages, then serves its request; `servings_for(model)` picks the
        OpenAIServing of the model the request names."""
        try:
            header, arrays = decode_frame(await raw.body())
            chat = {"chat": True, "completions": False}[header.get("endpoint")]
            model = (protocol.ChatCompletionRequest if chat else protocol.CompletionRequest)
            body = model.model_validate(header["request"])
            prompt_ids = [int(t) for t in header["prompt_ids"]]
            num_pages = int(header["num_pages"])
        except (ValueError, KeyError, TypeError, pydantic.ValidationError) as e:
            raise ApiError(400, f"KV frame: {e}", param="body") from None
        serving = servings_for(body.model)
        tenant = serving.tenant_of(body, raw)
        engine = self._model_engine(serving)
        pin = f"{raw.headers.get('x-request-id') or protocol.new_id('pd')}#import"

        def do_import() -> kv_transfer.ImportResult:
            own, theirs = engine.provenance(tenant).hex(), header.get("provenance")
            if theirs != own:
                raise ValueError(
                    f"KV provenance mismatch: the pages were computed under {theirs!r}, "
                    f"this replica's KV for the request's tenant is {own!r} (model, weights "
                    f"version, tokenizer, codec, dtype, page size or tenant differ)")
            importer = self.importers.get(serving.route)
            if importer is None:
                importer = self.importers[serving.route] = kv_transfer.PageImporter(engine)
                importer.warmup()
            importer.check_blob(arrays, num_pages)
            if num_pages * engine.config.page_size > len(prompt_ids):
                raise ValueError(f"{num_pages} pages hold more than the prompt's "
                                 f"{len(prompt_ids)} tokens")
            return importer.import_prefix(pin, prompt_ids, arrays, num_pages, tenant)

        loop = asyncio.get_running_loop()
        try:
            result = await self.engine.call(do_import, loop)
        except ValueError as e:
            raise ApiError(400, f"KV frame of request {pin.removesuffix('#import')!r}: {e}",
                           param="body") from None

        def release() -> None:
            importer = self.importers[serving.route]
            self.engine.call(lambda: importer.release(pin), loop)

        try:
            response = await (serving.chat(body, raw) if chat else
                              serving.completions(body, raw))
        except BaseException:
            release()
            raise
        response.headers[IMPORTED_TOKENS_HEADER] = str(result.transferred_tokens)
        if not isinstance(response, StreamingResponse):
            release()  # the request has finished: its answer is whole
            return response
        inner = response.body_iterator

        async def then_release():
            # The generator's end runs on a finished stream and on a client gone alike.
            try:
                async for chunk in inner:
                    yield chunk
            finally:
                release()

        response.body_iterator = then_release()
        return response
