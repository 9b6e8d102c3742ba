"""The serving engine's public facade: requests in, outputs out, one step at a time.

`Engine` builds the parts and keeps the API scripts, notebooks, the router and RL loops use:

  * `Scheduler` (kvjax.scheduler): which sequences run in each step, preemption, outputs;
  * `KVCacheManager` (kvjax.memory): pages, prefix cache, swap space, tiers, retention;
  * `ModelRunner` (kvjax.engine.runner): the device KV pool, params and the jitted step;
  * `EngineCore` (kvjax.engine.core): step = schedule -> execute -> update.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import grammar as grammar_lib
from kvjax.config import KVLayout, resolve_dtype
from kvjax.engine import compat, host_rows, kv_calibration
from kvjax.engine.config import EngineConfig, PreemptionMode
from kvjax.engine.core import EngineCore
from kvjax.engine.layer_budgets import pool_layer_groups, retention_manager
from kvjax.engine.pool import KVPoolSource, build_kv_pool
from kvjax.engine.request import (
    RequestOutput,
    Sequence,
    WeightUpdatePolicy,
    submit_all,
)
from kvjax.engine.runner import ModelRunner, StepBuckets, StepObserver, rules_entries
from kvjax.engine.step import (
    PAGES_PER_BLOCK,
    LogitsMode,
    StepPrograms,
    StepShape,
    attention_name,
)
from kvjax.engine.swap import DEMOTION_BITS, demoted_nbytes, demotes
from kvjax.kv import fused_write
from kvjax.kv.retention import Compactor, RetentionManager
from kvjax.kv.reuse import ChunkCopier
from kvjax.kv.state import pages_for
from kvjax.memory.host_pool import HostPagePool
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import TIER_KINDS, KVOpKind
from kvjax.memory.tiers import (
    PlannedTierPort,
    TieredSwapSpace,
    TierManager,
    TierTransfers,
    TransferLayout,
    measure_transfer_bandwidth,
)
from kvjax.models import invariant, llama
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams
from kvjax.scheduler.context import Segment, clip_spans, make_strategy, split_segments
from kvjax.scheduler.controller import SLO, make_controller
from kvjax.scheduler.host_split import make_host_split
from kvjax.scheduler.inplace import in_place_demotion
from kvjax.scheduler.policies import make_policy
from kvjax.scheduler.replay import DecisionRecorder, SchedulerRecipe
from kvjax.scheduler.scheduler import Scheduler, SchedulerConfig
from kvjax.scheduler.spec import make_drafter
from kvjax.trace import NULL_TRACER, Tracer
from kvjax.validation import check_identity, check_request_id

# Retention policies that evict whenever a sequence caches budget + P tokens, prefill included.
_ROLLING_EVICTION = ("streaming", "h2o", "tova")
# Bias entries per row of a step with rules (`StepShape.bias_width`): room for the most
# logit_bias entries a request may set and the stop tokens min_tokens masks.
_BIAS_WIDTH = 512


def _segments(request_id: str, prompt) -> tuple[object, list[tuple[int, int]]]:
    """A prompt given as `Segment`s: its token ids and reusable spans; else (prompt, [])."""
    if not isinstance(prompt, Seq) or not any(isinstance(p, Segment) for p in prompt):
        return prompt, []
    if not all(isinstance(p, Segment) for p in prompt):
        raise ValueError(f"request {request_id!r}: a prompt of segments must hold only "
                         f"kvjax.Segment items")
    return split_segments(prompt)


def _token_ids(request_id: str, prompt_ids) -> list[int]:
    """The prompt as a list of Python ints; ValueError for anything but a flat sequence of
    ints (a float, string or bool would otherwise pass through int() as a token)."""
    if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Seq | np.ndarray):
        raise ValueError(f"request {request_id!r}: the prompt must be a sequence of int token "
                         f"ids, got {type(prompt_ids).__name__} {prompt_ids!r:.80}")
    for t in prompt_ids:
        if isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer):
            raise ValueError(f"request {request_id!r}: token ids must be ints, got "
                             f"{type(t).__name__} {t!r:.80}")
    return [int(t) for t in prompt_ids]


class Engine:
    """Continuous-batching engine over one model.

    Attributes:
      model: the `Model` (config, params, tokenizer, weights_version).
      config: the `EngineConfig`.
      scheduler, kv_cache, runner, core: the parts (see the module docstring).
      kv_spec: the pool's `KVCacheSpec` (`kvjax.kv.spec`): its layer groups and the bytes of a
        token, a page and a sequence slot, per-page summaries of a retention policy included.
      kv_bytes_per_token: device bytes one cached token takes over every layer.
      stats: counters (steps, preemptions, swaps, prefix cache, timing).
      mesh: the tensor-parallel mesh params and KV are laid out on (kvjax.parallel.sharding),
        or None for one device.
    """

    def __init__(self, model: Model, config: EngineConfig | None = None, *,
                 clock: Callable[[], float] = time.perf_counter,
                 mesh: jax.sharding.Mesh | None = None, kv_pool: KVPoolSource | None = None):
        self.model = model
        self.config = config = config or EngineConfig()
        self.clock = clock
        self.mesh = mesh
        # Features joined at run time beside the config's (`compat.operations_of`).
        self.operations: set[compat.Feature] = set()
        if mesh is not None:
            from kvjax.parallel import sharding  # Imported lazily: only sharded engines need it.

            self.model = model = sharding.shard_model(model, config, mesh)
        mc = model.config
        compat.check_model(config, mc, on_mesh=mesh is not None)
        max_len = min(config.max_model_len or mc.max_position_embeddings,
                      mc.max_position_embeddings)
        self.max_model_len = pages_for(max_len, config.page_size) * config.page_size
        self.kv_dtype = resolve_dtype(config.kv_dtype) if config.kv_dtype else model.dtype
        layer_groups = pool_layer_groups(mc, config, self.max_model_len)
        retention = retention_manager(mc, config, layer_groups)
        self.max_pages_per_seq = self.max_model_len // config.page_size
        # Block tables keep one width, so context growth never changes a step's shape.
        self.block_table_width = pages_for(self.max_pages_per_seq, PAGES_PER_BLOCK) * \
            PAGES_PER_BLOCK
        pool = (build_kv_pool if kv_pool is None else kv_pool.build)(
            mc, config, max_model_len=self.max_model_len, kv_dtype=self.kv_dtype)
        self.kv_bytes_per_token = pool.kv_bytes_per_token
        self.kv_spec = retention.policy.wrap_spec(pool.spec)
        # A low-rank pool's key bases, before the pool is placed (on a mesh: sharded).
        kv = retention.policy.wrap_state(kv_calibration.at_start(pool.kv, model, config))
        if config.batch_invariant:
            invariant.check(mc, model.dtype, self.kv_dtype)
        if config.fused_kv_write:
            reason = fused_write.reason_for(
                kv, model.dtype, qk_norm=mc.qk_norm, batch_invariant=config.batch_invariant,
                pallas=attention_name(config.attention_impl, kv) == "pallas")
            if reason is not None:
                raise ValueError(f"EngineConfig.fused_kv_write for model {mc.name!r}: {reason}")
        host_split = make_host_split(config.host_split, **config.host_split_options)
        is_echo = retention.policy.echo_prefetch is not None  # host-authoritative pages
        if is_echo and config.num_host_pages <= 0:
            raise ValueError(f"retention_options echo_prefetch="
                             f"{retention.policy.echo_prefetch!r} keeps every page in the host "
                             f"pool: EngineConfig.num_host_pages must be > 0, got "
                             f"{config.num_host_pages!r}")
        uses_host = host_split.uses_host and config.num_host_pages > 0
        programs = StepPrograms(mc, attention_impl=config.attention_impl,
                                retention=retention.step_hooks, matmul_impl=config.matmul_impl,
                                batch_invariant=config.batch_invariant,
                                fused_kv_write=config.fused_kv_write,
                                host_compute=uses_host and host_rows.host_compute_reason() is None,
                                dtype=model.dtype, layer_groups=layer_groups)
        if mesh is not None:
            kv, programs = sharding.shard_kv_and_programs(kv, programs, model, mesh)
        else:
            # Committed from the start: jit caches committed and uncommitted inputs apart, and
            # a swap-in (device_put to a device) would otherwise commit the pool mid-run and
            # recompile every step program.
            kv = jax.device_put(kv, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        buckets = StepBuckets(config.max_num_seqs, config.max_prefill_seqs,
                              config.max_prefill_chunk, config.min_chunk_bucket,
                              self.block_table_width, config.max_num_batched_tokens,
                              config.chunk_bucket_factor,
                              spec_width=1 + config.spec.num_draft_tokens
                              if config.spec.enabled else 1,
                              history_width=self.max_model_len, bias_width=_BIAS_WIDTH,
                              mask_width=grammar_lib.mask_width(model.config.vocab_size))
        self.runner = ModelRunner(programs, buckets, kv, model.params, model.weights_version,
                                  page_size=config.page_size,
                                  kv_store=None if kv_pool is None else kv_pool.store(),
                                  num_tables=len(pool.spec.table_groups()))
        if uses_host or is_echo:
            self.runner.host_pool = host_rows.HostPool(
                kv, config.num_host_pages,
                num_device_leaves=retention.policy.num_index_leaves if is_echo else 0,
                per_layer=is_echo)
        self.stats: dict = {}
        self._grammars: grammar_lib.GrammarCompiler | None = None  # built on the first grammar
        tiers, swap_space = self._build_tiers(pool)
        self.runner.kv_programs[KVOpKind.SCRUB] = lambda kv, op: swap_space.scrub(
            kv, op.dst, op.seq_slots)
        # Swaps as data go to the plain swap space (with tiers on, pages go through the tiers).
        plain_swap = pool.swap_space
        self.runner.kv_programs[KVOpKind.SWAP_OUT] = plain_swap.swap_out
        self.runner.kv_programs[KVOpKind.SWAP_IN] = plain_swap.swap_in
        self.runner.kv_programs[KVOpKind.SWAP_DROP] = lambda kv, op: (
            plain_swap.drop(op.host_slot), kv)[1]
        # Only a swap space that keeps windows is ever asked for a window copy.
        self.runner.kv_programs[KVOpKind.COPY_WINDOW] = lambda kv, op: swap_space.copy_window(
            kv, op.src[0], op.dst[0])
        self._compactor = Compactor(mc.rope.rotate if retention.policy.rotates_keys else None)
        self.runner.kv_programs[KVOpKind.COMPACT] = lambda kv, op: self._compactor(kv, op.plan)
        self._chunk_copier = ChunkCopier(mc.rope)
        self.runner.kv_programs[KVOpKind.CHUNK_LOAD] = lambda kv, op: self._chunk_copier.copy(
            kv, op.plan.src_pages, op.plan.offset, op.plan.dst_slots, op.plan.shift,
            op.plan.key_scale)
        self.kv_cache = KVCacheManager(
            self.runner, pool.allocator, swap_space, retention, page_size=config.page_size,
            watermark=config.watermark, scrub_freed_pages=config.scrub_freed_pages,
            stats=self.stats, tiers=tiers, quantized_len=pool.quantized_len,
            clock=clock,
            host_pool=HostPagePool(config.num_host_pages) if uses_host or is_echo else None)
        self.context_reuse = make_strategy(config.context_reuse, **config.context_reuse_options)
        self.scheduler = Scheduler(
            self._scheduler_config(), self.kv_cache, make_policy(config.scheduler_policy),
            cache_key=self.provenance, clock=clock, stats=self.stats,
            weights_version=model.weights_version, tokenizer=model.tokenizer,
            drafter=make_drafter(config.spec.method, **config.spec.options),
            reuse_strategies={config.context_reuse: self.context_reuse},
            controller=make_controller(config.controller, **config.controller_options),
            host_split=host_split if uses_host else None)
        self.scheduler.in_place = in_place_demotion(pool.ledger, self.kv_cache,
                                                    config.kv_codec_options,
                                                    self.block_table_width)
        self.stats.update(weight_updates=0)
        # An evicting policy decides from step t's key scores before step t+1's block tables
        # can exist, and a verify step's kept drafts decide step t+1's positions: such
        # engines run synchronously.
        is_async = (config.async_scheduling and not retention.policy.evicts
                    and not config.spec.enabled)
        self.tracer: Tracer = Tracer() if config.trace else NULL_TRACER
        self.scheduler.set_tracer(self.tracer)
        self.core = EngineCore(
            self.scheduler, self.runner, stats=self.stats, async_scheduling=is_async,
            debug_provenance=config.debug_provenance, tracer=self.tracer)

    def _build_tiers(self, pool):
        """Host/disk tiers below the pool (config.tiers), and the swap space in front of them."""
        cfg = self.config.tiers
        self._swap_bandwidth = cfg.swap_bandwidth_bytes_per_s
        estimates = (self.config.preemption_mode is PreemptionMode.AUTO
                     or self.config.controlled)  # a controller prices swaps too
        if (estimates and self._swap_bandwidth is None
                and self.config.kv_layout is KVLayout.PAGED):
            rates = measure_transfer_bandwidth(self.runner.kv, min(pool.allocator.num_pages, 16),
                                               TransferLayout(cfg.transfer_layout))
            self._swap_bandwidth = 2 / (1 / rates["device_to_host_bytes_per_s"]
                                        + 1 / rates["host_to_device_bytes_per_s"])
        if not cfg.enabled:
            return None, pool.swap_space
        # The ledger decides transfers as KV ops of the step's plan; the runner moves the bytes.
        transfers = TierTransfers(self.runner.kv)
        tiers = TierManager(cfg, port=PlannedTierPort.of(self.runner.kv, transfers.memory_kind))
        transfers.warm_sizes = tuple(tiers.warm_sizes())
        self.runner.tier_transfers = transfers
        for kind in TIER_KINDS:
            self.runner.kv_programs[kind] = transfers.apply
        if pool.allocator.prefix_cache is not None:
            pool.allocator.record_evictions()
        return tiers, TieredSwapSpace(tiers, pool.swap_space, pool.allocator)

    def _scheduler_config(self) -> SchedulerConfig:
        cfg = self.config
        return SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_prefill_chunk=cfg.max_prefill_chunk, max_prefill_seqs=cfg.max_prefill_seqs,
            page_size=cfg.page_size, max_model_len=self.max_model_len,
            is_paged=cfg.kv_layout is KVLayout.PAGED, preemption_mode=cfg.preemption_mode,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_bytes_held=self.kv_spec.bytes_held if self.kv_spec.is_grouped else None,
            swap_bandwidth_bytes_per_s=self._swap_bandwidth,
            recompute_tokens_per_s=cfg.tiers.recompute_tokens_per_s,
            max_inflight_loads=cfg.tiers.max_inflight_loads,
            eos_token_ids=tuple(self.model.config.eos_token_ids),
            prefill_buckets=self.runner.buckets.prefill_buckets,
            prefill_padding_limit=cfg.prefill_padding_limit,
            num_draft_tokens=cfg.spec.num_draft_tokens if cfg.spec.enabled else 0,
            adaptive_drafts=cfg.spec.adaptive,
            max_tenant_page_share=cfg.max_tenant_page_share,
            contended_prefill_chunk=cfg.contended_prefill_chunk,
            contention_window_s=cfg.contention_window_s,
            hide_shared_hits=cfg.hide_shared_prefix_hits, **self._demotion())

    def _demotion(self) -> dict:
        """The precisions swapped copies can be demoted to, each with the byte ratio it saves:
        {bits: page bytes / demoted copy bytes} (an exact float K/V pool swapped through the
        plain swap space; a quantized pool's codes stay as they are)."""
        leaves = self.runner.kv.page_leaves()
        if self.config.kv_layout is not KVLayout.PAGED or self.config.tiers.enabled:
            return dict(demote_ratios={})
        nbytes = sum(x.nbytes for x in leaves)
        return dict(demote_ratios={
            bits: nbytes / sum(demoted_nbytes(x, bits) for x in leaves)
            for bits in DEMOTION_BITS if all(demotes(x, bits) for x in leaves)})

    # ----------------------------------------------------------------------------- views

    @property
    def kv(self):
        """The device KV state pytree (owned by the runner)."""
        return self.runner.kv

    @property
    def allocator(self):
        return self.kv_cache.allocator

    @property
    def tiers(self):
        return self.kv_cache.tiers

    @property
    def retention(self) -> RetentionManager:
        return self.kv_cache.retention

    @property
    def swap_space(self):
        return self.kv_cache.swap_space

    @property
    def policy(self):
        return self.scheduler.policy

    @property
    def num_pages(self) -> int:
        return self.kv_cache.num_pages

    @property
    def kv_bytes_per_page(self) -> int:
        """Device bytes of one page of the pool (`KVCacheSpec.page_bytes`: codes, metadata and
        per-page summaries of the layers a page holds)."""
        return int(self.kv_spec.page_bytes)

    @property
    def kv_samples(self) -> list[tuple[float, int, int]]:
        """Per step: (time, bytes holding live tokens, bytes reserved by running sequences)."""
        return self.core.kv_samples

    @property
    def last_logits(self):
        """The logits the last step returned (per its LogitsMode), or None."""
        return self.core.last_logits

    @property
    def attention_name(self) -> str:
        """The attention the step runs: 'native', 'pallas' or 'reference' (`AttentionImpl`)."""
        return attention_name(self.config.attention_impl, self.kv)

    @property
    def last_sampled_rows(self) -> tuple[tuple[str, int], ...]:
        """(sequence id `{request_id}#{sample}`, row of `last_logits`) for each row of the
        last step that sampled its sequence's next token (top-logprob taps)."""
        return self.core.last_sampled_rows

    @property
    def num_compiles(self) -> int:
        """Programs compiled so far; flat once every step shape has been seen."""
        return (self.runner.num_compiles + self.kv_cache.num_compiles
                + self._compactor.num_compiles + self._chunk_copier.num_compiles)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def sequence(self, seq_id: str) -> Sequence:
        """The live record of sequence `{request_id}#{sample}` (read it; do not change it).

        Drains the step in flight first, so the record holds every token sampled so far."""
        self.drain()
        return self.scheduler.sequence(seq_id)

    def force_token(self, seq_id: str, token: int) -> None:
        """Teacher forcing: replaces the sequence's last sampled token before a step computes
        it (its K/V and every later token then follow the forced one)."""
        self.drain()
        self.scheduler.force_last_token(seq_id, int(token))

    def record_decisions(self) -> DecisionRecorder:
        """Starts recording every call into the scheduler, what it decided and the clock
        readings it took (`kvjax.scheduler.replay`); the recorder's `stop()` returns the
        `DecisionTrace`, which `kvjax.scheduler.replay.replay` decides again without a model.
        Call it before the engine's first step."""
        cfg = self.config
        compat.check(cfg, on_mesh=self.mesh is not None,
                     uses=(compat.Feature.RECORD_DECISIONS, *compat.operations_of(self)))
        tiers = self.tiers
        if tiers is not None and (cfg.tiers.disk_bytes or tiers.stats["transfers_committed"]
                                  or tiers.num_inflight or len(tiers.host)):
            raise ValueError("record_decisions: a replay rebuilds the tiers fresh and without "
                             "a disk tier, whose transfers finish on its workers' time, so "
                             f"record before the first step with no disk (disk_bytes="
                             f"{cfg.tiers.disk_bytes})")
        allocator = copy.deepcopy(self.kv_cache.allocator)
        allocator.tracer = NULL_TRACER
        allocator.clock = time.monotonic  # a replay gives it the replayed clock
        recipe = SchedulerRecipe(
            config=self.scheduler.config, allocator=allocator, policy=cfg.scheduler_policy,
            retention=cfg.retention, retention_budget=cfg.retention_budget,
            retention_options=dict(cfg.retention_options), drafter=cfg.spec.method,
            drafter_options=dict(cfg.spec.options), controller=cfg.controller,
            controller_options=dict(cfg.controller_options), context_reuse=cfg.context_reuse,
            context_reuse_options=dict(cfg.context_reuse_options), watermark=cfg.watermark,
            scrub_freed_pages=cfg.scrub_freed_pages,
            weights_version=self.scheduler.weights_version,
            tiers=None if tiers is None else cfg.tiers,
            tier_pages=() if tiers is None else (tiers.port.page_shapes, tiers.port.page_dtypes,
                                                 tiers.port.memory_kind))
        return DecisionRecorder(self.scheduler, recipe, self.provenance)

    def export_trace(self, path) -> None:
        """Writes the recorded trace as Chrome/Perfetto JSON (needs EngineConfig.trace)."""
        if not self.tracer.enabled:
            raise ValueError("export_trace needs EngineConfig(trace=True)")
        self.tracer.export(path)

    def add_step_observer(self, observer: StepObserver) -> None:
        """Calls `observer` around every step and KV operation (metering, logits taps)."""
        self.runner.observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self.runner.observers.remove(observer)

    def prefix_cache_stats(self) -> dict:
        return self.kv_cache.prefix_cache_stats()

    def kv_bytes_moved(self) -> dict[str, int]:
        """KV bytes moved so far, both ways: 'host' between device and host (the tiers'
        traffic with tiers on: swaps, prefix-cache spills and loads; else the swap space's),
        'disk' between host and the disk tier (0 without one)."""
        if self.tiers is None:
            return dict(host=self.stats["swap_bytes"], disk=0)
        t = self.tiers.stats
        return dict(host=t["bytes_device_to_host"] + t["bytes_host_to_device"],
                    disk=t["bytes_host_to_disk"] + t["bytes_disk_to_host"])

    def metrics(self) -> dict[str, int]:
        """Gauges and counters for monitoring (what a server's /metrics exports).

        Gauges: num_running, num_waiting, num_swapped (sequences in each queue), num_pages,
        num_used_pages (held by a sequence), num_free_pages (allocatable: free, or cached and
        unreferenced). Counters since the engine was built: steps, prefill_tokens,
        decode_tokens, preemptions, prefix_queries, prefix_query_tokens, prefix_hit_tokens,
        host_bytes, disk_bytes (`kv_bytes_moved`), num_compiles.
        """
        s, moved = self.stats, self.kv_bytes_moved()
        return dict(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped), num_pages=self.num_pages,
            num_used_pages=self.allocator.num_used_pages(),
            num_free_pages=self.allocator.num_free_pages(), steps=s["steps"],
            prefill_tokens=s["prefill_tokens"], decode_tokens=s["decode_tokens"],
            preemptions=s["preemptions"], **self.prefix_cache_stats(),
            host_bytes=moved["host"], disk_bytes=moved["disk"], num_compiles=self.num_compiles)

    def snapshot_outputs(self, *, drain: bool = True, with_text: bool = True
                         ) -> list[RequestOutput]:
        """Current outputs of every unfinished request.

        Args:
          drain: finish the step in flight first, so every token sampled so far is included;
            False returns what the host has and leaves the step in flight (streaming).
          with_text: decode each sample's text (else `text` is None).
        """
        if drain:
            self.drain()
        return self.scheduler.snapshot_outputs(with_text=with_text)

    # ----------------------------------------------------------------------------- KV

    def calibrate_kv(self, prompts: Seq[Seq[int]], *, margin: float | None = None) -> None:
        """Calibrates a `scaling='calibrated'` fp8 KV pool, or a low-rank pool's key bases
        (`kvjax.engine.kv_calibration`), from calibration token sequences.

        Runs the model densely over `prompts`, sets static per-layer, per-kv-head K and V
        scales (margin * amax / fp8_max, kvjax.kv.calibration) and rebuilds the step programs
        for them; the codec names, and so the provenance, carry the scales' digest. Call it
        before serving (no request in flight), and again to recalibrate.
        """
        from kvjax.kv import calibration, quantized  # Imported lazily: fp8 engines only.
        from kvjax.memory.ops import KVOp, KVOpKind

        self.drain()
        if self.has_unfinished() or self.scheduler.paused:
            raise ValueError("calibrate_kv needs an idle engine: requests are in flight or "
                             "paused")
        lowrank = kv_calibration.lowrank_codec(self.config)
        if lowrank is not None:  # margin does not apply: the bases keep the top-r directions
            basis = kv_calibration.key_bases(self.model, prompts, lowrank.rank)
            self.runner.apply(KVOp(KVOpKind.CALIBRATE), lambda kv: kv.with_basis(basis))
            return
        codec = (quantized.make_codec(self.config.kv_codec, **self.config.kv_codec_options)
                 if self.config.kv_codec != "none" else None)
        if not isinstance(codec, quantized.codecs.Fp8Codec) or codec.scaling.value != \
                "calibrated":
            raise ValueError(f"calibrate_kv needs kv_codec fp8_e4m3/fp8_e5m2 with "
                             f"scaling='calibrated', got {self.config.kv_codec!r} "
                             f"{self.config.kv_codec_options}")
        k_scale, v_scale = calibration.fp8_kv_scales(
            self.model.params, self.model.config, prompts, codec.fmt,
            margin=calibration.DEFAULT_MARGIN if margin is None else margin)
        self.runner.apply(KVOp(KVOpKind.CALIBRATE),
                          lambda kv: quantized.calibrate_fp8(kv, k_scale, v_scale))

    def provenance(self, tenant: str | None = None, weights_version: str | None = None) -> bytes:
        """The KV provenance fingerprint: what produced a page, and who may read it."""
        tokenizer = self.model.tokenizer
        version = self.model.weights_version if weights_version is None else weights_version
        mc = self.model.config
        rope = f"rope={mc.rope.fingerprint}:absolute"
        if mc.local_rope is not None:  # keys of those layers are turned by their own RoPE
            rope += f";local={mc.local_rope.fingerprint}@{list(mc.local_rope_layers)}"
        parts = [
            f"model={mc.name}",
            f"weights={version}",
            f"tokenizer={getattr(tokenizer, 'fingerprint', type(tokenizer).__name__)}",
            "adapter=none",
            rope,
            f"codec={self.kv.codec_name}:{jnp.dtype(self.kv_dtype).name}",
            f"layout={self.config.kv_layout.value}:P{self.config.page_size}",
            f"tenant={tenant or ''}",
            f"retention={self.retention.fingerprint}",
        ]
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).digest()

    # ----------------------------------------------------------------------------- requests

    def validate_request(self, request_id: str, prompt_ids: Seq[int],
                         sampling: SamplingParams) -> list[int]:
        """Checks a request; raises ValueError naming the problem. Returns its token ids (of
        a prompt of `Segment`s, their concatenation)."""
        check_request_id(request_id)
        prompt_ids, _ = _segments(request_id, prompt_ids)
        self.kv.check_ready()  # A calibrated fp8 pool needs its scales first.
        if self.scheduler.has_request(request_id):
            raise ValueError(f"duplicate request_id {request_id!r}")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        prompt = _token_ids(request_id, prompt_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        bad = [t for t in sampling.stop_token_ids if not t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: stop token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        bad = [t for t, _ in sampling.logit_bias if not t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: logit_bias token id {bad[0]} is outside "
                             f"the vocabulary [0, {vocab})")
        entries = rules_entries(sampling, sampling.stop_ids(self.model.config.eos_token_ids))
        if entries > _BIAS_WIDTH:
            raise ValueError(f"request {request_id!r}: logit_bias and the stop tokens "
                             f"min_tokens masks take {entries} entries, more than {_BIAS_WIDTH}")
        if sampling.grammar is not None:
            self.grammar_matcher(request_id, sampling.grammar)
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens does not "
                             f"fit the context length {self.max_model_len} (at least one token "
                             f"must be generated)")
        need = self._max_pages_held(min(len(prompt) + sampling.max_new_tokens,
                                        self.max_model_len))
        if self.config.kv_layout is KVLayout.PAGED and need * sampling.n > self.num_pages:
            raise ValueError(f"request {request_id!r} needs {need * sampling.n} KV pages but "
                             f"the pool has {self.num_pages}")
        return prompt

    def add_request(self, request_id: str, prompt_ids: Seq[int] | Seq[Segment],
                    sampling: SamplingParams | None = None, *, tenant: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    context_reuse: str | None = None, slo: SLO | None = None,
                    cache_salt: str | None = None) -> None:
        """Queues a request. Invalid requests raise ValueError and change nothing.

        tenant: who sent it: its prefix-cache pages are its own, and fair admission and
          eviction count by it. cache_salt (vLLM's field): the request's pages are cached
          under this salt instead, shared by every request naming it whichever its tenant
          (`EngineConfig.hide_shared_prefix_hits` hides from each tenant the hits others
          paid for).

        slo: its TTFT / TPOT targets and KL budget (`kvjax.scheduler.controller.SLO`), which
          the engine's KV controller serves; None: EngineConfig.slo.

        prompt_ids: token ids, or `Segment`s whose reusable ones take their KV from the chunk
          cache (`kvjax.scheduler.context`) under `context_reuse` (a strategy name; None:
          EngineConfig.context_reuse). A strategy other than the configured one compiles its
          programs on first use.
        """
        sampling = sampling or SamplingParams()
        check_identity(request_id, tenant=tenant, priority=priority, arrival_time=arrival_time,
                       cache_salt=cache_salt)
        prompt = self.validate_request(request_id, prompt_ids, sampling)
        _, spans = _segments(request_id, prompt_ids)
        reuse = self.config.context_reuse if context_reuse is None else context_reuse
        try:
            strategy = self.scheduler.strategy(reuse)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        if spans and strategy.reuses and not self.kv_cache.has_prefix_cache:
            raise ValueError(f"request {request_id!r}: context_reuse={reuse!r} keeps chunks in "
                             f"the prefix cache, which this engine has off")
        if slo is not None and not isinstance(slo, SLO):
            raise ValueError(f"request {request_id!r}: slo must be a kvjax SLO, got {slo!r}")
        arrival = self.clock() if arrival_time is None else arrival_time
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(
            hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")
        common = dict(request_id=request_id, num_prompt_tokens=len(prompt), sampling=sampling,
                      arrival_time=arrival, order=self.scheduler.next_order(), tenant=tenant,
                      priority=priority, context_reuse=reuse, slo=slo or self.config.slo)
        if sampling.n > 1 and len(prompt) > 1:
            # The samples share the prompt: prefill all but its last token once, then fork.
            seqs = [Sequence(seq_id=f"{request_id}#prompt", tokens=prompt[:-1], seed=seed,
                             is_group_prefill=True,
                             chunk_spans=clip_spans(spans, len(prompt) - 1), **common)]
        else:
            seqs = [Sequence(seq_id=f"{request_id}#{i}", tokens=list(prompt), seed=seed + i,
                             sample_index=i, chunk_spans=clip_spans(spans, len(prompt)),
                             **common) for i in range(sampling.n)]
        if sampling.grammar is not None:
            for seq in seqs:
                seq.grammar = self.grammar_matcher(request_id, sampling.grammar)
        self.scheduler.add_request(request_id, prompt, seqs, arrival=arrival, tenant=tenant,
                                   n=sampling.n, cache_salt=cache_salt)

    def grammar_matcher(self, request_id: str, grammar: grammar_lib.Grammar,
                        output_ids: Seq[int] = ()) -> grammar_lib.GrammarMatcher:
        """A matcher of `grammar` past `output_ids` (a restored sequence's output); raises
        ValueError naming the request when the grammar does not compile (or the model has
        no tokenizer, or llguidance, an optional extra, is absent)."""
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise ValueError(f"request {request_id!r}: a grammar needs the model's tokenizer, "
                             f"and this model has none")
        if self._grammars is None:
            self._grammars = grammar_lib.GrammarCompiler(
                tokenizer, self.model.config.vocab_size, self.model.config.eos_token_ids)
        try:
            matcher = self._grammars.matcher(grammar)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        for token in output_ids:
            matcher.accept(token)
        return matcher

    def abort(self, request_id: str) -> None:
        """Stops a request; its pages are freed and it finishes with reason ABORT."""
        self.drain()
        self.scheduler.abort(request_id)

    def pause(self, request_id: str, *, to_host: bool = False) -> None:
        """Stops scheduling a request until `resume`; its KV stays on the device (pages kept,
        not preemptible) or, with `to_host`, is swapped to host memory, freeing its pages.
        To move it to another engine, `kvjax.engine.snapshot.save_snapshot` it, `abort` it
        here and restore it there."""
        if to_host:  # The request's pages are swapped out: what refuses swaps refuses this.
            compat.check(self.config, on_mesh=self.mesh is not None,
                         uses=(compat.Feature.PAUSE, compat.Feature.SWAP))
        self.drain()
        self.scheduler.pause(request_id, to_host=to_host)

    def resume(self, request_id: str) -> None:
        """Schedules a paused request again; it continues with the tokens it would have had."""
        self.scheduler.resume(request_id)

    def drain(self) -> None:
        """Finishes the step in flight (asynchronous scheduling): its tokens are committed and
        the host state is settled. Snapshots, aborts and weight updates call it."""
        self.core.drain()

    def _max_pages_held(self, num_tokens: int) -> int:
        """The most pages a sequence of `num_tokens` tokens (prompt + output) holds at once.

        Admission takes pages a chunk at a time, so this only decides whether a request can
        ever fit the pool. A policy that evicts as it goes (streaming, h2o) caches fewer than
        budget + P tokens before a step and at most one prefill chunk more after it, and a
        compaction may take up to the budget's pages before it frees the old ones; so its
        requests may be longer than the pool. SnapKV keeps a whole prefill (after a recompute,
        prompt and output) before it compresses, so it gets no bound below its full length.
        """
        p, policy = self.config.page_size, self.retention.policy
        # Every block table's pages; a window's table holds its window and one step's writes (a
        # prefill chunk, or a verify row of 1 + gamma tokens).
        drafts = self.config.spec.num_draft_tokens if self.config.spec.enabled else 0
        full = self.kv_spec.max_pages_held(num_tokens, max(self.config.max_prefill_chunk,
                                                           1 + drafts))
        if policy.name not in _ROLLING_EVICTION or self.retention.default_budget is None:
            return full  # (a controller keeps every token until it sets a budget)
        uncompacted = pages_for(policy.budget + p - 1 + self.config.max_prefill_chunk, p)
        return min(full, uncompacted + pages_for(policy.budget, p))

    # ----------------------------------------------------------------------------- weights

    def update_weights(self, params, version: str, *,
                       in_flight: WeightUpdatePolicy = WeightUpdatePolicy.RECOMPUTE) -> None:
        """Swaps in new weights between steps; no page computed by other weights is read again.

        The version enters the KV provenance fingerprint, so prefix-cache entries of earlier
        versions never hit. Sequences already in flight follow `in_flight`.
        """
        llama.check_params(params, self.model.config)
        self.drain()
        if self.scheduler.paused:
            raise ValueError(f"resume or abort the paused requests {sorted(self.scheduler.paused)} "
                             f"before a weight update: the in-flight policy applies to queued "
                             f"sequences only, so their old-weights KV would be read on")
        version = str(version)
        if version in self.runner.params or version == self.model.weights_version:
            raise ValueError(f"weights version {version!r} is already in use; versions must be new")
        in_flight = WeightUpdatePolicy(in_flight)
        self.model = dataclasses.replace(self.model, params=params, weights_version=version)
        self.runner.add_params(version, params)
        self.stats["weight_updates"] += 1
        self.scheduler.on_weights_update(version, in_flight)
        self.runner.keep_params(self.scheduler.versions)

    # ----------------------------------------------------------------------------- the step

    def step_shapes(self, logits_mode: LogitsMode = LogitsMode.NONE) -> list[StepShape]:
        """Every greedy step shape this engine can produce: what `warmup` compiles."""
        return self.runner.buckets.step_shapes(logits_mode)

    def warmup(self, *, sampling: bool = False) -> int:
        """Compiles every greedy step shape and KV program on padding inputs; returns the
        compile count. Padded tokens write nothing and padded rows read nothing. With
        `sampling`, the sampled variants of each shape too (four times the programs), so
        temperature, top-k, top-p, min-p, penalties, logit bias and min_tokens compile
        nothing either."""
        plan = self.context_reuse.plan(self.max_model_len)
        self.runner.warmup(self.model.weights_version, sampling=sampling,
                           blend_ratio=plan.blend_ratio or None,
                           max_blend_tokens=self.max_model_len)
        # Copy-on-write (n > 1 samples, shared partial pages): at most one copy per row.
        is_paged = self.config.kv_layout is KVLayout.PAGED
        controlled = self.config.controlled
        # A swap or a scrub moves the pages of every layer group's table at once.
        self.kv_cache.warmup(self.block_table_width * len(self.kv_spec.table_groups()),
                             swap=self.config.preemption_mode is not PreemptionMode.RECOMPUTE
                             or controlled,
                             demote_bits=tuple(self.scheduler.config.demote_ratios)
                             if controlled else (),
                             max_copies=self.config.max_num_seqs + self.config.max_prefill_seqs
                             if is_paged else 0,
                             max_chunk_tokens=self.max_model_len
                             if self.context_reuse.reuses else 0)
        self.runner.apply_ops(self.scheduler.in_place.warmup_ops())  # mixed-precision pools
        jax.block_until_ready(self.kv)
        return self.num_compiles

    def models(self) -> dict[str | None, Engine]:
        """The engines requests can be routed to: this one, under no name of its own (a server
        names it). `MultiModelEngine.models` names each of its models."""
        return {None: self}

    def step(self, *, logits_mode: LogitsMode = LogitsMode.NONE) -> list[RequestOutput]:
        """One scheduling iteration. Returns the outputs of requests that finished during it."""
        return self.core.step(logits_mode)

    # ----------------------------------------------------------------------------- blocking API

    def generate(self, prompts: Seq[Seq[int]], sampling: SamplingParams | Seq[SamplingParams]
                 | None = None) -> list[RequestOutput]:
        """Runs prompts to completion; invalid ones come back with `error` set, alone."""
        return list(self.stream(prompts, sampling, final_only=True))

    def stream(self, prompts: Seq[Seq[int]], sampling=None, *, final_only: bool = False
               ) -> Iterator[RequestOutput]:
        """Yields outputs as tokens arrive (every request each step), finals marked `finished`."""
        ids, results = submit_all(self.add_request, prompts, sampling,
                                  f"gen-{self.scheduler.next_order()}", self.clock())
        pending = {r for r in ids if r not in results}
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
            if not final_only:  # Streams what the host has; the step in flight stays in flight.
                yield from (o for o in self.scheduler.snapshot_outputs()
                            if o.request_id in pending)
        yield from (results[r] for r in ids)
