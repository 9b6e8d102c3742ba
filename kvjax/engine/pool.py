"""Building an engine's KV pool: the state pytree, its allocator and its swap space, sized from
the byte budget and the codec's exact bytes per token."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from kvjax.config import KVLayout, ModelConfig
from kvjax.engine import residual
from kvjax.engine.config import EngineConfig
from kvjax.engine.runner import KVStore
from kvjax.engine.swap import HostSwapSpace
from kvjax.kv.state import init_contiguous_kv, init_paged_kv, num_pages_for_budget
from kvjax.memory.block_manager import BlockManager
from kvjax.memory.slots import SlotAllocator


@dataclasses.dataclass
class KVPool:
    """A freshly built pool.

    Attributes:
      kv: the KV state pytree (on the host's default device, uncommitted).
      allocator: the BlockManager, WindowBlockManager (KIVI) or SlotAllocator.
      swap_space: host memory for swapped-out sequences (windows too for KIVI).
      kv_bytes_per_token: device bytes one cached token takes, all layers, K and V.
      quantized_len: KIVI: of a sequence's first n tokens, how many its pages hold (the rest
        are in its exact window); None: pages hold every token.
    """

    kv: Any
    allocator: Any
    swap_space: Any
    kv_bytes_per_token: float
    quantized_len: Callable[[int], int] | None = None


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
    per_token = mc.kv_bytes_per_token(kv_dtype)
    if config.kv_arena:
        return _arena_pool(mc, config, max_model_len=max_model_len, kv_dtype=kv_dtype)
    if config.kv_codec != "none":
        return _quantized_pool(mc, config, max_model_len=max_model_len)
    if config.kv_layout is KVLayout.CONTIGUOUS:
        per_seq = per_token * max_model_len
        budget = budget_bytes(config, per_token, max_model_len)
        max_seqs = min(budget // per_seq, config.max_num_seqs)
        if max_seqs < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no sequence of "
                             f"max_model_len={max_model_len} tokens")
        kv = init_contiguous_kv(mc, int(max_seqs), max_model_len, config.page_size, kv_dtype)
        allocator = SlotAllocator(int(max_seqs), max_model_len, config.page_size)
        return KVPool(kv, allocator, HostSwapSpace(), per_token)
    num_pages = config.num_pages or num_pages_for_budget(
        mc, budget_bytes(config, per_token, max_model_len), config.page_size, kv_dtype)
    kv = init_paged_kv(mc, num_pages, config.page_size, kv_dtype)
    allocator = BlockManager(num_pages, config.page_size,
                             **allocator_options(config))
    return KVPool(kv, allocator, HostSwapSpace(), per_token)


def _quantized_pool(mc: ModelConfig, config: EngineConfig, *, max_model_len: int) -> KVPool:
    from kvjax.kv import quantized  # Imported lazily: only quantized engines need it.

    options = config.kv_codec_options
    per_token = quantized.kv_bytes_per_token(mc, config.kv_codec, **options)
    # KIVI's per-sequence exact windows come out of an explicit byte budget first.
    num_seq_slots = quantized.num_seq_slots_for(config.kv_codec, config.max_num_seqs, **options)
    windows = quantized.residual_bytes(mc, num_seq_slots, config.kv_codec, **options)
    budget = budget_bytes(config, per_token, max_model_len) - (
        windows if config.kv_budget_bytes else 0)
    if budget < per_token * config.page_size and not config.num_pages:
        raise ValueError(f"kv_budget_bytes={config.kv_budget_bytes} holds no page "
                         f"beside {windows} bytes of KIVI windows")
    num_pages = config.num_pages or max(int(budget // (per_token * config.page_size)), 1)
    kv = quantized.init_quantized_kv(mc, num_pages, config.page_size, config.kv_codec,
                                     num_seq_slots=num_seq_slots, **options)
    if not num_seq_slots:
        allocator = BlockManager(num_pages, config.page_size,
                                 **allocator_options(config))
        return KVPool(kv, allocator, HostSwapSpace(), per_token)
    allocator = residual.WindowBlockManager(
        num_pages, config.page_size, num_seq_slots=num_seq_slots,
        **allocator_options(config), scrub_windows=config.scrub_freed_pages)
    return KVPool(kv, allocator, residual.WindowSwapSpace(allocator), per_token,
                  quantized_len=lambda n: int(kv.codec.num_quantized(n)))


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
    per_token = arena.layout_bytes_per_token(layout)
    num_pages = config.num_pages or max(
        int(budget_bytes(config, per_token, max_model_len) // (frame_words * arena.WORD)), 1)
    kv = arena.ArenaKV(arena.init_arena(num_pages, frame_words), layout, k_codec, v_codec)
    allocator = BlockManager(num_pages, config.page_size,
                             **allocator_options(config))
    return KVPool(kv, allocator, HostSwapSpace(), per_token)
