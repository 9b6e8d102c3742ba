"""Building an engine's KV pool: the state pytree, its allocator and its swap space, sized from
the byte budget and the pool's `KVCacheSpec` (the model's layer groups with the codec's exact
bytes per token, page and sequence slot)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax.numpy as jnp

from kvjax.config import KVLayout, ModelConfig
from kvjax.engine import residual
from kvjax.engine.config import EngineConfig
from kvjax.engine.layer_budgets import pool_layer_groups
from kvjax.engine.runner import KVStore
from kvjax.engine.swap import HostSwapSpace
from kvjax.kv.spec import KVCacheSpec
from kvjax.kv.state import exact_cache_spec, init_contiguous_kv, init_paged_kv
from kvjax.memory.block_manager import BlockManager
from kvjax.memory.groups import GroupedBlockManager
from kvjax.memory.precision import (
    MIXED_CODEC,
    LedgerPages,
    MixedOptions,
    PrecisionLedger,
    num_page_slots,
)
from kvjax.memory.slots import SlotAllocator


@dataclasses.dataclass
class KVPool:
    """A freshly built pool.

    Attributes:
      kv: the KV state pytree (on the host's default device, uncommitted).
      allocator: the BlockManager, WindowBlockManager (KIVI) or SlotAllocator.
      swap_space: host memory for swapped-out sequences (windows too for KIVI).
      spec: the `KVCacheSpec` the pool was sized from (bytes per token, page, window slot).
      quantized_len: KIVI: of a sequence's first n tokens, how many its pages hold (the rest
        are in its exact window); None: pages hold every token.
      ledger: a mixed-precision pool's `PrecisionLedger` (each page's class and the bytes
        held against the budget); None for pools of one precision.
    """

    kv: Any
    allocator: Any
    swap_space: Any
    spec: KVCacheSpec
    quantized_len: Callable[[int], int] | None = None
    ledger: PrecisionLedger | None = None

    @property
    def kv_bytes_per_token(self) -> float:
        """Device bytes one cached token takes, all layers, K and V."""
        return self.spec.bytes_per_token


class KVPoolSource(Protocol):
    """Builds an engine's pool somewhere other than on its own (a shared arena)."""

    def build(self, mc: ModelConfig, config: EngineConfig, *, max_model_len: int, kv_dtype
              ) -> KVPool:
        """The pool, as `build_kv_pool` returns it."""

    def store(self) -> KVStore:
        """Where the engine's runner keeps the pool's state."""



def allocator_options(config: EngineConfig) -> dict:
    """The block manager's prefix-cache settings from the engine config."""
    return dict(enable_prefix_cache=config.enable_prefix_cache,
                prefix_eviction=config.prefix_cache_eviction)

def budget_bytes(config: EngineConfig, kv_bytes_per_token: float, max_model_len: int) -> int:
    """The KV byte budget: configured, or enough for max_num_seqs full-length sequences."""
    if config.kv_budget_bytes is not None:
        return config.kv_budget_bytes
    return int(kv_bytes_per_token * max_model_len * config.max_num_seqs)


def build_kv_pool(mc: ModelConfig, config: EngineConfig, *, max_model_len: int, kv_dtype
                  ) -> KVPool:
    """The pool for `config`: quantized, contiguous or paged (which features compose is
    checked before, by kvjax.engine.compat)."""
    if config.kv_arena:
        return _arena_pool(mc, config, max_model_len=max_model_len, kv_dtype=kv_dtype)
    if config.kv_codec == "lowrank":
        return _lowrank_pool(mc, config, max_model_len=max_model_len, kv_dtype=kv_dtype)
    if config.kv_codec == MIXED_CODEC:
        return _mixed_pool(mc, config, max_model_len=max_model_len, kv_dtype=kv_dtype)
    if config.kv_codec != "none":
        return _quantized_pool(mc, config, max_model_len=max_model_len)
    spec = exact_cache_spec(mc, config.page_size, kv_dtype,
                            pool_layer_groups(mc, config, max_model_len))
    spec.check_servable()
    per_token = spec.bytes_per_token
    if config.kv_layout is KVLayout.CONTIGUOUS:
        per_seq = per_token * max_model_len
        budget = budget_bytes(config, per_token, max_model_len)
        max_seqs = min(budget // per_seq, config.max_num_seqs)
        if max_seqs < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no sequence of "
                             f"max_model_len={max_model_len} tokens")
        kv = init_contiguous_kv(mc, int(max_seqs), max_model_len, config.page_size, kv_dtype)
        allocator = SlotAllocator(int(max_seqs), max_model_len, config.page_size)
        return KVPool(kv, allocator, HostSwapSpace(), spec)
    num_pages = config.num_pages or spec.num_pages_for_budget(
        budget_bytes(config, per_token, max_model_len))
    kv = init_paged_kv(mc, num_pages, config.page_size, kv_dtype,
                       num_layers=spec.layers_per_table,
                       num_kv_heads=1 if spec.is_head_major else None)
    return KVPool(kv, _paged_allocator(spec, num_pages, config), HostSwapSpace(), spec)


