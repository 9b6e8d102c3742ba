"""Scheduler policies on a shared-prefix, multi-tenant workload, on the simulated clock.

Four tenants send 3:1:1:1 of the traffic; each has its own 96-token system prompt that 75%
of its requests start with (tenants never share prefix-cache pages: their salts differ).
Tenants 2 and 3 carry higher priorities. Requests arrive at 4 per second, faster than the
simulated CPU serves them, so a queue builds; the KV pool (16 MiB, 22 pages of 16 tokens of
SmolLM2-135M float32 KV) holds fewer than max_num_seqs full sequences, so admission order,
preemption and prefix reuse decide who waits. One run per policy: fcfs, priority, fair, lpm.

The page-size comparison reuses this config:
  --sweep="engine.page_size=16,32"
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_default.py"))
    config.name = "policies"  # the run's label (each variant is named by its override)
    config.clock = "simulated"  # deterministic: the same table on any host
    config.engine.max_num_seqs = 8  # decode buckets 1, 2, 4, 8
    config.engine.max_num_batched_tokens = 256  # 8 decode rows and a 128-token chunk fit
    config.engine.max_prefill_chunk = 128  # chunk buckets 32 and 128: a prefix-cache hit ...
    config.engine.min_chunk_bucket = 32  # ... leaves a short chunk that pads to 32 only
    config.engine.max_prefill_seqs = 1  # one prefill row per step
    config.engine.max_model_len = 256  # prompt (<= 128) + output (16) fits
    config.engine.kv_budget_mb = 16.0  # about 364 tokens (22 pages of 16) of float32 KV
    config.workload.name = "shared_prefix"  # a shared system prompt, then a question
    config.workload.num_requests = 24  # over all tenants
    config.workload.params = ConfigDict(dict(
        rate=4.0,  # arrivals per second over all tenants (split by tenant_weights)
        shared_fraction=0.75,  # of each tenant's requests start with its shared prefix
        num_prefixes=1,  # shared prefixes per tenant
        prefix_len=96,  # tokens of the shared prefix (and of the unshared ones)
        question_min=8, question_max=32,  # question tokens after the prefix
        output_len=16,  # output tokens per request
    ))
    config.workload.tenant_weights = (3, 1, 1, 1)  # tenant-0 sends half the traffic
    config.workload.tenant_priorities = (0, 0, 1, 2)  # the light tenants are more urgent
    config.slo.ttft_s = 5.0  # CPU-sized SLOs on the simulated clock: first token within 5 s
    config.slo.tpot_s = 0.5  # ... then at most 0.5 s per token
    config.sweep = [{"engine.scheduler_policy": policy}  # one run per policy
                    for policy in ("fcfs", "priority", "fair", "lpm")]
    return config
