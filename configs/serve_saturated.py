"""Serving settings for a saturated server: many clients keeping requests in flight.

configs/serve_demo.py's shapes (one 128-token prefill chunk per step) keep its warm-up short;
under a closed loop of 16 clients (vLLM's benchmark client, 256-token prompts, 64 output
tokens) larger prefill steps serve more: up to 4 sequences prefilling in a step, 512 tokens
each, 2048 tokens per step. Chosen by sweeping these three under `scripts/vllm_peer.py`
(docs/benchmarks.md "Serving settings by measurement"); warm-up compiles more step shapes
(about 45 s on 2 cores against 15 s).

  python scripts/serve.py --config=configs/serve_saturated.py --max_num_seqs=16
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_demo.py"))
    config.name = "saturated"
    config.engine.max_num_batched_tokens = 2048  # decode rows and up to 4 chunks of 512
    config.engine.max_prefill_chunk = 512
    config.engine.max_prefill_seqs = 4
    config.engine.max_model_len = 1024
    return config
