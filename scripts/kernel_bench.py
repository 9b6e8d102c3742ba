"""Times the paged attention kernels against the jnp reference, as a fraction of memory bandwidth.

For each context length: paged decode (one query per sequence) and chunked prefill (a chunk of
queries at the end of the context), each through the Pallas kernel, the jnp reference and, on a
GPU, JAX's own `jax.experimental.pallas.ops.gpu.paged_attention` (decode only); quantized decode
(per --quant_codecs: the kernel, its dequantize-everything oracle and the engine's jnp path that
dequantizes the pages it reads); sparse decode over a Quest-style selection of
--sparse_read_fraction of each row's pages (the kernel, its masked oracle over every page, and
the engine's Quest path: narrowed block tables through the dense decode kernel). Reports the
median time per call, the K/V bytes the tokens read occupy (what any implementation must read:
codes and scales for quantized pools, the selected pages for sparse decode), the achieved
bytes/s, and that as a fraction of the device's copy bandwidth measured in the same run. Prints
a table; writes JSON with --output_json.

  python scripts/kernel_bench.py --context_lens=4096,32768 --batch=8 --output_json=bench.json
  python scripts/kernel_bench.py --context_lens=256 --batch=2 --num_heads=8 --num_kv_heads=2 \
      --head_dim=64 --prefill_chunk=16   # CPU: interpret mode, small shapes only
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kvjax.config import resolve_dtype
from kvjax.kv import quest
from kvjax.kv.attention import (
    paged_attention_blockwise,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
)
from kvjax.kv.quantized import make_codec
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.quantized_decode import (
    quantized_decode_attention,
    quantized_decode_attention_reference,
)
from pallas_kernels.quantized_decode.reference import codec_view
from pallas_kernels.ragged_prefill import ragged_prefill_attention
from pallas_kernels.sparse_decode import (
    sparse_decode_attention,
    sparse_decode_attention_reference,
)

_CONTEXT_LENS = flags.DEFINE_list("context_lens", ["4096", "32768"], "KV tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per decode call.")
_PREFILL_BATCH = flags.DEFINE_integer("prefill_batch", 1, "Sequences per prefill call.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "Queries per prefill row (C).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page (P).")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 32, "Query heads (N).")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "KV heads (K).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim (D).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Q/K/V dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls per measurement (median reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
_BANDWIDTH_MIB = flags.DEFINE_integer("bandwidth_mib", 1024,
                                      "Size of the array copied to measure memory bandwidth.")
_INTERPRET = flags.DEFINE_bool("interpret", None,
                               "Run the Pallas kernels interpreted; default: on a CPU backend.")
_QUANT_CODECS = flags.DEFINE_list("quant_codecs", ["int8", "fp8_e4m3", "int4"],
                                  "Codecs of the quantized decode benchmark (none: skip it).")
_SPARSE_READ_FRACTION = flags.DEFINE_float(
    "sparse_read_fraction", 0.125, "Fraction of each row's pages sparse decode reads (0: skip).")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results as JSON.")


def median_seconds(fn: Callable[[], jax.Array], *, warmup: int, repeats: int) -> float:
    """Median wall time of fn() to block_until_ready, after compilation and warm-up calls."""
    for _ in range(warmup + 1):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(num_bytes: int, *, warmup: int, repeats: int) -> float:
    """Device memory bandwidth in bytes/s: one read and one write of a num_bytes float32 array."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    negate = jax.jit(jnp.negative)
    seconds = median_seconds(lambda: negate(x), warmup=warmup, repeats=repeats)
    return 2 * x.nbytes / seconds


