"""The press quality table: kvjax's retention rows beside kvpress's for the same press.

  python scripts/press_table.py --kvjax_json docs/results/bench_retention_presses_2k_9probes.json \
      --kvpress_json docs/results/kvpress_peer_2k.json --output_json /tmp/press_table_2k.json

Joins a `scripts/bench_retention.py` report and a `scripts/kvpress_peer.py` report on the same
probes, prints the markdown table and writes it with the rows as JSON; what each column is:
`kvjax.bench.press_table`.
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import press_table

FLAGS = flags.FLAGS
flags.DEFINE_list("kvjax_json", None, "bench_retention's --output_json (several runs on the "
                  "same probes join).", required=True)
flags.DEFINE_list("kvpress_json", None, "kvpress_peer's --output_json (likewise).",
                  required=True)
flags.DEFINE_string("output_json", None, "Write the merged rows and the markdown here.")


def main(argv):
    del argv
    kvjax = press_table.combine([_load(path) for path in FLAGS.kvjax_json])
    kvpress_runs = [_load(path) for path in FLAGS.kvpress_json]
    kvpress = press_table.combine(kvpress_runs)
    table = press_table.merge(kvjax, kvpress)
    markdown = press_table.format_table(table)
    print(markdown)
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(table, markdown=markdown, kvjax_json=FLAGS.kvjax_json,
                           kvpress_json=FLAGS.kvpress_json,
                           kvpress_versions=kvpress_runs[0].get("versions"),
                           kvpress_continuation_agreement=kvpress["rows"]["none"].get(
                               "kvjax_continuation_agreement")), f, indent=1)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    app.run(main)
