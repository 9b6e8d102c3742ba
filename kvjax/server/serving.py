"""The OpenAI endpoints' logic: a validated body in, engine requests out, a response back.

`OpenAIServing` turns a completion or chat body into one `EngineRequest` per prompt
(n samples each), submits them to the `AsyncEngine`, and answers with one JSON body or a
server-sent event stream in OpenAI's chunk format. Every refusal is an `ApiError` carrying
OpenAI's error JSON: 400 for a bad value (naming the field), 404 for an unknown model, 429
with Retry-After beyond the waiting-queue bound, 503 while draining. A client that
disconnects has its requests aborted at once, which frees their KV pages.

The responses themselves (JSON bodies, streamed chunks, logprobs, usage) are built by
`ResponseBuilder` (kvjax.server.responses).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvjax.engine import compat
from kvjax.engine.request import RequestOutput
from kvjax.sampling import SamplingParams
from kvjax.scheduler.controller import SLO
from kvjax.server import protocol
from kvjax.server.async_engine import (
    AsyncEngine,
    EngineRequest,
    NotAdmitting,
    QueueFull,
    RequestFailed,
    RequestStream,
)
from kvjax.server.kv_state import AffinityBook, affinity_key
from kvjax.server.metrics import ServerMetrics
from kvjax.server.output import (
    SampleDecoder,
    SampleDelta,
    echo_delta,
    prompt_logprobs_entries,
    token_strings,
)
from kvjax.server.responses import ResponseBuilder
from kvjax.server.structured import (
    GRAMMAR_ERRORS,
    ToolPlan,
    chat_turns,
    request_grammar,
)
from kvjax.validation import name_problem

TENANT_HEADER = "x-tenant"
PRIORITY_HEADER = "x-priority"
# A client-chosen response id (a router retrying a request on another replica keeps it).
REQUEST_ID_HEADER = "x-request-id"
# A request's SLO for the engine's KV controller (kvjax.scheduler.controller.SLO): seconds to
# first token, seconds per output token, and the KL (nats per token) it accepts to lose.
logger = logging.getLogger(__name__)

SLO_HEADERS = {"ttft_s": "x-slo-ttft-s", "tpot_s": "x-slo-tpot-s", "kl_budget": "x-kl-budget"}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the server admits and answers requests.

    Attributes:
      model_name: the id clients send as `model` (and /v1/models lists).
      max_waiting: most sequences (n per request) accepted without an output token yet;
        beyond it, 429.
      max_waiting_tokens: most prompt tokens of those requests; beyond it, 429 (an empty
        queue takes any one request).
      retry_after_s: the Retry-After header of a 429.
      drain_timeout_s: on SIGTERM, how long in-flight requests may take to finish.
      api_keys: API key -> the tenant its requests run as (None: the default tenant). When
        set, /v1/* and /tokenize, /detokenize need `Authorization: Bearer <key>` (else 401).
      allow_client_tenant: whether a client may name its tenant (X-Tenant header, else the
        body's `user`); None: only without api_keys. With a key, a named tenant is nested in
        the key's ("key-tenant/named"), so no client reaches another key's prefix cache.
      logprobs_after_temperature: report the logprobs (each token's and the top ones) of a
        sampled request (temperature > 0) after its temperature, the distribution it was
        drawn from before penalties and filters; False: the model's own (what trainers read).
      affinity_secret: the key of /kv_state's affinity digests, shared with the routers in
        front (`kvjax.server.kv_state`); None: a random key of this process.
    """

    model_name: str
    max_waiting: int = 128
    max_waiting_tokens: int = 1 << 16
    retry_after_s: int = 1
    drain_timeout_s: float = 30.0
    api_keys: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    allow_client_tenant: bool | None = None
    logprobs_after_temperature: bool = False
    affinity_secret: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        for key, tenant in self.api_keys.items():
            problem = name_problem(key) or (None if tenant is None else name_problem(tenant))
            if problem is not None:
                raise ValueError(f"api_keys: a key or its tenant {problem}")

    @property
    def honours_client_tenant(self) -> bool:
        return not self.api_keys if self.allow_client_tenant is None else \
            self.allow_client_tenant

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of the request's API key (None: the default tenant); ApiError 401 when
        keys are configured and the header does not carry one of them."""
        if not self.api_keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer":
            for key, tenant in self.api_keys.items():
                # Every key is compared in constant time: no timing tells a near miss.
                if hmac.compare_digest(token.strip().encode(), key.encode()):
                    return tenant
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>",
                       type="invalid_request_error", code="invalid_api_key")


class ApiError(Exception):
    """A refusal with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.body = protocol.error_body(message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def _engine_error_param(message: str, n: int, grammar_field: str | None) -> str | None:
    """Which request field an engine refusal is about (its message names the value)."""
    if grammar_field is not None and any(e in message for e in GRAMMAR_ERRORS):
        return grammar_field
    if "KV pages" in message:
        return "n" if n > 1 else "max_tokens"
    if "logit_bias" in message:
        return "logit_bias"
    if "token id" in message or "prompt" in message:
        return "prompt"
    return None


def model_list(name: str, root: str, max_model_len: int) -> dict[str, Any]:
    """/v1/models: OpenAI's model object with vLLM's fields (`root`, `parent`,
    `max_model_len`, `permission`), which vLLM's clients read."""
    created = protocol.now()
    permission = dict(
        id=protocol.new_id("modelperm"), object="model_permission", created=created,
        allow_create_engine=False, allow_sampling=True, allow_logprobs=True,
        allow_search_indices=False, allow_view=True, allow_fine_tuning=False,
        organization="*", group=None, is_blocking=False)
    return dict(object="list", data=[dict(
        id=name, object="model", created=created, owned_by="kvjax", root=root, parent=None,
        max_model_len=max_model_len, permission=[permission])])


def _constraint(body, tools: ToolPlan | None):
    """(field, grammar) of the request's constraint, (None, None) without one; ApiError 400
    naming the field when it is malformed."""
    try:
        return request_grammar(body, tools) or (None, None)
    except ValueError as e:
        field = str(e).split(":", 1)[0]
        raise ApiError(400, str(e), param=field) from None


class _Generation:
    """One engine request of an API request: its stream and one decoder per sample."""

    def __init__(self, engine: AsyncEngine, request: EngineRequest,
                 stream: RequestStream | None, decoders: list[SampleDecoder], choice_offset: int,
                 echo: SampleDelta | None = None):
        self.engine = engine
        self.request = request
        self.stream = stream  # None: nothing to generate (an echo of 0 tokens)
        self.decoders = decoders
        self.choice_offset = choice_offset
        self.echo = echo
        self.prompt_logprobs: list[dict | None] | None = None  # vLLM's, when asked for
        self.last: RequestOutput | None = None
        self.is_finished = stream is None

    async def deltas(self) -> AsyncIterator[list[SampleDelta]]:
        """The samples' deltas, one list per engine update, until every sample is done; an
        echoed prompt first."""
        if self.echo is not None:
            finish = "length" if self.stream is None else None
            yield [dataclasses.replace(self.echo, index=self.choice_offset + j,
                                       finish_reason=finish) for j in range(len(self.decoders))]
        while not self.is_finished:
            update = await self.stream.next()
            out = update.output
            self.last = out
            # Detokenizing (and stop-string search) runs off the event loop.
            deltas = await asyncio.to_thread(self._decode, update)
            for d in deltas:
                d.index += self.choice_offset
            if out.finished:
                self.is_finished = True
            elif len(out.outputs) == len(self.decoders) and all(
                    d.is_done for d in self.decoders):
                self.abort()  # Every sample met a stop string; the engine need not go on.
            if deltas:
                yield deltas

    def _decode(self, update) -> list[SampleDelta]:
        out, top = update.output, update.top_logprobs
        return [d for d in (
            self.decoders[s.index].update(s, None if top is None else top[s.index],
                                          out.finished)
            for s in out.outputs) if d is not None]

    def abort(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            self.engine.abort(self.request.request_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(d.token_ids) for d in self.decoders if d is not None)

    @property
    def num_cached_tokens(self) -> int:
        return self.last.num_cached_prompt_tokens if self.last is not None else 0


def request_id_of(raw: Request) -> str | None:
    """The X-Request-Id header (the response's id and the engine requests' prefix)."""
    request_id = raw.headers.get(REQUEST_ID_HEADER)
    if request_id is None:
        return None
    problem = name_problem(request_id)
    if problem is not None:
        raise ApiError(400, f"header X-Request-Id {problem}", param="X-Request-Id")
    return request_id

def slo_of(raw: Request) -> SLO | None:
    """The request's SLO from its X-SLO-TTFT-S / X-SLO-TPOT-S / X-KL-Budget headers; None
    without them (the engine's default SLO)."""
    given = {k: raw.headers.get(h) for k, h in SLO_HEADERS.items()
             if raw.headers.get(h) is not None}
    if not given:
        return None
    try:
        return SLO(**{k: float(v) for k, v in given.items()})
    except ValueError as e:
        raise ApiError(400, f"SLO headers {sorted(SLO_HEADERS[k] for k in given)}: {e}",
                       param=SLO_HEADERS[next(iter(given))]) from None


class OpenAIServing:
    """The endpoints over one `AsyncEngine`.

    Attributes:
      engine: the AsyncEngine requests go to.
      tokenizer: the model's tokenizer (text prompts, chat template, output text).
      max_model_len: the engine's context length (prompt + output).
      vocab_size: token ids must be below it.
      config: the ServerConfig.
      metrics: the ServerMetrics refusals are counted in.
      root: what the served name stands for (the model's own name), /v1/models' `root`.
    """

    def __init__(self, engine: AsyncEngine, *, tokenizer, max_model_len: int, vocab_size: int,
                 config: ServerConfig, metrics: ServerMetrics, route: str | None = None,
                 root: str | None = None):
        self.engine = engine
        self.route = route
        self.root = root or config.model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.config = config
        self.metrics = metrics
        self.affinities = AffinityBook()
        self._token_text = token_strings(tokenizer)
        self.responses = ResponseBuilder(config, self._token_text)

    # ----------------------------------------------------------------------------- endpoints

    async def completions(self, body: protocol.CompletionRequest, raw: Request) -> Response:
        self._check_model(body.model)
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: 0 tokens are only allowed with echo=true",
                           param="max_tokens")
        prompts = [await self._encode_text(p, "prompt") if isinstance(p, str) else list(p)
                   for p in body.prompts]
        texts = [p if isinstance(p, str) else None for p in body.prompts]
        return await self._serve(body, raw, prompts, max_tokens=body.max_tokens, chat=False,
                                 prompt_field="prompt", echo_texts=texts if body.echo else None)

    async def chat(self, body: protocol.ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(body.model)
        try:
            tools = ToolPlan.of(body)
        except ValueError as e:
            raise ApiError(400, str(e), param=str(e).split(":", 1)[0]) from None
        ids = await self._encode_chat(body.messages, body.add_generation_prompt, tools)
        return await self._serve(body, raw, [ids], max_tokens=body.max_new_tokens, chat=True,
                                 prompt_field="messages", tools=tools)

    async def tokenize(self, body: protocol.TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the ids the completions (prompt) or chat (messages) endpoint
        would run. kvjax's tokenizers add no special tokens to a text, so
        `add_special_tokens` changes nothing here, as in vLLM for such tokenizers."""
        self._check_model(body.model)
        if body.messages is not None:
            ids = await self._encode_chat(body.messages, body.add_generation_prompt)
        else:
            ids = await self._encode_text(body.prompt, "prompt")
        out = dict(count=len(ids), max_model_len=self.max_model_len, tokens=ids)
        if body.return_token_strs:
            out["token_strs"] = [self._token_text(t) for t in ids]
        return out

    async def detokenize(self, body: protocol.DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize: the text of token ids (special tokens kept)."""
        self._check_model(body.model)
        self._check_in_vocab(body.tokens, "tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, body.tokens,
                                       skip_special_tokens=False)
        return dict(prompt=text)

    def models(self) -> dict[str, Any]:
        """/v1/models (`model_list`)."""
        return model_list(self.config.model_name, self.root, self.max_model_len)

    # ----------------------------------------------------------------------------- requests

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.config.model_name}`", param="model", code="model_not_found")

    def _check_in_vocab(self, ids: Sequence[int], field: str) -> None:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"{field}: token id {bad[0]} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param=field)

    def _check_prompt_chars(self, num_chars: int, field: str) -> None:
        """Refuses, before tokenizing, a text too long to fit the context whatever its
        tokens: no token spans more than `max_token_chars` characters (4x slack for
        normalization), so such a text has more tokens than the context holds."""
        limit = 4 * (self.tokenizer.max_token_chars + 1) * self.max_model_len
        if num_chars > limit:
            raise ApiError(400, f"{field}: {num_chars} characters cannot fit this model's "
                           f"context length of {self.max_model_len} tokens", param=field)

    async def _encode_chat(self, messages: list[protocol.ChatMessage],
                           add_generation_prompt: bool, tools: ToolPlan | None = None
                           ) -> list[int]:
        """Token ids of chat messages (and offered tools) through the model's template, off
        the event loop."""
        if self.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions",
                           param="messages")
        turns = chat_turns(messages, tools)
        self._check_prompt_chars(sum(len(m["content"]) for m in turns), "messages")
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, turns,
                                           add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise ApiError(400, f"messages: the chat template refused them: {e}",
                           param="messages") from None
        return await self._encode_text(text, "messages")

    async def _encode_text(self, text: str, field: str) -> list[int]:
        """Token ids of `text`, tokenized off the event loop; a text the tokenizer cannot
        read is the client's error."""
        self._check_prompt_chars(len(text), field)
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        except Exception as e:  # The tokenizer's own refusal (TypeError, ValueError, ...).
            raise ApiError(400, f"{field}: the tokenizer cannot read it ({type(e).__name__})",
                           param=field) from None

    def _check_prompt(self, ids: list[int], max_tokens: int | None, field: str) -> int:
        """Checks one prompt against the vocabulary and context; returns its max_new_tokens."""
        if not ids:
            raise ApiError(400, f"{field}: the prompt is empty", param=field)
        self._check_in_vocab(ids, field)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ApiError(400, f"{field}: the prompt has {len(ids)} tokens; this model's "
                           f"context length is {self.max_model_len} and at least one token "
                           f"must be generated", param=field)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ApiError(400, f"max_tokens: {max_tokens} tokens after a prompt of {len(ids)} "
                           f"exceed this model's context length of {self.max_model_len}",
                           param="max_tokens")
        return max_tokens

    def _tenant(self, body, raw: Request) -> str | None:
        """The request's tenant: its API key's, and within it the one the client names
        where the server allows that."""
        key_tenant = self.config.authenticate(raw.headers.get("authorization"))
        named = raw.headers.get(TENANT_HEADER) or body.user or None
        if named is None or not self.config.honours_client_tenant:
            return key_tenant
        problem = name_problem(named)
        if problem is not None:  # (`user` was checked with the body)
            raise ApiError(400, f"header X-Tenant {named!r:.80} {problem}", param="X-Tenant")
        return named if key_tenant is None else f"{key_tenant}/{named}"

    def _identity(self, body, raw: Request) -> tuple[str | None, int]:
        tenant = self._tenant(body, raw)
        # What a router needs to find this tenant's pages here (GET /kv_state's prefix_roots).
        salt = getattr(body, "cache_salt", None)
        self.affinities.record(affinity_key(raw.headers.get("authorization"),
                                            raw.headers.get(TENANT_HEADER) or body.user or None,
                                            salt, secret=self.config.affinity_secret),
                               tenant, salt)
        priority = raw.headers.get(PRIORITY_HEADER)
        if priority is None:
            return tenant, 0
        try:
            value = int(priority)
        except ValueError:
            value = None
        if value is None or not -2**31 <= value < 2**31:
            raise ApiError(400, f"header X-Priority must be an int32, got {priority!r}",
                           param="X-Priority")
        return tenant, value

    def _sampling(self, body, max_new_tokens: int, grammar) -> SamplingParams:
        self._check_in_vocab(body.stop_token_ids or (), "stop_token_ids")
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=max(body.top_k or 0, 0), top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos, n=body.n,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0,
                logit_bias=body.logit_bias or (), min_p=body.min_p or 0.0,
                min_tokens=body.min_tokens, grammar=grammar)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]  # SamplingParams names its field first.
            field = {"max_new_tokens": "max_tokens"}.get(field, field)
            raise ApiError(400, f"{field}: {e}", param=field) from None

    async def _serve(self, body, raw: Request, prompts: list[list[int]], *,
                     max_tokens: int | None, chat: bool, prompt_field: str,
                     echo_texts: list[str | None] | None = None,
                     tools: ToolPlan | None = None) -> Response:
        """Runs one engine request per prompt. With `echo_texts` (completions' echo), each
        choice starts with its prompt (the client's text, or the ids decoded), scored when
        logprobs are asked for; max_tokens=0 then only echoes. With `tools`, replies that
        call one come back as `tool_calls`."""
        if body.n > self.config.max_waiting:
            raise ApiError(400, f"n: {body.n} samples can never be admitted: the server queues "
                           f"at most {self.config.max_waiting} sequences", param="n")
        field, grammar = _constraint(body, tools)
        tenant, priority = self._identity(body, raw)
        slo = slo_of(raw)
        api_id = request_id_of(raw) or protocol.new_id("chatcmpl" if chat else "cmpl")
        arrival = self.engine.clock()
        requests = []
        temperature = 1.0 if body.temperature is None else body.temperature
        after_temperature = (self.config.logprobs_after_temperature and body.wants_logprobs
                             and temperature > 0)
        for i, ids in enumerate(prompts):
            max_new = self._check_prompt(ids, max_tokens, prompt_field)
            requests.append(EngineRequest(
                request_id=f"{api_id}-{i}", prompt_ids=ids,
                sampling=self._sampling(body, max_new, grammar) if max_new else None,
                tenant=tenant, priority=priority, num_top_logprobs=body.num_top_logprobs,
                arrival_time=arrival, model=self.route, slo=slo,
                logprobs_temperature=temperature if after_temperature else None,
                cache_salt=body.cache_salt))
        if body.prompt_logprobs is not None and body.stream:
            raise ApiError(400, "prompt_logprobs: not available with stream=true",
                           param="prompt_logprobs")
        echoes = None if echo_texts is None else await self._echoes(requests, echo_texts, body)
        prompt_lps = None
        if body.prompt_logprobs is not None:
            spell = self.responses.spelling(body)
            prompt_lps = [prompt_logprobs_entries(
                r.prompt_ids, await self._score(r, body.prompt_logprobs), spell)
                for r in requests]
        generations = await self._submit(requests, body, echoes, field)
        for i, generation in enumerate(generations if prompt_lps else ()):
            generation.prompt_logprobs = prompt_lps[i]
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self.responses.sse(api_id, generations, chat, body, include_usage, tools),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.responses.complete(api_id, generations, chat, body, raw, tools)

    async def _echoes(self, requests: list[EngineRequest], texts: list[str | None], body
                      ) -> list[SampleDelta]:
        """Each request's echoed prompt, scored (on the engine thread) when logprobs are
        asked for."""
        echoes = []
        for request, text in zip(requests, texts, strict=True):
            scored = (await self._score(request, body.num_top_logprobs)
                      if body.wants_logprobs else None)
            echoes.append(await asyncio.to_thread(
                echo_delta, self.tokenizer, 0, request.prompt_ids, text, scored))
        return echoes

    async def _score(self, request: EngineRequest, num_top: int
                     ) -> list[tuple[float, dict[int, float], int] | None]:
        """The request's prompt scored on the engine thread (`AsyncEngine.score_prompt`)."""
        try:
            return await self.engine.score_prompt(
                request.request_id, request.prompt_ids, num_top, asyncio.get_running_loop(),
                model=self.route)
        except NotAdmitting as e:
            raise ApiError(503, str(e), type="server_error",
                           code="service_unavailable") from None
        except ValueError as e:
            raise ApiError(400, f"prompt: {e}", param="prompt") from None
        except RequestFailed as e:
            raise ApiError(500, str(e), type="server_error") from None

    def tenant_of(self, body, raw: Request) -> str | None:
        """The tenant a request runs as (its API key's, and the one it names if allowed)."""
        return self._tenant(body, raw)

    async def prefill_only(self, body, raw: Request, *, chat: bool
                           ) -> tuple[EngineRequest, RequestOutput]:
        """Runs a request's prompt for one token (the prefill of prefill/decode
        disaggregation, `kvjax.server.pd`): its engine request and final output.

        The body is checked as its endpoint would check it; it must ask for one prompt and
        n=1, and name no cache_salt (its pages travel under the tenant's provenance).
        """
        self._check_model(body.model)
        if body.n != 1:
            reason = compat.refusal(compat.Feature.DISAGGREGATION, compat.Feature.N_SAMPLES)
            raise ApiError(400, f"n={body.n} and prefill/decode disaggregation do not compose: "
                           f"{reason}", param="n")
        for field, refused in (("cache_salt", body.cache_salt is not None),
                               ("prompt", not chat and len(body.prompts) != 1)):
            if refused:
                raise ApiError(400, f"{field}: prefill/decode disaggregation serves one "
                               f"prompt, n=1 and no cache_salt", param=field)
        tools = None
        if chat:
            try:
                tools = ToolPlan.of(body)
            except ValueError as e:
                raise ApiError(400, str(e), param=str(e).split(":", 1)[0]) from None
            ids = await self._encode_chat(body.messages, body.add_generation_prompt, tools)
            max_tokens, field = body.max_new_tokens, "messages"
        else:
            prompt = body.prompts[0]
            ids = await self._encode_text(prompt, "prompt") if isinstance(prompt, str) else \
                list(prompt)
            max_tokens, field = body.max_tokens, "prompt"
        max_new = self._check_prompt(ids, max_tokens, field)
        _, grammar = _constraint(body, tools)
        sampling = dataclasses.replace(self._sampling(body, max_new, grammar),
                                       max_new_tokens=1, min_tokens=0, grammar=None)
        tenant, priority = self._identity(body, raw)
        api_id = request_id_of(raw) or protocol.new_id("prefill")
        request = EngineRequest(request_id=f"{api_id}-prefill", prompt_ids=ids,
                                sampling=sampling, tenant=tenant, priority=priority,
                                arrival_time=self.engine.clock(), model=self.route)
        [stream] = self._enqueue([request])
        try:
            await stream.accepted
        except ValueError as e:
            raise ApiError(400, str(e), param=field) from None
        except RequestFailed as e:
            raise ApiError(500, str(e), type="server_error") from None
        while not (update := await stream.next()).output.finished:
            pass
        return request, update.output

    def _enqueue(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Submits requests to the engine; a full queue is a 429, a draining server a 503."""
        try:
            return self.engine.submit(requests, asyncio.get_running_loop())
        except QueueFull as e:
            self.metrics.reject("queue_full")
            raise ApiError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except NotAdmitting as e:
            self.metrics.reject("not_admitting")
            raise ApiError(503, str(e), type="server_error", code="service_unavailable") from None

    async def _submit(self, requests: list[EngineRequest], body,
                      echoes: list[SampleDelta] | None = None,
                      grammar_field: str | None = None) -> list[_Generation]:
        if echoes is not None and requests[0].sampling is None:  # max_tokens=0: echo only
            return [_Generation(self.engine, r, None, [None] * body.n, i * body.n, echo)
                    for i, (r, echo) in enumerate(zip(requests, echoes, strict=True))]
        streams = self._enqueue(requests)
        generations = []
        for i, (request, stream) in enumerate(zip(requests, streams, strict=True)):
            echo = None if echoes is None else echoes[i]
            decoders = [SampleDecoder(self.tokenizer, j, stop=body.stop_strings,
                                      stop_token_ids=request.sampling.stop_token_ids,
                                      text_offset=0 if echo is None else len(echo.text),
                                      skip_special_tokens=body.skip_special_tokens,
                                      include_stop_str=body.include_stop_str_in_output)
                        for j in range(body.n)]
            generations.append(_Generation(self.engine, request, stream, decoders, i * body.n,
                                           echo))
        refusal = None
        for generation in generations:
            try:
                await generation.stream.accepted
            except (ValueError, RequestFailed) as e:
                generation.is_finished = True
                refusal = refusal or e
        if refusal is not None:
            for generation in generations:
                generation.abort()
            if isinstance(refusal, RequestFailed):
                raise ApiError(500, str(refusal), type="server_error")
            param = _engine_error_param(str(refusal), body.n, grammar_field)
            message = f"{param}: {refusal}" if param == grammar_field else str(refusal)
            raise ApiError(400, message, param=param)
        return generations
