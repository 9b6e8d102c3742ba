"""An engine's records of what it ran: the KV provenance fingerprint its prefix cache keys
pages by, and the recipe a decision recording needs to rebuild its scheduler for a replay
(`kvjax.scheduler.replay`)."""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable, Iterable

import jax.numpy as jnp

from kvjax.engine import compat
from kvjax.engine.config import EngineConfig
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.models.model import Model
from kvjax.scheduler.replay import DecisionRecorder, SchedulerRecipe
from kvjax.scheduler.scheduler import Scheduler
from kvjax.trace import NULL_TRACER


def provenance(model: Model, config: EngineConfig, *, codec_name: str, kv_dtype,
               retention_fingerprint: str, tenant: str | None = None,
               weights_version: str | None = None) -> bytes:
    """The KV provenance fingerprint: what produced a page, and who may read it."""
    tokenizer = model.tokenizer
    version = model.weights_version if weights_version is None else weights_version
    mc = model.config
    rope = f"rope={mc.rope.fingerprint}:absolute"
    if mc.local_rope is not None:  # keys of those layers are turned by their own RoPE
        rope += f";local={mc.local_rope.fingerprint}@{list(mc.local_rope_layers)}"
    parts = [
        f"model={mc.name}",
        f"weights={version}",
        f"tokenizer={getattr(tokenizer, 'fingerprint', type(tokenizer).__name__)}",
        "adapter=none",
        rope,
        f"codec={codec_name}:{jnp.dtype(kv_dtype).name}",
        f"layout={config.kv_layout.value}:P{config.page_size}",
        f"tenant={tenant or ''}",
        f"retention={retention_fingerprint}",
    ]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).digest()


def decision_recorder(cfg: EngineConfig, scheduler: Scheduler, kv_cache: KVCacheManager,
                      cache_key: Callable[..., bytes], *, on_mesh: bool,
                      operations: Iterable[compat.Feature]) -> DecisionRecorder:
    """Starts recording `scheduler`'s calls and decisions (see `Engine.record_decisions`);
    refuses what a replay cannot rebuild."""
    compat.check(cfg, on_mesh=on_mesh, uses=(compat.Feature.RECORD_DECISIONS, *operations))
    tiers = kv_cache.tiers
    if tiers is not None and (cfg.tiers.disk_bytes or tiers.stats["transfers_committed"]
                              or tiers.num_inflight or len(tiers.host)):
        raise ValueError("record_decisions: a replay rebuilds the tiers fresh and without "
                         "a disk tier, whose transfers finish on its workers' time, so "
                         f"record before the first step with no disk (disk_bytes="
                         f"{cfg.tiers.disk_bytes})")
    allocator = copy.deepcopy(kv_cache.allocator)
    allocator.tracer = NULL_TRACER
    allocator.clock = time.monotonic  # a replay gives it the replayed clock
    recipe = SchedulerRecipe(
        config=scheduler.config, allocator=allocator, policy=cfg.scheduler_policy,
        retention=cfg.retention, retention_budget=cfg.retention_budget,
        retention_options=dict(cfg.retention_options), drafter=cfg.spec.method,
        drafter_options=dict(cfg.spec.options), controller=cfg.controller,
        controller_options=dict(cfg.controller_options), context_reuse=cfg.context_reuse,
        context_reuse_options=dict(cfg.context_reuse_options), watermark=cfg.watermark,
        scrub_freed_pages=cfg.scrub_freed_pages,
        weights_version=scheduler.weights_version,
        tiers=None if tiers is None else cfg.tiers,
        tier_pages=() if tiers is None else (tiers.port.page_shapes, tiers.port.page_dtypes,
                                             tiers.port.memory_kind),
        keeps_windows=kv_cache.keeps_windows,
        quantized_lens=kv_cache.floors.quantized_lens(scheduler.config.max_model_len + 1))
    return DecisionRecorder(scheduler, recipe, cache_key)


def kv_bytes_moved(stats: dict, tiers) -> dict[str, int]:
    """KV bytes moved so far (see `Engine.kv_bytes_moved`), from the engine's `stats` and its
    `tiers` (None without)."""
    if tiers is None:
        return dict(host=stats["swap_bytes"], disk=0)
    t = tiers.stats
    return dict(host=t["bytes_device_to_host"] + t["bytes_host_to_device"],
                disk=t["bytes_host_to_disk"] + t["bytes_disk_to_host"])
