"""Retention policies on the embedded model at long context: memory, speed and quality vs exact KV.

  python scripts/bench_retention.py --output_json /tmp/bench_retention.json

Each policy and budget (--variants, `name:budget` tokens, then any policy options as
`:option=value`, e.g. `quest:1024:dense_layers=0`) on needle-in-a-haystack prompts (one per
--depths entry, --context tokens each): KV bytes per sequence, decode tokens/s, teacher-forced
KL and top-1 agreement against exact KV, retrieval, and for quest the recall of the exact
top-k attention pages; what each number is: `kvjax.bench.retention`.

With --schemes, the budget schemes instead (uniform, pyramid: PyramidKV per layer, adakv: AdaKV
per head, `kvjax.kv.budgets`) for each of --scheme_presses at --budget_fraction of the prompt,
on a simulated cache (--engine_presses adds the engine's uniform rows beside the simulated
ones, and for the presses that compress once its pyramid rows,
`retention_schedule='pyramid'`), with the pages a per-layer allocator holds:

  python scripts/bench_retention.py --schemes=uniform,pyramid,adakv --context=2048 \
      --depths=0.25,0.5,0.75 --num_tokens=16 --chunk=2048 --output_json /tmp/schemes.json

what each number is: `kvjax.bench.budgets`.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

import kvjax
from kvjax.bench import budgets, retention
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", ["streaming:512", "streaming:1024", "h2o:512", "h2o:1024",
                               "snapkv:512", "snapkv:1024", "quest:512", "quest:1024",
                               "tova:512", "knorm:512", "expected_attention:512",
                               "observed_attention:512"],
                  "Retention policies to compare with exact KV, as name:budget_tokens.")
flags.DEFINE_integer("context", 4096, "Prompt tokens per probe (the filler is sized to it).")
flags.DEFINE_list("depths", ["0.5"], "Where the needle sits in each probe (fraction).")
flags.DEFINE_integer("num_tokens", 24, "Teacher-forced tokens per probe (answer included).")
flags.DEFINE_integer("page_size", 16, "Tokens per page.")
flags.DEFINE_integer("chunk", 512, "Prefill chunk.")
flags.DEFINE_integer("seed", 0, "Probe seed.")
flags.DEFINE_list("recall_groups", ["2", "10", "20"],
                  "First layers of the layer groups Quest's page recall is reported for.")
flags.DEFINE_list("schemes", [], "Budget schemes to compare (uniform, pyramid, adakv, "
                  "pyramid+adakv); when given, runs them instead of --variants.")
flags.DEFINE_list("scheme_presses", ["snapkv", "expected_attention", "knorm"],
                  "Presses the budget schemes score with.")
flags.DEFINE_float("budget_fraction", 0.25, "Budget schemes: tokens kept, fraction of the prompt.")
flags.DEFINE_list("engine_presses", ["snapkv"],
                  "Budget schemes: presses whose uniform scheme (and pyramid) "
                  "also runs in the engine.")
flags.DEFINE_string("output_json", None, "Write every number here (rewritten after each row).")
flags.DEFINE_string("exact_cache", None,
                    "An .npz of the exact runs: read where it holds these probes, else written "
                    "(runs of other variants on the same probes then skip exact KV).")
flags.DEFINE_bool("by_probe", False,
                  "Run every variant on a probe before the next (engines kept warm), rewriting "
                  "every row after each probe: a run stopped early leaves rows on the same "
                  "first probes.")
flags.DEFINE_string("probes_json", None,
                    "Write the probes here (prompt, answer and forced continuation token ids, "
                    "needle position) for a peer framework to replay (scripts/kvpress_peer.py).")


def run_schemes(model) -> None:
    settings = budgets.SchemeBench(
        presses=tuple(FLAGS.scheme_presses), schemes=tuple(FLAGS.schemes),
        budget_fraction=FLAGS.budget_fraction, depths=tuple(float(x) for x in FLAGS.depths),
        context=FLAGS.context, num_tokens=FLAGS.num_tokens, page_size=FLAGS.page_size,
        chunk=FLAGS.chunk, seed=FLAGS.seed, engine_presses=tuple(FLAGS.engine_presses))
    report = budgets.run(model, settings)
    print(format_rows(report["rows"], budgets.COLUMNS, "press/scheme"))
    print(f"budget {report['budget']} tokens; prompt tokens: {report['prompt_tokens']} "
          f"(rows but '(engine)' simulated)")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags={k: FLAGS[k].value for k in (
                "schemes", "scheme_presses", "budget_fraction", "engine_presses", "context",
                "depths", "num_tokens", "page_size", "chunk", "seed")}, **report), f, indent=1)


def main(argv):
    del argv
    t0 = time.perf_counter()
    model = kvjax.load_model()
    if FLAGS.schemes:
        run_schemes(model)
        print(f"total {time.perf_counter() - t0:.0f}s")
        return
    settings = retention.RetentionBench(
        variants=tuple(FLAGS.variants), depths=tuple(float(x) for x in FLAGS.depths),
        context=FLAGS.context, num_tokens=FLAGS.num_tokens, page_size=FLAGS.page_size,
        chunk=FLAGS.chunk, seed=FLAGS.seed,
        recall_groups=tuple(int(x) for x in FLAGS.recall_groups),
        exact_cache=FLAGS.exact_cache, by_probe=FLAGS.by_probe)
    report = retention.run(model, settings, on_row=_write_json)
    print(format_rows(report["rows"], retention.COLUMNS, "policy:budget"))
    print(f"prompt tokens: {report['prompt_tokens']}; total {time.perf_counter() - t0:.0f}s")


def _write_json(report: dict) -> None:
    """Writes the rows so far (every row once the run ends) to --output_json, and the probes
    (known once exact KV has run) to --probes_json."""
    if FLAGS.probes_json:
        with open(FLAGS.probes_json, "w") as f:
            json.dump(dict(context=FLAGS.context, num_tokens=FLAGS.num_tokens,
                           probes=report["probes"]), f)
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags={k: FLAGS[k].value for k in (
                "variants", "context", "depths", "num_tokens", "page_size", "chunk", "seed",
                "recall_groups", "by_probe")},
                prompt_tokens=report["prompt_tokens"], rows=report["rows"]), f, indent=1)


if __name__ == "__main__":
    app.run(main)
