"""Generate text with kvjax.

  python scripts/generate.py --prompt "What is the capital of France?"
  python scripts/generate.py --prompt_ids 1,2,3 --max_new_tokens 16 --output_json out.json
"""

from __future__ import annotations

import json
import time

from absl import app, flags

import kvjax
from kvjax.generation import encode_prompt

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Embedded model (default), a Hugging Face directory or a .gguf.")
flags.DEFINE_string("prompt", None, "Prompt text; the chat template is applied unless --raw.")
flags.DEFINE_string("prompt_ids", None, "Comma-separated token ids (no template).")
flags.DEFINE_bool("raw", False, "Do not apply the chat template to --prompt.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
flags.DEFINE_float("temperature", 0.0, "0 is greedy.")
flags.DEFINE_integer("top_k", 0, "Top-k filter (0: off).")
flags.DEFINE_float("top_p", 1.0, "Top-p filter (1: off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_enum("kv_layout", "paged", ["paged", "contiguous"], "KV cache layout.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and KV dtype.")
flags.DEFINE_string("output_json", None, "Write {prompt_ids, output_ids, text} here.")


def main(argv):
    del argv
    if (FLAGS.prompt is None) == (FLAGS.prompt_ids is None):
        raise app.UsageError("pass exactly one of --prompt and --prompt_ids")
    t0 = time.perf_counter()
    model = kvjax.load_model(FLAGS.model, dtype=FLAGS.dtype)
    t_load = time.perf_counter() - t0
    if FLAGS.prompt_ids is not None:
        prompt = [int(t) for t in FLAGS.prompt_ids.split(",") if t.strip()]
    else:
        prompt = encode_prompt(model, FLAGS.prompt, chat=not FLAGS.raw)
    sampling = kvjax.SamplingParams(
        max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
        top_p=FLAGS.top_p, seed=FLAGS.seed)
    config = kvjax.EngineConfig(kv_layout=kvjax.KVLayout(FLAGS.kv_layout),
                                page_size=FLAGS.page_size, max_num_seqs=1)
    engine = kvjax.Engine(model, config)
    t1 = time.perf_counter()
    (out,) = engine.generate([prompt], sampling)
    elapsed = time.perf_counter() - t1
    if out.error:
        raise app.UsageError(out.error)
    sample = out.outputs[0]
    print(sample.text)
    print(f"\n[{len(sample.token_ids)} tokens in {elapsed:.1f}s incl. compile "
          f"({engine.num_compiles} programs); model loaded in {t_load:.1f}s; "
          f"finish: {sample.finish_reason.value}]")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump({"prompt_ids": prompt, "output_ids": sample.token_ids,
                       "text": sample.text}, f)


if __name__ == "__main__":
    app.run(main)
