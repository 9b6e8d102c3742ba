"""KV state pytrees and the one protocol every KV state implements.

`KVState` is what generic code (the jitted step, swapping, tiers, snapshots, disaggregation,
the Pallas dispatch) asks of a KV state; it never probes which variant it holds. The variants:

  * `PagedKV`: a pool of pages shared by all sequences; block tables (host metadata, shipped
    per step) say which pages hold a sequence's tokens. Pages are allocated on demand.
  * `LatentPagedKV`: a pool of pages of MLA latents (`kvjax.models.mla`): one row [c, k_r]
    per token and layer, read as keys and as values (whose first d_c columns matter).
  * `ContiguousKV`: the naive baseline. Every sequence slot owns `max_len` tokens up front,
    stored contiguously `[L, max_seqs, max_len, K, D]`; viewed as pages, slot b owns pages
    b*pages_per_seq .. (b+1)*pages_per_seq - 1 and its block table is that fixed range.
  * `kvjax.kv.quantized.QuantizedPagedKV`: pages of codec codes and metadata, and for KIVI
    an exact window per sequence slot beside them.
  * `kvjax.kv.quest.QuestKV`: a paged state with per-page key summaries (retention 'quest').

Both exact states store one layer's keys as pages `[num_pages, P, K, D]`, so the same attention
reads both. A token's flat slot index is `page * P + offset`; writes to slot -1 (or any slot
past the pool) are dropped, which is how padded tokens of a bucketed step write nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.config import ModelConfig
from kvjax.kv.attention import PageLoader
from kvjax.kv.codecs import IdentityCodec
from kvjax.kv.spec import KVCacheSpec, cache_spec
from kvjax.shapes import pages_for as pages_for  # defined without jax; importable here too


@runtime_checkable
class KVState(Protocol):
    """What every KV state provides (shapes: L layers, P page size, K kv heads, D head dim).

    A state is a frozen pytree; every method returns a new state. Its arrays fall in two
    groups, and whatever moves KV between places (swap, tiers, snapshots, disaggregation,
    scrubbing) moves them through these views, never through the state's own fields:

      * page leaves (`page_leaves`): each `[L, num_pages, ...]`, page-major, the KV of each
        page (keys and values, or codes and scales, plus any per-page summaries); a page's
        rows in every leaf together are the page.
      * sequence-slot leaves (`seq_slot_leaves`): each `[L, num_seq_slots, ...]`, per-sequence
        KV kept outside the pages (KIVI's exact windows); empty for most states. The step
        passes each row's slot as `StepInput.seq_slots`.

    `kvjax.kv.pages` gathers, scatters and zeroes pages through the page leaves.

    Attributes:
      page_size: P, tokens per page (the granularity attention reads at).
      num_pages: pages the state holds (for `ContiguousKV`, its slots viewed as pages).
      num_slots: num_pages * P flat token slots.
      num_seq_slots: sequence slots of the sequence-slot leaves (0 when there are none).
      codec_name: the codec with its options ('none' for exact states); part of the KV
        provenance fingerprint.
      needs_rows: whether `write_rows` and `row_loader` use the step's rows (block tables,
        lengths, seq_slots) beyond the slot mapping: True for KIVI, False for states that
        write and read by flat slot and page alone.
    """

    page_size: int
    num_pages: int
    num_slots: int
    num_seq_slots: int
    codec_name: str
    needs_rows: bool

    def check_ready(self) -> None:
        """Raises ValueError when the state cannot be written yet (calibrated fp8 unscaled)."""

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array) -> Self:
        """Writes k, v [T, K, D] of `layer` into flat slots [T] (-1: dropped)."""

    def write_rows(self, layer: jax.Array, inp: Any, shape: Any, k: jax.Array, v: jax.Array
                   ) -> Self:
        """Writes one step's new tokens k, v [T, K, D] of `layer`, as the step lays them out.

        inp: the `kvjax.engine.step.StepInput` (slot_mapping [T]; block_tables [R, W],
        kv_lens, q_lens, seq_slots [R]); shape: its `StepShape`. States with needs_rows False
        write `inp.slot_mapping`.
        """

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of `pages` [B, n] of `layer`, each [B, n, P, K, D]; reads only those pages."""

    def project_queries(self, layer: jax.Array, q: jax.Array) -> jax.Array:
        """Queries [..., N, D] in the form the loader's keys are read in: unchanged for states
        that store whole keys; [..., N, r] coordinates for a low-rank pool (`kvjax.kv.lowrank`),
        whose loader gives keys [..., K, r] (the softmax scale stays 1 / sqrt(D))."""

    def row_loader(self, layer: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
                   seq_slots: jax.Array, kv_floors: jax.Array | None = None
                   ) -> tuple[jax.Array, PageLoader]:
        """What attention reads for rows: (block tables [B, W], page loader [B, n] -> K, V).

        block_tables: [B, W] int32; kv_lens: [B] int32 after this step's write; seq_slots:
        [B] int32; kv_floors: [B] int32 (`StepInput.kv_floors`) or None (zeros). The loader
        maps index arrays [B, n] of the returned tables to K and V [B, n, P, K, D]
        (`kvjax.kv.attention.paged_attention_blockwise` takes the pair).
        """

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> Self:
        """Copy-on-write: page dst[i] becomes a copy of page src[i] in all layers. src, dst: [C]."""

    def map_keys(self, slots: jax.Array, fn: Callable[[jax.Array], jax.Array]) -> Self:
        """Replaces the keys of flat slots [M] in every layer by fn(keys [L, M, K, D]): the
        state's values (decoded, then encoded again, for codes). ValueError for a state whose
        keys cannot be rewritten one token at a time (KIVI, whose keys share group scales)."""

    def compact(self, plan: Compaction, rotate: Rotate | None) -> Self:
        """One sequence keeps `plan.keep` of its cached tokens, in order, as its new cache.

        rotate: (keys [M, K, D], shifts [M]) -> keys at positions + shifts (RoPE), applied
        to the kept keys `plan` shifts; None when nothing rotates (static). States that store
        each token alone move its rows (`compact_token_rows`); KIVI re-encodes the key groups
        whose tokens changed and rewrites the sequence's exact window.
        """

    def page_leaves(self) -> list[jax.Array]:
        """The page leaves, each [L, num_pages, ...], in a fixed order."""

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> Self:
        """This state with its page leaves replaced (same order, shapes and dtypes)."""

    def seq_slot_leaves(self) -> list[jax.Array]:
        """The sequence-slot leaves, each [L, num_seq_slots, ...]; [] for most states."""

    def with_seq_slot_leaves(self, leaves: Sequence[jax.Array]) -> Self:
        """This state with its sequence-slot leaves replaced."""

    def nbytes(self) -> int:
        """Device bytes of every buffer of the state."""


