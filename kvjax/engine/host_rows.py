"""Decode attention where the KV lives: rows whose older pages sit in a host pool.

The design, chosen as the simplest one that is exact:

* **What lives where.** Beside the device pool the runner holds a host pool: a KV state of the
  same class and page format (`kvjax.engine.runner.ModelRunner.host_kv`), its leaves in host
  memory (`pinned_host` where the backend has it, `kvjax.memory.tiers.host.host_memory_kind`).
  A sequence may keep its first h full pages there (positions [0, h * P)); every later page,
  including the one the step writes, stays on the device. Only full pages move, so host pages
  are never written by a step and the new token's K/V goes where it always goes.
* **Who decides.** A split policy (`kvjax.scheduler.host_split`) picks, each step, how many
  full pages of each decode row live in the host pool; the KV cache manager moves pages by
  issuing `KVOpKind.HOST_OUT` / `HOST_IN` ops (plain index arrays in the step's plan) and
  giving the device pages back to the allocator; the runner applies them before the step. The
  scheduler ships each row's host table and host length as plain data (`ScheduledRow.host_table`,
  `host_len`), the runner pads them into `StepInput.host_tables` [Bd, W] and `host_lens` [Bd],
  so a new split is a new input value, never a new program.
* **How a row attends.** Positions [0, host_lens) are read from the host pool, positions
  [host_lens, kv_lens) from the device pool, each part returning its log-sum-exp, and
  `kvjax.kv.attention.merge_partials` joins them exactly. Where the step runs the native CPU
  decode kernel, that kernel attends both parts and returns the log-sum-exp itself
  (`kernel_split`); else the blockwise jnp path does (`paged_attention_blockwise` with
  `kv_starts`). A row with host_lens 0 gets its device part unchanged (the host part is
  empty).
* **Where the host part runs.** Under `jax.experimental.compute_on.compute_on("device_host")`
  where the backend compiles it (probed once, `host_compute_reason`); else the step reads the
  host pool into device memory space and computes the host part there, logged once. On this
  project's CPU host both are the same memory, so tests check exactness and mechanism; link
  costs are modelled (`kvjax.bench.host_attention`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.jit import Program
from kvjax.kv import attention
from kvjax.kv.state import KVState

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HostAttention:
    """The host pool as one step's attention sees it.

    Attributes:
      kv: the host pool; in host memory space when `on_host`, else viewed in device space.
      on_host: the host part runs under compute_on("device_host").
      decode: the attention kernel that returns its log-sum-exp (`kvjax.kv.native.lse_decoder`:
        fn(kv, layer, q, block_tables, kv_lens) -> (out, lse)), which then attends both parts
        (the host part only where it runs in device space); None: the blockwise jnp path.
    """

    kv: KVState
    on_host: bool
    decode: Callable | None = None


def host_decode_attention(host_kv: KVState, layer: jax.Array, q: jax.Array, tables: jax.Array,
               lens: jax.Array, q_lens: jax.Array, *, soft_cap: float | None,
               pages_per_block: int) -> tuple[jax.Array, jax.Array]:
    """Decode attention of q [B, N, D] over positions [0, lens) of the host pool's pages
    `tables` [B, W]: ([B, N, D], lse [B, N])."""
    zeros = lens * 0  # [B]: built from an input, so it lives in the inputs' memory space
    tables, load = host_kv.row_loader(layer, tables, lens, zeros, zeros)
    out, lse = attention.paged_attention_blockwise(
        q[:, None], load, tables, lens, q_lens * (lens > 0), pages_per_block=pages_per_block,
        soft_cap=soft_cap, return_lse=True)
    return out[:, 0], lse[:, 0]


def _on_host(fn):
    """fn run under compute_on("device_host"), its array arguments moved to host memory
    space and its results back to device memory space."""
    from jax.experimental.compute_on import compute_on

    host_fn = compute_on("device_host")(jax.jit(fn))

    def run(host_kv, *args):
        args = [jax.device_put(x, jax.memory.Space.Host) for x in args]
        return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device),
                            host_fn(host_kv, *args))

    return run


def attend_split(kv: KVState, host: HostAttention, layer: jax.Array, q: jax.Array, inp,
                 num_decode: int, *, soft_cap: float | None, pages_per_block: int) -> jax.Array:
    """Decode attention of rows whose positions [0, host_lens) live in the host pool.

    q: [Bd, N, D] -> [Bd, N, D]; inp: the StepInput (`block_tables`, `kv_lens`, `q_lens` of
    the first Bd rows, `host_tables`, `host_lens`).
    """
    bd = num_decode
    lens, q_lens, host_lens = inp.kv_lens[:bd], inp.q_lens[:bd], inp.host_lens
    if host.decode is not None and not host.on_host:
        return kernel_split(host.decode, kv, host.kv, layer, q, inp.block_tables[:bd], lens,
                            inp.host_tables, host_lens, kv.page_size)
    tables, load = kv.row_loader(layer, inp.block_tables[:bd], lens, inp.seq_slots[:bd],
                                 inp.kv_floors[:bd])
    dev_out, dev_lse = attention.paged_attention_blockwise(
        q[:, None], load, tables, lens, q_lens, pages_per_block=pages_per_block,
        soft_cap=soft_cap, kv_starts=host_lens, return_lse=True)  # [Bd, 1, N, D], [Bd, 1, N]
    part = functools.partial(host_decode_attention, soft_cap=soft_cap,
                             pages_per_block=pages_per_block)
    if host.on_host:
        part = _on_host(part)
    host_out, host_lse = part(host.kv, layer, q, inp.host_tables, host_lens, q_lens)
    out, _ = attention.merge_partials(
        jnp.stack([dev_out[:, 0], host_out.astype(dev_out.dtype)]),
        jnp.stack([dev_lse[:, 0], host_lse]))  # [Bd, N, D]
    return out


def kernel_split(decode: Callable, kv: KVState, host_kv: KVState, layer: jax.Array,
                 q: jax.Array, block_tables: jax.Array, lens: jax.Array,
                 host_tables: jax.Array, host_lens: jax.Array, page_size: int) -> jax.Array:
    """Decode attention of q [B, N, D] over positions [host_lens, lens) in the device pool and
    [0, host_lens) in the host pool, both by `decode` (`HostAttention.decode`), merged by
    log-sum-exp: [B, N, D]. The device part reads the row's table from entry host_lens / P on
    (a decode query sees every cached key, so where its key set starts changes nothing)."""
    w = block_tables.shape[1]
    entries = jnp.minimum(jnp.arange(w)[None, :] + (host_lens // page_size)[:, None], w - 1)
    dev_out, dev_lse = decode(kv, layer, q, jnp.take_along_axis(block_tables, entries, axis=1),
                              lens - host_lens)  # [B, N, D], [B, N]
    host_out, host_lse = decode(host_kv, layer, q, host_tables, host_lens)
    out, _ = attention.merge_partials(jnp.stack([dev_out, host_out.astype(dev_out.dtype)]),
                                      jnp.stack([dev_lse, host_lse]))
    return out  # [B, N, D]


def device_view(host_kv: KVState) -> KVState:
    """The host pool in device memory space (the fallback when the host cannot compute):
    inside a jitted step, a read of the pool over the link."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), host_kv)


