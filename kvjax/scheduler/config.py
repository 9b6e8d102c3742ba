"""The limits and modes the scheduler and its components work under."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvjax.scheduler.preemption import PreemptionMode


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The limits and modes the scheduler works under (from the engine's `EngineConfig`).

    Attributes:
      max_num_seqs, max_num_batched_tokens, max_prefill_chunk, max_prefill_seqs, page_size:
        as in EngineConfig.
      max_model_len: the context limit (page-rounded).
      is_paged: the pool is paged (swapping and page-level admission apply).
      preemption_mode: RECOMPUTE, SWAP or AUTO.
      kv_bytes_per_token: device bytes one cached token takes (KV samples, a controller's prices).
      swap_bandwidth_bytes_per_s: measured or configured device<->host rate (AUTO).
      recompute_tokens_per_s: configured recompute rate (AUTO); None: measured from the steps.
      max_inflight_loads: tier loads in flight at once.
      eos_token_ids: tokens that stop a sequence unless it ignores EOS.
      max_pages_held: pages a sequence of n tokens holds at most (a retention policy bounds it).
      prefill_buckets: the padded prefill-token totals of a step (the runner's buckets).
      prefill_padding_limit: as in EngineConfig (cut chunks to end on a bucket); None: off.
      num_draft_tokens: gamma, the most draft tokens a sequence verifies in one step
        (`kvjax.scheduler.spec`); 0: no speculative decoding.
      adaptive_drafts: a sequence's draft length follows its last verify step
        (`SpecConfig.adaptive`).
      demote_ratios: {bits: a page's bytes over its copy's at bits} for each precision a
        swapped copy may be demoted to (float pages, the plain swap space); empty: none.
      max_tenant_page_share: as in EngineConfig.
      contended_prefill_chunk, contention_window_s: as in EngineConfig (`TenantActivity`).
      hide_shared_hits: as EngineConfig.hide_shared_prefix_hits (a `HitLedger` caps what a
        tenant hits under a shared cache salt).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int
    max_prefill_seqs: int
    page_size: int
    max_model_len: int
    is_paged: bool
    preemption_mode: PreemptionMode
    kv_bytes_per_token: float
    swap_bandwidth_bytes_per_s: float | None = None
    recompute_tokens_per_s: float | None = None
    max_inflight_loads: int = 1
    eos_token_ids: tuple[int, ...] = ()
    prefill_buckets: tuple[int, ...] = ()
    prefill_padding_limit: float | None = None
    num_draft_tokens: int = 0
    adaptive_drafts: bool = False
    demote_ratios: Mapping[int, float] = dataclasses.field(default_factory=dict)
    max_tenant_page_share: float | None = None
    contended_prefill_chunk: int | None = None
    contention_window_s: float = 15.0
    hide_shared_hits: bool = False
