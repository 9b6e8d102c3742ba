"""Tenant isolation under a prefix-cache flood, on the simulated clock.

Tenant "victim" repeats a 256-token system prompt with a distinct 16-token question (16
requests, 0.5 per second, so its prefix sits unreferenced between requests). Tenant
"flooder" sends 4 bursts of 6 distinct 512-token prompts, one every 4 s: 12k prefill tokens
that share nothing, against a 40 MiB KV pool (about 56 pages of 16 tokens), so the flood
holds the pool and its finished prompts push cached pages out. One run per sweep entry: no
flood; the flood under fcfs admission and LRU eviction (the defaults); fair-share eviction
alone; then adding fair admission, fair-share eviction, a per-tenant page share and short
prefill chunks for the tenant served more while another is active (`contended_prefill_chunk`)
one at a time; and no flood under the isolating settings. The victim's requests are the same
in every run.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_default.py"))
    config.name = "tenant_flood"  # the run's label (each variant is named by its override)
    config.clock = "simulated"  # deterministic: the same table on any host
    config.engine.max_num_seqs = 8  # decode buckets 1, 2, 4, 8
    config.engine.max_num_batched_tokens = 256  # 8 decode rows and a 128-token chunk fit
    config.engine.max_prefill_chunk = 128  # chunk buckets 32 and 128
    config.engine.min_chunk_bucket = 32
    config.engine.max_prefill_seqs = 1  # one prefill row per step
    config.engine.max_model_len = 640  # a flood prompt (512) + output fits
    config.engine.kv_budget_mb = 40.0  # about 900 tokens of float32 SmolLM2 KV
    config.workload.name = "tenant_flood"
    config.workload.num_requests = 40  # 16 of the victim's, 24 of the flood's
    config.workload.params = ConfigDict(dict(
        rate=0.5,  # the victim's arrivals per second
        system_prompt_len=256,  # the victim's shared system prompt
        question_len=16,  # then a distinct question
        output_len=16,  # the victim's output tokens
        flood_share=0.6,  # the flood's requests (24 of 40): bursts of ...
        burst_size=6,  # ... this many distinct prompts ...
        burst_interval_s=4.0,  # ... this often, from time 0 ...
        flood_prompt_len=512,  # ... of this many tokens ...
        flood_output_len=4,  # ... and output tokens
    ))
    config.slo.ttft_s = 5.0  # CPU-sized SLOs on the simulated clock
    config.slo.tpot_s = 0.5
    fair = {"engine.scheduler_policy": "fair"}
    fair_cache = {**fair, "engine.prefix_cache_eviction": "fair_share"}
    isolating = {**fair_cache, "engine.max_tenant_page_share": 0.5}
    # ... and while the victim is active, the flood's prefill chunks are cut to 32 tokens
    contended = {**isolating, "engine.contended_prefill_chunk": 32}
    no_flood = {"workload.num_requests": 16, "workload.params.flood_share": 0.0}
    config.sweep = [
        no_flood,  # fcfs + lru, no flood: the baseline
        {},  # fcfs + lru under the flood
        {"engine.prefix_cache_eviction": "fair_share"},  # fair-share eviction alone
        fair,  # fair admission
        fair_cache,  # ... and fair-share prefix-cache eviction
        isolating,  # ... and at most half the pool per tenant while another waits
        contended,  # ... and short flood chunks while the victim is active
        {**contended, "engine.contention_window_s": 5.0},  # ... active 5 s after a request
        {**no_flood, **isolating},  # all three, no flood
        {**no_flood, **contended},  # all four, no flood
    ]
    return config
