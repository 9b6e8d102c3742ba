"""Routing policies over server processes (scripts/bench_router_http.py): a shared-prefix
workload on the embedded SmolLM2, small enough for two replicas on a 2-core CPU.

Each replica is scripts/serve.py with this config (serve_demo's engine, 96 pages of 16
tokens); 32 requests at 4 per second, 90% of them opening with one of 4 shared 96-token
blocks, then an 8-24 token question, 16 output tokens.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_demo.py"))
    config.name = "router_shared_prefix"  # the run's label
    config.engine.num_pages = 96  # per replica: every shared block fits beside 8 requests
    config.workload.name = "shared_prefix"  # kvjax.bench.workloads.shared_prefix
    config.workload.num_requests = 32  # requests per policy
    config.workload.params = ConfigDict(dict(
        rate=4.0,  # arrivals per second
        shared_fraction=0.9,  # requests opening with a shared block
        num_prefixes=4,  # distinct shared blocks
        prefix_len=96,  # tokens per block
        question_min=8, question_max=24,  # tokens after the block
        output_len=16,  # output tokens
    ))
    return config
