"""Requests, the sequences the scheduler runs for them, and what a request returns."""

from __future__ import annotations

import dataclasses
import enum

from kvjax.grammar import GrammarMatcher
from kvjax.kv.retention_host import Probe
from kvjax.sampling_params import SamplingParams
from kvjax.scheduler.controller import SLO


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token was generated (it is kept in the output).
    LENGTH = "length"  # max_new_tokens or the model's context length was reached.
    ABORT = "abort"  # abort(request_id) was called.
    ERROR = "error"  # the request was invalid; `error` says why.


class WeightUpdatePolicy(enum.Enum):
    """What `Engine.update_weights` does with sequences already in flight."""

    RECOMPUTE = "recompute"  # drop their KV; re-prefill their tokens under the new weights.
    FINISH_OLD = "finish_old"  # complete them under the old weights, kept until they drain.
    ABORT = "abort"  # finish them now with reason ABORT.


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # holds no KV; (re)starts with a prefill.
    RUNNING = "running"  # holds KV pages on the device.
    SWAPPED = "swapped"  # its KV pages sit in host memory.
    FINISHED = "finished"


@dataclasses.dataclass
class Probing:
    """A sequence's probe rows between its prefill and its first decode row
    (`RetentionPolicy.probes`: KVzip's context reconstruction), one row per probe, in order.

    Attributes:
      probes: the probes, in the order they run.
      epoch: the sequence's `kv_epoch` they run in (a preemption starts them over).
      next: the probe that runs next.
      in_flight: rows dispatched and not committed yet.
    """

    probes: list[Probe]
    epoch: int
    next: int = 0
    in_flight: int = 0

    @property
    def is_dispatched(self) -> bool:
        return self.next == len(self.probes)

    def restart(self, epoch: int) -> None:
        """The sequence's KV moved or went (preemption): every probe runs again."""
        self.epoch, self.next, self.in_flight = epoch, 0, 0


@dataclasses.dataclass
class Sequence:
    """One token stream: a request, or one of its `n` samples.

    `tokens` is prompt + generated tokens; the first `num_computed` of them have their K/V in the
    cache (or in a step already dispatched: the scheduler counts a row's tokens when it schedules
    them). With asynchronous scheduling, a token sampled by a step still in flight is not in
    `tokens` yet: `num_unresolved` counts it (0 or 1), and `inflight_index` is its row in that
    step. `kv_epoch` changes whenever the sequence loses or moves its KV (preemption, restart),
    so a step's results apply their KV bookkeeping only to the epoch that scheduled them.
    With speculative decoding, `draft_tokens` are proposals after `tokens` that no verify step
    has checked yet (never output, never in the prefix cache; dropped with the KV).
    A prefill-only sequence (the shared prompt of an n > 1 group) holds the prompt minus its last
    token and forks into the samples once computed. A chunk fill (`kvjax.scheduler.context`)
    is prefill-only too: it computes a reusable chunk alone so its pages enter the chunk cache,
    and ends without output. `chunk_spans` are the [start, end) prompt positions whose KV a
    request copies from the chunk cache under strategy `context_reuse`.
    `grammar` is the matcher of a request with a grammar (`SamplingParams.grammar`), advanced
    with each committed output token; its rows sample under its mask.
    """

    seq_id: str
    request_id: str
    tokens: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    arrival_time: float
    order: int
    tenant: str | None = None
    priority: int = 0
    sample_index: int = 0
    is_group_prefill: bool = False
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_cached_prompt_tokens: int = 0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    first_scheduled_time: float | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    weights_version: str = ""  # the weights its KV is (to be) computed with
    token_versions: list[str] = dataclasses.field(default_factory=list)  # per output token
    num_unresolved: int = 0
    inflight_index: int = -1
    kv_epoch: int = 0
    draft_tokens: list[int] = dataclasses.field(default_factory=list)  # unverified proposals
    draft_len: int = 0  # adaptive speculation: drafts to propose next (0: gamma)
    chunk_spans: list = dataclasses.field(default_factory=list)  # [(start, end), ...]
    context_reuse: str = "full"
    is_chunk_fill: bool = False
    slo: SLO = SLO()
    kl_spent: float = 0.0  # estimated KL of the degradations a controller applied
    demoted_bits: int = 0  # its KV went through a host copy of this many bits (0: exact)
    inplace_bits: int = 0  # its pages were re-encoded in place at this many bits (0: never)
    grammar: GrammarMatcher | None = None
    paid_chain: tuple[bytes, list[bytes]] = (b"", [])  # (cache key, hashes) a tenant paid for
    probing: Probing | None = None  # probe rows to run before it decodes

    @property
    def is_prefill_only(self) -> bool:
        """It computes KV and emits no token (an n > 1 group's prompt, a chunk fill)."""
        return self.is_group_prefill or self.is_chunk_fill

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, the one still in flight included."""
        return len(self.tokens) + self.num_unresolved

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still has to be computed."""
        return self.num_tokens - self.num_computed

    @property
    def awaits_step_in_flight(self) -> bool:
        """Its next move comes from a dispatched step's results (a sampled token, or the end
        of a shared prompt's prefill), not from new pages."""
        return (self.num_unresolved > 0 or self.num_pending == 0
                or (self.probing is not None and self.probing.in_flight > 0))


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    text: str | None = None
    weights_versions: list[str] = dataclasses.field(default_factory=list)  # per token


@dataclasses.dataclass
class RequestOutput:
    """What a request returns (streamed while running, final once `finished`).

    Attributes:
      outputs: one CompletionOutput per sample (n of them).
      arrival_time, first_token_time, finish_time: clock readings (seconds).
      token_times: when each token of sample 0 was produced.
      num_cached_prompt_tokens: prompt tokens served from the prefix cache.
      error: why an invalid request failed (finish_reason ERROR), else None.
    """

    request_id: str
    prompt_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    tenant: str | None = None
    error: str | None = None
    kl_spent: float = 0.0  # estimated KL a KV controller's degradations cost it (worst sample)
