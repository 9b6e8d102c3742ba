"""The measured counterpart of the simulated link model (`scripts/bench_host_attention.py
--measure`, a step of `scripts/device_check.sh`).

On the machine it runs on, it measures:
  * host -> device and device -> host bandwidth: `jax.device_put` of one buffer between the
    default device and its host memory kind (`pinned_host`, else `unpinned_host`; the kind the
    host pool of `kvjax.engine.host_rows` and the host tier use), best of `repeats`;
  * the decode attention of host-resident rows on the host (`kvjax.engine.host_rows`'s host
    part, run on the CPU device) and the same attention on the default device, over the same
    float32 pages (the device's share of a step that host attention runs beside);
and prints each beside the figure the simulations assume: the link bandwidths of
`kvjax.bench.host_attention.LINKS`, the split policies' modelled rates
(`kvjax.scheduler.host_split.HOST_TOKENS_PER_S`, `DEVICE_STEP_S`), and the device attention's
roofline time on the simulated accelerator (KV bytes over `Scenario.hbm_bytes_per_s`).

Without a GPU (or another accelerator) host and device are one memory: the figures are this
CPU's, and the report says so ("no GPU: CPU figures").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from kvjax.bench import host_attention
from kvjax.bench.roofline import best_time_s
from kvjax.engine import host_rows
from kvjax.kv.state import PagedKV
from kvjax.scheduler import host_split


@dataclasses.dataclass(frozen=True)
class LinkMeasure:
    """Attributes:
      transfer_bytes: the buffer each transfer moves.
      num_rows, context, kv_heads, head_dim, page_size: the decode attention measured (float32
        pages; one layer; 4 query heads per kv head).
      repeats: best of this many timings each.
    """

    transfer_bytes: int = 256 << 20
    num_rows: int = 8
    context: int = 4096
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    repeats: int = 5


def measure_transfers(nbytes: int, repeats: int) -> dict:
    """Host <-> device bandwidth of `jax.device_put` with the device's host memory kind."""
    from kvjax.memory.tiers.host import host_memory_kind

    device = jax.devices()[0]
    kind = host_memory_kind(device, user="the link measurement")
    on_device = jax.sharding.SingleDeviceSharding(device)
    on_host = on_device if kind is None else on_device.with_memory_kind(kind)
    x = jax.device_put(np.ones(nbytes // 4, np.float32), on_device)
    host = jax.device_put(x, on_host)
    h2d = best_time_s(lambda: jax.device_put(host, on_device), repeats)
    d2h = best_time_s(lambda: jax.device_put(x, on_host), repeats)
    return dict(memory_kind=kind or "none (numpy)", transfer_bytes=nbytes,
                h2d_bytes_per_s=nbytes / h2d, d2h_bytes_per_s=nbytes / d2h)


def _attention(settings: LinkMeasure, device) -> float:
    """Seconds of one layer's decode attention of `num_rows` rows over `context` tokens of
    float32 pages, on `device` (`host_rows.host_decode_attention`)."""
    s = settings
    pages_per_row = s.context // s.page_size
    num_pages = s.num_rows * pages_per_row
    rng = np.random.default_rng(0)
    shape = (1, num_pages, s.page_size, s.kv_heads, s.head_dim)

    def put(x):
        return jax.device_put(x, device)

    kv = PagedKV(k_pages=put(rng.normal(size=shape).astype(np.float32)),
                 v_pages=put(rng.normal(size=shape).astype(np.float32)))
    q = put(rng.normal(size=(s.num_rows, 4 * s.kv_heads, s.head_dim)).astype(np.float32))
    tables = put(rng.permutation(num_pages).reshape(s.num_rows, pages_per_row)
                 .astype(np.int32))
    lens = put(np.full(s.num_rows, s.context, np.int32))
    ones = put(np.ones(s.num_rows, np.int32))
    layer = put(np.int32(0))
    part = jax.jit(functools.partial(host_rows.host_decode_attention, soft_cap=None,
                                     pages_per_block=8))
    return best_time_s(lambda: part(kv, layer, q, tables, lens, ones), s.repeats)


def run(settings: LinkMeasure) -> dict:
    """Every measured figure beside the simulated model's; `rows` for the printed table."""
    backend = jax.default_backend()
    on_accelerator = backend != "cpu"
    transfers = measure_transfers(settings.transfer_bytes, settings.repeats)
    host_s = _attention(settings, jax.devices("cpu")[0])
    device_s = _attention(settings, jax.devices()[0])
    tokens = settings.num_rows * settings.context
    kv_bytes = 2 * tokens * settings.kv_heads * settings.head_dim * 4
    scenario = host_attention.Scenario()
    links = host_attention.LINKS
    rows = {
        "host->device GB/s": dict(
            measured=transfers["h2d_bytes_per_s"] / 1e9,
            **{f"model_{k}": v / 1e9 for k, v in links.items()}),
        "device->host GB/s": dict(
            measured=transfers["d2h_bytes_per_s"] / 1e9,
            **{f"model_{k}": v / 1e9 for k, v in links.items()}),
        "host attention M tokens/s": dict(
            measured=tokens / host_s / 1e6, model=host_split.HOST_TOKENS_PER_S / 1e6),
        "host attention ms": dict(
            measured=1e3 * host_s, model=1e3 * tokens / host_split.HOST_TOKENS_PER_S),
        "device attention ms": dict(
            measured=1e3 * device_s, model=1e3 * kv_bytes / scenario.hbm_bytes_per_s),
        "host / device attention time": dict(
            measured=host_s / device_s,
            model=(tokens / host_split.HOST_TOKENS_PER_S)
            / (kv_bytes / scenario.hbm_bytes_per_s)),
        "device step ms (split policies' model)": dict(
            model=1e3 * host_split.DEVICE_STEP_S),
    }
    return dict(backend=backend, device=str(jax.devices()[0]),
                note=None if on_accelerator else "no GPU: CPU figures (host and device are "
                "one memory here; the model's figures are for the simulated link and GPU)",
                settings=dataclasses.asdict(settings), transfers=transfers,
                host_attention_s=host_s, device_attention_s=device_s,
                attention_kv_bytes=kv_bytes, links_bytes_per_s=links, rows=rows)
