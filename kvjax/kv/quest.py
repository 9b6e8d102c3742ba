"""Quest: query-aware selection of the KV pages a decode query reads.

Every page keeps a summary of the keys written into it, per layer and kv head: the elementwise
minimum and maximum over its tokens of each channel (`key_min`, `key_max`: [L, num_pages, K, D]).
For a query q (one head) and any key k of the page, q_d * k_d <= max(q_d * min_d, q_d * max_d)
channel by channel, so

    bound(q, page) = sum_d max(q_d * key_min_d, q_d * key_max_d) >= q . k  for every key k there.

This is Quest's criticality bound (Tang et al., 2024). The paper selects pages per head (its
models are multi-head); here one block table serves every query head of a row, so a page's
score combines its per-head bounds over all N query heads (`HeadReduction`): their maximum
(the default: a page some head needs stays selectable however little the others want it) or
their sum (closer to the attention mass summed over heads). A decode row reads only
its `num_read` pages of highest score, always including its most recent page; the rest of its
pages stay in memory. This saves reads, not memory. Prefill rows read every page, and so do
decode rows in the first `num_dense_layers` layers (the paper keeps its first two layers dense:
their attention is flat, so a few pages cannot hold it).

Summaries are maintained on write: a token written at offset 0 of a page starts the page's
summary afresh (a recycled page's stale summary never survives), every other token widens it.
Pages are filled in offset order (the engine appends; copy-on-write copies a page with its
summary), so a page's summary always covers exactly its written tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.kv.spec import KVCacheSpec, KVSpec
from kvjax.kv.state import KVState, SlotAddressed


class HeadReduction(enum.Enum):
    """How a page's per-query-head bounds combine into its one score."""

    MAX = "max"
    SUM = "sum"