@functools.cache
def host_compute_reason() -> str | None:
    """None when compute_on("device_host") runs the host part of decode attention on this
    backend and agrees with the plain computation; else why not (logged once: the step then
    computes the host part in device memory space)."""
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        reason = f"backend {device.platform} has no pinned_host memory"
    else:
        reason = _probe(device)
    if reason is not None:
        log.warning("host-resident rows: compute_on('device_host') unavailable (%s); their "
                    "attention reads the host pool from the device", reason)
    return reason


def _probe(device) -> str | None:
    from kvjax.kv.state import PagedKV

    rng = np.random.default_rng(0)
    pages = rng.normal(size=(1, 4, 4, 1, 8)).astype(np.float32)  # [L, pages, P, K, D]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    plain_kv = PagedKV(k_pages=jnp.asarray(pages), v_pages=jnp.asarray(pages))
    host_kv = jax.device_put(plain_kv, host)
    args = (jnp.int32(0), jnp.asarray(rng.normal(size=(1, 2, 8)), jnp.float32),
            jnp.asarray([[2, 0, 1, 3]], jnp.int32), jnp.asarray([12], jnp.int32),
            jnp.ones(1, jnp.int32))
    part = functools.partial(host_decode_attention, soft_cap=None, pages_per_block=2)
    try:
        got = jax.jit(_on_host(part))(host_kv, *args)
    except Exception as e:  # noqa: BLE001 - any failure to lower or run means "fall back"
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    want = jax.jit(part)(plain_kv, *args)
    if not np.allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5):
        return "compute_on('device_host') disagrees with the device computation"
    return None