def _paged_allocator(spec: KVCacheSpec, num_pages: int, config: EngineConfig):
    """The block manager of a paged pool: one per layer group over one free list when the
    spec has several block tables."""
    if spec.is_grouped:
        return GroupedBlockManager(num_pages, config.page_size,
                                   [t.window for t in spec.table_groups()],
                                   **allocator_options(config))
    return BlockManager(num_pages, config.page_size, **allocator_options(config))


def _quantized_pool(mc: ModelConfig, config: EngineConfig, *, max_model_len: int) -> KVPool:
    from kvjax.kv import quantized  # Imported lazily: only quantized engines need it.

    options = dict(config.kv_codec_options)
    options.pop("page_size", None)  # checked against the pool's by init_quantized_kv
    spec = quantized.cache_spec(mc, config.page_size, config.kv_codec,
                                pool_layer_groups(mc, config, max_model_len), **options)
    codec = quantized.make_codec(config.kv_codec, **options)
    if quantized.is_kivi(codec):  # KIVI's windows: kvjax.engine.compat refuses layer groups
        spec.check_single_group()
    spec.check_servable()
    if spec.is_grouped and quantized.is_layered(codec):
        raise ValueError(f"kv_codec={config.kv_codec!r} with calibrated scales does not serve "
                         f"model {mc.name!r}: its scales are per model layer, while a pool of "
                         f"several layer groups indexes layers within a group's page")
    per_token = spec.bytes_per_token
    # KIVI's per-sequence exact windows come out of an explicit byte budget first.
    num_seq_slots = quantized.num_seq_slots_for(config.kv_codec, config.max_num_seqs, **options)
    windows = num_seq_slots * spec.seq_slot_bytes
    budget = budget_bytes(config, per_token, max_model_len) - (
        windows if config.kv_budget_bytes else 0)
    if budget < spec.page_bytes and not config.num_pages:
        raise ValueError(f"kv_budget_bytes={config.kv_budget_bytes} holds no page "
                         f"beside {windows} bytes of KIVI windows")
    num_pages = config.num_pages or max(int(budget // spec.page_bytes), 1)
    kv = quantized.init_quantized_kv(mc, num_pages, config.page_size, config.kv_codec,
                                     num_seq_slots=num_seq_slots,
                                     num_layers=spec.layers_per_table,
                                     num_kv_heads=1 if spec.is_head_major else None,
                                     **config.kv_codec_options)
    if not num_seq_slots:
        return KVPool(kv, _paged_allocator(spec, num_pages, config), HostSwapSpace(), spec)
    allocator = residual.WindowBlockManager(
        num_pages, config.page_size, num_seq_slots=num_seq_slots,
        **allocator_options(config), scrub_windows=config.scrub_freed_pages)
    return KVPool(kv, allocator, residual.WindowSwapSpace(allocator), spec,
                  quantized_len=lambda n: int(kv.codec.num_quantized(n)))


def _lowrank_pool(mc: ModelConfig, config: EngineConfig, *, max_model_len: int, kv_dtype
                  ) -> KVPool:
    """Pages of key coordinates in a rank-r basis and exact values (`kvjax.kv.lowrank`); the
    basis is calibrated after the pool is built (`kvjax.engine.kv_calibration`)."""
    from kvjax.kv import codecs, lowrank  # Imported lazily: only low-rank engines need it.

    codec = codecs.get_codec(config.kv_codec, **config.kv_codec_options)
    spec = lowrank.cache_spec(mc, config.page_size, codec, kv_dtype,
                              pool_layer_groups(mc, config, max_model_len))
    spec.check_single_group()  # the bases are per model layer (kvjax.engine.compat refuses)
    spec.check_servable()
    num_pages = config.num_pages or spec.num_pages_for_budget(
        budget_bytes(config, spec.bytes_per_token, max_model_len))
    kv = lowrank.init_lowrank_kv(mc, num_pages, config.page_size, codec, kv_dtype)
    return KVPool(kv, _paged_allocator(spec, num_pages, config), HostSwapSpace(), spec)


def _mixed_pool(mc: ModelConfig, config: EngineConfig, *, max_model_len: int, kv_dtype
                ) -> KVPool:
    """A mixed-precision pool (`kvjax.kv.mixed`): the budget (num_pages: pages it buys at the
    write class) counted in bytes by a `PrecisionLedger`, over as many page slots as it holds
    at the coarsest class, which the block manager draws through `LedgerPages`."""
    from kvjax.kv import mixed  # Imported lazily: only mixed-precision engines need it.

    options = MixedOptions.parse(config.kv_codec_options)
    dtype = jnp.dtype(kv_dtype).name
    spec = mixed.cache_spec(mc, config.page_size, dtype=dtype, group=options.group,
                            write_bits=options.write_bits)
    spec.check_servable()
    write_page = spec.page_bytes_at(*options.write_bits)
    budget = (config.num_pages * write_page if config.num_pages else
              budget_bytes(config, spec.bytes_per_token, max_model_len))
    if budget < write_page:
        raise ValueError(f"kv_budget_bytes={config.kv_budget_bytes} holds no page at the "
                         f"write class {options.write_bits} ({write_page:.0f} bytes)")
    num_slots = num_page_slots(spec, budget)
    ledger = PrecisionLedger(spec, num_slots, budget, options.write_bits)
    kv = mixed.init_mixed_kv(mc, num_slots, config.page_size, dtype=dtype, group=options.group,
                             write_bits=options.write_bits)
    allocator = BlockManager(num_slots, config.page_size, pages=LedgerPages(ledger),
                             **allocator_options(config))
    return KVPool(kv, allocator, HostSwapSpace(), spec, ledger=ledger)


def arena_layout(mc: ModelConfig, config: EngineConfig, kv_dtype, frame_words: int):
    """The `FrameLayout` of `mc`'s pages (config's codec) in frames of `frame_words` words."""
    from kvjax.kv import arena  # Imported lazily: only arena engines need it.

    k_codec, v_codec = arena.arena_codecs(mc, kv_dtype, config.kv_codec,
                                          **config.kv_codec_options)
    return arena.frame_layout(mc, k_codec, v_codec, frame_words), k_codec, v_codec


def arena_words_per_page(mc: ModelConfig, config: EngineConfig, kv_dtype, page_size: int
                         ) -> int:
    """Words of a frame that holds exactly `page_size` tokens of `mc` (config's codec)."""
    layout, _, _ = arena_layout(mc, config, kv_dtype, 1 << 30)
    return layout.num_layers * layout.words_per_token * page_size


def _arena_pool(mc: ModelConfig, config: EngineConfig, *, max_model_len: int, kv_dtype
                ) -> KVPool:
    """An arena of its own: frames of exactly config.page_size tokens, sized by the budget."""
    from kvjax.kv import arena

    frame_words = arena_words_per_page(mc, config, kv_dtype, config.page_size)
    layout, k_codec, v_codec = arena_layout(mc, config, kv_dtype, frame_words)
    spec = arena.arena_cache_spec(mc, layout, k_codec, v_codec)
    num_pages = config.num_pages or max(
        int(budget_bytes(config, spec.bytes_per_token, max_model_len) // spec.page_bytes), 1)
    kv = arena.ArenaKV(arena.init_arena(num_pages, frame_words), layout, k_codec, v_codec)
    allocator = BlockManager(num_pages, config.page_size,
                             **allocator_options(config))
    return KVPool(kv, allocator, HostSwapSpace(), spec)
