"""KV behaviours together: int8 pages + SnapKV + a host tier + the prefix cache + swap, beside
each alone, on multi-turn chat with a device pool a quarter of its working set.

The workload and engine are configs/serve_tiers.py's (8 conversations of 3 turns, each turn's
prompt extending the previous one's; 31 pages of 16 tokens of SmolLM2-135M KV), on the
simulated clock. One run each: exact KV (prefix cache, recompute preemption), int8 pages,
SnapKV keeping 96 tokens per sequence (a first turn's prompt is 50-80 tokens, a third turn's
about 250), a 96 MiB host tier with swap preemption, and all of them at once; then KIVI-4
(group 16, residual 32) alone and in place of int8 in the combination. Quality
compares each variant's decoding with exact KV on the four longest prompts (16 tokens each);
memory is the peak of reserved KV bytes, bytes moved are per tier.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_tiers.py"))
    config.name = "combined"  # the run's label (each variant is named below)
    config.quality.num_prompts = 4  # quality against exact KV on the four longest prompts ...
    config.quality.prompts = "longest"  # (third turns: SnapKV compresses them)
    config.quality.num_tokens = 16  # ... over 16 decoded tokens each
    snapkv = {"kv.retention": "snapkv", "kv.budget": 96.0}
    host_tier = {"tiers.host_budget_mb": 96.0, "engine.preemption_mode": "swap"}
    # KIVI-4: keys per channel over groups of 16 tokens (a page), the last 32 tokens exact.
    kivi = {"kv.codec": "kivi4", "kv.codec_options.group": 16, "kv.codec_options.residual": 32}
    config.sweep = [
        {"name": "exact"},
        {"name": "int8", "kv.codec": "int8"},
        {"name": "snapkv:96", **snapkv},
        {"name": "host_tier+swap", **host_tier},
        {"name": "int8+snapkv+host_tier+swap", "kv.codec": "int8", **snapkv, **host_tier},
        {"name": "kivi4-r32", **kivi},
        {"name": "kivi4-r32+snapkv+host_tier+swap", **kivi, **snapkv, **host_tier},
    ]
    return config