class SlotAddressed:
    """`KVState` members of states written by flat slot and read by page (no sequence slots).

    A mixin for frozen pytree dataclasses that define `write`, `load_pages` and their page
    leaves; `codec_name` is 'none' unless the state overrides it.
    """

    needs_rows: ClassVar[bool] = False
    num_seq_slots: ClassVar[int] = 0

    @property
    def codec_name(self) -> str:
        return "none"

    def check_ready(self) -> None:
        """Always ready: nothing to calibrate."""

    def write_rows(self, layer: jax.Array, inp: Any, shape: Any, k: jax.Array, v: jax.Array
                   ) -> Self:
        """Writes k, v [T, K, D] of `layer` into `inp.slot_mapping` [T]."""
        return self.write(layer, inp.slot_mapping, k, v)

    def project_queries(self, layer: jax.Array, q: jax.Array) -> jax.Array:
        """Whole keys: the queries as they are."""
        return q

    def row_loader(self, layer: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
                   seq_slots: jax.Array, kv_floors: jax.Array | None = None
                   ) -> tuple[jax.Array, PageLoader]:
        """The rows' own block tables [B, W] and this layer's page loader."""
        return block_tables, functools.partial(self.load_pages, layer)

    def map_keys(self, slots: jax.Array, fn: Callable[[jax.Array], jax.Array]) -> Self:
        raise ValueError(f"a {type(self).__name__} ({self.codec_name}) does not rewrite its "
                         f"keys one token at a time")

    def compact(self, plan: Compaction, rotate: Rotate | None) -> Self:
        return compact_token_rows(self, plan, rotate)

    def seq_slot_leaves(self) -> list[jax.Array]:
        return []

    def with_seq_slot_leaves(self, leaves: Sequence[jax.Array]) -> Self:
        if leaves:
            raise ValueError(f"a {type(self).__name__} has no sequence-slot leaves, got "
                             f"{len(leaves)}")
        return self


Rotate = Callable[[jax.Array, jax.Array], jax.Array]  # (keys [M, K, D], shifts [M]) -> keys


