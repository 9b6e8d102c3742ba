"""Tiered KV benchmark: host/disk tiers vs all-on-device vs recompute-only, and transfer layouts.

  python scripts/bench_tiers.py --output_json runs/tiers.json
  python scripts/bench_tiers.py --model=embedded --conversations=4   # SmolLM2-135M

A multi-turn chat workload (kvjax.bench.workloads.multi_turn) is served in rounds: every
conversation's turn k is submitted at once and served to completion before turn k+1, so turn
k+1 finds turn k's pages cached only if nobody evicted them. The device pool is sized to a
quarter of the final KV working set (`--device_fraction`). Reported per configuration:
throughput, TTFT (all turns, and later turns only), engine steps, prefill tokens, tier hits and
bytes moved between tiers. `host_small+disk_sync` is `host_small+disk` with the disk tier's file
I/O inline in the step (`disk_io_threads=0`) instead of on worker threads. Then page-first vs
per-page transfer bandwidth for the same KV pool.

On a CPU backend the "host" tier lives in the same RAM as the "device" pool: the numbers show
the API at work and count bytes, not PCIe bandwidth.
"""

from __future__ import annotations

import json
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

import kvjax
from kvjax.bench.workloads import multi_turn
from kvjax.config import ModelConfig
from kvjax.memory.tiers import TierConfig, TransferLayout, measure_transfer_bandwidth
from kvjax.models import llama
from kvjax.models.model import Model

FLAGS = flags.FLAGS
RUNS = ("all_on_device", "recompute_only", "host_tier", "host_small+disk",
        "host_small+disk_sync")
flags.DEFINE_enum("model", "random", ["random", "embedded"],
                  "random: SmolLM2-135M's KV geometry (30 layers, 3 KV heads of 64) with a "
                  "narrow random MLP; embedded: SmolLM2-135M-Instruct itself.")
