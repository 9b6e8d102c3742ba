"""Prefill/decode disaggregation: prompts are prefilled on one engine, decoded on another.

A request's life:

1. The prefill engine runs it with `max_new_tokens=1`: it computes the prompt's KV and samples
   the first token (the request's TTFT is set here). When it finishes there, its full pages stay
   in that engine's prefix cache.
2. Export: right after that step, the sequence's full pages are gathered page-first from the
   prefill engine's KV state into one staging buffer `[L, n, P, K, D]` (every page-major leaf
   of the state, so quantized states travel as codes and scales).
3. Import, on the decode engine: pages it already holds for this prefix (its own prefix cache)
   are kept, the rest are allocated there, the staging buffer's missing pages are moved to the
   decode engine's devices (`jax.device_put`, resharding between meshes if they differ) and
   scattered into them; the pages are committed to its prefix cache under the same provenance
   and pinned until the request finishes (the pin's lookup counts in that engine's
   prefix-cache statistics).
4. The decode engine gets the request with the prompt plus the first token: its admission
   finds the imported pages as a prefix hit, computes only the tokens after the last full
   page (fewer than P, plus the first token), and decodes the rest.

The KV is exact, so greedy tokens equal a colocated engine's. Sampled requests keep their seed,
but the decode engine counts generated tokens from its own prompt, so their random streams are
valid but not identical to a colocated run's.

`replay_disaggregated` serves a trace with each engine on its own simulated clock (see
`kvjax.router.router.replay`); the transfer runs on the decode engine's clock, on the critical
path of the decode steps behind it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import numpy as np

from kvjax.engine import compat, kv_transfer
from kvjax.engine.engine import Engine
from kvjax.engine.request import CompletionOutput, FinishReason, RequestOutput, submit_all
from kvjax.kv import pages as kv_pages
from kvjax.router.router import Arrival, SimClock
from kvjax.sampling import SamplingParams
from kvjax.shapes import powers_of_2_up_to


@dataclasses.dataclass
class _Handoff:
    """A request between its prefill and its decode."""

    first: RequestOutput  # the prefill engine's output: the first token and its time
    prompt: list[int]
    sampling: SamplingParams
    tenant: str | None
    priority: int
    staged: kv_pages.PageBlob | None  # full pages [L, n, ...] per page leaf, n padded, on
    # the prefill engine's devices; None when the prompt has no full page
    num_staged: int  # real pages in `staged`
    ready_time: float  # when the staged pages exist (the prefill engine's clock)


class DisaggregatedEngine:
    """Prefill on one engine instance, decode on another, moving KV pages between them.

    Both engines must serve the same model with the same KV provenance (weights, codec, dtype,
    page size) in the paged layout with prefix caching on; they may sit on different devices
    or meshes.

    Attributes:
      prefill, decode: the two engines.
      stats: transfers, transfer_bytes (KV moved), transfer_time_s (blocking time of the
        moves), transferred_tokens, reused_tokens (pages the decode engine already held),
        recompute_fallbacks (imports that found no free pages: the decode engine recomputed).
    """

    def __init__(self, prefill: Engine, decode: Engine):
        kv_transfer.check_transferable(prefill, "prefill")
        kv_transfer.check_transferable(decode, "decode")
        if prefill.provenance() != decode.provenance():
            raise ValueError("prefill and decode engines produce KV of different provenance "
                             "(model, weights, codec, dtype or page size differ)")
        self.prefill = prefill
        self.decode = decode
        self.page_size = prefill.config.page_size
        self._exporter = kv_transfer.PageExporter(prefill)
        self._importer = kv_transfer.PageImporter(decode)
        self._handoffs: collections.deque[_Handoff] = collections.deque()
        self._requests: dict[str, dict] = {}  # request id -> its prompt, sampling, first output
        self._pinned: dict[str, str] = {}  # request id -> decode allocator's pinning sequence
        self._ids = itertools.count()
        self.stats = dict(transfers=0, transfer_bytes=0, transfer_time_s=0.0,
                          transferred_tokens=0, reused_tokens=0, recompute_fallbacks=0)

    # ----------------------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_ids: Sequence[int],
                    sampling: SamplingParams | None = None, *, tenant: str | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Queues a request on the prefill engine. Invalid requests raise ValueError."""
        sampling = sampling or SamplingParams()
        uses = (compat.Feature.N_SAMPLES,) if sampling.n != 1 else ()
        try:  # Recordings may have started since the pair was made.
            kv_transfer.check_transferable(self.prefill, "prefill", uses)
            kv_transfer.check_transferable(self.decode, "decode", uses)
        except ValueError as e:
            raise ValueError(f"request {request_id!r} (n={sampling.n}): {e}") from None
        if request_id in self._requests:
            raise ValueError(f"duplicate request_id {request_id!r}")
        prompt = self.decode.validate_request(request_id, prompt_ids, sampling)
        self.prefill.add_request(request_id, prompt, dataclasses.replace(sampling,
                                                                         max_new_tokens=1),
                                 tenant=tenant, priority=priority, arrival_time=arrival_time)
        self._requests[request_id] = dict(prompt=prompt, sampling=sampling, tenant=tenant,
                                          priority=priority)

    def has_unfinished(self) -> bool:
        return bool(self.prefill.has_unfinished() or self._handoffs
                    or self.decode.has_unfinished() or self._pinned)

    def decode_has_work(self) -> bool:
        """Whether the decode engine has requests to run or outputs to hand back."""
        return self.decode.has_unfinished() or bool(self._pinned)

    def num_pending_handoffs(self) -> int:
        return len(self._handoffs)

    def next_handoff_time(self) -> float | None:
        """When the earliest prefilled request's pages became ready, or None."""
        return self._handoffs[0].ready_time if self._handoffs else None

    @property
    def num_compiles(self) -> int:
        """Transfer programs compiled so far (this pair's export and import)."""
        return self._exporter.num_compiles + self._importer.num_compiles

    def warmup(self, max_prompt_len: int | None = None, *, engines: bool = True) -> None:
        """Compiles the transfer programs for every padded page count; the KV is unchanged.

        Covers prompts up to `max_prompt_len` tokens (default: the decode engine's context).
        With `engines`, both engines' step shapes are compiled too (`Engine.warmup`).
        """
        if engines:
            self.prefill.warmup()
            self.decode.warmup()
        max_len = self.decode.max_model_len if max_prompt_len is None else max_prompt_len
        max_pages = max(max_len // self.page_size, 1)
        sizes = powers_of_2_up_to(max_pages)  # every size pad_repeat_last gives
        for n, size in enumerate(sizes):
            staged = self._exporter.gather(self.prefill.kv, np.arange(size, dtype=np.int32))
            for part_size in sizes[:n + 1]:
                jax.device_put(self._importer.take(staged, np.arange(part_size, dtype=np.int32)),
                               self._importer.target)
            # Writing pages' own content back leaves the decode KV as it was.
            self._importer.warm(np.arange(size, dtype=np.int32))
        jax.block_until_ready(self.decode.kv)

    # ----------------------------------------------------------------------------- stepping

    def step_prefill(self) -> list[RequestOutput]:
        """One prefill-engine iteration; returns requests whose first token ended them."""
        done = []
        for out in self.prefill.step():
            meta = self._requests[out.request_id]
            sample = out.outputs[0] if out.outputs else None
            sampling = meta["sampling"]
            ends_here = (sample is None or sample.finish_reason is not FinishReason.LENGTH
                         or sampling.max_new_tokens == 1
                         or len(meta["prompt"]) + 1 >= self.decode.max_model_len)
            if ends_here:
                del self._requests[out.request_id]
                done.append(out)
                continue
            meta["first"] = out
            staged, num_staged = self._exporter.export_prefix(meta["prompt"], meta["tenant"])
            self._handoffs.append(_Handoff(
                first=out, prompt=meta["prompt"], sampling=sampling, tenant=meta["tenant"],
                priority=meta["priority"], staged=staged, num_staged=num_staged,
                ready_time=out.first_token_time))
        return done

    def transfer_ready(self, now: float | None = None) -> int:
        """Moves the KV of every handoff ready by `now` (all if None) into the decode engine.

        Returns the bytes moved. Each request is then queued on the decode engine.
        """
        moved = 0
        while self._handoffs and (now is None or self._handoffs[0].ready_time <= now):
            moved += self._import(self._handoffs.popleft())
        return moved

    def _import(self, h: _Handoff) -> int:
        request_id = h.first.request_id
        tokens = h.prompt + h.first.outputs[0].token_ids
        pin = f"{request_id}#import"
        result = self._importer.import_prefix(pin, tokens, h.staged, h.num_staged, h.tenant)
        self._pinned[request_id] = pin
        if result.moved_bytes:
            self.stats["transfers"] += 1
            self.stats["transfer_bytes"] += result.moved_bytes
            self.stats["transfer_time_s"] += result.seconds
        self.stats["transferred_tokens"] += result.transferred_tokens
        self.stats["reused_tokens"] += result.reused_tokens
        self.stats["recompute_fallbacks"] += int(result.is_fallback)
        remaining = dataclasses.replace(h.sampling,
                                        max_new_tokens=h.sampling.max_new_tokens - 1)
        self.decode.add_request(request_id, tokens, remaining, tenant=h.tenant,
                                priority=h.priority, arrival_time=h.first.arrival_time)
        return result.moved_bytes

    def step_decode(self) -> list[RequestOutput]:
        """One decode-engine iteration; returns the requests that finished, whole."""
        done = []
        for out in self.decode.step():
            pin = self._pinned.pop(out.request_id, None)
            if pin is not None:
                self._importer.release(pin)
            done.append(self._merge(out))
        return done

    def _merge(self, out: RequestOutput) -> RequestOutput:
        """The request's output: the prefill engine's first token, then the decode engine's."""
        meta = self._requests.pop(out.request_id)
        first = meta["first"]
        head = first.outputs[0]
        tail = out.outputs[0]
        token_ids = head.token_ids + tail.token_ids
        tokenizer = self.decode.model.tokenizer
        return dataclasses.replace(
            out, prompt_ids=list(meta["prompt"]),
            outputs=[CompletionOutput(
                index=0, token_ids=token_ids, logprobs=head.logprobs + tail.logprobs,
                finish_reason=tail.finish_reason,
                text=tokenizer.decode(token_ids) if tokenizer is not None else None)],
            arrival_time=first.arrival_time, first_token_time=first.first_token_time,
            token_times=first.token_times + out.token_times,
            num_cached_prompt_tokens=first.num_cached_prompt_tokens,
            num_preemptions=first.num_preemptions + out.num_preemptions)

    def step(self) -> list[RequestOutput]:
        """One iteration: a prefill step, the transfers it made ready, a decode step."""
        done = self.step_prefill()
        self.transfer_ready()
        if self.decode_has_work():
            done += self.step_decode()
        return done

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs prompts to completion; invalid ones come back with `error` set."""
        ids, results = submit_all(self.add_request, prompts, sampling,
                                  f"disagg-{next(self._ids)}", self.prefill.clock())
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id] = out
        return [results[r] for r in ids]


def replay_disaggregated(server: DisaggregatedEngine, arrivals: Sequence[Arrival]
                         ) -> list[RequestOutput]:
    """Serves a trace with the prefill and decode engines each on its own simulated clock.

    Both engines must use a `SimClock`. A handoff is ready at the prefill step's end; the
    decode engine imports every ready handoff at the start of its next turn, so the transfer
    time delays the decode steps behind it (the critical path).
    """
    p_clock, d_clock = server.prefill.clock, server.decode.clock
    if not (isinstance(p_clock, SimClock) and isinstance(d_clock, SimClock)):
        raise ValueError("replay_disaggregated needs both engines to use a SimClock")
    pending = collections.deque(sorted(arrivals, key=lambda a: a.arrival_time))
    outputs = []
    while pending or server.has_unfinished():
        t_prefill = p_clock() if server.prefill.has_unfinished() else math.inf
        t_decode = math.inf
        if server.decode_has_work():
            t_decode = d_clock()
        if server.num_pending_handoffs():
            t_decode = min(t_decode, max(d_clock(), server.next_handoff_time()))
        if pending and pending[0].arrival_time <= min(t_prefill, t_decode):
            a = pending.popleft()
            if not server.prefill.has_unfinished():
                p_clock.advance_to(a.arrival_time)
            server.add_request(a.request_id, a.prompt_ids, a.sampling, tenant=a.tenant,
                               arrival_time=a.arrival_time)
        elif t_prefill <= t_decode:
            with p_clock.busy():
                outputs += server.step_prefill()
        else:
            d_clock.advance_to(t_decode)
            with d_clock.busy():
                server.transfer_ready(d_clock())
                outputs += server.step_decode()
    return outputs
