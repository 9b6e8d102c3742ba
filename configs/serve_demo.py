"""A short benchmark of the embedded model that fits a 2-core CPU in well under 3 minutes.

16 chat-like requests (32-128 prompt tokens, 16-32 output tokens) arriving at 1 per second,
served with at most 8 sequences and one prefill chunk of up to 128 tokens per step, its
tokens padded to 16, 32, 64 or 128 (a chunk is cut to end on one of them when padding would
exceed 1/8 of it). Warm-up compiles 20 step shapes (4 decode-only, 16 mixed), each once.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_default.py"))
    config.name = "demo"  # the run's label
    config.engine.max_num_seqs = 8  # decode buckets 1, 2, 4, 8
    config.engine.max_num_batched_tokens = 256  # room for 8 decode rows and a 128-token chunk
    config.engine.max_prefill_chunk = 128  # prefill chunks pad to 16, 32, 64 or 128 tokens ...
    config.engine.min_chunk_bucket = 16
    config.engine.chunk_bucket_factor = 2
    config.engine.prefill_padding_limit = 0.125  # ... cut to end on one when padding > 1/8
    config.engine.max_prefill_seqs = 1  # one prefill row per step
    config.engine.max_model_len = 256  # prompt (<= 128) + output (<= 32) fits
    config.workload.num_requests = 16  # requests in the run
    config.workload.params = ConfigDict(dict(
        rate=1.0,  # arrivals per second
        prompt_dist="uniform", prompt_min=32, prompt_max=128,  # prompt tokens
        output_dist="uniform", output_min=16, output_max=32,  # output tokens
    ))
    config.slo.ttft_s = 5.0  # CPU-sized SLOs: first token within 5 s ...
    config.slo.tpot_s = 0.5  # ... then at most 0.5 s per token
    return config
