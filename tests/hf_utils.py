"""Hugging Face oracles for tests: tiny random checkpoints on disk, HF logits and greedy decoding.

transformers and torch are imported inside the functions so that test modules which only collect
do not pay for them.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def import_torch():
    """torch, limited to one intra-op thread.

    torch's worker threads spin while they wait; on a small machine shared with other processes
    two threads run a forward pass about ten times slower than one.
    """
    import torch

    torch.set_num_threads(1)
    return torch


@functools.cache
def _cached_gguf_functions():
    import gguf

    return (functools.cache(gguf.GGUFReader), functools.cache(gguf.get_tensor_name_map))


@contextlib.contextmanager
def gguf_parsed_once():
    """Within it, transformers' GGUF loads reuse one parse per file and one tensor-name map.

    A load of the embedded model parses the file's metadata twice (config, then tensors) and
    builds gguf's tensor-name map for each of its ~400 modules: about half its load time. The
    cached reader and map are the ones it would build again, so what loads is the same.
    """
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = _cached_gguf_functions()
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _config_class(model_type: str):
    import transformers

    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "phi3": transformers.Phi3Config, "gemma2": transformers.Gemma2Config,
               "gemma3_text": transformers.Gemma3TextConfig,
               "deepseek_v2": transformers.DeepseekV2Config,
               "deepseek_v3": transformers.DeepseekV3Config,
               "mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
               "qwen3_moe": transformers.Qwen3MoeConfig}
    if model_type not in classes:
        raise ValueError(f"no tiny config for model_type {model_type!r}; known: {sorted(classes)}")
    return classes[model_type]


def make_tiny_hf_checkpoint(tmp_path: str | os.PathLike, model_type: str, *, seed: int = 0,
                            torch_dtype: str = "float32", max_shard_size: str | None = None,
                            **overrides: Any) -> Path:
    """Writes a small random `model_type` checkpoint with `save_pretrained` (safetensors).

    Every parameter is random, including RMSNorm weights (Qwen3's per-head Q/K norms too),
    Qwen2's Q/K/V biases and DeepSeek-V3's expert-choice bias (which Hugging Face initializes
    to constants), so a mix-up of any two tensors changes the logits.

    Args:
      tmp_path: the parent directory; the checkpoint goes into `<tmp_path>/<model_type>-<seed>`.
      model_type: 'llama', 'mistral', 'qwen2', 'qwen3', 'phi3', 'gemma2', 'gemma3_text',
        'deepseek_v2' or 'deepseek_v3' (pass the MLA dims and first_k_dense_replace), or the
        mixtures of experts 'mixtral', 'qwen2_moe', 'qwen3_moe' (pass the expert counts).
      seed: torch seed of the random weights.
      torch_dtype: dtype the weights are stored in ('float32' or 'bfloat16').
      max_shard_size: e.g. '100KB' to write a sharded checkpoint with an index json.
      **overrides: config fields replacing `TINY_DEFAULTS` (e.g. num_key_value_heads=1).

    Returns:
      The checkpoint directory.
    """
    import transformers

    torch = import_torch()
    # Phi-3's default pad id (32000) lies outside the tiny vocabulary.
    defaults = {**TINY_DEFAULTS, **({"pad_token_id": 0} if model_type == "phi3" else {})}
    config = _config_class(model_type)(**{**defaults, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias
                buffer.copy_(0.2 * torch.randn_like(buffer))
    model = model.to(getattr(torch, torch_dtype))
    directory = Path(tmp_path) / f"{model_type}-{seed}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def load_hf_model(model_dir: str | os.PathLike):
    """A transformers causal LM from `model_dir`, in float32 and eval mode."""
    import transformers

    torch = import_torch()
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()


def _as_model(model_dir_or_model):
    if isinstance(model_dir_or_model, (str, os.PathLike)):
        return load_hf_model(model_dir_or_model)
    return model_dir_or_model


def hf_logits(model_dir_or_model, token_ids: list[int]) -> np.ndarray:
    """[T, V] float32 logits of Hugging Face's forward pass over one sequence."""
    torch = import_torch()
    model = _as_model(model_dir_or_model)
    with torch.no_grad():
        out = model(torch.tensor([token_ids], dtype=torch.long)).logits[0]
    return out.float().numpy()


def hf_greedy(model_dir_or_model, prompt_ids: list[int], max_new_tokens: int, *,
              stop_at_eos: bool = False) -> list[int]:
    """Greedy continuation of `prompt_ids` by Hugging Face `generate` (new tokens only).

    Args:
      model_dir_or_model: a checkpoint directory or an already loaded transformers model.
      prompt_ids: the prompt's token ids.
      max_new_tokens: how many tokens to generate.
      stop_at_eos: stop at the model's EOS ids (then fewer tokens may come back); by default
        exactly `max_new_tokens` tokens are generated, EOS or not.
    """
    import transformers

    torch = import_torch()
    model = _as_model(model_dir_or_model)
    if not stop_at_eos:
        # A plain argmax loop over HF's own KV cache: `generate` would stop at EOS, and its
        # min_new_tokens would change the distribution by masking EOS out.
        out, ids, past = [], torch.tensor([prompt_ids], dtype=torch.long), None
        with torch.no_grad():
            for _ in range(max_new_tokens):
                result = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = result.past_key_values
                token = int(result.logits[0, -1].argmax())
                out.append(token)
                ids = torch.tensor([[token]], dtype=torch.long)
        return out
    generation = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id or 0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], dtype=torch.long),
                             attention_mask=torch.ones((1, len(prompt_ids)), dtype=torch.long),
                             generation_config=generation)
    return out[0, len(prompt_ids):].tolist()


def shared_prefix_prompts(rng: np.random.Generator, vocab_size: int) -> list[list[int]]:
    """Three prompts of ids in [3, vocab_size): the first and last share 12 tokens (a prefix
    cache hit for page sizes dividing 12), the middle one is 21 tokens of its own."""
    shared = rng.integers(3, vocab_size, 12).tolist()
    return [shared + [7, 8, 9], rng.integers(3, vocab_size, 21).tolist(), shared + [40]]


def engine_greedy(model, engine_config: dict[str, Any], prompts: list[list[int]],
                  max_new_tokens: int):
    """(the engine, each prompt's greedy tokens): every prompt submitted at once to an engine
    of `engine_config`, generating `max_new_tokens` past EOS."""
    import kvjax

    engine = kvjax.Engine(model, kvjax.EngineConfig(**engine_config))
    greedy = kvjax.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return engine, [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
