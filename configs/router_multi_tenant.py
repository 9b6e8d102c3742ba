"""Routing policies over server processes (scripts/bench_router_http.py): a multi-tenant
workload on the embedded SmolLM2, small enough for two replicas on a 2-core CPU.

Each replica is scripts/serve.py with this config (serve_demo's engine, 96 pages of 16
tokens). 8 tenants, each sending (as the request's `user`, so each tenant's pages hash under
its own provenance on every replica) prompts that open with the tenant's own 96-token system
prompt, then a log-normal 8-32 token message; 48 requests at 4 per second in all, 16 output
tokens at most. 8 system prompts of 6 pages each fill half a replica's pool: a replica that
serves every tenant evicts some of them under load.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_demo.py"))
    config.name = "router_multi_tenant"  # the run's label
    config.engine.num_pages = 96  # per replica
    config.workload.name = "multi_tenant_burst"  # kvjax.bench.workloads.multi_tenant_burst
    config.workload.num_requests = 48  # requests per policy
    config.workload.params = ConfigDict(dict(
        num_tenants=8,  # tenants "tenant-0".. "tenant-7", each with its own system prompt
        base_rate=0.5,  # arrivals per second per tenant (4 per second in all)
        burst_multiplier=1.0,  # no tenant floods: every tenant at base_rate
        system_prompt_len=96,  # tokens of each tenant's system prompt (6 pages)
        prompt_len=16, prompt_max=32,  # log-normal tokens after it (median, at most)
        output_len=16, output_max=16,  # log-normal output tokens (median, at most)
    ))
    return config
