"""In-place demotion of a running sequence's pages: KL against exact KV and bytes held.

  python scripts/bench_inplace_demotion.py --config=configs/serve_controller.py \
      --output_json=docs/results/bench_inplace_demotion.json

Serves the config's quality prompts (the longest `quality.num_prompts` of its workload, as the
controller's KL tables do) on a mixed-precision pool, demotes the prompt's pages in place after
prefill (every full page, or the cold ones: all but the last two) and decodes
`quality.num_tokens` greedy tokens; prints one row per plan (`kvjax.bench.inplace`).
"""

from __future__ import annotations

import json
import shlex
import sys

from absl import app, flags
from ml_collections import config_flags

from kvjax.bench import inplace, runner
from kvjax.bench.metrics import format_rows
from kvjax.models.loading import load_model

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "configs/serve_controller.py or a variant.",
                                lock_config=False)
flags.DEFINE_string("output_json", None, "Write the rows here.")
flags.mark_flags_as_required(["config"])

_COLUMNS = (("kl_mean", "KL mean", "{:.2e}"), ("kl_p99", "KL p99", "{:.2e}"),
            ("kl_max", "KL max", "{:.2e}"), ("top1_agreement", "top-1", "{:.3f}"),
            ("bytes_ratio", "bytes / exact", "{:.3f}"))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    model = load_model(config.model.name, dtype=config.model.dtype)
    requests = runner.build_workload(config, model.tokenizer)
    prompts = [r.prompt_ids for r in sorted(requests, key=lambda r: -len(r.prompt_ids))
               [:config.quality.num_prompts]]
    rows = inplace.measure(model, prompts, config.quality.num_tokens,
                           page_size=config.engine.page_size)
    print(format_rows(rows, _COLUMNS, "plan"))
    if FLAGS.output_json:
        command = shlex.join(["python", "scripts/bench_inplace_demotion.py", *sys.argv[1:]])
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(command=command, prompt_lens=[len(p) for p in prompts], rows=rows,
                           env=runner.environment()), f, indent=2)


if __name__ == "__main__":
    app.run(main)
