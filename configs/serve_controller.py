"""The KV controllers side by side: a bursty multi-tenant workload with three SLO classes on a
small device pool, one run per controller (scripts/bench_controller.py).

Three tenants of SmolLM2-135M chat traffic (each prompt its tenant's 48-token system prompt,
then log-normal around 160 tokens; 24 output tokens; at most 48 + 480 and 64): tenant-0
interactive (priority 2; TTFT 4 s, TPOT 0.5 s, exact KV only), tenant-1 standard (priority 1;
TTFT 8 s, TPOT 1 s, KL budget 0.2 nats per token) and tenant-2 batch (priority 0; TTFT 20 s,
TPOT 2 s, KL budget 1.0). Each tenant sends 0.07 requests per second and the batch tenant
floods at 6x that from 30 s to 70 s: 0.21 requests per second in all before the flood and 0.63
during it. The device pool holds 40 pages of 16 tokens (a few requests' worth). Every run uses
the priority scheduler; the controllers that change retention run on a streaming (sinks +
window) engine whose per-sequence budget they set (at most 256 tokens; sequences start exact),
the others on exact KV; `inplace` and `joint-inplace` on a mixed-precision pool
(`kv_codec="mixed"`, rows written exact; a page demoted in place leaves the prefix cache, so
prefix pages a lookup has reused stay exact). A controller offloads one victim at most twice
(max_preemptions). The simulated clock makes each run reproducible.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_default.py"))
    config.name = "controller"
    config.clock = "simulated"
    config.engine.page_size = 16
    config.engine.num_pages = 40  # 640 tokens: 29 MiB of float32 SmolLM2 KV
    config.engine.max_num_seqs = 8
    config.engine.max_num_batched_tokens = 512
    config.engine.max_prefill_chunk = 256
    config.engine.min_chunk_bucket = 64
    config.engine.max_prefill_seqs = 2
    config.engine.max_model_len = 640
    config.engine.scheduler_policy = "priority"
    # The cost weights: a nat of KL is worth 10 s of delay, a joule 10 ms (the energy prices
    # themselves come from config.energy_profile; the KL tables are measured by the script).
    config.engine.controller_options = ConfigDict(dict(kl_cost_s=10.0, energy_cost_s=0.01,
                                                       max_preemptions=2))
    config.workload.name = "multi_tenant_burst"
    config.workload.num_requests = 48
    config.workload.params = ConfigDict(dict(
        num_tenants=3, base_rate=0.07, burst_tenant=2, burst_multiplier=6.0,
        burst_start_s=30.0, burst_duration_s=40.0, prompt_len=160, output_len=24,
        prompt_max=480, output_max=64, system_prompt_len=48))
    config.workload.tenant_priorities = (2, 1, 0)
    config.workload.tenant_slos = ((4.0, 0.5, 0.0), (8.0, 1.0, 0.2), (20.0, 2.0, 1.0))
    config.quality.prompts = "longest"  # the KL tables: the longest prompts lose the most
    config.quality.num_prompts = 2
    config.quality.num_tokens = 16
    # What the KL tables measure (scripts/bench_controller.py): the retention policy the
    # retention and joint controllers drive, and the budgets they may choose.
    config.kl_tables = ConfigDict(dict(retention="streaming", budgets=(64, 128, 192)))
    streaming = {"kv.retention": "streaming", "kv.budget": 256.0}
    mixed = {"kv.codec": "mixed"}
    config.sweep = [
        {"name": "fixed", "engine.controller": "fixed"},
        {"name": "admission", "engine.controller": "admission"},
        {"name": "preemption", "engine.controller": "preemption"},
        {"name": "tiers", "engine.controller": "tiers"},
        {"name": "codec", "engine.controller": "codec", "engine.preemption_mode": "swap"},
        {"name": "prefix", "engine.controller": "prefix"},
        {"name": "retention", "engine.controller": "retention", **streaming},
        {"name": "joint", "engine.controller": "joint", **streaming},
        # In-place demotion on a mixed-precision pool (rows written exact; cold pages of
        # running sequences re-encoded at int8 / int4 on the device, priced by the int8 /
        # int4 KL table), with the prefix cache (a demoted page leaves its index); the pool
        # refuses retention that compacts pages, so these run on exact KV.
        {"name": "inplace", "engine.controller": "inplace", **mixed},
        {"name": "joint-inplace", "engine.controller": "joint", **mixed},
        # The rule that keeps prefix pages exact, varied (docs/benchmarks.md): every cold page
        # demoted (keep_hits=0), pages reused at least twice kept (2), and today's rule (a
        # reused page kept) with admissions leaving the running sequences' next pages free
        # where demotion cannot make them (reserve_growth).
        {"name": "inplace-keep0", "engine.controller": "inplace", **mixed,
         "kv.codec_options.keep_hits": 0},
        {"name": "inplace-keep2", "engine.controller": "inplace", **mixed,
         "kv.codec_options.keep_hits": 2},
        {"name": "inplace-reserve", "engine.controller": "inplace", **mixed,
         "engine.controller_options.reserve_growth": True},
        {"name": "inplace-keep2-reserve", "engine.controller": "inplace", **mixed,
         "kv.codec_options.keep_hits": 2, "engine.controller_options.reserve_growth": True},
    ]
    return config
