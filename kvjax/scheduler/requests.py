"""The scheduler's request table: sequences by id, their queues, and the outputs they become."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.request import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SeqStatus,
    Sequence,
)
from kvjax.trace import NULL_TRACER, Tracer


class RequestTable:
    """Sequences of every unfinished request, the three queues, and finished outputs.

    The waiting / running / swapped bookkeeping of the `Scheduler`: every move of a sequence
    between queues that is not a scheduling decision (registration, finishing, pausing, a
    restart, the fork of a shared prompt into its samples) happens here.

    Attributes:
      kv_cache: the KVCacheManager whose pages a finished or restarted sequence frees.
      waiting, running, swapped: the queues; `paused` holds a paused request's sequences.
      tracer: where request lifecycle events go (`set_tracer`).
    """

    def __init__(self, config: SchedulerConfig, kv_cache, *, clock: Callable[[], float],
                 tokenizer=None, default_version: Callable[[], str]):
        self.config = config
        self.kv_cache = kv_cache
        self.tokenizer = tokenizer
        self._clock = clock
        self._default_version = default_version  # the version a new sequence runs under
        self._seqs: dict[str, Sequence] = {}
        self._requests: dict[str, list[str]] = {}  # request id -> its sequence ids
        self._request_meta: dict[str, dict] = {}
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.paused: dict[str, list[Sequence]] = {}  # request id -> its sequences out of queues
        self._finished_outputs: list[RequestOutput] = []
        self._order = itertools.count()
        self.tracer: Tracer = NULL_TRACER  # request lifecycle events (set_tracer)

    def set_tracer(self, tracer: Tracer) -> None:
        """Reports request lifecycle events to `tracer` (and KV events, via the KV cache)."""
        self.tracer = tracer
        self.kv_cache.set_tracer(tracer)

    # ----------------------------------------------------------------------------- views

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        """Whether a step has work: paused requests are unfinished but not counted."""
        return bool(self.waiting or self.running or self.swapped)

    def sequence(self, seq_id: str) -> Sequence:
        """The record of a live sequence (`{request_id}#{sample}`); KeyError if unknown."""
        return self._seqs[seq_id]

    def sequences(self, request_id: str | None = None) -> list[Sequence]:
        """Live sequences, of one request or of all."""
        if request_id is None:
            return list(self._seqs.values())
        return [self._seqs[s] for s in self._requests.get(request_id, [])]

    def force_last_token(self, seq_id: str, token: int) -> None:
        """Replaces a sequence's last sampled token, which no step has computed yet."""
        seq = self._seqs[seq_id]
        if seq.num_computed >= len(seq.tokens) or len(seq.tokens) <= seq.num_prompt_tokens:
            raise ValueError(f"sequence {seq_id!r} has no sampled token waiting to be computed")
        seq.tokens[-1] = token

    def request_ids(self, *, internal: bool = False) -> list[str]:
        """Unfinished requests, in submission order (with `internal`, chunk fills too)."""
        return [r for r in self._requests
                if internal or not self._request_meta[r].get("internal")]

    def request_meta(self, request_id: str) -> dict:
        """A request's prompt, arrival, tenant, n and (once finished) finish time."""
        return self._request_meta[request_id]

    def next_order(self) -> int:
        return next(self._order)

    def take_finished(self) -> list[RequestOutput]:
        """Outputs of requests that finished since the last call."""
        finished, self._finished_outputs = self._finished_outputs, []
        return finished

    # ----------------------------------------------------------------------------- records

    def add_request(self, request_id: str, prompt: list[int], seqs: list[Sequence], *,
                    arrival: float, tenant: str | None, n: int, internal: bool = False,
                    cache_salt: str | None = None) -> None:
        """Registers a request and queues its sequences as waiting (`internal`: a chunk fill,
        which emits no output; `cache_salt`: the shared prefix-cache salt it names)."""
        self._requests[request_id] = []
        self._request_meta[request_id] = dict(prompt=prompt, arrival=arrival, tenant=tenant,
                                              n=n, samples={}, internal=internal,
                                              cache_salt=cache_salt)
        for seq in seqs:
            self.register(seq)
        self.tracer.emit("arrive", "request", f"request/{request_id}", tenant=str(tenant),
                         prompt_tokens=len(prompt), num_seqs=len(seqs), internal=internal)

    def restore_request(self, request_id: str, seq_ids: list[str], meta: dict) -> None:
        """Registers a request record as saved (snapshots); its sequences come with `restore`."""
        self._requests[request_id] = list(seq_ids)
        self._request_meta[request_id] = dict(meta, samples={})

    def restore_sequence(self, seq: Sequence, *, has_kv: bool) -> None:
        """Registers a saved sequence: running when its KV was placed in the pool, waiting
        (recomputed) otherwise, or finished."""
        self._seqs[seq.seq_id] = seq
        self._order = itertools.count(max(next(self._order), seq.order + 1))
        if has_kv:
            self.running.append(seq)
        elif seq.status is not SeqStatus.FINISHED:
            seq.status = SeqStatus.WAITING
            seq.num_computed = 0
            self.waiting.append(seq)

    def find(self, seq_id: str) -> Sequence | None:
        """The record of a live sequence, None if unknown."""
        return self._seqs.get(seq_id)

    def cache_salt(self, seq: Sequence) -> str | None:
        """The shared prefix-cache salt the sequence's request names, if any."""
        meta = self._request_meta.get(seq.request_id)
        return None if meta is None else meta.get("cache_salt")

    def register(self, seq: Sequence) -> None:
        """Queues a new sequence of a registered request as waiting."""
        seq.weights_version = seq.weights_version or self._default_version()
        self._seqs[seq.seq_id] = seq
        self._requests[seq.request_id].append(seq.seq_id)
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Stops a request; its pages are freed and it finishes with reason ABORT."""
        if request_id not in self._requests:
            raise ValueError(f"unknown request_id {request_id!r}")
        for seq_id in list(self._requests[request_id]):
            seq = self._seqs[seq_id]
            if seq.status is not SeqStatus.FINISHED:
                self.finish(seq, FinishReason.ABORT)
        self.paused.pop(request_id, None)
        self.maybe_emit(request_id)
        for fill in [r for r, m in self._request_meta.items() if m.get("internal")]:
            if not any(w in self._requests for w in self._request_meta[fill]["waiters"]):
                self.abort(fill)  # No request waits for this chunk any more.

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if self.kv_cache.has_sequence(seq.seq_id):
            self.kv_cache.free(seq.seq_id)
        self.kv_cache.drop_swapped(seq.seq_id)
        self.kv_cache.retention.forget(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._request_meta[seq.request_id]["finish_time"] = self._clock()
        self.tracer.emit("finish", "request", f"request/{seq.request_id}", seq_id=seq.seq_id,
                         reason=reason.value, num_tokens=len(seq.tokens))

    def maybe_emit(self, request_id: str) -> None:
        """Emits a request's output and drops its records once all its sequences finished."""
        seq_ids = self._requests.get(request_id, [])
        seqs = [self._seqs[s] for s in seq_ids]
        meta = self._request_meta[request_id]
        if len(seqs) < meta["n"] or any(s.status is not SeqStatus.FINISHED for s in seqs):
            return
        if not meta.get("internal"):  # A chunk fill ends without output.
            self._finished_outputs.append(self.output(request_id, finished=True))
        for s in seq_ids:
            del self._seqs[s]
        del self._requests[request_id]
        del self._request_meta[request_id]

    def check_stop(self, seq: Sequence) -> None:
        """Finishes the sequence if its last token stops it (EOS, a stop token, its grammar's
        end) or it reached a length limit."""
        p = seq.sampling
        token = seq.tokens[-1]
        eos = () if p.ignore_eos else self.config.eos_token_ids
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if (token in eos or token in p.stop_token_ids
                or (seq.grammar is not None and seq.grammar.is_finished)):
            self.finish(seq, FinishReason.STOP)
        elif (len(seq.output_ids) >= p.max_new_tokens
              or len(seq.tokens) >= self.config.max_model_len):
            self.finish(seq, FinishReason.LENGTH)

    def restart(self, seq: Sequence) -> None:
        """Drops a sequence's KV (device pages or host copy); it re-prefills its tokens later."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
        if self.kv_cache.has_sequence(seq.seq_id):
            self.kv_cache.free(seq.seq_id)
        self.kv_cache.drop_swapped(seq.seq_id)
        seq.num_computed = 0
        seq.kv_epoch += 1
        seq.draft_tokens = []
        if seq.status is not SeqStatus.WAITING:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def fork_group(self, parent: Sequence) -> None:
        """Replaces a shared prompt's prefill by the request's `n` samples, which share its
        pages (or, where the pool cannot share them, prefill afresh)."""
        meta = self._request_meta[parent.request_id]
        prompt = meta["prompt"]
        self.running.remove(parent)
        parent.status = SeqStatus.FINISHED
        self._requests[parent.request_id].remove(parent.seq_id)
        for i in range(meta["n"]):
            child = Sequence(
                seq_id=f"{parent.request_id}#{i}", request_id=parent.request_id,
                tokens=list(prompt), num_prompt_tokens=len(prompt), sampling=parent.sampling,
                seed=parent.seed + i, arrival_time=parent.arrival_time, order=parent.order,
                tenant=parent.tenant, priority=parent.priority, sample_index=i,
                num_cached_prompt_tokens=parent.num_cached_prompt_tokens,
                first_scheduled_time=parent.first_scheduled_time,
                weights_version=parent.weights_version, chunk_spans=parent.chunk_spans,
                context_reuse=parent.context_reuse,
                grammar=None if parent.grammar is None else parent.grammar.fork())
            if not self.kv_cache.fork(parent.seq_id, child.seq_id):
                self.register(child)  # No room to share (contiguous slots): prefill afresh.
                continue
            child.num_computed = parent.num_computed
            child.status = SeqStatus.RUNNING
            self._seqs[child.seq_id] = child
            self._requests[child.request_id].append(child.seq_id)
            self.running.append(child)
        self.kv_cache.free(parent.seq_id)
        del self._seqs[parent.seq_id]

    # ----------------------------------------------------------------------------- pausing

    def pause(self, request_id: str, *, to_host: bool = False) -> None:
        """Takes a request out of scheduling until `resume`: no step computes or preempts it.

        Its running sequences keep their device pages, or with `to_host` swap them to host
        memory (the preemption swap path; paged layout); waiting and swapped ones keep their
        state. Call between steps (the engine drains first).
        """
        if not self.has_request(request_id) or request_id in self.paused:
            raise ValueError(f"request {request_id!r} is not an unfinished, unpaused request")
        if to_host and not self.config.is_paged:
            raise ValueError(f"request {request_id!r}: pausing to host memory needs the paged "
                             f"layout (the swap space holds pages)")
        seqs = [s for s in self.sequences(request_id) if s.status is not SeqStatus.FINISHED]
        for seq in seqs:
            for queue in (self.running, self.waiting, self.swapped):
                if seq in queue:
                    queue.remove(seq)
            if to_host and seq.status is SeqStatus.RUNNING and seq.num_computed > 0:
                seq.kv_epoch += 1
                seq.draft_tokens = []
                self.kv_cache.swap_out(seq.seq_id, seq.num_computed)
                seq.status = SeqStatus.SWAPPED
        self.paused[request_id] = seqs

    def resume(self, request_id: str) -> None:
        """Puts a paused request back in its queues: device-resident sequences run on, swapped
        ones swap in when pages allow."""
        if request_id not in self.paused:
            raise ValueError(f"request {request_id!r} is not paused")
        queues = {SeqStatus.RUNNING: self.running, SeqStatus.WAITING: self.waiting,
                  SeqStatus.SWAPPED: self.swapped}
        for seq in self.paused.pop(request_id):
            queues[seq.status].append(seq)

    # ----------------------------------------------------------------------------- outputs

    def output(self, request_id: str, *, finished: bool, with_text: bool = True
               ) -> RequestOutput:
        meta = self._request_meta[request_id]
        seqs = sorted((self._seqs[s] for s in self._requests[request_id]),
                      key=lambda s: s.sample_index)
        tokenizer = self.tokenizer if with_text else None
        outputs = [CompletionOutput(
            index=s.sample_index, token_ids=list(s.output_ids), logprobs=list(s.logprobs),
            finish_reason=s.finish_reason,
            text=tokenizer.decode(s.output_ids) if tokenizer is not None else None,
            weights_versions=list(s.token_versions))
            for s in seqs if not s.is_group_prefill]
        first = seqs[0]
        times = first.token_times if not first.is_group_prefill else []
        return RequestOutput(
            request_id=request_id, prompt_ids=list(meta["prompt"]), outputs=outputs,
            finished=finished, arrival_time=meta["arrival"],
            first_token_time=times[0] if times else None,
            finish_time=meta.get("finish_time") if finished else None, token_times=list(times),
            num_cached_prompt_tokens=first.num_cached_prompt_tokens,
            num_preemptions=sum(s.num_preemptions for s in seqs), tenant=meta["tenant"],
            kl_spent=max(s.kl_spent for s in seqs))

    def snapshot_outputs(self, *, with_text: bool = True) -> list[RequestOutput]:
        """Current (streaming) outputs of every unfinished request (`text` None unless
        `with_text`)."""
        return [self.output(r, finished=False, with_text=with_text) for r in self._requests]
