"""Loads llama-architecture GGUF files (llama.cpp's format) into a kvjax `Model`.

Every tensor is dequantized to float32 on the host (any type `gguf.dequantize` knows: F32, F16,
Q8_0, Q4_0, Q4_1, K-quants, ...), mapped into the params pytree of `kvjax.models.llama`, then cast
to the requested dtype. The model therefore computes with the dequantized weights exactly; the
quantized storage itself is not kept.

llama.cpp's converter permutes the rows of attn_q and attn_k within each head so that its RoPE can
rotate adjacent pairs (x0, x1), (x2, x3), ...; kvjax rotates halves (x_i, x_{i+D/2}) like Hugging
Face, so the loader undoes that permutation.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig, resolve_dtype
from kvjax.models import llama
from kvjax.models.model import Model
from kvjax.models.rope import RoPE, RopeType
from kvjax.models.tokenizer import Tokenizer

_ARCH = "llama"

# kvjax layer param -> GGUF tensor name inside block N (blk.N.<name>.weight).
_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "mlp_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
}


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """GGUF metadata as plain Python values: key -> str | int | float | bool | list."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _open(path: Path) -> gguf.GGUFReader:
    if not path.exists():
        raise FileNotFoundError(f"no GGUF file at {path}")
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata is missing {key}")
    return metadata[key]


