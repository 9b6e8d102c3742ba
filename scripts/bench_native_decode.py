"""Times the native CPU decode kernel alone, several kernel sources side by side.

Each of --sources (a `paged_decode.cc`, e.g. the current one and an older one saved with
`git show REV:kvjax/kv/native/paged_decode.cc > old.cc`) is compiled with the flags
`kvjax.kv.native` uses and registered under its own FFI target. For each codec, one jitted
call runs the kernel over every layer of a random page pool (SmolLM2-135M's shape by default:
L=30, K=3, G=3, D=64, P=16), as a decode step does; the sources' calls alternate, so a noisy
machine slows them alike. Prints the median ms per step, the KV bytes read (codes and scales
for quantized pools) and bytes/s; also the largest difference between sources' outputs
(--output_json writes them).

  python scripts/bench_native_decode.py --sources=/tmp/old.cc,kvjax/kv/native/paged_decode.cc
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kvjax import cpu_kernels
from kvjax.kv import codecs, native

FLAGS = flags.FLAGS

_SOURCES = flags.DEFINE_list("sources", [str(native._SOURCE)], "Kernel sources to compare.")
_CODECS = flags.DEFINE_list("kv_codecs", ["none", "int8", "int4"], "KV codecs (none: float32).")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows decoding at once.")
_CONTEXT = flags.DEFINE_integer("context", 7680, "KV tokens per row.")
_LAYERS = flags.DEFINE_integer("num_layers", 30, "Layers of the pool (one kernel call each).")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 3, "KV heads.")
_GROUP = flags.DEFINE_integer("group", 3, "Query heads per kv head.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_SHUFFLE = flags.DEFINE_bool("shuffle_pages", False,
                             "Random block tables (default: each row's pages in order, as a "
                             "fresh engine's FIFO free list hands them out).")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed steps per source and codec.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Write the results here.")


def _pool(codec_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> dict:
    """Random K and V pools [L, num_pages, P, K, D] stored by the codec, as kernel arguments."""
    none = jnp.zeros((1,), jnp.float32)
    if codec_name == "none":
        return dict(k=jnp.asarray(rng.standard_normal(shape, np.float32)),
                    v=jnp.asarray(rng.standard_normal(shape, np.float32)),
                    meta=[none] * 4, bits=8, group=0)
    codec = codecs.get_codec(codec_name)
    encode = jax.jit(codec.encode)

    def stored():  # layer by layer: the float pool of every layer at once would not fit
        layers = [encode(jnp.asarray(rng.standard_normal(shape[1:], np.float32)))
                  for _ in range(shape[0])]
        return {key: jnp.stack([x[key] for x in layers]) for key in layers[0]}

    k, v = stored(), stored()
    if "zero" in k:
        return dict(k=k["codes"], v=v["codes"], meta=[k["scale"], v["scale"], k["zero"],
                                                      v["zero"]],
                    bits=codec.bits, group=codec.group)
    return dict(k=k["codes"], v=v["codes"], meta=[k["scale"], v["scale"], none, none], bits=8,
                group=0)


def _step(target: str, pool: dict, tables: np.ndarray, lens: np.ndarray, num_layers: int):
    """A jitted decode step's attention: the kernel on every layer, outputs summed."""
    head_dim = _HEAD_DIM.value

    def run(q, k, v, meta):
        def layer(i, acc):  # q depends on acc so the calls stay in order
            # The kernel writes the attention [B, N, D], then each head's log-sum-exp [B, N].
            out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((q.size + q.size // head_dim,),
                                                                jnp.float32))(
                q + 0 * acc[:, :, :1], k, v, *meta, i.astype(jnp.int32), jnp.int32(0), tables,
                lens, jnp.ones_like(lens), sm_scale=np.float32(head_dim ** -0.5),
                soft_cap=np.float32(0.0), bits=np.int32(pool["bits"]),
                group=np.int32(pool["group"]), num_queries=np.int32(1), split_rows=True)
            return acc + out[:q.size].reshape(q.shape)  # [B, N, D]

        return jax.lax.fori_loop(0, num_layers, layer, jnp.zeros_like(q))

    return jax.jit(run)


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    b, p, k_heads = _BATCH.value, _PAGE_SIZE.value, _KV_HEADS.value
    blocks = -(-_CONTEXT.value // p)
    num_pages = b * blocks
    order = rng.permutation(num_pages) if _SHUFFLE.value else np.arange(num_pages)
    tables = order.reshape(b, blocks).astype(np.int32)
    lens = np.full((b,), _CONTEXT.value, np.int32)
    q = jnp.asarray(rng.standard_normal((b, k_heads * _GROUP.value, _HEAD_DIM.value),
                                        np.float32))
    shape = (_LAYERS.value, num_pages, p, k_heads, _HEAD_DIM.value)
    targets = cpu_kernels.register_sources(_SOURCES.value, "KvjaxPagedDecode",
                                           "bench_native_decode")
    results = []
    for codec_name in _CODECS.value:
        pool = _pool(codec_name, shape, rng)
        # Every page of the pool is some row's: the step reads all of it.
        nbytes = sum(x.nbytes for x in (pool["k"], pool["v"], *pool["meta"]) if x.size > 1)
        steps = [_step(t, pool, tables, lens, _LAYERS.value) for t in targets]
        outs = [np.asarray(f(q, pool["k"], pool["v"], pool["meta"])) for f in steps]
        times = [[] for _ in steps]
        for _ in range(_REPEATS.value):
            for f, t in zip(steps, times, strict=True):
                start = time.perf_counter()
                f(q, pool["k"], pool["v"], pool["meta"]).block_until_ready()
                t.append(time.perf_counter() - start)
        for source, out, t in zip(_SOURCES.value, outs, times, strict=True):
            ms = statistics.median(t) * 1e3
            diff = float(np.abs(out - outs[0]).max())
            print(f"{codec_name:5s} {source}: {ms:7.1f} ms/step  {nbytes / 1e9:.3f} GB  "
                  f"{nbytes / ms / 1e6:5.1f} GB/s  max |diff| vs first {diff:.2e}")
            results.append(dict(codec=codec_name, source=source, ms_per_step=ms,
                                kv_bytes=nbytes, gb_per_s=nbytes / ms / 1e6,
                                max_abs_diff_vs_first=diff, times_s=t))
        del pool
    if _OUTPUT.value:
        flag_values = {name: FLAGS[name].value for name in
                       ("sources", "kv_codecs", "batch", "context", "num_layers",
                        "num_kv_heads", "group", "head_dim", "page_size", "shuffle_pages",
                        "repeats")}
        with open(_OUTPUT.value, "w") as f:
            json.dump(dict(flags=flag_values, results=results), f, indent=1)


if __name__ == "__main__":
    app.run(main)