def make_paged_kv(seed: int, *, batch: int, context_len: int, page_size: int,
                  num_kv_heads: int, head_dim: int, dtype) -> dict[str, jax.Array]:
    """Pages [num_pages, P, K, D] for `batch` full sequences, block tables randomly permuted."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context_len // page_size)
    num_pages = batch * pages_per_seq
    block_tables = rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32)
    key_k, key_v = jax.random.split(jax.random.PRNGKey(seed))
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return dict(k_pages=jax.random.normal(key_k, shape, dtype),
                v_pages=jax.random.normal(key_v, shape, dtype),
                block_tables=jnp.asarray(block_tables),
                kv_lens=jnp.full((batch,), context_len, jnp.int32))


def live_kv_bytes(batch: int, context_len: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of K and V that the live tokens occupy: what any implementation must read."""
    return 2 * batch * context_len * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def jax_gpu_paged_decode(kv: dict[str, jax.Array]) -> tuple[Callable | None, str]:
    """JAX's own GPU paged attention on our inputs, or None and the reason it cannot run."""
    if jax.default_backend() != "gpu":
        return None, f"ops.gpu.paged_attention needs a GPU, backend is {jax.default_backend()}"
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    k_heads_first = jnp.transpose(kv["k_pages"], (2, 0, 1, 3))  # [K, num_pages, P, D]
    v_heads_first = jnp.transpose(kv["v_pages"], (2, 0, 1, 3))
    pages_per_seq = kv["block_tables"].shape[1]
    k_splits = max(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
    fn = jax.jit(functools.partial(gpu_paged.paged_attention, k_splits=k_splits))
    return (lambda q: fn(q, k_heads_first, v_heads_first, kv["block_tables"], kv["kv_lens"])), ""


def bench_decode(context_len: int, *, interpret: bool, bandwidth: float, dtype
                 ) -> tuple[list[dict], list[dict]]:
    """Rows for one decode shape, and the implementations skipped with their reasons."""
    b, n, k, d = _BATCH.value, _NUM_HEADS.value, _NUM_KV_HEADS.value, _HEAD_DIM.value
    kv = make_paged_kv(0, batch=b, context_len=context_len, page_size=_PAGE_SIZE.value,
                       num_kv_heads=k, head_dim=d, dtype=dtype)
    q = jax.random.normal(jax.random.PRNGKey(1), (b, n, d), dtype)
    impls = {
        "pallas": jax.jit(functools.partial(paged_decode_attention, interpret=interpret)),
        "reference": jax.jit(paged_decode_attention_reference),
    }
    calls = {name: functools.partial(fn, q, **kv) for name, fn in impls.items()}
    jax_op, reason = jax_gpu_paged_decode(kv)
    if jax_op is not None:
        calls["jax_ops_gpu"] = functools.partial(jax_op, q)
    num_bytes = live_kv_bytes(b, context_len, k, d, dtype)
    rows, skipped = measure("decode", calls, context_len, b, num_bytes, bandwidth)
    if jax_op is None:
        skipped.append(dict(op="decode", impl="jax_ops_gpu", context_len=context_len,
                            reason=reason))
    return rows, skipped


def bench_prefill(context_len: int, *, interpret: bool, bandwidth: float, dtype
                  ) -> tuple[list[dict], list[dict]]:
    """Rows for one prefill shape: a chunk of C queries ending at context_len."""
    b, c = _PREFILL_BATCH.value, min(_PREFILL_CHUNK.value, context_len)
    n, k, d = _NUM_HEADS.value, _NUM_KV_HEADS.value, _HEAD_DIM.value
    kv = make_paged_kv(2, batch=b, context_len=context_len, page_size=_PAGE_SIZE.value,
                       num_kv_heads=k, head_dim=d, dtype=dtype)
    q = jax.random.normal(jax.random.PRNGKey(3), (b, c, n, d), dtype)
    q_lens = jnp.full((b,), c, jnp.int32)
    impls = {
        "pallas": jax.jit(functools.partial(ragged_prefill_attention, interpret=interpret)),
        "reference": jax.jit(paged_prefill_attention_reference),
    }
    calls = {name: functools.partial(fn, q, **kv, q_lens=q_lens) for name, fn in impls.items()}
    num_bytes = live_kv_bytes(b, context_len, k, d, dtype)
    return measure("prefill", calls, context_len, b, num_bytes, bandwidth)


def bench_quantized_decode(context_len: int, *, interpret: bool, bandwidth: float, dtype
                           ) -> tuple[list[dict], list[dict]]:
    """Rows for decode over a quantized pool, one codec after another."""
    b, n, k, d = _BATCH.value, _NUM_HEADS.value, _NUM_KV_HEADS.value, _HEAD_DIM.value
    kv = make_paged_kv(4, batch=b, context_len=context_len, page_size=_PAGE_SIZE.value,
                       num_kv_heads=k, head_dim=d, dtype=jnp.float32)
    q = jax.random.normal(jax.random.PRNGKey(5), (b, n, d), dtype)
    rows, skipped = [], []
    for codec_name in [c for c in _QUANT_CODECS.value if c != "none"]:
        codec = make_codec(codec_name)
        k_stored, v_stored = (as_pool_storage(codec.encode(kv[name]))
                              for name in ("k_pages", "v_pages"))
        args = dict(k_stored=k_stored, v_stored=v_stored, block_tables=kv["block_tables"],
                    kv_lens=kv["kv_lens"])

        def jnp_blockwise(q, k_stored, v_stored, block_tables, kv_lens, *, codec=codec):
            """The engine's reference path: dequantize each block's pages as it reads them."""
            def load(pages):
                return (codec.decode(codec_view({n_: x[pages] for n_, x in k_stored.items()},
                                                codec)),
                        codec.decode(codec_view({n_: x[pages] for n_, x in v_stored.items()},
                                                codec)))
            width = -(-block_tables.shape[1] // 8) * 8
            tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))
            return paged_attention_blockwise(q[:, None], load, tables, kv_lens,
                                             jnp.ones_like(kv_lens), pages_per_block=8)[:, 0]

        impls = {
            "pallas": functools.partial(quantized_decode_attention, codec=codec,
                                        interpret=interpret),
            "reference": functools.partial(quantized_decode_attention_reference, codec=codec),
            "jnp_blockwise": jnp_blockwise,
        }
        calls = {name: functools.partial(jax.jit(fn), q, **args) for name, fn in impls.items()}
        num_bytes = int(2 * b * context_len * codec.bytes_per_token(k, d))
        new_rows, new_skipped = measure(f"q-{codec_name}", calls, context_len, b, num_bytes,
                                        bandwidth)
        rows += new_rows
        skipped += new_skipped
    return rows, skipped


