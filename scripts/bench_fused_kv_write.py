"""The fused KV write (EngineConfig.fused_kv_write) against K/V materialized, then scattered:
every layer's projection and write alone per token count, and the engine's greedy decode
(kvjax.bench.fused_kv_write).

  python scripts/bench_fused_kv_write.py --tokens=1,8,32,128 \
      --output_json=docs/results/fused_kv_write.json
"""

from __future__ import annotations

from absl import app, flags

from kvjax.bench import fused_kv_write

_TOKENS = flags.DEFINE_list("tokens", ["1", "8", "32", "128"], "Token rows per step.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls per system (alternating).")
_BATCH = flags.DEFINE_integer("batch", 8, "Engine run: sequences.")
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "Engine run: prompt tokens.")
_NEW = flags.DEFINE_integer("new_tokens", 32, "Engine run: generated tokens per sequence.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    result = fused_kv_write.run([int(t) for t in _TOKENS.value], _REPEATS.value, _BATCH.value,
                                _PROMPT.value, _NEW.value)
    print(fused_kv_write.table(result))
    if _OUTPUT.value:
        fused_kv_write.write(result, _OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