@struct.dataclass
class Compaction:
    """One sequence's compaction (retention), as index arrays padded to static sizes.

    The sequence keeps cache indices `keep` of its S cached tokens, in order, as its new
    cache indices 0..S'-1 (`kvjax.kv.retention_host.plan_compaction` builds it on the host from
    the block manager's new layout). It describes the change twice, once per kind of state:

      * as slot moves and key rotations, for states that store each token alone (exact K/V,
        per-token codecs): `src`, `dst`, `rot_slots`, `rot_shifts`;
      * as the whole new layout, for states whose tokens share storage (KIVI's key groups and
        exact window): `keep`, `kept_src`, `kept_dst`, `shifts` and the scalars.

    Attributes:
      src, dst: [M] int32, token slot src[i] is copied into dst[i], every read before any
        write (padding repeats a pair or moves a slot onto itself).
      rot_slots, rot_shifts: [M2] int32, after the moves the key in slot rot_slots[i] turns
        forward by rot_shifts[i] rotary positions (repeats carry equal shifts).
      keep: [N] int32, the old cache index of new index j < S', -1 past S'.
      kept_src, kept_dst: [N] int32, that token's old and new slot, -1 past S'.
      shifts: [N] int32, rotary positions added to the key of new index j (0: none).
      old_len, new_len: int32 scalars, S and S'.
      old_floor: int32 scalar, the sequence's kv_floor before (`StepInput.kv_floors`); its
        floor is 0 afterwards.
      seq_slot: int32 scalar, the sequence's slot in the sequence-slot leaves.
    """

    src: jax.Array
    dst: jax.Array
    rot_slots: jax.Array
    rot_shifts: jax.Array
    keep: jax.Array
    kept_src: jax.Array
    kept_dst: jax.Array
    shifts: jax.Array
    old_len: jax.Array
    new_len: jax.Array
    old_floor: jax.Array
    seq_slot: jax.Array


def move_token_rows(kv: KVState, src: jax.Array, dst: jax.Array) -> KVState:
    """Copies token slots src [M] into dst [M] in every layer; all reads precede all writes.

    Moves whatever the state stores per token: every page leaf must be [L, num_pages, P, ...]
    (exact K and V; a per-token codec's codes and scales). A leaf with another number of rows
    per page (KIVI's per-group key scales, Quest's page summaries) holds no row per token, so
    the move is refused.
    """
    leaves = kv.page_leaves()
    for x in leaves:
        if x.shape[2] != kv.page_size:
            raise ValueError(f"token moves need one row per token, but a page leaf of shape "
                             f"{x.shape} has {x.shape[2]} rows per page of {kv.page_size} "
                             f"tokens ({kv.codec_name})")

    def move(x):  # [L, num_pages, P, ...]
        flat = x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])  # [L, slots, ...]
        return flat.at[:, dst].set(flat[:, src]).reshape(x.shape)

    return kv.with_page_leaves([move(x) for x in leaves])


def compact_token_rows(kv: KVState, plan: Compaction, rotate: Rotate | None) -> KVState:
    """`KVState.compact` of a state that stores each token alone: the plan's slot moves, then
    its key rotations (`KVState.map_keys`)."""
    kv = move_token_rows(kv, plan.src, plan.dst)
    if rotate is None:
        return kv
    return kv.map_keys(plan.rot_slots, jax.vmap(lambda keys: rotate(keys, plan.rot_shifts)))


def scatter_rows(x: jax.Array, layer: jax.Array | slice, rows: jax.Array, values: jax.Array
                 ) -> jax.Array:
    """Sets rows of `layer` in x [L, N, R, ...] (pages, or window slots); rows index n * R + r.

    rows: any integer shape I; values: I + x.shape[3:], or [L] + I + x.shape[3:] for
    layer=slice(None). Rows outside [0, N * R), -1 among them, are dropped. In place when x
    is donated.
    """
    num_layers, num_blocks, per_block = x.shape[:3]
    n = num_blocks * per_block
    flat = x.reshape(num_layers, n, *x.shape[3:])
    rows = jnp.where((rows >= 0) & (rows < n), rows, n)
    if rows.size == 1:
        # XLA rewrites a one-row scatter as a dynamic-update-slice that copies the whole
        # buffer; a second row, out of range, keeps it a scatter, done in place.
        lead = values.ndim - rows.ndim - (x.ndim - 3)  # 1 with every layer at once
        rows = jnp.concatenate([rows.reshape(1), jnp.full((1,), n, rows.dtype)])
        values = values.reshape(*values.shape[:lead], 1, *x.shape[3:])
        values = jnp.concatenate([values, jnp.zeros_like(values)], axis=lead)
    flat = flat.at[layer, rows].set(values.astype(x.dtype), mode="drop")
    return flat.reshape(x.shape)


