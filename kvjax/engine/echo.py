"""Host-authoritative sparse KV (ECHO): the device side of one step.

With Quest's `echo_prefetch` option (`kvjax.kv.retention.Quest`) a decode row's every full page
has a copy in the runner's host pool (`kvjax.engine.host_rows.HostPool`), and residency is per
(layer, page): each layer keeps on the device the pages its own previous selection ranked
highest (`kvjax.scheduler.echo`), in device pages the row holds for the purpose ("frames": the
frame at block-table entry k may hold, in layer l, another entry's layer l). The row ships
`StepInput.host_tables` [Bd, W] (per entry, its host copy, or -1 where it has none) and
`StepInput.layer_tables` [Bd, L, W] (per layer and entry, the device page holding that layer of
the entry, or -1: read the host copy).

In the step, each layer's exact Quest selection is computed on the summaries of all the
row's pages (`kvjax.kv.quest.echo_summaries`: the host pool's, kept in device memory, for
entries with a host copy), and attention reads each selected page's layer from the device
where resident and from the host pool otherwise: a page that was not prefetched is fetched for
this step, never skipped. The values are the same either way (the host copy was taken from the
full page), so the selection and the tokens equal plain Quest's at every step. The selection of
every layer goes back to the host (`StepOutput.page_reads`), where the scheduler plans the next
step's residency from it and counts how many selected (layer, page) pairs were already on the
device.

With misses kept (Quest's `echo_keep_misses`), after the layers the step writes each layer's
misses, the pages it read from the host pool, into frames the host offered
(`StepInput.keep_frames`), by a rule the host applies to the selection it reads back
(`kvjax.scheduler.echo.kept_misses`), so the next step finds them on the device. What it wrote
also goes to the next step as a feed (`StepOutput.kept_feed`, like the sampled tokens): under
asynchronous scheduling the host plans that step before reading this one's selection, so the
next step adds the kept pages to its layer tables itself (`merge_kept`), and the host, which
applies the same merge when it reads the selections back, knows every table the device used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kv import attention
from kvjax.kv.state import KVState


def echo_loader(kv: KVState, host_kv: KVState, layer: jax.Array, layer_tables: jax.Array,
                host_tables: jax.Array, kv_lens: jax.Array, seq_slots: jax.Array,
                kv_floors: jax.Array):
    """A page loader over table entries: entry j of row b from device page layer_tables[b, j]
    (this layer's table) where it is >= 0 (resident), else from host page host_tables[b, j].

    Returns fn(index [B, n] int32 table entries) -> K, V [B, n, P, K, D].
    """
    resident = layer_tables >= 0  # [B, W]
    dev_tables, dev_load = kv.row_loader(layer, jnp.maximum(layer_tables, 0), kv_lens,
                                         seq_slots, kv_floors)
    zeros = kv_lens * 0
    host_tables, host_load = host_kv.row_loader(layer, jnp.maximum(host_tables, 0), kv_lens,
                                                zeros, zeros)

    def load(index):
        on_device = jnp.take_along_axis(resident, index, axis=1)[:, :, None, None, None]
        k_dev, v_dev = dev_load(jnp.take_along_axis(dev_tables, index, axis=1))
        k_host, v_host = host_load(jnp.take_along_axis(host_tables, index, axis=1))
        return (jnp.where(on_device, k_dev, k_host.astype(k_dev.dtype)),
                jnp.where(on_device, v_dev, v_host.astype(v_dev.dtype)))  # [B, n, P, K, D]

    return load


def attend_echo(kv: KVState, host_kv: KVState, layer: jax.Array, q: jax.Array, inp,
                num_decode: int, reads: tuple[jax.Array, jax.Array], *,
                soft_cap: float | None, pages_per_block: int) -> jax.Array:
    """Decode attention of host-authoritative rows over their selected pages.

    q: [Bd, N, D] -> [Bd, N, D]; inp: the StepInput; reads: (indices [Bd, W] of the selected
    table entries, their kv_lens [Bd]).
    """
    bd = num_decode
    load = echo_loader(kv, host_kv, layer, inp.layer_tables[:, layer], inp.host_tables,
                       inp.kv_lens[:bd], inp.seq_slots[:bd], inp.kv_floors[:bd])
    out = attention.paged_attention_blockwise(
        q[:, None], load, reads[0], reads[1], inp.q_lens[:bd],
        pages_per_block=pages_per_block, soft_cap=soft_cap)  # [Bd, 1, N, D]
    return out[:, 0]


def every_page(block_tables: jax.Array, kv_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The reads of a row that reads every page: (indices [B, W] in table order, kv_lens)."""
    b, w = block_tables.shape
    return jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w)), kv_lens