def config_from_metadata(metadata: dict[str, Any], *, tie_word_embeddings: bool,
                         name: str = "gguf", rope_freqs: np.ndarray | None = None
                         ) -> ModelConfig:
    """The `ModelConfig` of a llama-architecture GGUF, from its `llama.*` and tokenizer keys.

    The vocabulary size is the length of `tokenizer.ggml.tokens`. Whether the embedding is tied
    is not metadata: a file without an `output.weight` tensor ties it. `rope_freqs` (the
    `rope_freqs.weight` tensor llama.cpp writes for Llama 3.x) divides the RoPE frequencies;
    `rope.scaling.type` "linear" stretches positions by `rope.scaling.factor`.
    """
    arch = metadata.get("general.architecture")
    if arch != _ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: [{_ARCH!r}]")
    prefix = f"{_ARCH}."
    scaling = metadata.get(prefix + "rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling type {scaling!r}")
    theta = float(metadata.get(prefix + "rope.freq_base", 10000.0))
    if rope_freqs is not None:
        if scaling != "none":
            raise ValueError("a GGUF with rope_freqs and rope scaling type "
                             f"{scaling!r}: kvjax applies one or the other")
        rope = RoPE(RopeType.FREQ_FACTORS, theta=theta,
                    freq_factors=tuple(float(f) for f in rope_freqs))
    elif scaling == "linear":
        rope = RoPE(RopeType.LINEAR, theta=theta,
                    factor=float(_required(metadata, prefix + "rope.scaling.factor")))
    else:
        rope = RoPE(theta=theta)
    hidden = _required(metadata, prefix + "embedding_length")
    num_heads = _required(metadata, prefix + "attention.head_count")
    head_dim = metadata.get(prefix + "attention.key_length", hidden // num_heads)
    value_dim = metadata.get(prefix + "attention.value_length", head_dim)
    rotary_dim = metadata.get(prefix + "rope.dimension_count", head_dim)
    if value_dim != head_dim or rotary_dim != head_dim:
        raise ValueError(f"unsupported GGUF head layout: key_length={head_dim}, "
                         f"value_length={value_dim}, rope.dimension_count={rotary_dim} "
                         "(kvjax needs them equal)")
    eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in metadata]
    return ModelConfig(
        vocab_size=len(_required(metadata, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=_required(metadata, prefix + "feed_forward_length"),
        num_layers=_required(metadata, prefix + "block_count"),
        num_heads=num_heads,
        num_kv_heads=metadata.get(prefix + "attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope=rope,
        rms_norm_eps=float(_required(metadata, prefix + "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=_required(metadata, prefix + "context_length"),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        tie_word_embeddings=tie_word_embeddings,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        name=name,
    )


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation. w: [heads*D, H] (GGUF rows) -> same shape."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    # llama.cpp stores head row (pair i, member j) at i*2 + j; rotate-half wants j*D/2 + i.
    w = w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)  # [heads, 2, D/2, H]
    return w.reshape(rows, *w.shape[3:])


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor shapes as numpy sees them ([out, in] for matrices), per block-local name."""
    c = config
    nd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "attn_norm": (c.hidden_size,),
        "attn_q": (nd, c.hidden_size),
        "attn_k": (kd, c.hidden_size),
        "attn_v": (kd, c.hidden_size),
        "attn_output": (c.hidden_size, nd),
        "ffn_norm": (c.hidden_size,),
        "ffn_gate": (c.intermediate_size, c.hidden_size),
        "ffn_up": (c.intermediate_size, c.hidden_size),
        "ffn_down": (c.hidden_size, c.intermediate_size),
    }


def _dequantize(tensor: Any, expected: tuple[int, ...]) -> np.ndarray:
    try:
        w = gguf.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {tensor.name} has unsupported type "
                         f"{tensor.tensor_type.name}") from e
    w = np.array(w, dtype=np.float32)  # a copy: F32 tensors are views of the mapped file
    if w.shape != expected:
        raise ValueError(f"GGUF tensor {tensor.name} has shape {w.shape}, expected {expected}")
    return w


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_gguf(path: str | os.PathLike, dtype: str = "float32") -> Model:
    """Loads a llama-architecture GGUF file.

    Args:
      path: the .gguf file.
      dtype: 'float32', 'bfloat16' or 'float16': the dtype of every param after dequantization.

    Returns:
      A `Model` whose params follow `kvjax.models.llama`, with the GGUF's tokenizer and
      `weights_version` 'sha256:<digest of the file>'.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: not a GGUF file, an architecture other than llama, unsupported rope scaling or
        tensor types, or tensors missing, unexpected or of the wrong shape (the message names it).
    """
    target = resolve_dtype(dtype)
    path = Path(path)
    reader = _open(path)
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = tensors.get("rope_freqs.weight")
    if rope_freqs is not None:
        rope_freqs = _dequantize(rope_freqs, tuple(int(n) for n in rope_freqs.data.shape))
    config = config_from_metadata(
        metadata, tie_word_embeddings="output.weight" not in tensors, name=path.stem,
        rope_freqs=rope_freqs)
    expected = _expected_shapes(config)
    wanted = {"token_embd.weight", "output_norm.weight"}
    if rope_freqs is not None:
        wanted.add("rope_freqs.weight")
    if not config.tie_word_embeddings:
        wanted.add("output.weight")
    wanted |= {f"blk.{i}.{n}.weight" for i in range(config.num_layers) for n in expected}
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise ValueError(f"GGUF file {path} is missing tensor(s) {missing[:8]}")
    unexpected = sorted(tensors.keys() - wanted)
    if unexpected:
        raise ValueError(f"GGUF file {path} has tensor(s) kvjax does not support: {unexpected[:8]}")

    def block(i: int, name: str) -> np.ndarray:
        w = _dequantize(tensors[f"blk.{i}.{name}.weight"], expected[name])
        if name == "attn_q":
            w = _unpermute_rows(w, config.num_heads)
        elif name == "attn_k":
            w = _unpermute_rows(w, config.num_kv_heads)
        return w if w.ndim == 1 else w.T  # [in, out]: kvjax computes x @ W

    h, v = config.hidden_size, config.vocab_size
    layers = {
        key: jnp.asarray(np.stack([block(i, name) for i in range(config.num_layers)]), target)
        for key, name in _LAYER_TENSORS.items()
    }
    params: dict[str, Any] = {
        "embed": jnp.asarray(_dequantize(tensors["token_embd.weight"], (v, h)), target),
        "final_norm": jnp.asarray(_dequantize(tensors["output_norm.weight"], (h,)), target),
        "layers": layers,
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(_dequantize(tensors["output.weight"], (v, h)).T, target)
    llama.check_params(params, config)
    return Model(config=config, params=params, tokenizer=Tokenizer.from_gguf_metadata(metadata),
                 weights_version=f"sha256:{_file_digest(path)}", source=str(path))