flags.DEFINE_integer("conversations", 8, "Conversations in the multi-turn workload.")
flags.DEFINE_integer("turns", 3, "Turns per conversation.")
flags.DEFINE_integer("answer_len", 32, "Tokens generated per turn (and answer length).")
flags.DEFINE_float("device_fraction", 0.25, "Device pool / final KV working set.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_multi_integer("transfer_pages", [16, 64], "Pages per transfer measurement.")
flags.DEFINE_list("runs", list(RUNS), "Configurations to serve, in order.")
flags.DEFINE_string("output_json", None, "Write the results here.")

# SmolLM2-135M's KV per token (30 layers x 3 KV heads x 64 x K,V x float32 = 45 KiB) with cheap
# compute, so a CPU run moves realistically sized pages without a slow forward pass.
RANDOM_CONFIG = ModelConfig(vocab_size=512, hidden_size=192, intermediate_size=384,
                            num_layers=30, num_heads=3, num_kv_heads=3, head_dim=64,
                            max_position_embeddings=2048, eos_token_ids=(), name="smollm2-kv")


class ByteTokenizer:
    """Bytes modulo the vocabulary: enough for workload generation on a random model."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode()]


def load(name: str) -> tuple[Model, object]:
    if name == "embedded":
        model = kvjax.load_model(None, "float32")
        return model, model.tokenizer
    params = llama.init_params(RANDOM_CONFIG, jax.random.PRNGKey(0), scale=0.5)
    return Model(config=RANDOM_CONFIG, params=params, source="random"), ByteTokenizer(512)


def rounds(tokenizer, num_conversations: int, num_turns: int, answer_len: int):
    """The workload as rounds: round k holds every conversation's turn k."""
    requests = multi_turn(tokenizer, seed=0, num_requests=num_conversations * num_turns,
                          num_turns=num_turns, user_min=32, user_max=64,
                          answer_len=answer_len, think_time_s=0.0)
    by_turn: dict[int, list] = {}
    for r in requests:
        by_turn.setdefault(r.turn, []).append(r)
    return [by_turn[t] for t in sorted(by_turn)]


def serve(model: Model, config: kvjax.EngineConfig, workload) -> dict:
    """Serves the rounds on a warmed-up engine; returns throughput, TTFT and tier counters."""
    engine = kvjax.Engine(model, config)
    engine.warmup()
    ttft, later_ttft, tokens = [], [], 0
    start = time.perf_counter()
    for turn, batch in enumerate(workload):
        params = kvjax.SamplingParams(max_new_tokens=batch[0].max_new_tokens, ignore_eos=True)
        for out in engine.generate([list(r.prompt_ids) for r in batch], params):
            t = out.first_token_time - out.arrival_time
            ttft.append(t)
            if turn:
                later_ttft.append(t)
            tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    s = engine.stats
    result = dict(
        wall_s=elapsed, throughput_tok_s=tokens / elapsed,
        ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
        later_turns_ttft_p50_s=float(np.percentile(later_ttft, 50)),
        later_turns_ttft_p99_s=float(np.percentile(later_ttft, 99)),
        steps=s["steps"], prefill_tokens=s["prefill_tokens"],
        tier_hit_tokens=s["tier_hit_tokens"],
        prefix_hit_tokens=engine.prefix_cache_stats()["prefix_hit_tokens"],
        preemptions=s["preemptions"], swap_bytes=s["swap_bytes"],
        bytes_moved={k: s[k] for k in ("bytes_device_to_host", "bytes_host_to_device",
                                       "bytes_host_to_disk", "bytes_disk_to_host")})
    if engine.tiers is not None:
        result["tier_transfers"] = {k: engine.tiers.stats[k] for k in (
            "transfers_committed", "transfers_failed", "pages_dropped", "pages_loaded")}
        engine.tiers.close()
    return result


def working_set_pages(workload, page_size: int) -> int:
    """Pages holding every conversation's final prompt and answer at once."""
    last = {}
    for batch in workload:
        for r in batch:
            last[r.conversation_id] = len(r.prompt_ids) + r.max_new_tokens
    return sum(-(-n // page_size) for n in last.values())


def main(argv):
    del argv
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="kvjax-bench-xla-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    model, tokenizer = load(FLAGS.model)
    workload = rounds(tokenizer, FLAGS.conversations, FLAGS.turns, FLAGS.answer_len)
    page_size = FLAGS.page_size
    total_pages = working_set_pages(workload, page_size)
    longest = max(len(r.prompt_ids) + r.max_new_tokens for b in workload for r in b)
    device_pages = max(int(total_pages * FLAGS.device_fraction), -(-longest // page_size) + 1)
    page_bytes = model.config.kv_bytes_per_token(model.dtype) * page_size
    # Few step shapes (9) keep warm-up compilation short on a CPU.
    base = dict(page_size=page_size, max_num_seqs=4, max_num_batched_tokens=512,
                max_prefill_chunk=256, max_prefill_seqs=1, min_chunk_bucket=64,
                max_model_len=-(-longest // page_size) * page_size + page_size)
    disk_dir = tempfile.mkdtemp(prefix="kvjax-bench-disk-")
    configs = {
        "all_on_device": dict(num_pages=total_pages + 8),
        "recompute_only": dict(num_pages=device_pages),
        "host_tier": dict(num_pages=device_pages, tiers=TierConfig(
            host_bytes=total_pages * page_bytes)),
    }
    small = dict(host_bytes=device_pages * page_bytes,
                 disk_bytes=2 * total_pages * (page_bytes + 64), disk_dir=disk_dir)
    configs["host_small+disk"] = dict(num_pages=device_pages, tiers=TierConfig(**small))
    configs["host_small+disk_sync"] = dict(num_pages=device_pages, tiers=TierConfig(
        **small, disk_io_threads=0))
    unknown = set(FLAGS.runs) - set(configs)
    if unknown:
        raise ValueError(f"--runs names unknown configurations {sorted(unknown)}; "
                         f"known: {list(configs)}")
    results = dict(model=FLAGS.model, backend=jax.default_backend(), page_bytes=page_bytes,
                   working_set_pages=total_pages, device_pages=device_pages,
                   num_requests=sum(len(b) for b in workload), runs={})
    for name in FLAGS.runs:
        overrides = configs[name]
        t0 = time.perf_counter()
        results["runs"][name] = serve(model, kvjax.EngineConfig(**base, **overrides), workload)
        print(f"{name}: {json.dumps(results['runs'][name])} ({time.perf_counter() - t0:.0f}s)")
    pool = kvjax.Engine(model, kvjax.EngineConfig(**base, num_pages=max(FLAGS.transfer_pages)))
    results["transfer_layouts"] = {
        f"{layout.value}/{n}": measure_transfer_bandwidth(pool.kv, n, layout, repeats=5)
        for n in FLAGS.transfer_pages for layout in TransferLayout}
    for key, rates in results["transfer_layouts"].items():
        print(f"{key}: {rates['bytes'] / 2**20:.1f} MiB, device->host "
              f"{rates['device_to_host_bytes_per_s'] / 1e9:.2f} GB/s, host->device "
              f"{rates['host_to_device_bytes_per_s'] / 1e9:.2f} GB/s")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
