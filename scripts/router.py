"""Route OpenAI requests over several kvjax server replicas (kvjax.router.http).

  python scripts/serve.py --port 8001 &  python scripts/serve.py --port 8002 &
  python scripts/router.py --replica http://127.0.0.1:8001,http://127.0.0.1:8002 \
      --policy prefix_affinity --port 8000

Prefill/decode disaggregation: `--prefill_replica` names replicas that only prefill; each
request's prompt runs there for one token, its KV pages move to one of the `--replica`
(decode) replicas, which answers the client (kvjax.server.pd). Alternating phases instead
(`--phase_period_s`): every replica prefills and decodes, taking new prompts only in its own
window of each period (kvjax.router.phases); no KV moves.

Each request goes to the healthy replica the policy picks from the replicas' polled GET
/kv_state; a request whose replica dies before any output runs once more on another (same
X-Request-Id); a stream that breaks after output ends with an error event. The router keeps no
state beyond these flags: restart it freely.
"""

from __future__ import annotations

import logging

from absl import app, flags

from kvjax.router.http import RouterConfig, serve_router
from kvjax.router.policies import POLICIES
from kvjax.server.kv_state import read_affinity_secret

FLAGS = flags.FLAGS
flags.DEFINE_list("replica", [], "Base URLs of the replicas (http://host:port), in order.")
flags.DEFINE_list("prefill_replica", [], "Base URLs of prefill replicas: with them, requests "
                  "are prefilled there and decoded on the --replica replicas.")
flags.DEFINE_enum("policy", "round_robin", sorted(POLICIES), "Routing policy.")
flags.DEFINE_float("phase_period_s", None, "Alternate prefill and decode phases: in each "
                   "period of this many seconds, each --replica in turn gets every new request "
                   "for its 1/N of it (kvjax.router.phases).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_float("poll_interval_s", 0.1, "Seconds between polls of each replica.")
flags.DEFINE_float("read_timeout_s", 300.0, "Longest silence from a replica on a request "
                   "(before its answer or between stream events); then 504.")
flags.DEFINE_string("replica_api_key", None, "Key for replicas that need one (/kv_state).")
flags.DEFINE_string("affinity_secret_file", None, "A file holding the key of /kv_state's "
                    "affinity digests, the same for a router and its replicas (default: a "
                    "random key per process, so a router finds no tenant's pages).")
flags.DEFINE_string("log_level", "info", "uvicorn's log level.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.replica:
        raise app.UsageError("give at least one --replica URL")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll (20 a second)
    config = RouterConfig(replicas=tuple(FLAGS.replica), policy=FLAGS.policy,
                          poll_interval_s=FLAGS.poll_interval_s,
                          read_timeout_s=FLAGS.read_timeout_s,
                          replica_api_key=FLAGS.replica_api_key,
                          affinity_secret=read_affinity_secret(FLAGS.affinity_secret_file),
                          prefill_replicas=tuple(FLAGS.prefill_replica),
                          phase_period_s=FLAGS.phase_period_s)
    serve_router(config, host=FLAGS.host, port=FLAGS.port, log_level=FLAGS.log_level)


if __name__ == "__main__":
    app.run(main)
