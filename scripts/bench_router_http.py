"""Routing policies through real processes: N server replicas behind the HTTP router.

  python scripts/bench_router_http.py --output_dir /tmp/bench_router_http
  python scripts/bench_router_http.py --num_replicas 3 --policies round_robin,load_aware
  python scripts/bench_router_http.py --disaggregate --policies round_robin

Starts --num_replicas `scripts/serve.py --config=<--config>` processes, then, per policy, a
`scripts/router.py` process in front of them, and replays the config's workload through it
(serve_bench --target; a fresh seed per policy so no policy reuses another's cached pages).
Prints a table (prefix hit rate from the replicas' /metrics, TTFT p50/p99, output tokens/s)
and writes router_http.json. The replicas share this machine's cores: tokens/s is bound by
them, not by the number of replicas.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from kvjax.bench import router_http
from kvjax.models.loading import load_model

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "configs/router_shared_prefix.py",
                                "serve_bench config: the replicas' engine and the workload.")
flags.DEFINE_integer("num_replicas", 2, "Server processes behind the router.")
flags.DEFINE_list("policies", ["round_robin", "least_loaded", "prefix_affinity", "load_aware"],
                  "Routing policies, each run through its own router process.")
flags.DEFINE_bool("disaggregate", False, "Instead of comparing policies: the first policy "
                  "colocated (every replica serves) vs disaggregated (replica 0 prefills, the "
                  "others decode) vs alternating phases (each replica in turn takes the new "
                  "requests), with KV bytes moved per request (router_http_pd.json).")
flags.DEFINE_float("phase_period_s", 4.0, "With --disaggregate: the alternating mode's period "
                   "(each of N replicas takes new requests for 1/N of it).")
flags.DEFINE_string("output_dir", "/tmp/bench_router_http", "Where router_http.json goes.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
    config = FLAGS.config
    config_path = config_flags.get_config_filename(FLAGS["config"])
    # The replicas read the same file with the same --config.* overrides.
    server_args = [f"--config={config_path}",
                   *(arg for arg in sys.argv[1:] if arg.startswith("--config."))]
    tokenizer = load_model(config.model.name, dtype=config.model.dtype).tokenizer
    with router_http.replica_processes(server_args, FLAGS.num_replicas) as replicas:
        urls = [url for url, _ in replicas]
        if FLAGS.disaggregate:
            rows = router_http.run_disaggregation(config, urls, FLAGS.policies[0], tokenizer,
                                                  phase_period_s=FLAGS.phase_period_s)
        else:
            rows = router_http.run_policies(config, urls, FLAGS.policies, tokenizer)
    if FLAGS.disaggregate:
        print(router_http.disaggregation_table(rows))
        print(f"wrote {router_http.write(rows, FLAGS.output_dir, 'router_http_pd.json')}")
    else:
        print(router_http.table(rows))
        print(f"wrote {router_http.write(rows, FLAGS.output_dir)}")


if __name__ == "__main__":
    app.run(main)