def as_pool_storage(stored: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Codec output [num_pages, P, ...] as QuantizedPagedKV holds it: float8 codes as bytes."""
    return {name: (jax.lax.bitcast_convert_type(x, jnp.uint8)
                   if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 1 else x)
            for name, x in stored.items()}


def bench_sparse_decode(context_len: int, *, interpret: bool, bandwidth: float, dtype
                        ) -> tuple[list[dict], list[dict]]:
    """Rows for decode over a Quest-style selection of each row's pages."""
    b, n, k, d = _BATCH.value, _NUM_HEADS.value, _NUM_KV_HEADS.value, _HEAD_DIM.value
    page_size = _PAGE_SIZE.value
    kv = make_paged_kv(6, batch=b, context_len=context_len, page_size=page_size,
                       num_kv_heads=k, head_dim=d, dtype=dtype)
    q = jax.random.normal(jax.random.PRNGKey(7), (b, n, d), dtype)
    width = kv["block_tables"].shape[1]
    num_read = max(1, int(round(_SPARSE_READ_FRACTION.value * width)))
    scores = jax.random.normal(jax.random.PRNGKey(8), (b, width))
    page_indices, narrowed_lens = quest.select_pages(scores, kv["kv_lens"], page_size, num_read)
    narrowed = jnp.take_along_axis(kv["block_tables"], page_indices, axis=1)  # [B, num_read]
    args = dict(kv, page_indices=page_indices)
    calls = {
        "pallas": functools.partial(jax.jit(functools.partial(
            sparse_decode_attention, interpret=interpret)), q, **args),
        "reference": functools.partial(jax.jit(sparse_decode_attention_reference), q, **args),
        "pallas_narrowed": functools.partial(jax.jit(functools.partial(
            paged_decode_attention, interpret=interpret)), q, kv["k_pages"], kv["v_pages"],
            narrowed, narrowed_lens),
    }
    num_bytes = live_kv_bytes(b, num_read * page_size, k, d, dtype)
    return measure("sparse", calls, context_len, b, num_bytes, bandwidth)


def measure(op: str, calls: dict[str, Callable[[], jax.Array]], context_len: int, batch: int,
            num_bytes: int, bandwidth: float) -> tuple[list[dict], list[dict]]:
    """Times each call: (rows, skipped); an implementation that fails is skipped, not fatal."""
    want = np.asarray(calls["reference"](), np.float32)
    rows, skipped = [], []
    for impl, call in calls.items():
        try:
            seconds = median_seconds(call, warmup=_WARMUP.value, repeats=_REPEATS.value)
            err = float(np.max(np.abs(np.asarray(call(), np.float32) - want)))
        except Exception as e:  # A failing implementation must not end the run.
            skipped.append(dict(op=op, impl=impl, context_len=context_len,
                                reason=f"{type(e).__name__}: {e}"[:500]))
            continue
        rows.append(dict(op=op, impl=impl, context_len=context_len, batch=batch,
                         time_ms=seconds * 1e3, kv_bytes=num_bytes,
                         gb_per_s=num_bytes / seconds / 1e9,
                         roofline_fraction=num_bytes / seconds / bandwidth,
                         max_abs_err_vs_reference=err))
    return rows, skipped


def format_table(rows: list[dict]) -> str:
    header = (f"{'op':10} {'impl':15} {'ctx':>7} {'batch':>5} {'ms':>10} {'KV MiB':>9} "
              f"{'GB/s':>8} {'roofline':>8} {'max err':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['op']:10} {r['impl']:15} {r['context_len']:>7} {r['batch']:>5} "
                     f"{r['time_ms']:>10.3f} {r['kv_bytes'] / 2**20:>9.1f} "
                     f"{r['gb_per_s']:>8.2f} {r['roofline_fraction']:>8.3f} "
                     f"{r['max_abs_err_vs_reference']:>9.2e}")
    return "\n".join(lines)


def run(context_lens: list[int], *, interpret: bool) -> dict:
    """The whole benchmark as a JSON-ready dict."""
    dtype = resolve_dtype(_DTYPE.value)
    bandwidth = measure_bandwidth(_BANDWIDTH_MIB.value * 2**20, warmup=_WARMUP.value,
                                  repeats=_REPEATS.value)
    rows, skipped = [], []
    for context_len in context_lens:
        benches = [bench_decode, bench_prefill]
        if any(c != "none" for c in _QUANT_CODECS.value):
            benches.append(bench_quantized_decode)
        if _SPARSE_READ_FRACTION.value > 0:
            benches.append(bench_sparse_decode)
        for bench in benches:
            new_rows, new_skipped = bench(context_len, interpret=interpret, bandwidth=bandwidth,
                                          dtype=dtype)
            rows += new_rows
            skipped += new_skipped
    device = jax.devices()[0]
    return dict(backend=jax.default_backend(), device_kind=device.device_kind,
                jax_version=jax.__version__, interpret=interpret,
                config={name: flags.FLAGS[name].value for name in (
                    "batch", "prefill_batch", "prefill_chunk", "page_size", "num_heads",
                    "num_kv_heads", "head_dim", "dtype", "repeats", "warmup",
                    "quant_codecs", "sparse_read_fraction")},
                bandwidth_bytes_per_s=bandwidth, results=rows, skipped=skipped)


def main(argv):
    del argv
    interpret = (jax.default_backend() == "cpu" if _INTERPRET.value is None
                 else _INTERPRET.value)
    context_lens = [int(x) for x in _CONTEXT_LENS.value]
    report = run(context_lens, interpret=interpret)
    print(f"backend={report['backend']} device={report['device_kind']} "
          f"interpret={interpret} copy bandwidth={report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print(format_table(report["results"]))
    for s in report["skipped"]:
        print(f"skipped {s['op']}/{s['impl']} at {s['context_len']} tokens: {s['reason']}")
    if _OUTPUT_JSON.value:
        with open(_OUTPUT_JSON.value, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {_OUTPUT_JSON.value}")


if __name__ == "__main__":
    app.run(main)
