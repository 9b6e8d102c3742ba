"""Times the native CPU prefill attention kernel alone, several kernel sources side by side.

Each of --sources (a `paged_prefill.cc`, e.g. the current one and an older one saved with
`git show REV:kvjax/kv/native/paged_prefill.cc > old.cc`) is compiled with the flags
`kvjax.kv.native` uses and registered under its own FFI target. Per --settings (context S and
chunk C: one row's last C queries over its S keys), one jitted call of one layer at
SmolLM2-135M's attention shape (K=3, G=3, D=64, P=16) on random float32 pages; the sources'
calls alternate. Prints the median ms, the causal FLOPs' rate and the largest difference
from the first source's output (--output_json writes them).

  python scripts/bench_native_prefill.py --sources=/tmp/old.cc,kvjax/kv/native/paged_prefill.cc
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kvjax import cpu_kernels
from kvjax.bench.decode import environment
from kvjax.kv import native

FLAGS = flags.FLAGS

_SOURCES = flags.DEFINE_list("sources", [str(native._PREFILL_SOURCE)], "Kernel sources.")
_SETTINGS = flags.DEFINE_list("settings", ["2048:2048", "8192:2048"], "context:chunk pairs.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per source and setting.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Write the results here.")
K, G, D, P = 3, 3, 64, 16


def main(argv):
    del argv
    env, rng, results = environment(), np.random.default_rng(0), []
    targets = cpu_kernels.register_sources(_SOURCES.value, "KvjaxPagedPrefill",
                                           "bench_native_prefill")
    run = jax.jit(native.paged_prefill_attention, static_argnames="target")
    for setting in _SETTINGS.value:
        context, chunk = (int(x) for x in setting.split(":"))
        pages = -(-context // P)
        k, v = (jnp.asarray(rng.normal(size=(1, pages, P, K, D)).astype(np.float32))
                for _ in range(2))
        q = jnp.asarray(rng.normal(size=(1, chunk, K * G, D)).astype(np.float32))
        args = (q, k, v, 0, jnp.arange(pages, dtype=jnp.int32)[None],
                jnp.array([context], jnp.int32), jnp.array([chunk], jnp.int32))
        outs = [np.asarray(run(*args, target=t)) for t in targets]
        times = [[] for _ in targets]
        for _ in range(_REPEATS.value):
            for t, ts in zip(targets, times, strict=True):
                start = time.perf_counter()
                run(*args, target=t).block_until_ready()
                ts.append(time.perf_counter() - start)
        # Causal pairs: each query sees the keys up to its position (QK and PV, 2 FLOPs each).
        pairs = sum(context - chunk + i + 1 for i in range(chunk))
        flops = 4 * pairs * K * G * D
        for source, out, ts in zip(_SOURCES.value, outs, times, strict=True):
            ms = 1e3 * statistics.median(ts)
            diff = float(np.abs(out - outs[0]).max())
            print(f"S={context} C={chunk} {source}: {ms:8.1f} ms  {flops / ms / 1e6:6.1f} "
                  f"GFLOP/s  max |diff| {diff:.1e}")
            results.append(dict(context=context, chunk=chunk, source=source, ms=ms,
                                gflop_per_s=flops / ms / 1e6, max_abs_diff=diff))
    env["load_average_end"] = list(os.getloadavg())
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump(dict(env=env, results=results), f, indent=1)


if __name__ == "__main__":
    app.run(main)