@struct.dataclass
class PagedKV(SlotAddressed):
    """A pool of KV pages shared by all sequences.

    Attributes:
      k_pages: [L, num_pages, P, K, D] keys (RoPE already applied).
      v_pages: [L, num_pages, P, K, D] values.
    """

    k_pages: jax.Array
    v_pages: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def layer_pages(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """This layer's pages, each [num_pages, P, K, D]."""
        return self.k_pages[layer], self.v_pages[layer]

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of `pages` [B, n] of `layer`, each [B, n, P, K, D]; reads only those pages."""
        return self.k_pages[layer, pages], self.v_pages[layer, pages]

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array) -> PagedKV:
        """Writes k, v [T, K, D] of `layer` into flat slots [T] (-1: dropped)."""
        return self.replace(k_pages=scatter_rows(self.k_pages, layer, slots, k),
                            v_pages=scatter_rows(self.v_pages, layer, slots, v))

    def map_keys(self, slots: jax.Array, fn: Callable[[jax.Array], jax.Array]) -> PagedKV:
        k = self.k_pages  # [L, num_pages, P, K, D]
        flat = k.reshape(k.shape[0], k.shape[1] * k.shape[2], *k.shape[3:])  # [L, slots, K, D]
        new = fn(flat[:, slots]).astype(k.dtype)
        return self.replace(k_pages=flat.at[:, slots].set(new).reshape(k.shape))

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> PagedKV:
        """Copy-on-write: page dst[i] becomes a copy of page src[i] in all layers. src, dst: [C]."""
        return self.replace(k_pages=self.k_pages.at[:, dst].set(self.k_pages[:, src]),
                            v_pages=self.v_pages.at[:, dst].set(self.v_pages[:, src]))

    def page_leaves(self) -> list[jax.Array]:
        """[k_pages, v_pages], each [L, num_pages, P, K, D]."""
        return [self.k_pages, self.v_pages]

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> PagedKV:
        k_pages, v_pages = leaves
        return self.replace(k_pages=k_pages, v_pages=v_pages)

    def nbytes(self) -> int:
        return self.k_pages.nbytes + self.v_pages.nbytes


@struct.dataclass
class LatentPagedKV(SlotAddressed):
    """A pool of MLA latent pages shared by all sequences: one tensor, no separate values.

    Attention reads each page as MQA keys and values both (K = 1, D = d_c + d_r); the model
    keeps the first d_c columns of the output (`kvjax.models.mla`), so values cost no bytes.

    Attributes:
      latent_pages: [L, num_pages, P, 1, d_c + d_r] the normed latent c, then the RoPE'd
        shared key part k_r.
    """

    latent_pages: jax.Array

    @property
    def num_pages(self) -> int:
        return self.latent_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.latent_pages.shape[2]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values of `pages` [B, n] of `layer`: the same latents [B, n, P, 1, D]."""
        latents = self.latent_pages[layer, pages]
        return latents, latents

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array
              ) -> LatentPagedKV:
        """Writes latents k [T, 1, D] of `layer` into flat slots [T] (-1: dropped); v is the
        same latent, read back from k."""
        return self.replace(latent_pages=scatter_rows(self.latent_pages, layer, slots, k))

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> LatentPagedKV:
        """Copy-on-write: page dst[i] becomes a copy of page src[i] in all layers."""
        x = self.latent_pages
        return self.replace(latent_pages=x.at[:, dst].set(x[:, src]))

    def page_leaves(self) -> list[jax.Array]:
        """[latent_pages], [L, num_pages, P, 1, D]."""
        return [self.latent_pages]

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> LatentPagedKV:
        (latent_pages,) = leaves
        return self.replace(latent_pages=latent_pages)

    def nbytes(self) -> int:
        return self.latent_pages.nbytes


