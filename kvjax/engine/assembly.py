"""Building the engine's memory parts: the tiers and swap space below the pool, the KV
programs the runner applies for the scheduler's KV operations, and the `SchedulerConfig` the
pool and the config imply. Each is a function of explicit arguments; `Engine.__init__` calls
them in order."""

from __future__ import annotations

from kvjax import grammar as grammar_lib
from kvjax.config import KVLayout
from kvjax.engine.config import EngineConfig, PreemptionMode
from kvjax.engine.intake import BIAS_WIDTH
from kvjax.engine.runner import ModelRunner, StepBuckets
from kvjax.engine.step import attention_name
from kvjax.engine.swap import DEMOTION_BITS, demoted_nbytes, demotes
from kvjax.kv import fused_write
from kvjax.kv.retention import Compactor
from kvjax.kv.reuse import ChunkCopier
from kvjax.memory.ops import TIER_KINDS, KVOpKind
from kvjax.memory.tiers import (
    PlannedTierPort,
    TieredSwapSpace,
    TierManager,
    TierTransfers,
    TransferLayout,
    measure_transfer_bandwidth,
)
from kvjax.models import invariant
from kvjax.scheduler.scheduler import SchedulerConfig


def build_tiers(config: EngineConfig, runner: ModelRunner, pool):
    """Host/disk tiers below the pool (config.tiers), and the swap space in front of them.

    Returns (tiers or None, swap space, swap bandwidth in bytes/s or None): the bandwidth is
    the configured one, else measured where preemption or a controller prices swaps."""
    cfg = config.tiers
    swap_bandwidth = cfg.swap_bandwidth_bytes_per_s
    estimates = (config.preemption_mode is PreemptionMode.AUTO
                 or config.controlled)  # a controller prices swaps too
    if estimates and swap_bandwidth is None and config.kv_layout is KVLayout.PAGED:
        rates = measure_transfer_bandwidth(runner.kv, min(pool.allocator.num_pages, 16),
                                           TransferLayout(cfg.transfer_layout))
        swap_bandwidth = 2 / (1 / rates["device_to_host_bytes_per_s"]
                              + 1 / rates["host_to_device_bytes_per_s"])
    if not cfg.enabled:
        return None, pool.swap_space, swap_bandwidth
    # The ledger decides transfers as KV ops of the step's plan; the runner moves the bytes.
    transfers = TierTransfers(runner.kv)
    tiers = TierManager(cfg, port=PlannedTierPort.of(runner.kv, transfers.memory_kind))
    transfers.warm_sizes = tuple(tiers.warm_sizes())
    runner.tier_transfers = transfers
    for kind in TIER_KINDS:
        runner.kv_programs[kind] = transfers.apply
    if pool.allocator.prefix_cache is not None:
        pool.allocator.record_evictions()
    return tiers, TieredSwapSpace(tiers, pool.swap_space, pool.allocator), swap_bandwidth


def install_kv_programs(runner: ModelRunner, swap_space, plain_swap, compactor: Compactor,
                        chunk_copier: ChunkCopier) -> None:
    """Registers in `runner` the programs of the scrub, swap, window-copy, compaction and
    chunk-load KV operations. Swaps as data go to the plain swap space `plain_swap` (with
    tiers on, pages go through the tiers); scrubs and window copies to `swap_space`."""
    runner.kv_programs[KVOpKind.SCRUB] = lambda kv, op: swap_space.scrub(
        kv, op.dst, op.seq_slots)
    runner.kv_programs[KVOpKind.SWAP_OUT] = plain_swap.swap_out
    runner.kv_programs[KVOpKind.SWAP_IN] = plain_swap.swap_in
    runner.kv_programs[KVOpKind.SWAP_DROP] = lambda kv, op: (
        plain_swap.drop(op.host_slot), kv)[1]
    # Only a swap space that keeps windows is ever asked for a window copy.
    runner.kv_programs[KVOpKind.COPY_WINDOW] = lambda kv, op: swap_space.copy_window(
        kv, op.src[0], op.dst[0])
    runner.kv_programs[KVOpKind.COMPACT] = lambda kv, op: compactor(kv, op.plan)
    runner.kv_programs[KVOpKind.CHUNK_LOAD] = lambda kv, op: chunk_copier.copy(
        kv, op.plan.src_pages, op.plan.offset, op.plan.dst_slots, op.plan.shift,
        op.plan.key_scale)


