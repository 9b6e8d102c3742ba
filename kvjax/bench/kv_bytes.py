"""KV bytes per token and sequences per budget of the models researchers study, by the engine's
own sizing, each checked against an engine built on a random-weights model of its KV shape.

For each model (the attention fields of its published config.json, `HF_CONFIGS`, read by the
same `kvjax.models.hf.config_from_hf` that loads a checkpoint):

  * kvjax: the model's layer groups (`ModelConfig.kv_layer_groups`: global layers keep every
    token, sliding-window layers their window; MLA layers one latent) sized by the engine's spec
    (`kvjax.kv.state.exact_cache_spec`). Bytes per token at `context` tokens are
    `KVCacheSpec.bytes_held(context) / context`; sequences in the budget are the pool's pages
    (`KVCacheSpec.num_pages_for_budget`) over the pages one sequence's block tables hold once it
    has decoded to `context` tokens (`KVCacheSpec.pages_held`: every page of a global table, a
    window's table from the page holding its window's first token);
  * every layer global with full K/V: the same model with no windows, by the same spec, and for
    MLA models K and V expanded per head (N * (qk_nope + qk_rope + v_head_dim) values per layer:
    a formula, since no kvjax pool holds that form).

The engine check (`engine_check`) builds, per model, an engine on a random-weights model with
the config's layers, kv heads, head dim and windows (windows divided by `Setup.window_scale`,
so short requests cross them; hidden size, MLP, vocabulary and query heads cut so it is cheap)
at a byte budget sized for `Setup.check_sequences` sequences, and runs that many requests to
completion: the pool's page bytes and buffers must equal the spec's within the budget, the
sequences must all decode together without preemption, and each decoding sequence's block
tables must hold exactly `KVCacheSpec.pages_held` pages.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import kvjax
from kvjax.config import ModelConfig
from kvjax.kv.spec import KVCacheSpec
from kvjax.kv.state import exact_cache_spec
from kvjax.models.hf import config_from_hf
from kvjax.shapes import pages_for
from kvjax.testing import tiny_model


@dataclasses.dataclass(frozen=True)
class Setup:
    """Attributes:
      dtype: the KV dtype.
      context: tokens per sequence.
      budget_gib: the KV budget.
      page_size: P.
      window_scale: the engine check divides every window by this (floor).
      check_context: tokens per sequence of the engine check (prompt + new tokens); longer
        than every scaled window.
      check_new_tokens: greedy tokens each check request decodes.
      check_sequences: requests of the engine check, all sized into its budget.
      check_models: the models the engine check builds.
    """

    dtype: str = "bfloat16"
    context: int = 8192
    budget_gib: float = 16.0
    page_size: int = 16
    window_scale: int = 32
    check_context: int = 192
    check_new_tokens: int = 16
    check_sequences: int = 3
    check_models: tuple[str, ...] = ("Llama-3.2-1B", "Qwen3-0.6B", "Gemma-3-1B", "Mistral-7B",
                                     "Phi-3-mini", "DeepSeek-V2-Lite")


# The fields of each model's config.json (Hugging Face Hub, main branch) that shape its KV cache
# and that `config_from_hf` requires. DeepSeek's expert-routing fields (n_routed_experts,
# first_k_dense_replace, ...) are left out: experts change no KV byte.
HF_CONFIGS: dict[str, tuple[str, dict]] = {
    "Llama-3.2-1B": ("meta-llama/Llama-3.2-1B", dict(
        model_type="llama", num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=True)),
    "Qwen3-0.6B": ("Qwen/Qwen3-0.6B", dict(
        model_type="qwen3", num_hidden_layers=28, hidden_size=1024, intermediate_size=3072,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000, use_sliding_window=False,
        sliding_window=None, max_window_layers=28, tie_word_embeddings=True)),
    # One global layer in six ((i + 1) % 6 == 0: layers 5, 11, 17, 23), the rest window 512.
    "Gemma-3-1B": ("google/gemma-3-1b-it", dict(
        model_type="gemma3_text", num_hidden_layers=26, hidden_size=1152,
        intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        vocab_size=262144, max_position_embeddings=32768, query_pre_attn_scalar=256,
        rope_theta=1000000, rope_local_base_freq=10000, sliding_window=512,
        sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh")),
    "Mistral-7B": ("mistralai/Mistral-7B-v0.1", dict(
        model_type="mistral", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096)),
    # Trained for 4096 positions: its 8k rows are the cache's arithmetic, not a usable context.
    "Phi-3-mini": ("microsoft/Phi-3-mini-4k-instruct", dict(
        model_type="phi3", num_hidden_layers=32, hidden_size=3072, intermediate_size=8192,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        max_position_embeddings=4096, rope_theta=10000.0, rope_scaling=None,
        sliding_window=2047)),
    "DeepSeek-V2-Lite": ("deepseek-ai/DeepSeek-V2-Lite", dict(
        model_type="deepseek_v2", num_hidden_layers=27, hidden_size=2048,
        intermediate_size=10944, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=102400, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rope_theta=10000,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                          beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
    "DeepSeek-V2": ("deepseek-ai/DeepSeek-V2", dict(
        model_type="deepseek_v2", num_hidden_layers=60, hidden_size=5120,
        intermediate_size=12288, num_attention_heads=128, num_key_value_heads=128,
        vocab_size=102400, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rope_theta=10000,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                          beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
    "DeepSeek-V3": ("deepseek-ai/DeepSeek-V3", dict(
        model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168,
        intermediate_size=18432, num_attention_heads=128, num_key_value_heads=128,
        vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rope_theta=10000,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
}


def model_configs() -> dict[str, ModelConfig]:
    """Every model's `ModelConfig`, as loading its checkpoint would build it."""
    return {name: config_from_hf(fields, name=name)
            for name, (_, fields) in HF_CONFIGS.items()}


