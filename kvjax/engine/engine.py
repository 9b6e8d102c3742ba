"""The serving engine's public facade: requests in, outputs out, one step at a time.

`Engine` builds the parts and keeps the API scripts, notebooks, the router and RL loops use:

  * `Scheduler` (kvjax.scheduler): which sequences run in each step, preemption, outputs;
  * `KVCacheManager` (kvjax.memory): pages, prefix cache, swap space, tiers, retention;
  * `ModelRunner` (kvjax.engine.runner): the device KV pool, params and the jitted step;
  * `EngineCore` (kvjax.engine.core): step = schedule -> execute -> update.

Its own work is split into components: `RequestIntake` (kvjax.engine.intake: checking and
queueing requests), `kvjax.engine.assembly` (tiers, KV programs, the scheduler's config,
warm-up) and `kvjax.engine.recording` (the KV provenance, decision recordings).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

import jax

from kvjax.config import resolve_dtype
from kvjax.delegation import delegate
from kvjax.engine import assembly, compat, host_rows, kv_calibration, recording
from kvjax.engine.config import EngineConfig
from kvjax.engine.core import EngineCore
from kvjax.engine.intake import RequestIntake
from kvjax.engine.layer_budgets import pool_layer_groups, retention_manager
from kvjax.engine.pool import KVPoolSource, build_kv_pool
from kvjax.engine.request import (
    RequestOutput,
    Sequence,
    WeightUpdatePolicy,
    submit_all,
)
from kvjax.engine.runner import ModelRunner, StepObserver
from kvjax.engine.step import (
    PAGES_PER_BLOCK,
    LogitsMode,
    StepPrograms,
    StepShape,
    attention_name,
)
from kvjax.kv.retention import Compactor, RetentionManager
from kvjax.kv.reuse import ChunkCopier
from kvjax.kv.state import pages_for
from kvjax.memory.host_pool import HostPagePool
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.models import llama
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams
from kvjax.scheduler.context import make_strategy
from kvjax.scheduler.controller import make_controller
from kvjax.scheduler.echo import echo_keep_width
from kvjax.scheduler.host_split import make_host_split
from kvjax.scheduler.inplace import in_place_demotion
from kvjax.scheduler.policies import make_policy
from kvjax.scheduler.replay import DecisionRecorder
from kvjax.scheduler.scheduler import Scheduler
from kvjax.scheduler.spec import make_drafter
from kvjax.trace import NULL_TRACER, Tracer


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
        retention = retention_manager(mc, config, layer_groups, model.tokenizer,
                                      self.max_model_len)
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
        assembly.check_pool(config, mc, kv, retention, dtype=model.dtype, kv_dtype=self.kv_dtype)
        host_split = make_host_split(config.host_split, **config.host_split_options)
        is_echo = retention.policy.echo_prefetch is not None  # host-authoritative pages
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
        buckets = assembly.step_buckets(config, vocab_size=mc.vocab_size,
                                        block_table_width=self.block_table_width,
                                        max_model_len=self.max_model_len)
        self.runner = ModelRunner(programs, buckets, kv, model.params, model.weights_version,
                                  page_size=config.page_size,
                                  kv_store=None if kv_pool is None else kv_pool.store(),
                                  num_tables=len(pool.spec.table_groups()))
        if uses_host or is_echo:
            self.runner.host_pool = host_rows.HostPool(
                kv, config.num_host_pages,
                num_device_leaves=retention.policy.num_index_leaves if is_echo else 0,
                per_layer=is_echo, keep_width=echo_keep_width(retention.policy))
        self.stats: dict = {}
        tiers, swap_space, swap_bandwidth = assembly.build_tiers(config, self.runner, pool)
        self._compactor = Compactor(mc.rope.rotate if retention.policy.rotates_keys else None)
        self._chunk_copier = ChunkCopier(mc.rope)
        assembly.install_kv_programs(self.runner, swap_space, pool.swap_space, self._compactor,
                                     self._chunk_copier)
        self.kv_cache = KVCacheManager(
            self.runner, pool.allocator, swap_space, retention, page_size=config.page_size,
            watermark=config.watermark, scrub_freed_pages=config.scrub_freed_pages,
            stats=self.stats, tiers=tiers, quantized_len=pool.quantized_len,
            clock=clock,
            host_pool=HostPagePool(config.num_host_pages) if uses_host or is_echo else None)
        self.context_reuse = make_strategy(config.context_reuse, **config.context_reuse_options)
        self.scheduler = Scheduler(
            assembly.scheduler_config(
                config, self.runner, max_model_len=self.max_model_len,
                kv_bytes_per_token=self.kv_bytes_per_token, swap_bandwidth=swap_bandwidth,
                eos_token_ids=mc.eos_token_ids),
            self.kv_cache, make_policy(config.scheduler_policy),
            cache_key=self.provenance, clock=clock, stats=self.stats,
            weights_version=model.weights_version, tokenizer=model.tokenizer,
            drafter=make_drafter(config.spec.method, **config.spec.options),
            reuse_strategies={config.context_reuse: self.context_reuse},
            controller=make_controller(config.controller, **config.controller_options),
            host_split=host_split if uses_host else None)
        self.intake = RequestIntake(
            config, mc, model.tokenizer, scheduler=self.scheduler, kv_cache=self.kv_cache,
            runner=self.runner, kv_spec=self.kv_spec, max_model_len=self.max_model_len,
            clock=clock)
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
        return recording.decision_recorder(
            self.config, self.scheduler, self.kv_cache, self.provenance,
            on_mesh=self.mesh is not None, operations=compat.operations_of(self))

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
        return recording.kv_bytes_moved(self.stats, self.tiers)

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
        self.drain()
        if self.has_unfinished() or self.scheduler.paused:
            raise ValueError("calibrate_kv needs an idle engine: requests are in flight or "
                             "paused")
        kv_calibration.calibrate(self.runner, self.model, self.config, prompts, margin=margin)

    def provenance(self, tenant: str | None = None, weights_version: str | None = None) -> bytes:
        """The KV provenance fingerprint: what produced a page, and who may read it."""
        return recording.provenance(
            self.model, self.config, codec_name=self.kv.codec_name, kv_dtype=self.kv_dtype,
            retention_fingerprint=self.retention.fingerprint, tenant=tenant,
            weights_version=weights_version)

    # ----------------------------------------------------------------------------- requests

    validate_request = delegate("intake", RequestIntake.validate_request)
    add_request = delegate("intake", RequestIntake.add_request)
    grammar_matcher = delegate("intake", RequestIntake.grammar_matcher)

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
        assembly.warm_up(self.config, self.runner, self.kv_cache, self.scheduler,
                         self.context_reuse, weights_version=self.model.weights_version,
                         sampling=sampling, max_model_len=self.max_model_len,
                         table_pages=self.block_table_width * len(self.kv_spec.table_groups()))
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
