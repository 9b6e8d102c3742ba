"""The fused KV write (EngineConfig.fused_kv_write) against K/V materialized, then scattered:
every layer's projection and write alone per token count, and the engine's greedy decode
(kvjax.bench.fused_kv_write).

  python scripts/bench_fused_kv_write.py --tokens=1,8,32,128 \
      --output_json=docs/results/fused_kv_write.json

The Pallas fused write's bytes in the engine step compiled for GPUs and TPUs come from the
deviceless compile (its qk_norm step programs, run in the deviceless environment); this
script prints them as a table from that JSON:

  scripts/deviceless_compile.py --programs=step_decode_qk,step_decode_fused,step_mixed_qk,\
      step_mixed_fused --targets=h100,v5e --dtypes=bfloat16 --shapes=smollm2,8b \
      --output_json=docs/results/fused_kv_write_deviceless.json
  python scripts/bench_fused_kv_write.py \
      --compiled_records=docs/results/fused_kv_write_deviceless.json
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import fused_kv_write

_TOKENS = flags.DEFINE_list("tokens", ["1", "8", "32", "128"], "Token rows per step.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls per system (alternating).")
_BATCH = flags.DEFINE_integer("batch", 8, "Engine run: sequences.")
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "Engine run: prompt tokens.")
_NEW = flags.DEFINE_integer("new_tokens", 32, "Engine run: generated tokens per sequence.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Write the results here.")
_COMPILED = flags.DEFINE_string("compiled_records", None, "Only print the compiled steps' "
                                "bytes from this deviceless_compile JSON.")


def main(argv):
    del argv
    if _COMPILED.value:
        with open(_COMPILED.value) as f:
            print(fused_kv_write.compiled_bytes_table(json.load(f)))
        return
    result = fused_kv_write.run([int(t) for t in _TOKENS.value], _REPEATS.value, _BATCH.value,
                                _PROMPT.value, _NEW.value)
    print(fused_kv_write.table(result))
    if _OUTPUT.value:
        fused_kv_write.write(result, _OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
