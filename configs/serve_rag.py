"""Retrieval-augmented prompts served with non-prefix context reuse (kvjax.scheduler.context).

24 requests at 0.3 per second, each a system prompt + 3 of 16 corpus documents (drawn with
reuse, in varying order, each a reusable chunk) + a question whose answer is a code planted in
one of them. Compare the strategies side by side:

  python scripts/serve_bench.py --config configs/serve_rag.py \
      --sweep kv.context_reuse=full,none,ape,epic,cacheblend

Quality (KL to full prefill over the answers) is measured by scripts/bench_context_reuse.py.
"""

import pathlib

from ml_collections import ConfigDict

from kvjax.bench.runner import load_config


def get_config() -> ConfigDict:
    config = load_config(pathlib.Path(__file__).with_name("serve_default.py"))
    config.name = "rag"
    config.engine.max_num_seqs = 8
    config.engine.max_num_batched_tokens = 512
    config.engine.max_prefill_chunk = 512
    config.engine.max_prefill_seqs = 4  # chunk fills of a missing document run side by side
    config.engine.max_model_len = 1024
    config.engine.num_pages = 1024  # 16k tokens: every document and the requests' own pages
    config.kv.context_reuse = "none"
    config.workload.name = "rag"
    config.workload.num_requests = 24
    config.workload.params = ConfigDict(dict(
        rate=0.3, num_docs=16, docs_per_prompt=3, output_len=8))
    config.slo.ttft_s = 2.0
    config.slo.tpot_s = 0.5
    return config
