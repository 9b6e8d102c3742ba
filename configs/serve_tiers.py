"""Multi-turn chat on a device KV pool a quarter of its working set: host tier vs none.

Conversations of 3 turns (user messages of 32-64 tokens, 32-token answers); each turn's
prompt extends the previous one's, so a turn finds the earlier turn's pages in the prefix
cache only if nobody evicted them. Turns arrive on their own schedule (open loop: a turn may
arrive before the previous one finished; with a 30 s mean think time 2 of 16 did). The
pool holds 31 pages of 16 tokens of SmolLM2-135M float32 KV. One run each: no tiers
(evicted prefix pages are recomputed), a host tier (evicted pages spill to host memory and
load back on a hit), and a small host tier with a disk tier behind it.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_default.py"))
    config.name = "tiers"  # the run's label (each variant is named below)
    config.clock = "simulated"  # deterministic: the same table on any host
    config.engine.max_num_seqs = 4  # decode buckets 1, 2, 4
    config.engine.max_num_batched_tokens = 260  # 4 decode rows and a 256-token chunk
    config.engine.max_prefill_chunk = 256  # chunk buckets 64 and 256
    config.engine.min_chunk_bucket = 64
    config.engine.max_prefill_seqs = 1  # one prefill row per step
    config.engine.max_model_len = 512  # the longest conversation (about 280 tokens) fits
    config.engine.num_pages = 31  # 22 MiB of float32 KV, a quarter of the working set
    config.workload.name = "multi_turn"  # conversations whose turns extend each other
    config.workload.num_requests = 24  # 8 conversations of 3 turns
    config.workload.params = ConfigDict(dict(
        rate=0.5,  # conversations started per second
        num_turns=3,  # turns per conversation
        # Mean gap between a conversation's turns: long enough that other conversations
        # evict a finished turn's pages before the next turn asks for them.
        think_time_s=30.0,
        user_min=32, user_max=64,  # user message tokens
        answer_len=32,  # answer tokens (generated; the next turn's prompt holds them)
    ))
    config.slo.ttft_s = 5.0  # CPU-sized SLOs on the simulated clock
    config.slo.tpot_s = 0.5
    config.sweep = [
        {"name": "recompute_only"},  # no tiers
        {"name": "host_tier", "tiers.host_budget_mb": 96.0},  # about 136 pages
        {"name": "host_small+disk", "tiers.host_budget_mb": 22.0,  # 31 pages ...
         "tiers.disk_budget_mb": 180.0},  # ... and 256 page files
    ]
    return config