def _update_summaries(key_min: jax.Array, key_max: jax.Array, layer: jax.Array,
                      slots: jax.Array, k: jax.Array, page_size: int
                      ) -> tuple[jax.Array, jax.Array]:
    """Widens the summaries [L, num_pages, K, D] of the pages that slots [T] write k [T, K, D]."""
    num_pages = key_min.shape[1]
    is_valid = slots >= 0
    pages = jnp.where(is_valid, slots // page_size, num_pages)  # [T]; out of range -> dropped
    starts = jnp.where(is_valid & (slots % page_size == 0), pages, num_pages)  # [T]
    kf = k.astype(jnp.float32)  # [T, K, D]
    key_min = key_min.at[layer, starts].set(jnp.inf, mode="drop")
    key_max = key_max.at[layer, starts].set(-jnp.inf, mode="drop")
    key_min = key_min.at[layer, pages].min(kf, mode="drop")  # [L, num_pages, K, D]
    key_max = key_max.at[layer, pages].max(kf, mode="drop")
    return key_min, key_max


@struct.dataclass
class QuestKV(SlotAddressed):
    """A paged KV state with per-page key summaries for query-aware page selection.

    Its page leaves are the base's followed by the summaries, so swapping and scrubbing carry
    the summaries along with the pages.

    Attributes:
      base: the wrapped paged state (`PagedKV` or a per-token quantized paged state), one that
        writes by flat slot (`needs_rows` False).
      key_min: [L, num_pages, K, D] float32, elementwise minimum of the page's keys.
      key_max: [L, num_pages, K, D] float32, elementwise maximum of the page's keys.
    """

    base: KVState
    key_min: jax.Array
    key_max: jax.Array

    @property
    def num_pages(self) -> int:
        return self.base.num_pages

    @property
    def page_size(self) -> int:
        return self.base.page_size

    @property
    def num_slots(self) -> int:
        return self.base.num_slots

    @property
    def codec_name(self) -> str:
        return self.base.codec_name

    def check_ready(self) -> None:
        self.base.check_ready()

    def layer_pages(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.base.layer_pages(layer)

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.base.load_pages(layer, pages)

    @property
    def needs_rows(self) -> bool:
        return self.base.needs_rows

    def _summarized(self, layer: jax.Array, slots: jax.Array, k: jax.Array, base: KVState
                    ) -> QuestKV:
        key_min, key_max = _update_summaries(self.key_min, self.key_max, layer, slots, k,
                                             self.page_size)
        return self.replace(base=base, key_min=key_min, key_max=key_max)

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array) -> QuestKV:
        """Writes k, v [T, K, D] into flat slots [T] (-1: dropped) and updates the summaries."""
        return self._summarized(layer, slots, k, self.base.write(layer, slots, k, v))

    def write_rows(self, layer: jax.Array, inp: Any, shape: Any, k: jax.Array, v: jax.Array
                   ) -> QuestKV:
        """The base's row write (KIVI); the summaries follow the tokens' page slots, from
        their exact keys (a quantized key's bound is its exact key's)."""
        return self._summarized(layer, inp.slot_mapping, k,
                                self.base.write_rows(layer, inp, shape, k, v))

    def row_loader(self, layer: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
                   seq_slots: jax.Array, kv_floors: jax.Array | None = None):
        return self.base.row_loader(layer, block_tables, kv_lens, seq_slots, kv_floors)

    def seq_slot_leaves(self) -> list[jax.Array]:
        return self.base.seq_slot_leaves()

    def with_seq_slot_leaves(self, leaves: Sequence[jax.Array]) -> QuestKV:
        return self.replace(base=self.base.with_seq_slot_leaves(leaves))

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> QuestKV:
        """Copy-on-write of pages src [C] -> dst [C], summaries included."""
        return self.replace(base=self.base.copy_pages(src, dst),
                            key_min=self.key_min.at[:, dst].set(self.key_min[:, src]),
                            key_max=self.key_max.at[:, dst].set(self.key_max[:, src]))

    def page_leaves(self) -> list[jax.Array]:
        """The base's page leaves, then key_min and key_max."""
        return [*self.base.page_leaves(), self.key_min, self.key_max]

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> QuestKV:
        *base_leaves, key_min, key_max = leaves
        return self.replace(base=self.base.with_page_leaves(base_leaves), key_min=key_min,
                            key_max=key_max)

    def nbytes(self) -> int:
        return self.base.nbytes() + self.key_min.nbytes + self.key_max.nbytes


def init_quest_kv(base: KVState) -> QuestKV:
    """Wraps a paged state (exact, quantized or KIVI) with empty summaries."""
    k, _ = jax.eval_shape(base.load_pages, jnp.int32(0), jnp.zeros((1, 1), jnp.int32))
    num_layers = base.page_leaves()[0].shape[0]
    shape = (num_layers, base.num_pages, k.shape[3], k.shape[4])  # [L, num_pages, K, D]
    return QuestKV(base=base, key_min=jnp.zeros(shape, jnp.float32),
                   key_max=jnp.zeros(shape, jnp.float32))


def summarized_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The spec of `init_quest_kv` over a state of `spec`: each page also holds, per layer, the
    min and max of its keys ([K, D] float32 each)."""

    def with_summaries(layer: KVSpec) -> KVSpec:
        _, heads, width = layer.format.tensors[0]  # the keys
        extra = 2 * heads * width * jnp.dtype(jnp.float32).itemsize
        return dataclasses.replace(layer, page_extra_bytes=layer.page_extra_bytes + extra)

    return spec.with_specs(with_summaries)


def page_bounds(q: jax.Array, key_min: jax.Array, key_max: jax.Array) -> jax.Array:
    """Upper bounds of the attention logits q . k of each page's keys, per query head.

    Args:
      q: [B, N, D] queries (RoPE applied, unscaled).
      key_min, key_max: [B, W, K, D] summaries of the W pages each row may read.
    Returns:
      [B, W, N] float32: entry (b, w, n) >= q[b, n] . k for every key k written into page w.
    """
    b, n, d = q.shape
    k_heads = key_min.shape[2]
    qg = q.astype(jnp.float32).reshape(b, 1, k_heads, n // k_heads, d)  # [B, 1, K, G, D]
    lo = qg * key_min[:, :, :, None, :]  # [B, W, K, G, D]
    hi = qg * key_max[:, :, :, None, :]
    return jnp.sum(jnp.maximum(lo, hi), axis=-1).reshape(b, -1, n)  # [B, W, N]


def select_pages(scores: jax.Array, kv_lens: jax.Array, page_size: int, num_read: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The `num_read` best pages of each row, in table order, and the length they hold.

    The row's last (partially filled) page is always selected; pages past the row's length
    never are. A row with at most `num_read` pages selects all of them, unchanged.

    Args:
      scores: [B, W] page scores (table order).
      kv_lens: [B] int32 tokens in each row's cache.
      page_size: P.
      num_read: pages to keep per row (static, <= W).
    Returns:
      (indices [B, num_read] int32 increasing table indices, entries past the row's selection
      are padding; kv_lens [B] int32, the tokens the selected pages hold, the last one partial).
    """
    w = scores.shape[1]
    num_valid = (kv_lens + page_size - 1) // page_size  # [B]
    index = jnp.arange(w, dtype=jnp.int32)[None, :]  # [1, W]
    scores = jnp.where(index == num_valid[:, None] - 1, jnp.inf, scores.astype(jnp.float32))
    scores = jnp.where(index < num_valid[:, None], scores, -jnp.inf)  # [B, W]
    _, top = jax.lax.top_k(scores, num_read)  # [B, num_read]
    indices = jnp.sort(top.astype(jnp.int32), axis=-1)  # valid pages first, then padding
    num_selected = jnp.minimum(num_valid, num_read)
    last_count = kv_lens - (num_valid - 1) * page_size
    lens = jnp.where(kv_lens > 0, (num_selected - 1) * page_size + last_count, 0)
    return indices, lens.astype(jnp.int32)


def select_decode_pages(kv: QuestKV, layer: jax.Array, q: jax.Array, block_tables: jax.Array,
                        kv_lens: jax.Array, num_read: int, *, num_dense_layers: int = 0,
                        head_reduction: HeadReduction = HeadReduction.MAX,
                        summaries: Any = None) -> tuple[jax.Array, jax.Array] | None:
    """Which block-table entries decode rows read: their Quest-selected pages.

    Args:
      layer: int32 scalar, the layer index (traced inside the layer scan).
      q: [B, N, D] one query per row; block_tables: [B, W] int32; kv_lens: [B] int32.
      num_read: pages each row reads (static).
      num_dense_layers: layers below this index read every page, unchanged (static).
      head_reduction: how the per-head bounds of a page make its score (static).
      summaries: fn(layer) -> (key_min, key_max) [B, W, K, D] of each entry's page, where the
        pages do not all lie in `kv` (`echo_summaries`); None: `kv`'s pages of block_tables.
    Returns:
      None when every row reads every page (num_read >= W), else (indices [B, W] int32: the
      selected entries in table order first, then 0 as padding; kv_lens [B] of the selection).
      Attention over `take_along_axis(tables, indices)` up to those lengths is attention over
      the selected pages' tokens, each at its original rotary position; the tables may be a
      state's logical tables (`KVState.row_loader`), whose loader knows each page's position.
    """
    b, w = block_tables.shape
    if num_read >= w:
        return None

    def narrowed():
        if summaries is None:
            key_min = kv.key_min[layer][block_tables]  # [B, W, K, D]
            key_max = kv.key_max[layer][block_tables]
        else:
            key_min, key_max = summaries(layer)
        bounds = page_bounds(q, key_min, key_max)  # [B, W, N]
        reduce = jnp.max if head_reduction is HeadReduction.MAX else jnp.sum
        scores = reduce(bounds, axis=-1)  # [B, W]
        indices, lens = select_pages(scores, kv_lens, kv.page_size, num_read)
        return jnp.pad(indices, ((0, 0), (0, w - num_read))), lens

    if num_dense_layers == 0:
        return narrowed()
    every = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    return jax.lax.cond(layer < num_dense_layers, lambda: (every, kv_lens), narrowed)


def narrow_decode_rows(kv: QuestKV, layer: jax.Array, q: jax.Array, block_tables: jax.Array,
                       kv_lens: jax.Array, num_read: int, *, num_dense_layers: int = 0,
                       head_reduction: HeadReduction = HeadReduction.MAX
                       ) -> tuple[jax.Array, jax.Array]:
    """Block tables [B, W] with the Quest-selected pages first, and their kv_lens [B]
    (`select_decode_pages` applied to `block_tables`)."""
    selected = select_decode_pages(kv, layer, q, block_tables, kv_lens, num_read,
                                   num_dense_layers=num_dense_layers,
                                   head_reduction=head_reduction)
    if selected is None:
        return block_tables, kv_lens
    indices, lens = selected
    return jnp.take_along_axis(block_tables, indices, axis=1), lens


def echo_summaries(kv: QuestKV, host_kv: QuestKV, block_tables: jax.Array,
                   host_tables: jax.Array):
    """fn(layer) -> (key_min, key_max) [B, W, K, D] of each row's pages under ECHO
    (`kvjax.engine.echo`): an entry with a host copy (host_tables [B, W] >= 0) from the host
    pool's summaries (kept in device memory, and equal to the page's: the copy was taken from
    the full page), any other from the device pool's page block_tables [B, W]."""
    on_device = (host_tables < 0)[:, :, None, None]  # [B, W, 1, 1]
    host = jnp.maximum(host_tables, 0)

    def at(layer):
        return tuple(jnp.where(on_device, d[layer][block_tables], h[layer][host])
                     for d, h in ((kv.key_min, host_kv.key_min),
                                  (kv.key_max, host_kv.key_max)))  # [B, W, K, D] each

    return at
