"""The serving engine: the one host-side owner of KV state and of every mutation of it.

Each `step()` is one scheduling iteration: decode rows for the running sequences first, then
prefill chunks of partially computed, swapped-out and waiting sequences under a per-step token
budget; then a single jitted call of the model over all of them. When pages run out the
lowest-ranked running sequence is preempted (recomputed later, or swapped to host memory).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import KVLayout, resolve_dtype
from kvjax.engine import residual
from kvjax.engine.config import EngineConfig, PreemptionMode
from kvjax.engine.request import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SeqStatus,
    Sequence,
    WeightUpdatePolicy,
    submit_all,
)
from kvjax.engine.step import PAGES_PER_BLOCK, LogitsMode, ModelRunner, StepShape, empty_step_input
from kvjax.engine.swap import HostSwapSpace
from kvjax.kv.retention import RetentionManager, make_retention
from kvjax.kv.state import init_contiguous_kv, init_paged_kv, num_pages_for_budget, pages_for
from kvjax.memory.block_manager import AllocStatus, BlockManager
from kvjax.memory.slots import SlotAllocator
from kvjax.memory.tiers import (
    TieredSwapSpace,
    TierManager,
    TransferLayout,
    decide_preemption,
    measure_transfer_bandwidth,
    page_hash_chain,
)
from kvjax.models import llama
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams
from kvjax.scheduler.policies import LongestPrefixMatch, make_policy

# Retention policies that evict whenever a sequence caches budget + P tokens, prefill included.
_ROLLING_EVICTION = ("streaming", "h2o")


def _bucket(n: int, minimum: int, maximum: int) -> int:
    """The smallest power of two >= n, clipped to [minimum, maximum]."""
    return int(min(max(1 << max(n - 1, 0).bit_length(), minimum), maximum))


class Engine:
    """Continuous-batching engine over one model.

    Attributes:
      model: the `Model` (config, params, tokenizer, weights_version).
      config: the `EngineConfig`.
      kv: the current KV state pytree (donated to each step).
      stats: counters (steps, preemptions, swaps, prefix cache, timing).
      mesh: the tensor-parallel mesh params and KV are laid out on (kvjax.parallel.sharding),
        or None for one device.
    """

    def __init__(self, model: Model, config: EngineConfig | None = None, *,
                 clock: Callable[[], float] = time.perf_counter,
                 mesh: jax.sharding.Mesh | None = None):
        self.model = model
        self.config = config = config or EngineConfig()
        self.clock = clock
        self.mesh = mesh
        if mesh is not None:
            from kvjax.parallel import sharding  # Imported lazily: only sharded engines need it.

            self.model = model = sharding.shard_model(model, config, mesh)
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.max_model_len = pages_for(self.max_model_len, config.page_size) * config.page_size
        self.kv_dtype = resolve_dtype(config.kv_dtype) if config.kv_dtype else model.dtype
        if mesh is not None and config.retention != "none":
            raise ValueError(f"retention={config.retention!r} does not run on a mesh")
        self.retention = RetentionManager(make_retention(
            config.retention, config.retention_budget, config.page_size,
            **config.retention_options), rope_theta=mc.rope_theta)
        self.runner = ModelRunner(mc, attention_impl=config.attention_impl,
                                  retention=self.retention.step_hooks)
        self.max_pages_per_seq = self.max_model_len // config.page_size
        # Block tables keep one width, so context growth never changes a step's shape.
        self.block_table_width = pages_for(self.max_pages_per_seq, PAGES_PER_BLOCK) * \
            PAGES_PER_BLOCK
        self.kv_bytes_per_token = mc.kv_bytes_per_token(self.kv_dtype)
        if config.kv_codec != "none":
            if config.kv_layout is not KVLayout.PAGED:
                raise ValueError(f"kv_codec={config.kv_codec!r} needs the paged layout")
            from kvjax.kv import quantized  # Imported lazily: only quantized engines need it.

            options = config.kv_codec_options
            self.kv_bytes_per_token = quantized.kv_bytes_per_token(mc, config.kv_codec, **options)
            # KIVI's per-sequence exact windows come out of an explicit byte budget first.
            num_seq_slots = quantized.num_seq_slots_for(config.kv_codec, config.max_num_seqs,
                                                        **options)
            windows = quantized.residual_bytes(mc, num_seq_slots, config.kv_codec, **options)
            budget = self._budget_bytes() - (windows if config.kv_budget_bytes else 0)
            if budget < self.kv_bytes_per_token * config.page_size and not config.num_pages:
                raise ValueError(f"kv_budget_bytes={config.kv_budget_bytes} holds no page "
                                 f"beside {windows} bytes of KIVI windows")
            num_pages = config.num_pages or max(
                int(budget // (self.kv_bytes_per_token * config.page_size)), 1)
            self.kv = quantized.init_quantized_kv(mc, num_pages, config.page_size,
                                                  config.kv_codec, num_seq_slots=num_seq_slots,
                                                  **options)
            if num_seq_slots:
                if mesh is not None:
                    raise ValueError(f"kv_codec={config.kv_codec!r} (KIVI windows) does not run "
                                     f"on a mesh")
                self.allocator = residual.WindowBlockManager(
                    num_pages, config.page_size, num_seq_slots=num_seq_slots,
                    enable_prefix_cache=config.enable_prefix_cache,
                    scrub_windows=config.scrub_freed_pages)
            else:
                self.allocator = BlockManager(num_pages, config.page_size,
                                              enable_prefix_cache=config.enable_prefix_cache)
        elif config.kv_layout is KVLayout.CONTIGUOUS:
            max_seqs = self._contiguous_slots()
            self.kv = init_contiguous_kv(mc, max_seqs, self.max_model_len, config.page_size,
                                         self.kv_dtype)
            self.allocator = SlotAllocator(max_seqs, self.max_model_len, config.page_size)
        else:
            num_pages = config.num_pages or num_pages_for_budget(
                mc, self._budget_bytes(), config.page_size, self.kv_dtype)
            self.kv = init_paged_kv(mc, num_pages, config.page_size, self.kv_dtype)
            self.allocator = BlockManager(num_pages, config.page_size,
                                          enable_prefix_cache=config.enable_prefix_cache)
        self.num_pages = self.allocator.num_pages
        self.kv = self.retention.policy.wrap_state(self.kv)
        if mesh is not None:
            self.kv, self.runner = sharding.shard_kv_and_runner(self.kv, self.runner, model, mesh)
        else:
            # Committed from the start: jit caches committed and uncommitted inputs apart, and
            # a swap-in (device_put to a device) would otherwise commit the pool mid-run and
            # recompile every step program.
            self.kv = jax.device_put(self.kv, jax.devices()[0])
        self.policy = make_policy(config.scheduler_policy)
        if isinstance(self.policy, LongestPrefixMatch):
            self.policy.cached_tokens = self._peek_cached_tokens
        self.swap_space = (residual.WindowSwapSpace(self.allocator)
                           if isinstance(self.allocator, residual.WindowBlockManager)
                           else HostSwapSpace())
        self._seqs: dict[str, Sequence] = {}
        self._requests: dict[str, list[str]] = {}  # request id -> its sequence ids
        self._request_meta: dict[str, dict] = {}
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._swapped: list[Sequence] = []
        self._finished_outputs: list[RequestOutput] = []
        self._order = itertools.count()
        self.stats = dict(steps=0, preemptions=0, swaps_out=0, swaps_in=0, swap_bytes=0,
                          prefill_tokens=0, decode_tokens=0, host_time_s=0.0, step_time_s=0.0,
                          scrubbed_pages=0)
        self.kv_samples: list[tuple[float, int, int]] = []
        self._init_tiers()
        # Params of every weights version some sequence still runs under (finish_old drains).
        self._params = {model.weights_version: model.params}
        self._page_version: dict[int, str] = {}  # host record of which weights wrote a page
        self.stats.update(weight_updates=0, stale_kv_reads=0)

    # ----------------------------------------------------------------------------- sizing

    def _budget_bytes(self) -> int:
        if self.config.kv_budget_bytes is not None:
            return self.config.kv_budget_bytes
        return int(self.kv_bytes_per_token * self.max_model_len * self.config.max_num_seqs)

    def _contiguous_slots(self) -> int:
        per_seq = self.kv_bytes_per_token * self.max_model_len
        slots = min(self._budget_bytes() // per_seq, self.config.max_num_seqs)
        if slots < 1:
            raise ValueError(f"a KV budget of {self._budget_bytes()} bytes holds no sequence of "
                             f"max_model_len={self.max_model_len} tokens")
        return int(slots)

    @property
    def kv_bytes_per_page(self) -> int:
        return int(self.kv_bytes_per_token * self.config.page_size)

    def calibrate_kv(self, prompts: Seq[Seq[int]], *, margin: float | None = None) -> None:
        """Calibrates a `scaling='calibrated'` fp8 KV pool from calibration token sequences.

        Runs the model densely over `prompts`, sets static per-layer, per-kv-head K and V
        scales (margin * amax / fp8_max, kvjax.kv.calibration) and rebuilds the step programs
        for them; the codec names, and so the provenance, carry the scales' digest. Call it
        before serving (no request in flight), and again to recalibrate.
        """
        from kvjax.kv import calibration, quantized  # Imported lazily: fp8 engines only.

        if self.has_unfinished():
            raise ValueError("calibrate_kv needs an idle engine: requests are in flight")
        codec = getattr(self.kv, "codec", None)
        if not isinstance(codec, quantized.codecs.Fp8Codec) or codec.scaling.value != \
                "calibrated":
            raise ValueError(f"calibrate_kv needs kv_codec fp8_e4m3/fp8_e5m2 with "
                             f"scaling='calibrated', got {self.config.kv_codec!r} "
                             f"{self.config.kv_codec_options}")
        k_scale, v_scale = calibration.fp8_kv_scales(
            self.model.params, self.model.config, prompts, codec.fmt,
            margin=calibration.DEFAULT_MARGIN if margin is None else margin)
        self.kv = quantized.calibrate_fp8(self.kv, k_scale, v_scale)

    @property
    def num_compiles(self) -> int:
        """Programs compiled so far; flat once every step shape has been seen."""
        return (self.runner.num_compiles + self.swap_space.num_compiles
                + self.retention.num_compiles)

    # ----------------------------------------------------------------------------- provenance

    def provenance(self, tenant: str | None = None, weights_version: str | None = None) -> bytes:
        """The KV provenance fingerprint: what produced a page, and who may read it."""
        tokenizer = self.model.tokenizer
        version = self.model.weights_version if weights_version is None else weights_version
        parts = [
            f"model={self.model.config.name}",
            f"weights={version}",
            f"tokenizer={getattr(tokenizer, 'fingerprint', type(tokenizer).__name__)}",
            "adapter=none",
            f"rope=theta{self.model.config.rope_theta}:absolute",
            f"codec={getattr(self.kv, 'codec_name', 'none')}:{jnp.dtype(self.kv_dtype).name}",
            f"layout={self.config.kv_layout.value}:P{self.config.page_size}",
            f"tenant={tenant or ''}",
            f"retention={self.retention.fingerprint}",
        ]
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).digest()

    # ----------------------------------------------------------------------------- requests

    def validate_request(self, request_id: str, prompt_ids: Seq[int],
                         sampling: SamplingParams) -> list[int]:
        """Checks a request; raises ValueError naming the problem."""
        if hasattr(self.kv, "check_ready"):  # A calibrated fp8 pool needs its scales first.
            self.kv.check_ready()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
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

    def add_request(self, request_id: str, prompt_ids: Seq[int],
                    sampling: SamplingParams | None = None, *, tenant: str | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Queues a request. Invalid requests raise ValueError and change nothing."""
        sampling = sampling or SamplingParams()
        prompt = self.validate_request(request_id, prompt_ids, sampling)
        arrival = self.clock() if arrival_time is None else arrival_time
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(
            hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")
        order = next(self._order)
        common = dict(request_id=request_id, num_prompt_tokens=len(prompt), sampling=sampling,
                      arrival_time=arrival, order=order, tenant=tenant, priority=priority)
        if sampling.n > 1 and len(prompt) > 1:
            # The samples share the prompt: prefill all but its last token once, then fork.
            seqs = [Sequence(seq_id=f"{request_id}#prompt", tokens=prompt[:-1], seed=seed,
                             is_group_prefill=True, **common)]
        else:
            seqs = [Sequence(seq_id=f"{request_id}#{i}", tokens=list(prompt), seed=seed + i,
                             sample_index=i, **common) for i in range(sampling.n)]
        self._requests[request_id] = []
        self._request_meta[request_id] = dict(prompt=prompt, arrival=arrival, tenant=tenant,
                                              n=sampling.n, samples={})
        for seq in seqs:
            self._register(seq)

    def _register(self, seq: Sequence) -> None:
        seq.weights_version = seq.weights_version or self.model.weights_version
        self._seqs[seq.seq_id] = seq
        self._requests[seq.request_id].append(seq.seq_id)
        self._waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Stops a request; its pages are freed and it finishes with reason ABORT."""
        if request_id not in self._requests:
            raise ValueError(f"unknown request_id {request_id!r}")
        for seq_id in list(self._requests[request_id]):
            seq = self._seqs[seq_id]
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, FinishReason.ABORT)
        self._maybe_emit(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._swapped)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ----------------------------------------------------------------------------- scheduling

    def _peek_cached_tokens(self, seq: Sequence) -> int:
        peek = getattr(self.allocator, "peek_cached_tokens", None)
        if peek is None or seq.status is not SeqStatus.WAITING:
            return 0
        return peek(seq.tokens, cache_key=self._cache_key(seq))

    def _cache_key(self, seq: Sequence) -> bytes:
        return self.provenance(seq.tenant, seq.weights_version)

    def _ranked(self, seqs: list[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=self.policy.priority_key)

    def _free_pages_of(self, seq: Sequence) -> None:
        self.retention.drop(seq.seq_id)
        freed = self.allocator.free(seq.seq_id)
        if self.config.scrub_freed_pages:
            if freed:
                self._spill_evictions()
            # Also with no page freed (its pages stay in the prefix cache): a KIVI sequence's
            # window slot is freed with it and must be zeroed before a new sequence takes it.
            self.kv = self.swap_space.scrub(self.kv, freed)
            self.stats["scrubbed_pages"] += len(freed)

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        if (seq.num_computed > 0 and self.config.kv_layout is KVLayout.PAGED
                and self._swap_on_preempt(seq)):
            pages = self.allocator.block_table(seq.seq_id)[:pages_for(seq.num_computed,
                                                                      self.config.page_size)]
            nbytes = self.swap_space.swap_out(self.kv, seq.seq_id, pages)
            self.stats["swaps_out"] += 1
            self.stats["swap_bytes"] += nbytes
            self._free_pages_of(seq)
            seq.status = SeqStatus.SWAPPED
            self._swapped.append(seq)
            return
        self._free_pages_of(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self._waiting.append(seq)

    def _admit(self, seq: Sequence, *, is_due: bool = True) -> bool:
        """Registers a waiting sequence with the allocator (prefix-cache lookup).

        With tiers on, the hash chain continues in the host and disk tiers; False while pages
        found there are loading (the sequence is scheduled only once they are committed).
        `is_due`: the scheduler wants to run it this step (False: a prefetch).
        """
        if self.tiers is not None and self.allocator.has_sequence(seq.seq_id):
            return not self.tiers.is_loading(seq.seq_id)
        cached = self.allocator.add_sequence(seq.seq_id, seq.tokens,
                                             cache_key=self._cache_key(seq))
        seq.num_computed = cached
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
        return self._load_from_tiers(seq, is_due=is_due)

    def _swap_in(self, seq: Sequence) -> bool:
        if self.tiers is not None:
            return self._swap_in_from_tiers(seq)
        cached = self.allocator.add_sequence(seq.seq_id, seq.tokens[:seq.num_computed + 1],
                                             cache_key=self._cache_key(seq))
        status, copies = self.allocator.ensure_writable(seq.seq_id, cached, seq.num_computed)
        if status is not AllocStatus.OK:
            self.allocator.free(seq.seq_id)
            return False
        self._apply_copies(copies)
        pages = self.allocator.block_table(seq.seq_id)
        first = cached // self.config.page_size
        self.kv, nbytes = self.swap_space.swap_in(self.kv, seq.seq_id, pages, first)
        for page in pages[first:]:
            self._page_version[page] = seq.weights_version
        self.stats["swaps_in"] += 1
        self.stats["swap_bytes"] += nbytes
        seq.status = SeqStatus.RUNNING
        return True

    def _apply_copies(self, copies) -> None:
        self._spill_evictions()
        if copies:
            src = np.array([c.src for c in copies], np.int32)
            dst = np.array([c.dst for c in copies], np.int32)
            for c in copies:
                self._page_version[c.dst] = self._page_version.get(c.src, "")
            n = _bucket(len(copies), 1, 1 << 30)
            # Pad by repeating the last copy: idempotent, and keeps shapes bucketed.
            src = np.concatenate([src, np.full(n - len(src), src[-1], np.int32)])
            dst = np.concatenate([dst, np.full(n - len(dst), dst[-1], np.int32)])
            self.kv = self.runner.copy_pages(self.kv, src, dst)

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
        full = pages_for(num_tokens, p)
        if policy.name not in _ROLLING_EVICTION:
            return full
        uncompacted = pages_for(policy.budget + p - 1 + self.config.max_prefill_chunk, p)
        return min(full, uncompacted + pages_for(policy.budget, p))

    def _can_admit(self, num_new_pages: int) -> bool:
        reserve = int(self.config.watermark * self.num_pages)
        return self.allocator.num_free_pages() - num_new_pages >= reserve

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """Picks this step's rows: (sequence, number of its pending tokens to compute)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        self._poll_tiers()
        decode: list[tuple[Sequence, int]] = []
        prefill: list[tuple[Sequence, int]] = []
        copies = []
        scheduled: set[str] = set()
        active = self._active_version()
        # 1. Decode rows for running sequences, highest ranked first; preempt from the bottom.
        for seq in self._ranked(self._running):
            if (seq.status is not SeqStatus.RUNNING or seq.num_pending != 1
                    or seq.weights_version != active):
                continue
            if len(decode) >= cfg.max_num_seqs or budget < 1:
                break
            while True:
                cached = self._cached_len(seq)
                status, ops = self.allocator.ensure_writable(seq.seq_id, cached, cached + 1)
                if status is AllocStatus.OK:
                    copies += ops
                    decode.append((seq, 1))
                    scheduled.add(seq.seq_id)
                    budget -= 1
                    break
                victims = [s for s in self._ranked(self._running) if s.seq_id not in scheduled]
                victim = victims[-1]
                self._preempt(victim)
                if victim is seq:
                    break
        # 2. Prefill chunks: running partial prefills, then swapped, then waiting sequences.
        partial = [s for s in self._ranked(self._running)
                   if s.num_pending > 1 and s.seq_id not in scheduled]
        candidates = partial + self._ranked(self._swapped) + self._ranked(self._waiting)
        for seq in candidates:
            if seq.weights_version != active:
                continue
            if budget <= 0 or len(prefill) >= cfg.max_prefill_seqs:
                break
            if seq.status is SeqStatus.SWAPPED:
                need = pages_for(seq.num_computed, cfg.page_size)
                if len(self._running) >= cfg.max_num_seqs or not self._can_admit(need):
                    break
                if not self._swap_in(seq):
                    break
                self._swapped.remove(seq)
                self._running.append(seq)
                if seq.num_pending == 1 and len(decode) < cfg.max_num_seqs:
                    status, ops = self.allocator.ensure_writable(
                        seq.seq_id, seq.num_computed, seq.num_computed + 1)
                    if status is AllocStatus.OK:
                        copies += ops
                        decode.append((seq, 1))
                        scheduled.add(seq.seq_id)
                        budget -= 1
                continue
            is_new = seq.status is SeqStatus.WAITING
            if is_new:
                if len(self._running) >= cfg.max_num_seqs:
                    break
                if not self._admit(seq):
                    continue
            chunk = min(seq.num_pending, budget, cfg.max_prefill_chunk)
            cached = self._cached_len(seq)
            need = self.allocator.pages_needed(seq.seq_id, cached + chunk)
            ok = not is_new or self._can_admit(need)
            if ok:
                status, ops = self.allocator.ensure_writable(seq.seq_id, cached, cached + chunk)
                ok = status is AllocStatus.OK
            if not ok:
                if is_new:
                    self.allocator.free(seq.seq_id)
                    seq.num_computed = 0
                break
            copies += ops
            if is_new:
                self._waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self._running.append(seq)
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = self.clock()
            prefill.append((seq, chunk))
            scheduled.add(seq.seq_id)
            budget -= chunk
        if not decode and not prefill and self._running:
            # Nothing fits: free the lowest-ranked running sequence so the rest can progress.
            self._preempt(self._ranked(self._running)[-1])
        self._prefetch_from_tiers(idle=not decode and not prefill)
        self._apply_copies(copies)
        self._active = active
        return decode + prefill, len(decode)

    def _active_version(self) -> str:
        """The weights version this step serves: versions in flight take turns step by step."""
        live = {s.weights_version for s in self._running + self._swapped + self._waiting}
        versions = [v for v in self._params if v in live] or [self.model.weights_version]
        return versions[self.stats["steps"] % len(versions)]

    # ----------------------------------------------------------------------------- weights

    def update_weights(self, params, version: str, *,
                       in_flight: WeightUpdatePolicy = WeightUpdatePolicy.RECOMPUTE) -> None:
        """Swaps in new weights between steps; no page computed by other weights is read again.

        The version enters the KV provenance fingerprint, so prefix-cache entries of earlier
        versions never hit. Sequences already in flight follow `in_flight`.
        """
        llama.check_params(params, self.model.config)
        version = str(version)
        if version in self._params or version == self.model.weights_version:
            raise ValueError(f"weights version {version!r} is already in use; versions must be new")
        in_flight = WeightUpdatePolicy(in_flight)
        self.model = dataclasses.replace(self.model, params=params, weights_version=version)
        self._params[version] = params
        self.stats["weight_updates"] += 1
        for seq in list(self._running + self._swapped + self._waiting):
            started = seq.num_computed > 0 or seq.status is not SeqStatus.WAITING or \
                len(seq.tokens) > seq.num_prompt_tokens
            if not started or in_flight is WeightUpdatePolicy.RECOMPUTE:
                self._restart(seq)
                seq.weights_version = version
            elif in_flight is WeightUpdatePolicy.ABORT:
                self._finish(seq, FinishReason.ABORT)
                self._maybe_emit(seq.request_id)
        self._drop_unused_params()

    def _restart(self, seq: Sequence) -> None:
        """Drops a sequence's KV (device pages or host copy); it re-prefills its tokens later."""
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._swapped:
            self._swapped.remove(seq)
        if self.allocator.has_sequence(seq.seq_id):
            self._free_pages_of(seq)
        self.swap_space.drop(seq.seq_id)
        seq.num_computed = 0
        if seq.status is not SeqStatus.WAITING:
            seq.status = SeqStatus.WAITING
            self._waiting.append(seq)

    def _drop_unused_params(self) -> None:
        live = {s.weights_version for s in self._running + self._swapped + self._waiting}
        live.add(self.model.weights_version)
        for version in [v for v in self._params if v not in live]:
            del self._params[version]

    def _check_provenance(self, rows, kv_lens) -> None:
        """Raises if a row would read a page written under other weights (and counts them)."""
        page_size = self.config.page_size
        for (seq, _), kv_len in zip(rows, kv_lens, strict=True):
            table = self.allocator.block_table(seq.seq_id)[:pages_for(kv_len, page_size)]
            stale = [p for p in table if self._page_version.get(p) != seq.weights_version]
            if stale:
                self.stats["stale_kv_reads"] += len(stale)
                raise RuntimeError(
                    f"stale KV: sequence {seq.seq_id!r} (weights {seq.weights_version!r}) would "
                    f"read pages {stale[:4]} written under "
                    f"{[self._page_version.get(p) for p in stale[:4]]}")

    # ----------------------------------------------------------------------------- tiers

    def _init_tiers(self) -> None:
        """Host/disk tiers below the pool (config.tiers) and the preemption cost model's inputs."""
        cfg = self.config.tiers
        self.tiers = None
        self._tier_first_page: dict[str, int] = {}  # swapped sequence -> its first loaded page
        self.stats.update(bytes_device_to_host=0, bytes_host_to_device=0, bytes_host_to_disk=0,
                          bytes_disk_to_host=0, tier_hit_tokens=0, preemption_decisions=[])
        if cfg.enabled:
            if self.config.kv_layout is not KVLayout.PAGED:
                raise ValueError(f"tiers need the paged layout, got kv_layout="
                                 f"{self.config.kv_layout.value!r}")
            if self.config.retention != "none":
                raise ValueError(f"tiers do not run with retention={self.config.retention!r}: "
                                 f"a retained sequence's pages hold a subset of its tokens")
            self.tiers = TierManager(cfg, self.kv)
            if self.allocator.prefix_cache is not None:
                self.allocator.record_evictions()
            self.swap_space = TieredSwapSpace(self.tiers, self.swap_space, self.allocator)
        self._swap_bandwidth = cfg.swap_bandwidth_bytes_per_s
        if (self.config.preemption_mode is PreemptionMode.AUTO and self._swap_bandwidth is None
                and self.config.kv_layout is KVLayout.PAGED):
            rates = measure_transfer_bandwidth(self.kv, min(self.num_pages, 16),
                                               TransferLayout(cfg.transfer_layout))
            self._swap_bandwidth = 2 / (1 / rates["device_to_host_bytes_per_s"]
                                        + 1 / rates["host_to_device_bytes_per_s"])

    def _swap_on_preempt(self, seq: Sequence) -> bool:
        """SWAP or RECOMPUTE as configured; under AUTO, the cost model decides (and is logged)."""
        mode = self.config.preemption_mode
        if mode is not PreemptionMode.AUTO:
            return mode is PreemptionMode.SWAP
        rate = self.config.tiers.recompute_tokens_per_s or (
            (self.stats["prefill_tokens"] + self.stats["decode_tokens"])
            / max(self.stats["step_time_s"], 1e-9))
        decision = decide_preemption(seq.seq_id, seq.num_computed,
                                     bytes_per_token=self.kv_bytes_per_token,
                                     bandwidth_bytes_per_s=self._swap_bandwidth,
                                     recompute_tokens_per_s=max(rate, 1e-9))
        self.stats["preemption_decisions"].append(dataclasses.asdict(decision))
        return PreemptionMode(decision.choice) is PreemptionMode.SWAP

    def _sync_tier_stats(self) -> None:
        for key in ("bytes_device_to_host", "bytes_host_to_device", "bytes_host_to_disk",
                    "bytes_disk_to_host"):
            self.stats[key] = self.tiers.stats[key]

    def _spill_evictions(self) -> None:
        """Copies cached pages evicted since the last call out to the tiers; runs before anything
        writes to those pages (copies, scrubs, loads, the step)."""
        if self.tiers is not None and self.allocator.prefix_cache is not None:
            evicted = self.allocator.drain_evictions()
            if evicted:
                self.tiers.spill(self.kv, evicted)
            self._sync_tier_stats()

    def _poll_tiers(self, owner: str | None = None) -> None:
        """Advances tier transfers (only `owner`'s, if given); sequences whose loads finished get
        their pages counted."""
        if self.tiers is None:
            return
        self._spill_evictions()
        self.kv, results = self.tiers.poll(self.kv, owner=owner)
        self._sync_tier_stats()
        page_size = self.config.page_size
        for result in results:
            seq = self._seqs[result.owner]
            swapped = seq.status is SeqStatus.SWAPPED
            first = (self._tier_first_page.pop(seq.seq_id) if swapped
                     else seq.num_computed // page_size)
            for page in self.allocator.block_table(seq.seq_id)[first:first + result.num_loaded]:
                self._page_version[page] = seq.weights_version
            if swapped:
                self._finish_swap_in(seq, first + result.num_loaded)
                self._swapped.remove(seq)
                self._running.append(seq)
                continue
            gained = result.num_loaded * page_size
            if gained:
                seq.num_computed += gained
                self.allocator.commit(seq.seq_id, seq.tokens[:seq.num_computed])
                self.stats["tier_hit_tokens"] += gained
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt_tokens = min(seq.num_computed, seq.num_prompt_tokens)

    def _tier_hit(self, seq: Sequence, cache_key: bytes, first_page: int) -> list[bytes]:
        """Hashes of the pages after `first_page` that the tiers hold, in chain order."""
        hashes = page_hash_chain(seq.tokens[:len(seq.tokens) - 1], cache_key,
                                 self.config.page_size)[first_page:]
        return hashes[:self.tiers.lookup(hashes)]

    def _load_from_tiers(self, seq: Sequence, *, is_due: bool) -> bool:
        """Issues loads of the pages continuing an admitted sequence's device prefix hit.

        A sequence due to run now waits for its load at once: there is no compute to overlap
        the wait with, and joining the next step instead costs a whole step and staggers the
        batch. Prefetches (and spills) stay asynchronous.

        Returns False while a load is in flight (the sequence waits for it), else True.
        """
        if (self.tiers is None or self.allocator.prefix_cache is None
                or self.tiers.num_loading >= self.config.tiers.max_inflight_loads):
            return True
        page_size = self.config.page_size
        first = seq.num_computed // page_size
        hashes = self._tier_hit(seq, self.allocator.cache_key_of(seq.seq_id), first)
        # Load only when the whole sequence then fits: loaded pages held by a sequence that
        # cannot run would only squeeze the running ones into preemption.
        if not hashes or not self._can_admit(pages_for(len(seq.tokens), page_size) - first):
            return True
        status, _ = self.allocator.ensure_writable(
            seq.seq_id, seq.num_computed, seq.num_computed + len(hashes) * page_size)
        if status is not AllocStatus.OK:
            return True
        pages = self.allocator.block_table(seq.seq_id)[first:first + len(hashes)]
        if self.tiers.load(seq.seq_id, hashes, pages) == 0:
            return True
        if is_due:
            self._poll_tiers(owner=seq.seq_id)
        return not self.tiers.is_loading(seq.seq_id)

    def _prefetch_from_tiers(self, *, idle: bool) -> None:
        """Admits the next waiting sequences, in queue order, whose prefix continues in the
        tiers, so their loads overlap this step instead of starting when the scheduler reaches
        them; it never passes a sequence it cannot prefetch, so it takes no pages ahead of it.

        A step with nothing to run waits for the transfers in flight instead of spinning, and
        releases waiting sequences that hold pages without loading: the queue's head may need
        them, and their loaded pages stay in the device prefix cache.
        """
        if self.tiers is None:
            return
        if idle:
            self.tiers.block_until_landed()
            for seq in list(self._waiting):
                if (self.allocator.has_sequence(seq.seq_id)
                        and not self.tiers.is_loading(seq.seq_id)):
                    self._free_pages_of(seq)
                    seq.num_computed = 0
        if self.allocator.prefix_cache is None:
            return
        for seq in self._ranked(self._waiting)[:self.config.tiers.max_inflight_loads]:
            if (self.tiers.num_loading >= self.config.tiers.max_inflight_loads
                    or len(self._running) >= self.config.max_num_seqs):
                break
            if self.allocator.has_sequence(seq.seq_id):
                continue
            key = self._cache_key(seq)
            first = self.allocator.peek_cached_tokens(seq.tokens, cache_key=key) // \
                self.config.page_size
            hit = self._tier_hit(seq, key, first)
            if not hit or not self._can_admit(
                    pages_for(len(seq.tokens), self.config.page_size) - first):
                break
            self._admit(seq, is_due=False)

    def _swap_in_from_tiers(self, seq: Sequence) -> bool:
        """Starts (or finishes) bringing a swapped sequence back through the tiers.

        Pages still on the device through the prefix cache are reused; the rest are loaded from
        the tiers, and whatever the tiers lost or failed to move is recomputed. True when the
        sequence can run now; False while its load is in flight (`_poll_tiers` resumes it).
        """
        tiers = self.tiers
        if (tiers.is_loading(seq.seq_id) or tiers.swap_pending(seq.seq_id)
                or len(self._running) + tiers.num_loading >= self.config.max_num_seqs):
            return False
        keys = tiers.swap_keys(seq.seq_id)
        cached = self.allocator.add_sequence(seq.seq_id, seq.tokens[:seq.num_computed + 1],
                                             cache_key=tiers.swap_cache_key(seq.seq_id))
        status, copies = self.allocator.ensure_writable(seq.seq_id, cached, seq.num_computed)
        if status is not AllocStatus.OK:
            self.allocator.free(seq.seq_id)
            return False
        self._apply_copies(copies)
        first = cached // self.config.page_size
        available = keys[first:][:tiers.lookup(keys[first:])]
        pages = self.allocator.block_table(seq.seq_id)[first:first + len(available)]
        issued = tiers.load(seq.seq_id, available, pages)
        self.stats["swaps_in"] += 1
        self.stats["swap_bytes"] += issued * tiers.page_bytes
        if issued:
            self._tier_first_page[seq.seq_id] = first
            return False
        self._finish_swap_in(seq, first)
        return True

    def _finish_swap_in(self, seq: Sequence, num_valid_pages: int) -> None:
        """The first `num_valid_pages` pages hold the sequence's KV; the rest is recomputed."""
        seq.num_computed = min(seq.num_computed, num_valid_pages * self.config.page_size)
        seq.status = SeqStatus.RUNNING
        self.tiers.drop(seq.seq_id)

    # ----------------------------------------------------------------------------- the step

    def _decode_buckets(self, *, mixed: bool) -> list[int]:
        """Padded decode-row counts: powers of two alone, powers of four beside a prefill."""
        cap = _bucket(self.config.max_num_seqs, 1, 1 << 30)
        base = 4 if mixed else 2
        sizes, n = [], 1
        while n < cap:
            sizes.append(n)
            n *= base
        return ([0] if mixed else []) + sizes + [cap]

    def _chunk_buckets(self) -> list[int]:
        """Padded prefill chunk lengths: powers of four from min_chunk_bucket, and the maximum."""
        cap = _bucket(self.config.max_prefill_chunk, 1, 1 << 30)
        sizes, n = [], min(self.config.min_chunk_bucket, cap)
        while n < cap:
            sizes.append(n)
            n *= 4
        return sizes + [cap]

    def step_shapes(self, logits_mode: LogitsMode = LogitsMode.NONE) -> list[StepShape]:
        """Every greedy step shape this engine can produce: what `warmup` compiles."""
        width = self.block_table_width
        shapes = [StepShape(bd, 0, 1, width, logits_mode=logits_mode)
                  for bd in self._decode_buckets(mixed=False)]
        prefill_rows = sorted({1, self.config.max_prefill_seqs})
        shapes += [StepShape(bd, bp, c, width, logits_mode=logits_mode)
                   for bd in self._decode_buckets(mixed=True) for bp in prefill_rows
                   for c in self._chunk_buckets()]
        return shapes

    def warmup(self) -> int:
        """Compiles every greedy step shape on padding inputs; returns the compile count.

        Padded tokens write nothing and padded rows read nothing, so the KV state is unchanged.
        """
        for shape in self.step_shapes():
            _, self.kv = self.runner.step(self.model.params, self.kv, empty_step_input(shape),
                                          shape)
        if self.tiers is not None:
            self.kv = self.tiers.warmup(self.kv)
        self.kv = self.retention.warmup(self.kv)
        swaps = self.config.preemption_mode is not PreemptionMode.RECOMPUTE
        self.kv = self.swap_space.warmup(self.kv, self.block_table_width, swap=swaps,
                                         scrub=self.config.scrub_freed_pages)
        jax.block_until_ready(self.kv)
        return self.num_compiles

    def _build_input(self, rows, num_decode: int, logits_mode: LogitsMode):
        cfg = self.config
        prefill_rows = rows[num_decode:]
        mixed = bool(prefill_rows)
        bd = min(b for b in self._decode_buckets(mixed=mixed) if b >= num_decode)
        # Prefill rows come in two sizes only (one sequence, or the most allowed), which keeps
        # the number of step shapes small enough to compile them all during warm-up.
        bp = (1 if len(prefill_rows) == 1 else cfg.max_prefill_seqs) if prefill_rows else 0
        longest = max((n for _, n in prefill_rows), default=1)
        chunk = min(c for c in self._chunk_buckets() if c >= longest) if mixed else 1
        max_pages = self.block_table_width
        sampling = [s.sampling for s, _ in rows]
        shape = StepShape(
            num_decode=bd, num_prefill=bp, chunk=chunk, max_pages=max_pages,
            all_greedy=all(p.is_greedy for p in sampling),
            needs_filter=any(p.needs_filter for p in sampling), logits_mode=logits_mode)
        buf = empty_step_input(shape)
        page_size = cfg.page_size
        for i, (seq, n) in enumerate(rows):
            r = i if i < num_decode else bd + (i - num_decode)
            t0 = r if i < num_decode else bd + (i - num_decode) * chunk
            table = np.asarray(self.allocator.block_table(seq.seq_id), np.int32)
            pos = np.arange(seq.num_computed, seq.num_computed + n, dtype=np.int32)
            buf["tokens"][t0:t0 + n] = seq.tokens[seq.num_computed:seq.num_computed + n]
            buf["positions"][t0:t0 + n] = pos
            # Retention: positions are logical (RoPE); slots and lengths count cached tokens.
            cpos = pos - self.retention.num_evicted(seq.seq_id)
            buf["slot_mapping"][t0:t0 + n] = table[cpos // page_size] * page_size + \
                cpos % page_size
            buf["score_weights"][t0:t0 + n] = self.retention.score_weights(
                seq.seq_id, pos, len(seq.tokens))
            for page in set(table[cpos // page_size].tolist()):
                self._page_version[page] = seq.weights_version
            width = min(len(table), max_pages)
            buf["block_tables"][r, :width] = table[:width]
            buf["kv_lens"][r] = cpos[-1] + 1
            buf["q_lens"][r] = n
            p = seq.sampling
            buf["temperature"][r] = p.temperature
            buf["top_k"][r] = p.top_k
            buf["top_p"][r] = p.top_p
            buf["seeds"][r] = seq.seed
            buf["counters"][r] = len(seq.tokens) - seq.num_prompt_tokens
            if isinstance(self.allocator, residual.WindowBlockManager):
                buf["seq_slots"][r] = self.allocator.seq_slot(seq.seq_id)
        row_index = [i if i < num_decode else bd + (i - num_decode) for i in range(len(rows))]
        return shape, buf, row_index

    def step(self, *, logits_mode: LogitsMode = LogitsMode.NONE) -> list[RequestOutput]:
        """One scheduling iteration. Returns the outputs of requests that finished during it."""
        t_start = time.perf_counter()
        rows, num_decode = self._schedule()
        if rows:
            shape, buf, row_index = self._build_input(rows, num_decode, logits_mode)
            if self.config.debug_provenance:
                self._check_provenance(rows, [buf["kv_lens"][r] for r in row_index])
            t_dispatch = time.perf_counter()
            out, self.kv = self.runner.step(self._params[self._active], self.kv, buf, shape)
            tokens = np.asarray(out.tokens)  # The one host sync per step.
            logprobs = np.asarray(out.logprobs)
            t_done = time.perf_counter()
            self.last_logits = out.logits
            key_scores = None if out.key_scores is None else np.asarray(out.key_scores)
            self._commit(rows, row_index, tokens, logprobs, key_scores)
            if len(self._params) > 1:
                self._drop_unused_params()
            self.stats["steps"] += 1
            self.stats["step_time_s"] += t_done - t_dispatch
            self.stats["host_time_s"] += (t_dispatch - t_start) + (time.perf_counter() - t_done)
            self._sample_kv()
        finished, self._finished_outputs = self._finished_outputs, []
        return finished

    def _commit(self, rows, row_index, tokens, logprobs, key_scores=None) -> None:
        now = self.clock()
        for (seq, n), r in zip(rows, row_index, strict=True):
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed += n
            self.allocator.commit(seq.seq_id, seq.tokens[:seq.num_computed])
            self.policy.on_tokens(seq, n)
            self._retain(seq, n, None if key_scores is None else key_scores[r])
            self.stats["decode_tokens" if n == 1 and seq.num_pending == 0 and
                       len(seq.tokens) > seq.num_prompt_tokens else "prefill_tokens"] += n
            if seq.num_pending:
                continue
            if seq.is_group_prefill:
                self._fork_group(seq)
                continue
            seq.tokens.append(int(tokens[r]))
            seq.logprobs.append(float(logprobs[r]))
            seq.token_times.append(now)
            self._check_stop(seq)
        for request_id in {seq.request_id for seq, _ in rows}:
            self._maybe_emit(request_id)

    def _cached_len(self, seq: Sequence) -> int:
        """Tokens of `seq` in the cache: its logical length less what retention evicted."""
        return seq.num_computed - self.retention.num_evicted(seq.seq_id)

    def _retain(self, seq: Sequence, n: int, key_scores: np.ndarray | None) -> None:
        """Tells the retention policy about a row's n computed tokens; frees what it drops."""
        if self.retention.is_exact:
            return
        self.retention.observe(seq.seq_id, seq.num_computed - n, n, key_scores)
        is_prefill_done = seq.num_pending == 0
        keep = self.retention.select(seq.seq_id, is_prefill_done=is_prefill_done)
        if keep is None:
            return
        status, src, dst, freed = self.allocator.retain(seq.seq_id, keep)
        if status is not AllocStatus.OK:  # No page for a copy now: evict after a later step.
            return
        self.kv = self.retention.evict(self.kv, seq.seq_id, keep, src, dst, len(freed),
                                       is_prefill_done=is_prefill_done,
                                       block_table=self.allocator.block_table(seq.seq_id))
        for page in self.allocator.block_table(seq.seq_id):
            self._page_version[page] = seq.weights_version
        if freed and self.config.scrub_freed_pages:
            self.kv = self.swap_space.scrub(self.kv, freed)
            self.stats["scrubbed_pages"] += len(freed)

    def _fork_group(self, parent: Sequence) -> None:
        meta = self._request_meta[parent.request_id]
        prompt = meta["prompt"]
        self._running.remove(parent)
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
                weights_version=parent.weights_version)
            try:
                copies = self.allocator.fork(parent.seq_id, child.seq_id) or []
            except ValueError:  # No room to share (contiguous slots): prefill it afresh.
                self._register(child)
                continue
            self.retention.fork(parent.seq_id, child.seq_id)
            self._apply_copies(copies)
            if isinstance(self.swap_space, residual.WindowSwapSpace):
                self.kv = self.swap_space.copy_window(self.kv, parent.seq_id, child.seq_id)
            child.num_computed = parent.num_computed
            child.status = SeqStatus.RUNNING
            self._seqs[child.seq_id] = child
            self._requests[child.request_id].append(child.seq_id)
            self._running.append(child)
        self._free_pages_of(parent)
        del self._seqs[parent.seq_id]

    def _check_stop(self, seq: Sequence) -> None:
        p = seq.sampling
        token = seq.tokens[-1]
        eos = () if p.ignore_eos else self.model.config.eos_token_ids
        if token in eos or token in p.stop_token_ids:
            self._finish(seq, FinishReason.STOP)
        elif len(seq.output_ids) >= p.max_new_tokens or len(seq.tokens) >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        for queue in (self._running, self._waiting, self._swapped):
            if seq in queue:
                queue.remove(seq)
        if self.allocator.has_sequence(seq.seq_id):
            self._free_pages_of(seq)
        self.swap_space.drop(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._request_meta[seq.request_id]["finish_time"] = self.clock()

    def _maybe_emit(self, request_id: str) -> None:
        seq_ids = self._requests.get(request_id, [])
        seqs = [self._seqs[s] for s in seq_ids]
        meta = self._request_meta[request_id]
        if len(seqs) < meta["n"] or any(s.status is not SeqStatus.FINISHED for s in seqs):
            return
        self._finished_outputs.append(self._output(request_id, finished=True))
        for s in seq_ids:
            del self._seqs[s]
        del self._requests[request_id]
        del self._request_meta[request_id]

    def _output(self, request_id: str, *, finished: bool) -> RequestOutput:
        meta = self._request_meta[request_id]
        seqs = sorted((self._seqs[s] for s in self._requests[request_id]),
                      key=lambda s: s.sample_index)
        tokenizer = self.model.tokenizer
        outputs = [CompletionOutput(
            index=s.sample_index, token_ids=list(s.output_ids), logprobs=list(s.logprobs),
            finish_reason=s.finish_reason,
            text=tokenizer.decode(s.output_ids) if tokenizer is not None else None)
            for s in seqs if not s.is_group_prefill]
        first = seqs[0]
        times = first.token_times if not first.is_group_prefill else []
        return RequestOutput(
            request_id=request_id, prompt_ids=list(meta["prompt"]), outputs=outputs,
            finished=finished, arrival_time=meta["arrival"],
            first_token_time=times[0] if times else None,
            finish_time=meta.get("finish_time") if finished else None, token_times=list(times),
            num_cached_prompt_tokens=first.num_cached_prompt_tokens,
            num_preemptions=sum(s.num_preemptions for s in seqs), tenant=meta["tenant"])

    def snapshot_outputs(self) -> list[RequestOutput]:
        """Current (streaming) outputs of every unfinished request."""
        return [self._output(r, finished=False) for r in self._requests]

    # ----------------------------------------------------------------------------- metrics

    def _sample_kv(self) -> None:
        """Records (time, bytes holding live tokens, bytes reserved by running sequences)."""
        live = sum(self._cached_len(s) for s in self._running)
        if isinstance(self.allocator, SlotAllocator):
            reserved_tokens = len(self._running) * self.max_model_len
        else:
            reserved_tokens = self.allocator.num_used_pages() * self.config.page_size
            live = min(live, reserved_tokens)
        per_token = self.kv_bytes_per_token
        self.kv_samples.append((self.clock(), int(live * per_token),
                                int(reserved_tokens * per_token)))

    def prefix_cache_stats(self) -> dict:
        stats = getattr(self.allocator, "stats", None)
        if stats is None:
            return dict(prefix_queries=0, prefix_query_tokens=0, prefix_hit_tokens=0)
        return dict(prefix_queries=stats.prefix_queries,
                    prefix_query_tokens=stats.prefix_query_tokens,
                    prefix_hit_tokens=stats.prefix_hit_tokens)

    # ----------------------------------------------------------------------------- blocking API

    def generate(self, prompts: Seq[Seq[int]], sampling: SamplingParams | Seq[SamplingParams]
                 | None = None) -> list[RequestOutput]:
        """Runs prompts to completion; invalid ones come back with `error` set, alone."""
        return list(self.stream(prompts, sampling, final_only=True))

    def stream(self, prompts: Seq[Seq[int]], sampling=None, *, final_only: bool = False
               ) -> Iterator[RequestOutput]:
        """Yields outputs as tokens arrive (every request each step), finals marked `finished`."""
        ids, results = submit_all(self.add_request, prompts, sampling,
                                  f"gen-{next(self._order)}", self.clock())
        pending = {r for r in ids if r not in results}
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
            if not final_only:
                yield from (o for o in self.snapshot_outputs() if o.request_id in pending)
        yield from (results[r] for r in ids)
