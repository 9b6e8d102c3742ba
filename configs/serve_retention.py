"""Retention policies on long-context needle probes, on the simulated clock.

Each request is a 2k-token needle-in-a-haystack prompt (the fact at depth 0.5) that asks for
a 4-digit code; `retrieval_accuracy` is the fraction of outputs that contain it. Prompts are
prefilled in 512-token chunks. One run per policy: exact KV, then streaming, h2o, snapkv and
quest, each keeping (quest: reading) 512 tokens per sequence; streaming's budget is given as
0.25 of the context (a float in (0, 1) is a fraction of engine.max_model_len: 512 of 2048).
Quality compares each policy's decoding with exact KV on the first probe.

Sized for a shared 2-core CPU: the five runs took 8 minutes, scoring included. 4k-token
probes (--config.workload.params.context_len=4000 --config.engine.max_model_len=4096) take
several times as long there (prefill, and the exact engine's one-prefill scoring, grow with
the context); on an accelerator also raise workload.num_requests.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_default.py"))
    config.name = "retention"  # the run's label (each variant is named below)
    config.clock = "simulated"  # deterministic: the same table on any host
    config.engine.max_num_seqs = 2  # decode buckets 1, 2
    config.engine.max_num_batched_tokens = 514  # a 512-token chunk beside 2 decode rows
    config.engine.max_prefill_chunk = 512  # the one prefill chunk size ...
    config.engine.min_chunk_bucket = 512  # ... so every prefill pads to 512 tokens
    config.engine.max_prefill_seqs = 1  # one prefill row per step
    config.engine.max_model_len = 2048  # a 2000-token prompt and 16 output tokens fit
    config.engine.enable_prefix_cache = False  # each probe is its own haystack
    config.workload.name = "long_context"  # needle-in-a-haystack prompts
    config.workload.num_requests = 2  # probes, all at t=0
    config.workload.params = ConfigDict(dict(
        context_len=2000,  # prompt tokens (the longest whole-sentence filler that fits)
        spread=0.0,  # every prompt about context_len tokens
        output_len=16,  # generated tokens (the answer is 4 digits)
        needle=True,  # plant a fact and ask for it
        needle_position=0.5,  # the fact's depth in the filler (exact KV retrieves it here)
    ))
    config.slo.ttft_s = 60.0  # a 2k prefill on the simulated CPU takes tens of seconds ...
    config.slo.tpot_s = 0.5  # ... then at most 0.5 s per token
    config.quality.num_prompts = 1  # quality against exact KV on the first probe ...
    config.quality.num_tokens = 16  # ... over its 16 decoded tokens
    config.sweep = [
        {"name": "none"},
        {"name": "streaming:0.25", "kv.retention": "streaming", "kv.budget": 0.25},
        {"name": "h2o:512", "kv.retention": "h2o", "kv.budget": 512.0},
        {"name": "snapkv:512", "kv.retention": "snapkv", "kv.budget": 512.0},
        {"name": "quest:512", "kv.retention": "quest", "kv.budget": 512.0},
    ]
    return config