def _groups(spec: KVCacheSpec) -> str:
    """'4 global + 22 window 512', or '27 latent 512+64'."""
    parts = []
    for g in spec.groups:
        fmt = g.spec.format
        what = (f"latent {fmt.latent_dim}+{fmt.rope_dim}" if fmt.latent_dim
                else f"{fmt.num_kv_heads}x{fmt.head_dim} K/V")
        keep = f"window {g.spec.num_keep_tokens}" if g.spec.num_keep_tokens else "global"
        parts.append(f"{len(g.layers)} {keep} {what}")
    return " + ".join(parts)


def _sizing(spec: KVCacheSpec, setup: Setup, budget: float) -> dict:
    """A spec's bytes per token at `context` and the sequences its pool holds."""
    held = spec.bytes_held(setup.context)
    pool_pages = spec.num_pages_for_budget(budget)
    seq_pages = spec.pages_held(setup.context)
    return dict(bytes_per_token=held / setup.context, seq_mib=seq_pages * spec.page_bytes / 2**20,
                seqs_in_budget=pool_pages // seq_pages)


def _per_head_kv(config: ModelConfig, setup: Setup, budget: float) -> dict:
    """MLA's model with K and V expanded per head, every layer global (a formula)."""
    m, p = config.mla, setup.page_size
    per_token = (config.num_layers * config.num_heads * (m.qk_head_dim + m.v_head_dim)
                 * jnp.dtype(setup.dtype).itemsize)
    seq_pages = pages_for(setup.context, p)
    return dict(bytes_per_token=float(per_token), seq_mib=seq_pages * p * per_token / 2**20,
                seqs_in_budget=int(budget // (p * per_token)) // seq_pages)


def row(config: ModelConfig, setup: Setup) -> dict:
    """One model's figures: kvjax's layer groups against every layer global with full K/V."""
    budget = setup.budget_gib * 2**30
    spec = exact_cache_spec(config, setup.page_size, setup.dtype)
    ours = _sizing(spec, setup, budget)
    if config.mla is not None:
        full, full_form = _per_head_kv(config, setup, budget), "K/V per head (formula)"
    else:
        no_windows = dataclasses.replace(config, layer_windows=())
        full = _sizing(exact_cache_spec(no_windows, setup.page_size, setup.dtype), setup, budget)
        full_form = "K/V heads (engine spec)"
    return dict(groups=_groups(spec), layers=config.num_layers,
                **{f"kvjax_{k}": v for k, v in ours.items()},
                full_form=full_form, **{f"full_{k}": v for k, v in full.items()},
                bytes_ratio=ours["bytes_per_token"] / full["bytes_per_token"],
                spec_groups=spec.describe())


def check_config(config: ModelConfig, setup: Setup) -> ModelConfig:
    """`config`'s KV shape on a cheap model: its layers, kv heads, head dim (or MLA widths) and
    windows divided by `window_scale`; hidden size, MLP and vocabulary tiny, and as many query
    heads as kv heads (2 for MLA), since queries are not cached."""
    windows = tuple(w // setup.window_scale for w in config.layer_windows)
    if any(w == 0 for w, full in zip(windows, config.layer_windows, strict=True) if full):
        raise ValueError(f"window_scale={setup.window_scale} turns a window of {config.name} "
                         f"into 0 tokens")
    return dataclasses.replace(
        config, vocab_size=64, hidden_size=64, intermediate_size=64,
        num_heads=2 if config.mla is not None else config.num_kv_heads, layer_windows=windows,
        max_position_embeddings=max(config.max_position_embeddings, setup.check_context),
        bos_token_id=1, eos_token_ids=(63,), name=f"{config.name}-kv-shape")


def engine_check(config: ModelConfig, setup: Setup) -> dict:
    """Serves `check_sequences` requests on an engine built from `config`'s KV shape at a budget
    sized for them (decoded pages plus one page per window table for a prefill chunk's reach,
    plus half a page the pool must leave unused): pool bytes against the spec's, sequences
    admitted together, and held pages against `KVCacheSpec.pages_held` (and their bytes against
    `KVCacheSpec.bytes_held`, at token granularity) at every decode step."""
    tiny = check_config(config, setup)
    p, n = setup.page_size, setup.check_sequences
    spec = exact_cache_spec(tiny, p, setup.dtype)
    windowed_tables = sum(bool(t.window) for t in spec.table_groups())
    budget_pages = n * (spec.pages_held(setup.check_context) + windowed_tables)
    budget = int((budget_pages + 0.5) * spec.page_bytes)
    engine = kvjax.Engine(tiny_model(tiny, seed=0), kvjax.EngineConfig(
        page_size=p, max_model_len=setup.check_context + p, kv_dtype=setup.dtype,
        kv_budget_bytes=budget, max_num_seqs=n, max_prefill_chunk=p,
        max_num_batched_tokens=n * p, enable_prefix_cache=False, async_scheduling=False))
    prompt_len = setup.check_context - setup.check_new_tokens + 1  # the last token is not cached
    greedy = kvjax.SamplingParams(max_new_tokens=setup.check_new_tokens, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"r{i}", [(7 * i + t) % 61 + 2 for t in range(prompt_len)], greedy)
    most_running, decode_checks, mismatches, tokens, excess = 0, 0, [], {}, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = len(out.outputs[0].token_ids)
        running = engine.scheduler.running
        most_running = max(most_running, len(running))
        for seq in running:
            if seq.num_computed <= seq.num_prompt_tokens:
                continue  # prefilling: a chunk's pages reach past the window
            decode_checks += 1
            held = engine.allocator.num_held_pages(seq.seq_id)
            if held != spec.pages_held(seq.num_computed):
                mismatches.append((seq.seq_id, seq.num_computed, held))
            excess.append(held * spec.page_bytes - spec.bytes_held(seq.num_computed))
    all_global = exact_cache_spec(dataclasses.replace(tiny, layer_windows=()), p, setup.dtype)
    return dict(
        budget_bytes=budget, spec_page_bytes=spec.page_bytes,
        engine_page_bytes=engine.kv_bytes_per_page, num_pages=engine.num_pages,
        spec_num_pages=spec.num_pages_for_budget(budget), pool_nbytes=engine.kv.nbytes(),
        spec_pool_bytes=spec.nbytes(engine.num_pages), windows=sorted(set(tiny.layer_windows)),
        num_table_groups=len(spec.table_groups()), requests=n, most_running=most_running,
        preemptions=engine.stats["preemptions"], completed_tokens=tokens,
        decode_checks=decode_checks, held_mismatches=mismatches,
        held_minus_spec_bytes=[min(excess, default=0), max(excess, default=0)],
        all_global_seqs_in_pool=int(engine.num_pages * spec.page_bytes
                                    // (all_global.pages_held(setup.check_context)
                                        * all_global.page_bytes)),
        free_pages_after=engine.allocator.num_free_pages())


def table(setup: Setup) -> dict[str, dict]:
    """Every model's `row`."""
    return {name: row(c, setup) for name, c in model_configs().items()}


def run(setup: Setup) -> dict:
    """Every model's row, and the engine check of `setup.check_models`."""
    configs = model_configs()
    return dict(setup=dataclasses.asdict(setup),
                hub_ids={name: hub for name, (hub, _) in HF_CONFIGS.items()},
                rows=table(setup),
                engine_checks={name: engine_check(configs[name], setup)
                               for name in setup.check_models})


COLUMNS = [("groups", "kvjax layer groups (what a token stores per layer)", "{}"),
           ("kvjax_bytes_per_token", "kvjax bytes/token at 8k", "{:.0f}"),
           ("full_bytes_per_token", "all-global full K/V bytes/token", "{:.0f}"),
           ("bytes_ratio", "kvjax / full", "{:.3f}"),
           ("kvjax_seq_mib", "kvjax MiB per 8k seq", "{:.1f}"),
           ("full_seq_mib", "full MiB per 8k seq", "{:.1f}"),
           ("kvjax_seqs_in_budget", "kvjax 8k seqs in 16 GiB", "{}"),
           ("full_seqs_in_budget", "full 8k seqs in 16 GiB", "{}")]

CHECK_COLUMNS = [("windows", "windows (scaled)", "{}"),
                 ("num_table_groups", "block tables", "{}"),
                 ("engine_page_bytes", "page bytes (engine = spec)", "{}"),
                 ("num_pages", "pool pages", "{}"), ("pool_nbytes", "pool bytes", "{}"),
                 ("budget_bytes", "budget bytes", "{}"),
                 ("most_running", "decoding together", "{}"),
                 ("all_global_seqs_in_pool", "all-global seqs in pool", "{}"),
                 ("preemptions", "preemptions", "{}"),
                 ("decode_checks", "held == spec checks", "{}")]
