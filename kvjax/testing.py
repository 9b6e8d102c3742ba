"""A tiny random model and stand-ins for tests, notebooks and quick benchmark checks.

    from kvjax.testing import ByteTokenizer, greedy_reference, tiny_model

    model = tiny_model()                       # 2 layers, compiles in seconds on a CPU
    tokens = greedy_reference(model, [1, 5, 9], max_new_tokens=8)

The model runs the same code paths as a real Llama (paged attention, GQA with 2 query heads
per KV head, RoPE); only its size and weights are made up, so its outputs mean nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import MlaConfig, ModelConfig, MoeConfig
from kvjax.models import llama
from kvjax.models.model import Model
from kvjax.models.rope import RoPE
from kvjax.shapes import next_power_of_2

TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                   eos_token_ids=(127,), name="tiny")
"""The tiny model's config: L=2, N=4, K=2, D=8, a 128-token vocabulary, EOS 127."""


# Multi-head latent attention (DeepSeek-V2 form) at TINY's size: 4 heads read one latent head
# of 16 + 4 columns per token, a low-rank query.
TINY_MLA = dataclasses.replace(
    TINY, num_kv_heads=1, head_dim=20, name="tiny-mla",
    mla=MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  q_lora_rank=12))

# A mixture of experts (Mixtral's routing) at TINY's size: 8 experts of 16, 2 per token, so a
# step of up to 4 tokens gathers its experts, a longer one runs them all, and one of 47 tokens
# or more groups its rows by expert (`kvjax.models.moe.default_method`).
TINY_MOE = dataclasses.replace(
    TINY, name="tiny-moe",
    moe=MoeConfig(num_experts=8, num_experts_per_tok=2, expert_size=16))


def random_prompts(lengths, *, seed: int, vocab_size: int = 120) -> list[list[int]]:
    """Prompts of the given lengths, token ids drawn uniformly from [0, vocab_size) by a
    generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab_size, size=n)] for n in lengths]


def permuted_block_tables(rng: np.random.Generator, lengths, page_size: int, num_pages: int,
                          *, return_free: bool = False):
    """Block tables [B, W] of sequences of `lengths` tokens over randomly permuted distinct
    pages of a pool of `num_pages`; entries past a sequence's pages repeat its first page of
    the permutation (any valid page: attention masks them by length). With `return_free`,
    also the pages no table uses, in permuted order."""
    width = -(-max(lengths) // page_size)
    perm = rng.permutation(num_pages)
    tables = np.zeros((len(lengths), width), np.int32)
    used = 0
    for i, n in enumerate(lengths):
        m = -(-n // page_size)
        tables[i, :m] = perm[used:used + m]
        tables[i, m:] = perm[0]
        used += m
    return (tables, perm[used:]) if return_free else tables


def tiny_model(config: ModelConfig = TINY, seed: int = 0, scale: float = 0.5) -> Model:
    """A Llama with random weights, large enough that greedy decoding is not degenerate.

    Args:
      config: the architecture; `TINY` by default.
      seed: the PRNG seed of the weights.
      scale: the weights' initial scale (see `kvjax.models.llama.init_params`).
    """
    params = llama.init_params(config, jax.random.PRNGKey(seed), scale=scale)
    return Model(config=config, params=params, source="random")


@functools.cache
def _dense_logits(config: ModelConfig):
    """Last-token logits of a sequence right-padded to a power of two (>= 16) tokens: causal
    attention keeps the padding out of every real position, and the padded lengths bound the
    compiles to a few per session."""
    forward = jax.jit(lambda params, tokens, n: llama.forward_dense(params, config, tokens)[n - 1])

    def logits(params, tokens: list[int]) -> jax.Array:
        return forward(params, _padded(tokens), np.int32(len(tokens)))

    return logits


def _padded(tokens) -> np.ndarray:
    """[power of two >= 16] int32: `tokens` right-padded with zeros."""
    padded = np.zeros(next_power_of_2(max(len(tokens), 16)), np.int32)
    padded[:len(tokens)] = tokens
    return padded


@functools.cache
def _dense_logprobs(config: ModelConfig):
    return jax.jit(lambda params, tokens: jax.nn.log_softmax(
        llama.forward_dense(params, config, tokens), axis=-1))


def dense_logprobs(model: Model, token_ids: list[int]) -> np.ndarray:
    """[T, V] float32: row i is log p(next token | token_ids[:i + 1]), by the cache-free dense
    forward pass (padded to a power of two, so a few compiles serve a whole session)."""
    return np.asarray(_dense_logprobs(model.config)(model.params, _padded(token_ids)))[
        :len(token_ids)]


def greedy_reference(model: Model, prompt: list[int], max_new_tokens: int,
                     stop: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by full recomputation, no KV cache: the engine's oracle.

    Recomputes the whole sequence for every token (O(T^2) work), so keep it short.

    Args:
      model: the model to decode.
      prompt: the prompt's token ids.
      max_new_tokens: the most tokens generated.
      stop: token ids that end the continuation (included in it).

    Returns:
      The generated token ids, without the prompt.
    """
    tokens = list(prompt)
    step = _dense_logits(model.config)
    out = []
    for _ in range(max_new_tokens):
        token = int(jnp.argmax(step(model.params, tokens)))
        tokens.append(token)
        out.append(token)
        if token in stop:
            break
    return out