def scheduler_config(cfg: EngineConfig, runner: ModelRunner, *,
                     max_model_len: int, kv_bytes_per_token: int,
                     swap_bandwidth: float | None, eos_token_ids) -> SchedulerConfig:
    """The scheduler's config for an engine of config `cfg` over `runner`'s pool."""
    return SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_prefill_chunk=cfg.max_prefill_chunk, max_prefill_seqs=cfg.max_prefill_seqs,
        page_size=cfg.page_size, max_model_len=max_model_len,
        is_paged=cfg.kv_layout is KVLayout.PAGED, preemption_mode=cfg.preemption_mode,
        kv_bytes_per_token=kv_bytes_per_token,
        swap_bandwidth_bytes_per_s=swap_bandwidth,
        recompute_tokens_per_s=cfg.tiers.recompute_tokens_per_s,
        max_inflight_loads=cfg.tiers.max_inflight_loads,
        eos_token_ids=tuple(eos_token_ids),
        prefill_buckets=runner.buckets.prefill_buckets,
        prefill_padding_limit=cfg.prefill_padding_limit,
        num_draft_tokens=cfg.spec.num_draft_tokens if cfg.spec.enabled else 0,
        adaptive_drafts=cfg.spec.adaptive,
        max_tenant_page_share=cfg.max_tenant_page_share,
        contended_prefill_chunk=cfg.contended_prefill_chunk,
        contention_window_s=cfg.contention_window_s,
        hide_shared_hits=cfg.hide_shared_prefix_hits,
        demote_ratios=demote_ratios(cfg, runner))


def demote_ratios(config: EngineConfig, runner: ModelRunner) -> dict[int, float]:
    """The precisions swapped copies can be demoted to, each with the byte ratio it saves:
    {bits: page bytes / demoted copy bytes} (an exact float K/V pool swapped through the
    plain swap space; a quantized pool's codes stay as they are)."""
    leaves = runner.kv.page_leaves()
    if config.kv_layout is not KVLayout.PAGED or config.tiers.enabled:
        return {}
    nbytes = sum(x.nbytes for x in leaves)
    return {bits: nbytes / sum(demoted_nbytes(x, bits) for x in leaves)
            for bits in DEMOTION_BITS if all(demotes(x, bits) for x in leaves)}


def warm_up(config: EngineConfig, runner: ModelRunner, kv_cache, scheduler, context_reuse, *,
            weights_version: str, sampling: bool, max_model_len: int,
            table_pages: int) -> None:
    """Compiles every step shape of `runner` and every KV program of `kv_cache` the engine
    can run (see `Engine.warmup`); `table_pages` is the pages a swap or scrub moves at most (a
    block table's width times the layer groups' tables)."""
    plan = context_reuse.plan(max_model_len)
    runner.warmup(weights_version, sampling=sampling, blend_ratio=plan.blend_ratio or None,
                  max_blend_tokens=max_model_len)
    # Copy-on-write (n > 1 samples, shared partial pages): at most one copy per row.
    is_paged = config.kv_layout is KVLayout.PAGED
    controlled = config.controlled
    # A swap or a scrub moves the pages of every layer group's table at once.
    kv_cache.warmup(table_pages,
                    swap=config.preemption_mode is not PreemptionMode.RECOMPUTE or controlled,
                    demote_bits=tuple(scheduler.config.demote_ratios) if controlled else (),
                    max_copies=config.max_num_seqs + config.max_prefill_seqs if is_paged else 0,
                    max_chunk_tokens=max_model_len if context_reuse.reuses else 0)
    runner.apply_ops(scheduler.in_place.warmup_ops())  # mixed-precision pools


def check_pool(config: EngineConfig, model_config, kv, retention, *, dtype, kv_dtype) -> None:
    """Refuses, with a ValueError naming the setting, a pool the config's batch invariance,
    fused KV write or ECHO retention cannot run on."""
    mc = model_config
    if config.batch_invariant:
        invariant.check(mc, dtype, kv_dtype)
    if config.fused_kv_write:
        reason = fused_write.reason_for(
            kv, dtype, qk_norm=mc.qk_norm, batch_invariant=config.batch_invariant,
            pallas=attention_name(config.attention_impl, kv) == "pallas")
        if reason is not None:
            raise ValueError(f"EngineConfig.fused_kv_write for model {mc.name!r}: {reason}")
    echo = retention.policy.echo_prefetch
    if echo is not None and config.num_host_pages <= 0:  # host-authoritative pages
        raise ValueError(f"retention_options echo_prefetch={echo!r} keeps every page in the "
                         f"host pool: EngineConfig.num_host_pages must be > 0, got "
                         f"{config.num_host_pages!r}")


def step_buckets(config: EngineConfig, *, vocab_size: int, block_table_width: int,
                 max_model_len: int) -> StepBuckets:
    """The step shapes an engine of `config` pads its steps to."""
    return StepBuckets(config.max_num_seqs, config.max_prefill_seqs, config.max_prefill_chunk,
                       config.min_chunk_bucket, block_table_width,
                       config.max_num_batched_tokens, config.chunk_bucket_factor,
                       spec_width=1 + config.spec.num_draft_tokens if config.spec.enabled
                       else 1,
                       history_width=max_model_len, bias_width=BIAS_WIDTH,
                       mask_width=grammar_lib.mask_width(vocab_size))