@struct.dataclass
class ContiguousKV(SlotAddressed):
    """Per-sequence preallocated KV, the baseline paged memory is measured against.

    Attributes:
      k: [L, max_seqs, max_len, K, D] keys.
      v: [L, max_seqs, max_len, K, D] values.
      page_size: the granularity at which attention views a slot's storage (static).
    """

    k: jax.Array
    v: jax.Array
    page_size: int = struct.field(pytree_node=False, default=16)

    @property
    def max_seqs(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def pages_per_seq(self) -> int:
        return self.max_len // self.page_size

    @property
    def num_pages(self) -> int:
        return self.max_seqs * self.pages_per_seq

    @property
    def num_slots(self) -> int:
        return self.max_seqs * self.max_len

    def _as_pages(self, x: jax.Array) -> jax.Array:
        num_layers, _, _, k, d = x.shape
        return x.reshape(num_layers, self.num_pages, self.page_size, k, d)

    def layer_pages(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self._as_pages(self.k)[layer], self._as_pages(self.v)[layer]

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self._as_pages(self.k)[layer, pages], self._as_pages(self.v)[layer, pages]

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array
              ) -> ContiguousKV:
        return self.replace(k=scatter_rows(self._as_pages(self.k), layer, slots, k).reshape(
                                self.k.shape),
                            v=scatter_rows(self._as_pages(self.v), layer, slots, v).reshape(
                                self.v.shape))

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> ContiguousKV:
        """Page dst[i] becomes a copy of page src[i] in all layers (forking a slot)."""
        k, v = self._as_pages(self.k), self._as_pages(self.v)
        return self.replace(k=k.at[:, dst].set(k[:, src]).reshape(self.k.shape),
                            v=v.at[:, dst].set(v[:, src]).reshape(self.v.shape))

    def block_table(self, seq_slot: int, num_pages: int) -> np.ndarray:
        """The fixed block table of sequence slot `seq_slot`, truncated to num_pages entries."""
        return seq_slot * self.pages_per_seq + np.arange(num_pages, dtype=np.int32)

    def page_leaves(self) -> list[jax.Array]:
        """K and V viewed as pages, each [L, num_pages, P, K, D]."""
        return [self._as_pages(self.k), self._as_pages(self.v)]

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> ContiguousKV:
        k, v = leaves
        return self.replace(k=k.reshape(self.k.shape), v=v.reshape(self.v.shape))

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def init_paged_kv(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, *,
                  num_layers: int | None = None, num_kv_heads: int | None = None
                  ) -> PagedKV | LatentPagedKV:
    """A zeroed pool of `num_pages` pages of `page_size` tokens: K and V heads, or MLA latents
    for a model with `ModelConfig.mla`.

    num_layers: layers a page holds (`KVCacheSpec.layers_per_table` for a model with several
    layer groups); None: every layer of the model.
    num_kv_heads: kv heads a page holds (1: head-major pages, `kvjax.kv.spec`); None: every
    kv head of the model."""
    if num_pages <= 0 or page_size <= 0:
        raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be positive")
    shape = (num_layers or config.num_layers, num_pages, page_size,
             num_kv_heads or config.num_kv_heads, config.head_dim)
    if config.mla is not None:
        return LatentPagedKV(latent_pages=jnp.zeros(shape, dtype))
    return PagedKV(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype))


def init_contiguous_kv(config: ModelConfig, max_seqs: int, max_len: int, page_size: int = 16,
                       dtype=jnp.float32) -> ContiguousKV:
    """Zeroed storage of `max_len` tokens for each of `max_seqs` sequence slots."""
    if config.mla is not None:
        raise ValueError(f"model {config.name!r} caches MLA latents, which the contiguous "
                         f"layout (separate K and V) does not store")
    if max_seqs <= 0 or max_len <= 0:
        raise ValueError(f"max_seqs={max_seqs} and max_len={max_len} must be positive")
    if max_len % page_size:
        raise ValueError(f"max_len={max_len} must be a multiple of page_size={page_size}")
    shape = (config.num_layers, max_seqs, max_len, config.num_kv_heads, config.head_dim)
    return ContiguousKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                        page_size=page_size)


def exact_cache_spec(config: ModelConfig, page_size: int, dtype, groups=None) -> KVCacheSpec:
    """The spec of `config`'s layer groups (or `groups`, `kvjax.kv.spec.LayerGroup`s) stored
    exactly at `dtype` in pages of `page_size` (`PagedKV`; `ContiguousKV` viewed as pages)."""
    codec = IdentityCodec(jnp.dtype(dtype).name)
    groups = config.kv_layer_groups() if groups is None else groups
    return cache_spec(groups, codec_name="none", page_size=page_size,
                      tensor_bytes=codec.bytes_per_token)


def num_pages_for_budget(config: ModelConfig, budget_bytes: int, page_size: int, dtype) -> int:
    """How many pages of `dtype` KV fit in `budget_bytes` (all layers, K and V)."""
    return exact_cache_spec(config, page_size, dtype).num_pages_for_budget(budget_bytes)