class ByteTokenizer:
    """Stands in for a real tokenizer with the tiny model: one id in [2, 128) per byte.

    Enough for `kvjax.bench.workloads`, which only needs `encode`. Byte b becomes
    `2 + b % 126`, so ids are not decodable; BOS is 1.
    """

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [1] * add_bos + [2 + b % 126 for b in text.encode()]


# The tiny tokenizer's special tokens and their ids; EOS is the tiny model's EOS.
TINY_SPECIAL_TOKENS = {"<|im_start|>": 0, "<s>": 1, "<|im_end|>": 2, "</s>": 127}
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.cache
def tiny_tokenizer():
    """A decodable one-byte-per-token tokenizer over the tiny model's 128 ids, with a ChatML
    template: a `kvjax.models.tokenizer.Tokenizer` (so servers and chat paths run unchanged).

    Ids 3..126 are single bytes: tab, newline, printable ASCII and 27 other control bytes
    (all valid one-byte UTF-8, so any id sequence decodes); 0, 1, 2 and 127 are the special
    tokens of `TINY_SPECIAL_TOKENS` (BOS 1, EOS 127). Text outside those bytes cannot be
    encoded.
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from kvjax.models.tokenizer import Tokenizer, _byte_level_alphabet

    others = [b for b in range(32) if b not in (9, 10)]
    byte_values = [9, 10, *range(32, 127), *others][:124]
    alphabet = _byte_level_alphabet()
    vocab = {alphabet[b]: 3 + i for i, b in enumerate(byte_values)}
    vocab.update(TINY_SPECIAL_TOKENS)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in TINY_SPECIAL_TOKENS])
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=(127,),
                     chat_template=TINY_CHAT_TEMPLATE)


def tiny_chat_model(seed: int = 0) -> Model:
    """`tiny_model()` with `tiny_tokenizer()`: text prompts, chat and streaming detokenization
    on a model that compiles in seconds."""
    return dataclasses.replace(tiny_model(seed=seed), tokenizer=tiny_tokenizer())


_NOT_LLAMA_FIELDS = ("qkv_bias", "qk_norm", "layer_windows", "activation", "norm_unit_offset",
                     "scale_embeddings", "sandwich_norms", "query_pre_attn_scalar",
                     "attn_logit_softcap", "final_logit_softcap", "local_rope",
                     "local_rope_layers", "mla")


def save_hf_checkpoint(model: Model, directory) -> None:
    """Writes `model` (a Llama without QKV biases, default RoPE, e.g. `tiny_model()`) as a HF
    directory (config.json + model.safetensors) that `kvjax.load_model` reads back to the same
    params: what scripts taking `--model` run on in tests, without torch. A model with a
    tokenizer (`tiny_chat_model()`) also gets tokenizer.json and tokenizer_config.json, so a
    server started on the directory takes text and chat."""
    import json
    import pathlib

    from safetensors.numpy import save_file

    from kvjax.models.hf import LAYER_WEIGHTS

    c, params = model.config, model.params
    # Fields a plain Llama config.json cannot state (Qwen's, Gemma's), set apart from defaults.
    other_fields = [f.name for f in dataclasses.fields(c) if f.name in _NOT_LLAMA_FIELDS
                    and getattr(c, f.name) != f.default]
    if c.rope != RoPE(theta=c.rope.theta) or other_fields:
        raise ValueError(f"save_hf_checkpoint writes plain Llama checkpoints, not {c}")
    tensors = {"model.embed_tokens.weight": np.asarray(params["embed"]),
               "model.norm.weight": np.asarray(params["final_norm"])}
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)  # [V, H]
    for key, name in LAYER_WEIGHTS.items():
        for i, w in enumerate(np.asarray(params["layers"][key])):
            tensors[f"model.layers.{i}.{name}"] = np.ascontiguousarray(w.T)  # [out, in]
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope.theta, bos_token_id=1,
        eos_token_id=list(c.eos_token_ids), tie_word_embeddings=c.tie_word_embeddings)))
    tokenizer = model.tokenizer
    if tokenizer is not None:
        from kvjax.models.tokenizer import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise ValueError(f"save_hf_checkpoint writes kvjax Tokenizers (tokenizer.json), "
                             f"not {type(tokenizer).__name__}")
        tokenizer.backend.save(str(directory / "tokenizer.json"))
        special = {role: tokenizer.backend.id_to_token(token_id) for role, token_id in (
            ("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_ids[0]))
            if token_id is not None}
        (directory / "tokenizer_config.json").write_text(json.dumps(
            dict(special, chat_template=tokenizer.chat_template)))
