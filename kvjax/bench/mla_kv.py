"""KV bytes per token of multi-head latent attention beside the K/V caches it replaces.

For each model config (the real models' attention shapes; weights are irrelevant to bytes):

  * the MLA cache kvjax holds: one latent [d_c] plus one RoPE key part [d_r] per token and
    layer, sized by the engine's own spec (`kvjax.kv.state.exact_cache_spec`);
  * the same model's cache with K and V expanded per head (what a runtime without latent
    caching stores: N * (qk_nope + qk_rope) key values and N * v_head_dim value values);
  * a GQA model for scale (Llama-3-8B: 8 kv heads of 128), by the same engine spec.

Each row also gives the bytes of one 8k-token sequence and how many such sequences a 16 GiB
budget holds (whole pages, `KVCacheSpec.num_pages_for_budget`). A small random-weights MLA
model's engine is built to check that the engine's pool takes the spec's bytes per page.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import kvjax
from kvjax.config import MlaConfig, ModelConfig
from kvjax.kv.state import exact_cache_spec, pages_for
from kvjax.testing import tiny_model


@dataclasses.dataclass(frozen=True)
class Setup:
    """Attributes:
      dtype: the KV dtype.
      context: tokens per sequence.
      budget_gib: the KV budget.
      page_size: P.
    """

    dtype: str = "bfloat16"
    context: int = 8192
    budget_gib: float = 16.0
    page_size: int = 16


def _mla(name: str, layers: int, hidden: int, heads: int, **dims) -> ModelConfig:
    mla = MlaConfig(**dims)
    return ModelConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=1,
                       head_dim=mla.cache_dim, mla=mla, name=name)


# The attention shapes of the published configs (config.json of each model).
MODELS = {
    "DeepSeek-V2-Lite": _mla("DeepSeek-V2-Lite", 27, 2048, 16, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "DeepSeek-V2": _mla("DeepSeek-V2", 60, 5120, 128, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536),
    "DeepSeek-V3": _mla("DeepSeek-V3", 61, 7168, 128, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536),
    "Llama-3-8B (GQA)": ModelConfig(vocab_size=128256, hidden_size=4096,
                                    intermediate_size=14336, num_layers=32, num_heads=32,
                                    num_kv_heads=8, head_dim=128, name="Llama-3-8B"),
}


def _row(form: str, layers: int, values_per_layer: int, bytes_per_token: float,
         setup: Setup) -> dict:
    budget = setup.budget_gib * 2 ** 30
    seq_pages = pages_for(setup.context, setup.page_size)
    seq_bytes = seq_pages * setup.page_size * bytes_per_token
    return dict(form=form, layers=layers, values_per_token_layer=values_per_layer,
                bytes_per_token_layer=bytes_per_token / layers,
                bytes_per_token=bytes_per_token, seq_mib=seq_bytes / 2 ** 20,
                seqs_in_budget=int(budget // seq_bytes))


def run(setup: Setup) -> dict:
    """Every model's rows, and the engine check."""
    itemsize = jnp.dtype(setup.dtype).itemsize
    rows = {}
    for name, c in MODELS.items():
        spec = exact_cache_spec(c, setup.page_size, setup.dtype)
        if c.mla is None:
            rows[name] = _row("K/V heads (engine spec)", c.num_layers,
                              2 * c.num_kv_heads * c.head_dim, spec.bytes_per_token, setup)
            continue
        m = c.mla
        rows[f"{name} MLA"] = _row("latent + RoPE key (engine spec)", c.num_layers,
                                   m.cache_dim, spec.bytes_per_token, setup)
        expanded = c.num_heads * (m.qk_head_dim + m.v_head_dim)
        rows[f"{name} as MHA"] = _row("K/V per head (formula)", c.num_layers, expanded,
                                      c.num_layers * expanded * itemsize, setup)
    return dict(setup=dataclasses.asdict(setup), rows=rows, engine_check=engine_check(setup))


def engine_check(setup: Setup) -> dict:
    """A random-weights MLA model (DeepSeek-V2-Lite's latent widths, 2 layers, small hidden
    size) built into an engine at a budget of 100 pages: the pool's pages and buffer bytes
    against the spec's."""
    base = MODELS["DeepSeek-V2-Lite"]
    config = dataclasses.replace(base, num_layers=2, hidden_size=64, intermediate_size=64,
                                 num_heads=2, vocab_size=64, name="mla-check")
    spec = exact_cache_spec(config, setup.page_size, setup.dtype)
    engine = kvjax.Engine(tiny_model(config), kvjax.EngineConfig(
        page_size=setup.page_size, max_model_len=256, kv_dtype=setup.dtype,
        kv_budget_bytes=int(100 * spec.page_bytes)))
    return dict(spec_page_bytes=spec.page_bytes, engine_page_bytes=engine.kv_bytes_per_page,
                num_pages=engine.num_pages, pool_nbytes=engine.kv.nbytes(),
                spec_pool_bytes=spec.nbytes(engine.num_pages))


COLUMNS = [("form", "what is cached", "{}"), ("layers", "L", "{}"),
           ("values_per_token_layer", "values/token/layer", "{}"),
           ("bytes_per_token_layer", "bytes/token/layer", "{:.0f}"),
           ("bytes_per_token", "bytes/token (all layers)", "{:.0f}"),
           ("seq_mib", "MiB per sequence", "{:.1f}"),
           ("seqs_in_budget", "sequences in budget", "{}")]