class HostPool:
    """The runner's host pool: a KV state like the device pool's, of `num_pages` pages, in
    host memory, and the programs that move pages between the pools (`KVOpKind.HOST_OUT`,
    `HOST_IN`, whole pages or single layers of pages; index arrays padded to powers of two,
    so each count compiles once).

    Attributes:
      kv: the host pool's KV state.
      memory_kind: where its leaves live (`pinned_host`, else `unpinned_host`; None: device
        memory, on a backend with no host memory kind).
      num_layer_tables: L when decode rows ship per-layer device tables (ECHO's per-layer
        residency, `StepInput.layer_tables`), else 0.
      keep_width: V, the frames per layer a decode row's step may keep its misses in (ECHO,
        `StepInput.keep_frames`), else 0.
    """

    def __init__(self, device_kv: KVState, num_pages: int, *, num_device_leaves: int = 0,
                 per_layer: bool = False, keep_width: int = 0):
        """num_device_leaves: the last page leaves stay in device memory (small per-page
        indexes a step reads for every page, such as Quest's key summaries under ECHO);
        per_layer: decode rows read each layer's pages through a table of their own."""
        from kvjax.memory.tiers.host import host_memory_kind

        leaves = device_kv.page_leaves()
        kv = device_kv.with_page_leaves(
            [jnp.zeros((x.shape[0], num_pages, *x.shape[2:]), x.dtype) for x in leaves])
        sharding = leaves[0].sharding
        self.memory_kind = host_memory_kind(next(iter(sharding.device_set)),
                                            user="host-resident rows")
        host = (sharding if self.memory_kind is None
                else sharding.with_memory_kind(self.memory_kind))
        n = len(leaves) - num_device_leaves
        self._sharding = jax.tree.map(lambda _: host, kv).with_page_leaves(
            [host] * n + [sharding] * num_device_leaves)
        self.kv = jax.device_put(kv, self._sharding)
        self._out = Program(_move_out, donate_argnums=1, out_shardings=self._sharding)
        self._in = Program(_move_in, donate_argnums=0)
        self._in_layers = Program(_move_in_layers, donate_argnums=0)
        self.num_layer_tables = leaves[0].shape[0] if per_layer else 0
        self.keep_width = keep_width if per_layer else 0

    @property
    def num_compiles(self) -> int:
        return self._out.num_compiles + self._in.num_compiles + self._in_layers.num_compiles

    def move_out(self, device_kv: KVState, src, dst) -> None:
        """Host page dst[i] becomes a copy of device page src[i]."""
        self.kv = self._out(device_kv, self.kv, np.asarray(src, np.int32),
                            np.asarray(dst, np.int32))

    def move_in(self, device_kv: KVState, src, dst) -> KVState:
        """The device pool with page dst[i] a copy of host page src[i]."""
        return self._in(device_kv, self.kv, np.asarray(src, np.int32), np.asarray(dst, np.int32))

    def move_in_layers(self, device_kv: KVState, layers, src, dst) -> KVState:
        """The device pool with layer layers[i] of page dst[i] a copy of that layer of host
        page src[i] (its other layers unchanged)."""
        return self._in_layers(device_kv, self.kv, *(np.asarray(x, np.int32)
                                                     for x in (layers, src, dst)))

    def warmup(self, device_kv: KVState, max_pages: int, max_layer_pages: int = 0) -> KVState:
        """Compiles the moves for every padded count up to `max_pages` (single-layer moves up
        to `max_layer_pages`); they write past both pools (scatters drop such indices), so
        neither changes."""
        from kvjax.shapes import powers_of_2_up_to

        for n in powers_of_2_up_to(max_pages):
            self.move_out(device_kv, np.zeros(n), np.full(n, self.kv.num_pages))
            device_kv = self.move_in(device_kv, np.zeros(n), np.full(n, device_kv.num_pages))
        for n in powers_of_2_up_to(max_layer_pages) if max_layer_pages else ():
            device_kv = self.move_in_layers(device_kv, np.zeros(n), np.zeros(n),
                                            np.full(n, device_kv.num_pages))
        return device_kv


def _move_out(device_kv: KVState, host_kv: KVState, src, dst) -> KVState:
    from kvjax.kv import pages

    return pages.scatter_pages(device_view(host_kv), dst, pages.gather_pages(device_kv, src))


def _move_in(device_kv: KVState, host_kv: KVState, src, dst) -> KVState:
    from kvjax.kv import pages

    return pages.scatter_pages(device_kv, dst, pages.gather_pages(device_view(host_kv), src))


def _move_in_layers(device_kv: KVState, host_kv: KVState, layers, src, dst) -> KVState:
    host = device_view(host_kv).page_leaves()
    return device_kv.with_page_leaves(
        [x.at[layers, dst].set(h[layers, src].astype(x.dtype), mode="drop")
         for x, h in zip(device_kv.page_leaves(), host, strict=True)])  # [L, pages, ...] each
