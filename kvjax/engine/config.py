"""Engine configuration."""

from __future__ import annotations

import dataclasses

from kvjax.config import KVLayout
from kvjax.engine import compat
from kvjax.engine.step import AttentionImpl, MatmulImpl
from kvjax.kv import quantized
from kvjax.kv.layer_retention import check_schedule
from kvjax.kv.retention import make_retention
from kvjax.memory.precision import MIXED_CODEC
from kvjax.memory.prefix_cache import PrefixEviction
from kvjax.memory.tiers import TierConfig
from kvjax.scheduler.context import make_strategy
from kvjax.scheduler.controller import SLO, FixedController, make_controller
from kvjax.scheduler.host_split import make_host_split
from kvjax.scheduler.preemption import PreemptionMode
from kvjax.scheduler.spec import SpecConfig

__all__ = ["EngineConfig", "PreemptionMode", "SpecConfig"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an `Engine` lays out and schedules KV.

    Attributes:
      kv_layout: PAGED (on-demand pages) or CONTIGUOUS (max_model_len reserved per sequence).
      page_size: P, tokens per page (also the attention granularity of the contiguous layout).
      kv_budget_bytes: device bytes for KV (all layers, K and V); sizes the page pool. None:
        enough for max_num_seqs full-length sequences.
      num_pages: explicit pool size; overrides kv_budget_bytes.
      kv_dtype: storage dtype of K/V ('float32', 'bfloat16'); None: the model's dtype.
      kv_codec: a quantized KV codec name from kvjax.kv.codecs ('none', 'int8', 'int4', ...);
        the pool holds codes and scales, so a smaller codec yields more pages per byte budget.
        'mixed' is a mixed-precision pool (DiffKV, `kvjax.kv.mixed`): rows at exact / int8 /
        int4, keys and values apart, cold pages re-encoded in place by a controller.
      kv_codec_options: keyword options of the codec (e.g. {'group': 32}; for 'lowrank',
        whose pages hold keys as coordinates in a calibrated rank-r basis, {'rank': 32,
        'quantize': 'int8', 'calibration': 'embedded' or 'manual'}: `kvjax.kv.lowrank`;
        'mixed': `kvjax.memory.precision.MixedOptions`, e.g. {'write_bits': (0, 0),
        'coarsest_k_bits': 8} for K8V4).
      max_num_seqs: most sequences running at once (decode rows per step).
      max_num_batched_tokens: per-step token budget (decode tokens + prefill chunk tokens).
      max_prefill_chunk: longest prefill chunk of one sequence in one step.
      max_prefill_seqs: most sequences prefilling in one step.
      max_model_len: context length limit (prompt + generated); None: the model's.
      enable_prefix_cache: share full prompt pages across requests (paged layout only).
      prefix_cache_eviction: which unreferenced cached page goes first ("lru", or
        "fair_share": that of the tenant holding the most cached pages, so a tenant flooding
        the cache with distinct prefixes evicts its own pages first).
      max_tenant_page_share: a tenant whose running sequences hold this fraction of the pool
        admits no more while another tenant's requests wait (None: no limit).
      contended_prefill_chunk: while another tenant is active (it has an unfinished request,
        or had one within `contention_window_s`), a tenant served more tokens than it
        recently runs prefill chunks of at most this many tokens, so the other's arrivals
        wait for a short step instead of a long one (a step is not preemptible); alone, a
        tenant keeps `max_prefill_chunk`. At most max_prefill_chunk; a chunk bucket
        (min_chunk_bucket) pads least. None: off.
      contention_window_s: how long a tenant stays active after its last unfinished request,
        and the time constant over which served tokens are forgotten
        (`kvjax.scheduler.tenants.TenantActivity`).
      hide_shared_prefix_hits: requests naming a `cache_salt` share prefix-cache pages across
        tenants; with this on, a tenant hits such a page only once it has computed the page's
        tokens itself (`kvjax.memory.prefix_cache.HitLedger`), so a hit's speed never tells
        it what another tenant sent. The price: each tenant's first request with a prefix runs
        as a miss.
      scheduler_policy: a name registered in kvjax.scheduler.policies.
      preemption_mode: RECOMPUTE, SWAP or AUTO (swap when moving the sequence's KV out and back
        is estimated cheaper than recomputing it; each decision lands in
        stats['preemption_decisions']).
      tiers: host and disk tiers below the device pool (kvjax.memory.tiers.TierConfig: budgets,
        disk directory, transfer layout, fault injection); off by default. With tiers on,
        evicted prefix-cache pages spill to host (then disk) and are loaded back on a later hit,
        and swaps go through the tiers' checked transfers.
      watermark: fraction of pages kept free when admitting new requests.
      scrub_freed_pages: zero pages when they return to the free list.
      attention_impl: AUTO, REFERENCE, PALLAS or NATIVE (kvjax.engine.step.AttentionImpl).
      matmul_impl: AUTO, XLA or NATIVE: the decoder's matmuls (kvjax.engine.step.MatmulImpl;
        AUTO reads each layer's weights in place with the native CPU kernel in decode-sized
        steps on one CPU device; float32 or bfloat16 weights).
      batch_invariant: every sequence's logits and logprobs bitwise the same whatever the
        batch, chunking, prefix-cache hits, preemption and mix of prefill and decode rows,
        and the same as `kvjax.models.invariant.forward_invariant` (the RL trainer's forward):
        fixed-order native matmuls at every step size, attention one query at a time
        (kvjax.models.invariant). CPU backend, float32 parameters, float32 pages; overrides
        attention_impl and matmul_impl.
      fused_kv_write: each layer's K/V projection writes its rows into the pages itself (one
        kernel: matmul, the keys' per-head norm of qk_norm models, RoPE on K, rows stored
        into the donated pool; `kvjax.kv.fused_write`) instead of K and V materialized, then
        scattered. Where the attention is the Pallas kernels (attention_impl PALLAS, or AUTO
        on GPU/TPU) the Pallas kernel writes in every step, any float pages. Else the native
        CPU kernel, in the steps whose matmuls are native (matmul_impl NATIVE; AUTO up to
        `kvjax.models.linear.NATIVE_MAX_TOKENS` tokens per dtype, where larger float32 steps
        keep XLA's faster matmuls and the scatter; every step with batch_invariant): exact
        float32 pages of a float32 model on the CPU backend; not with matmul_impl XLA.
      min_chunk_bucket: the smallest padded prefill-token total of a step (shape bucketing).
      chunk_bucket_factor: padded prefill-token totals are min_chunk_bucket times powers of
        this (and the largest chunk): smaller factors pad less and compile more step shapes.
      prefill_padding_limit: when padding a step's prefill tokens up to the next bucket would
        exceed this fraction of it, the scheduler cuts the last prefill chunk so the step ends
        on a smaller bucket (where one lies inside that chunk) and computes the rest in the
        next step (fewer padded tokens, more steps to a first token); None: never cut.
      trace: record KV-semantic trace events (`kvjax.trace`; engine.export_trace writes
        them as Perfetto JSON). Off: components hold NULL_TRACER and record nothing.
      debug_provenance: before every step, check that each page a row reads was written under
        the row's weights version; a mismatch raises (the stale-KV detector).
      retention: a retention policy registered in kvjax.kv.retention ('none', 'streaming',
        'h2o', 'snapkv', 'quest', and the presses 'tova', 'knorm', 'expected_attention',
        'observed_attention'): which tokens each sequence keeps, which pages it reads.
      retention_budget: tokens per sequence the policy keeps (quest: reads per decode query);
        None for 'none'.
      retention_options: keyword options of the policy (e.g. {'num_sinks': 4}).
      retention_schedule: how the budget is shared over layers: 'uniform' (every layer keeps
        the same tokens) or 'pyramid' (PyramidKV: lower layers keep more, upper ones fewer, the
        same tokens in all; each run of layers with equal budgets gets a block table of its own
        and gives back the pages past its budget; `kvjax.kv.layer_retention`; presses that
        compress the prompt once: snapkv, knorm, expected_attention, observed_attention), or
        'adakv' (AdaKV: every layer keeps K * B (kv head, token) pairs split over its heads by
        the press's scores, in head-major pages with a block table per (layer, kv head) that
        give back each head's pages past its share; `kvjax.kv.head_retention`; the same presses),
        or 'pyramid_adakv' (both: each layer's pyramid budget split over its heads as AdaKV
        splits it, in the same head-major pages), or 'per_head' (kvpress's granularity: every
        layer and kv head keeps B tokens by its own scores, in the same head-major pages), or
        'global' (KVzip's default: the model's L * K * B (layer, kv head, token) pairs of
        largest score ranked together, so the scores also set each layer's share; the same
        head-major pages).
      retention_head_floor: under 'adakv', 'pyramid_adakv' and 'global', the fraction of its
        even share every kv head keeps before the pairs of largest score take the rest
        (AdaKV's safeguard; None: 0.2, AdaKV's default; 0: the scores alone, as kvpress's
        KVzip ranks them); refused with the other schedules.
      async_scheduling: schedule and dispatch step t+1 while the device runs step t (sampled
        tokens feed the next step on the device; the host reads them one step later). Greedy
        outputs are identical either way. Steps that return logits, engines whose
        retention policy evicts from each step's key scores, and speculative engines (the
        tokens a verify step keeps decide the next step's positions) run synchronously.
      spec: speculative decoding (kvjax.scheduler.spec.SpecConfig: draft method 'none',
        'ngram' or 'sparse_self', gamma, the drafter's options such as the sparse draft's
        sinks and window); lossless, off by default.
      context_reuse: how requests that mark reusable prompt segments (`kvjax.Segment`) reuse
        cached chunks (`kvjax.scheduler.context`): 'full' (recompute: the exact default),
        'none', 'ape', 'epic' or 'cacheblend'; a request may name another.
      context_reuse_options: keyword options of that strategy (ape: temperature; epic:
        num_tokens; cacheblend: ratio).
      kv_arena: store pages as frames of a word arena (`kvjax.kv.arena`), the layout
        models of a `kvjax.engine.multi.MultiModelEngine` share one budget through; alone, the
        engine's arena holds its own pages (of page_size tokens each).
      controller: a KV controller registered in kvjax.scheduler.controller ('fixed', the
        configured behaviour; 'admission', 'preemption', 'tiers', 'retention', 'codec' or
        'joint'), consulted every step under the requests' SLOs.
      controller_options: keyword options of the controller (e.g. its measured KL tables).
      slo: the SLO of a request that names none (`kvjax.scheduler.controller.SLO`: TTFT and
        TPOT targets, KL budget); by default no targets and exact KV only.
      host_split: how many pages of each decode row live in a host pool, where its decode
        attention reads them (`kvjax.scheduler.host_split`: 'never', 'when_full', 'always',
        'random', 'neo'; `kvjax.engine.host_rows`); exact.
      host_split_options: keyword options of that policy (each: host_tokens_per_s and
        device_step_s, the rates a KV controller prices host rows with; neo splits by them
        and device_tokens_per_s; random: seed).
      num_host_pages: pages in the host pool (the engine holds one when host_split is not
        'never' and this is > 0).
    """

    kv_layout: KVLayout = KVLayout.PAGED
    page_size: int = 16
    kv_budget_bytes: int | None = None
    num_pages: int | None = None
    kv_dtype: str | None = None
    kv_codec: str = "none"
    kv_codec_options: dict = dataclasses.field(default_factory=dict)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 256
    max_prefill_seqs: int = 4
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    prefix_cache_eviction: PrefixEviction = PrefixEviction.LRU
    max_tenant_page_share: float | None = None
    contended_prefill_chunk: int | None = None
    contention_window_s: float = 15.0
    hide_shared_prefix_hits: bool = False
    scheduler_policy: str = "fcfs"
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    tiers: TierConfig = TierConfig()
    watermark: float = 0.01
    scrub_freed_pages: bool = False
    attention_impl: AttentionImpl = AttentionImpl.AUTO
    matmul_impl: MatmulImpl = MatmulImpl.AUTO
    batch_invariant: bool = False
    fused_kv_write: bool = False
    min_chunk_bucket: int = 16
    chunk_bucket_factor: int = 4
    prefill_padding_limit: float | None = None
    debug_provenance: bool = False
    trace: bool = False
    retention: str = "none"
    retention_budget: int | None = None
    retention_options: dict = dataclasses.field(default_factory=dict)
    retention_schedule: str = "uniform"
    retention_head_floor: float | None = None
    async_scheduling: bool = True
    spec: SpecConfig = SpecConfig()
    context_reuse: str = "full"
    context_reuse_options: dict = dataclasses.field(default_factory=dict)
    kv_arena: bool = False
    controller: str = "fixed"
    controller_options: dict = dataclasses.field(default_factory=dict)
    slo: SLO = SLO()
    host_split: str = "never"
    host_split_options: dict = dataclasses.field(default_factory=dict)
    num_host_pages: int = 0

    def __post_init__(self):
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                     "max_prefill_seqs", "min_chunk_bucket"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.chunk_bucket_factor, int) or self.chunk_bucket_factor < 2:
            raise ValueError(f"EngineConfig.chunk_bucket_factor must be an int >= 2, got "
                             f"{self.chunk_bucket_factor!r}")
        if self.prefill_padding_limit is not None and not 0.0 <= self.prefill_padding_limit < 1:
            raise ValueError(f"EngineConfig.prefill_padding_limit must be None or in [0, 1), "
                             f"got {self.prefill_padding_limit!r}")
        if self.max_tenant_page_share is not None and not 0.0 < self.max_tenant_page_share <= 1:
            raise ValueError(f"EngineConfig.max_tenant_page_share must be None or in (0, 1], "
                             f"got {self.max_tenant_page_share!r}")
        chunk = self.contended_prefill_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or not 0 < chunk <= self.max_prefill_chunk):
            raise ValueError(f"EngineConfig.contended_prefill_chunk must be None or an int in "
                             f"[1, max_prefill_chunk={self.max_prefill_chunk}], got {chunk!r}")
        if not self.contention_window_s > 0:
            raise ValueError(f"EngineConfig.contention_window_s must be > 0, got "
                             f"{self.contention_window_s!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"EngineConfig.watermark must be in [0, 1), got {self.watermark!r}")
        if isinstance(self.spec, dict):
            object.__setattr__(self, "spec", SpecConfig(**self.spec))
        if isinstance(self.slo, dict):
            object.__setattr__(self, "slo", SLO(**self.slo))
        make_controller(self.controller, **self.controller_options)
        make_host_split(self.host_split, **self.host_split_options)
        if isinstance(self.num_host_pages, bool) or not isinstance(self.num_host_pages, int) \
                or self.num_host_pages < 0:
            raise ValueError(f"EngineConfig.num_host_pages must be an int >= 0, got "
                             f"{self.num_host_pages!r}")
        for name, enum_type in (("kv_layout", KVLayout), ("preemption_mode", PreemptionMode),
                                ("attention_impl", AttentionImpl),
                                ("matmul_impl", MatmulImpl),
                                ("prefix_cache_eviction", PrefixEviction)):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, enum_type(value))
        reuse = make_strategy(self.context_reuse, **self.context_reuse_options)
        if reuse.reuses and not self.enable_prefix_cache and self.kv_layout is KVLayout.PAGED:
            raise ValueError(f"EngineConfig.context_reuse={self.context_reuse!r} keeps chunks "
                             f"in the prefix cache: set enable_prefix_cache=True")
        self._check_kernel_reads_codec()
        if self.fused_kv_write and self.matmul_impl is MatmulImpl.XLA and \
                not self.batch_invariant and self.attention_impl is not AttentionImpl.PALLAS:
            raise ValueError("EngineConfig.fused_kv_write projects K and V with the native "
                             "matmul (or the Pallas kernel, with attention_impl='pallas'), "
                             "and matmul_impl='xla' asks for XLA's: use AUTO or NATIVE")
        if self.batch_invariant and self.attention_impl is AttentionImpl.PALLAS:
            raise ValueError("EngineConfig.batch_invariant runs its own fixed-order attention "
                             "on the CPU's native kernels; the Pallas kernels' block sizes "
                             "follow the batch: use attention_impl AUTO")
        compat.check(self, on_mesh=False)
        check_schedule(self.retention_schedule, make_retention(
            self.retention, self.retention_budget, self.page_size, **self.retention_options),
            self.retention_head_floor)

    @property
    def controlled(self) -> bool:
        """Whether a KV controller decides beyond the fixed settings (it may offload, swap,
        demote or set retention budgets, so the engine prepares for all of them)."""
        return self.controller != FixedController.name

    def _check_kernel_reads_codec(self) -> None:
        if self.kv_codec == MIXED_CODEC:
            if self.attention_impl in (AttentionImpl.NATIVE, AttentionImpl.PALLAS):
                raise ValueError(f"attention_impl={self.attention_impl.value.upper()} reads "
                                 f"pages of one precision, while kv_codec='mixed' gives each "
                                 f"row a class of its own: use AUTO or REFERENCE")
            return
        if self.attention_impl is AttentionImpl.NATIVE and self.kv_codec != "none":
            from kvjax.kv import native

            reason = native.codec_reason(quantized.make_codec(self.kv_codec,
                                                              **self.kv_codec_options))
            if reason is not None:
                raise ValueError(f"attention_impl=NATIVE reads float pages and int8/int4/int2 "
                                 f"codes with float32 scales, not {reason}; use AUTO (the "
                                 f"reference for other codecs) or REFERENCE")
        if self.kv_codec == "none" or self.attention_impl is not AttentionImpl.PALLAS:
            return
        from pallas_kernels.quantized_decode.kernel import code_format  # Kernel code: lazy.

        try:
            code_format(quantized.make_codec(self.kv_codec, **self.kv_codec_options))
        except ValueError as e:
            raise ValueError(f"attention_impl=PALLAS: {e}; use AUTO (the reference where "
                             f"no kernel reads the codec) or REFERENCE") from None