def read_mask(reads: tuple[jax.Array, jax.Array], page_size: int, width: int) -> jax.Array:
    """[B, W] bool: which table entries the reads (indices [B, W], kv_lens [B]) select."""
    indices, lens = reads
    num_selected = (lens + page_size - 1) // page_size  # [B]
    valid = jnp.arange(indices.shape[1])[None, :] < num_selected[:, None]  # [B, W]
    rows = jnp.arange(indices.shape[0])[:, None]
    return jnp.zeros((indices.shape[0], width), bool).at[rows, indices].max(valid)


def merge_kept(inp) -> jax.Array:
    """The decode rows' layer tables [Bd, L, W] with what the previous step kept: where
    `inp.kept_pages[b, l, v]` (the device page of the v-th frame that step offered in layer l)
    is >= 0, layer l reads from it the entry that step (row `inp.kept_rows[b]` of
    `inp.kept_feed`) wrote there, else the one it held (`inp.kept_owners`, unless -1)."""
    tables = inp.layer_tables  # [Bd, L, W]
    bd, num_layers, width = tables.shape
    kept = inp.kept_feed[jnp.maximum(inp.kept_rows, 0)]  # [Bd, L, V]
    entry = jnp.where(kept >= 0, kept, inp.kept_owners)
    valid = (inp.kept_rows >= 0)[:, None, None] & (entry >= 0) & (inp.kept_pages >= 0)
    rows = jnp.broadcast_to(jnp.arange(bd)[:, None, None], kept.shape)
    layers = jnp.broadcast_to(jnp.arange(num_layers)[None, :, None], kept.shape)
    return tables.at[rows, layers, jnp.where(valid, entry, width)].set(inp.kept_pages,
                                                                       mode="drop")


def keep_misses(kv: KVState, host_kv: KVState, page_reads: jax.Array, inp, num_decode: int
                ) -> tuple[KVState, jax.Array]:
    """The device pool with each decode row's misses kept: in layer l, the i-th entry (in
    table order) read from the host pool (page_reads [Bd, L, W] selected it, it has a host
    copy and no device page in that layer) goes into the i-th frame of `inp.keep_frames`
    [Bd, L, V] whose entry (`inp.keep_owners`) the step did not read; that layer of the
    frame's page becomes a copy of that layer of the entry's host copy.

    The same rule as `kvjax.scheduler.echo.kept_misses`, which the host applies to the
    selection it reads back. Returns (the pool, [Bd, L, V] the entry written into each
    offered frame, -1: none).
    """
    bd = num_decode
    frames, owners = inp.keep_frames, inp.keep_owners  # [Bd, L, V]
    num_layers, width = page_reads.shape[1], page_reads.shape[2]
    host_tables = inp.host_tables  # [Bd, W]
    miss = page_reads & (inp.layer_tables < 0) & (host_tables[:, None, :] >= 0)  # [Bd, L, W]
    owner_read = (owners >= 0) & jnp.take_along_axis(page_reads, jnp.maximum(owners, 0),
                                                     axis=2)
    eligible = (frames >= 0) & ~owner_read  # [Bd, L, V]
    rank = jnp.cumsum(eligible.astype(jnp.int32), axis=2) - 1
    order = jnp.argsort(~miss, axis=2, stable=True)  # misses first, in table order
    entry = jnp.take_along_axis(order, jnp.clip(rank, 0, width - 1), axis=2)  # [Bd, L, V]
    written = eligible & (rank < miss.sum(axis=2, keepdims=True))
    rows = jnp.arange(bd)[:, None, None]
    dst = jnp.where(written, inp.block_tables[:bd][rows, jnp.maximum(frames, 0)],
                    kv.num_pages).reshape(-1)
    src = host_tables[rows, entry].reshape(-1)
    layers = jnp.broadcast_to(jnp.arange(num_layers)[None, :, None], frames.shape).reshape(-1)
    return kv.with_page_leaves(
        [x.at[layers, dst].set(h[layers, src].astype(x.dtype), mode="drop")
         for x, h in zip(kv.page_leaves(), host_kv.page_leaves(), strict=True)]
    ), jnp.where(written, entry, -1).astype(jnp.int32)
