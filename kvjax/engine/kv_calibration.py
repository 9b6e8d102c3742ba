"""Calibrating a low-rank key pool (`kv_codec='lowrank'`): its bases from sample prompts.

With `calibration='embedded'` (the default) the engine calibrates when it starts, from
`embedded_prompts`: a few paragraphs of ordinary English text in the model's tokenizer
(seeded random token ids for a model without one), in one sequence of 2048 positions. The
bases depend only on the weights, the prompts and the rank, so they are cached on disk
(`$KVJAX_LOWRANK_CACHE`, default `~/.cache/kvjax/lowrank`) under a key made of those three:
a second engine of the same model reads the file instead of running the model again. The
weights enter the key through a fingerprint of every parameter leaf's shape, dtype and a
strided sample of its values (a full hash would read every weight at each start), plus the
model's weights version. With `calibration='manual'` the pool waits for
`Engine.calibrate_kv(prompts)`.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kvjax.kv import calibration, codecs

_SAMPLE_TEXTS = (
    "The river town grew around a stone bridge built in the twelfth century. Merchants "
    "crossed it every morning with carts of grain, wool and salt, and the toll they paid "
    "kept the bridge standing through floods, wars and a long succession dispute.",
    "To make the lentil soup, warm olive oil in a heavy pot, soften the onions and garlic, "
    "then add cumin, tomatoes and the rinsed lentils. Simmer for forty minutes, season with "
    "salt and lemon juice, and serve it with warm flatbread.",
    "A neutron star is the collapsed core of a massive star. It packs more mass than the Sun "
    "into a sphere about twenty kilometers across, spins up to hundreds of times a second "
    "and sweeps beams of radio waves across the sky like a lighthouse.",
    "def merge_sorted(a, b):\n    # Walks both lists once and keeps the output sorted.\n"
    "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "User: What is the capital of Norway, and what is it known for?\nAssistant: The capital "
    "of Norway is Oslo. It is known for its fjord, the Viking Ship Museum, the opera house "
    "whose roof you can walk on, and the sculptures of Vigeland Park.",
    "In 1887 the cartographer Ingrid Hansen measured the coastline of the northern islands "
    "with a chain of 66 feet. Her maps, revised in 1903 and again in 1921, were used by "
    "fishing fleets until the first aerial surveys.",
)
# Calibration positions: RoPE turns a key further the later it sits, so bases taken from short
# prompts alone miss the directions of keys deep in a long context.
CALIBRATION_TOKENS = 2048


def embedded_prompts(model: Any) -> list[list[int]]:
    """The built-in calibration prompt in `model`'s tokens: the sample texts in seeded orders,
    one after another, to CALIBRATION_TOKENS positions (the model's limit if lower)."""
    length = min(CALIBRATION_TOKENS, model.config.max_position_embeddings)
    rng = np.random.default_rng(0)
    tokenizer = model.tokenizer
    if tokenizer is None:
        return [rng.integers(0, model.config.vocab_size, length).tolist()]
    texts = [tokenizer.encode(text + "\n\n") for text in _SAMPLE_TEXTS]
    tokens: list[int] = []
    while len(tokens) < length:
        for i in rng.permutation(len(texts)):
            tokens += texts[i]
    return [tokens[:length]]


def weights_fingerprint(model: Any) -> str:
    """A short hash of the model's name, weights version and every parameter leaf's shape,
    dtype and a strided sample of about 4096 of its values."""
    h = hashlib.blake2b(f"{model.config.name}|{model.weights_version}".encode(), digest_size=8)
    for path, leaf in jax.tree_util.tree_leaves_with_path(model.params):
        flat = np.asarray(leaf).reshape(-1)
        h.update(f"{jax.tree_util.keystr(path)}{leaf.shape}{leaf.dtype}".encode())
        h.update(np.ascontiguousarray(flat[::max(flat.size // 4096, 1)]).tobytes())
    return h.hexdigest()


def _cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVJAX_LOWRANK_CACHE",
                                       pathlib.Path.home() / ".cache" / "kvjax" / "lowrank"))


def key_bases(model: Any, prompts: Sequence[Sequence[int]], rank: int, *,
              use_cache: bool = True) -> np.ndarray:
    """`calibration.key_bases` of `model` over `prompts`, read from the disk cache when an
    earlier call computed the same ones: [L, D, r, K] float32."""
    prompt_hash = hashlib.blake2b(repr([list(map(int, p)) for p in prompts]).encode(),
                                  digest_size=8).hexdigest()
    path = _cache_dir() / f"{weights_fingerprint(model)}-{prompt_hash}-r{rank}.npy"
    if use_cache and path.exists():
        return np.load(path)
    basis = calibration.key_bases(model.params, model.config, prompts, rank)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, basis)
        os.replace(tmp, path)  # Atomic: a concurrent reader sees a whole file or none.
    return basis


def lowrank_codec(config: Any) -> codecs.LowRankCodec | None:
    """The engine config's low-rank codec, or None for another codec."""
    if config.kv_codec != "lowrank":
        return None
    return codecs.get_codec(config.kv_codec, **config.kv_codec_options)


def at_start(kv: Any, model: Any, config: Any) -> Any:
    """The engine's fresh pool `kv`, its key bases calibrated from `embedded_prompts` when
    `config` asks for a low-rank pool calibrated at start; any other pool as it is."""
    codec = lowrank_codec(config)
    if codec is None or codec.calibration is not codecs.LowRankCalibration.EMBEDDED:
        return kv
    return kv.with_basis(key_bases(model, embedded_prompts(model), codec.rank))


def calibrate(runner, model, config, prompts, *, margin: float | None = None) -> None:
    """Calibrates `runner`'s pool from `prompts` (see `Engine.calibrate_kv`): a low-rank
    pool's key bases, or a `scaling='calibrated'` fp8 pool's K and V scales."""
    from kvjax.kv import quantized  # Imported lazily: fp8 engines only.
    from kvjax.memory.ops import KVOp, KVOpKind

    lowrank = lowrank_codec(config)
    if lowrank is not None:  # margin does not apply: the bases keep the top-r directions
        basis = key_bases(model, prompts, lowrank.rank)
        runner.apply(KVOp(KVOpKind.CALIBRATE), lambda kv: kv.with_basis(basis))
        return
    codec = (quantized.make_codec(config.kv_codec, **config.kv_codec_options)
             if config.kv_codec != "none" else None)
    if not isinstance(codec, quantized.codecs.Fp8Codec) or codec.scaling.value != \
            "calibrated":
        raise ValueError(f"calibrate_kv needs kv_codec fp8_e4m3/fp8_e5m2 with "
                         f"scaling='calibrated', got {config.kv_codec!r} "
                         f"{config.kv_codec_options}")
    k_scale, v_scale = calibration.fp8_kv_scales(
        model.params, model.config, prompts, codec.fmt,
        margin=calibration.DEFAULT_MARGIN if margin is None else margin)
    runner.apply(KVOp(KVOpKind.CALIBRATE),
                 lambda kv: quantized.calibrate_fp8(kv, k_scale, v_scale))
