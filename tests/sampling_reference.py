"""NumPy oracles of the sampling rules (`kvjax.sampling`), written from their definitions, and
a brute-force generate loop that applies them to the cache-free dense forward pass."""

from __future__ import annotations

import functools

import jax
import numpy as np

from kvjax.models import llama
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams
from kvjax.shapes import next_power_of_2


def rules_reference(logits: np.ndarray, prompt: list[int], output: list[int],
                    p: SamplingParams, stop_ids: tuple[int, ...]) -> np.ndarray:
    """[V] float64: raw logits after the logit bias, the min_tokens mask and the repetition,
    frequency and presence penalties, in vLLM's order, for the token after `output`."""
    x = logits.astype(np.float64)
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        x[list(stop_ids)] = -np.inf
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else \
            x[token] * p.repetition_penalty
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def keep_reference(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """[V] bool: the tokens min-p, then top-k, then top-p (over the top-k set, renormalized)
    keep from tempered logits (top_p = 1 keeps every token top-k kept)."""
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    order = [t for t in np.argsort(-scaled, kind="stable") if keep[t]]
    if top_k:
        order = order[:top_k]
    mass = probs[order] / probs[order].sum()
    kept, before = [], 0.0
    for token, m in zip(order, mass, strict=True):
        if kept and top_p < 1.0 and before >= top_p:
            break
        kept.append(token)
        before += m
    out = np.zeros(len(scaled), bool)
    out[kept] = True
    return out


def next_token_reference(logits: np.ndarray, prompt: list[int], output: list[int],
                         p: SamplingParams, stop_ids: tuple[int, ...], seed: int) -> int:
    """The token the rules pick: the argmax when greedy, else a draw from the tempered,
    filtered distribution with the engine's per-request key (seed, token index)."""
    x = rules_reference(logits, prompt, output, p, stop_ids)
    if p.is_greedy:
        return int(np.argmax(x))
    scaled = x / p.temperature
    scaled = np.where(keep_reference(scaled, p.top_k, p.top_p, p.min_p), scaled, -np.inf)
    key = jax.random.fold_in(jax.random.key(seed), len(output))
    return int(jax.random.categorical(key, scaled.astype(np.float32)))


@functools.cache
def _forward(config):
    return jax.jit(lambda params, tokens: llama.forward_dense(params, config, tokens))


def dense_logits(model: Model, tokens: list[int]) -> np.ndarray:
    """[V] float32, the next-token logits after `tokens`, by the dense forward pass (padded
    to a power of two so a few compiles serve a session)."""
    padded = np.zeros(next_power_of_2(max(len(tokens), 16)), np.int32)
    padded[:len(tokens)] = tokens
    return np.asarray(_forward(model.config)(model.params, padded))[len(tokens) - 1]


def generate_reference(model: Model, prompt: list[int], p: SamplingParams, seed: int
                       ) -> list[int]:
    """A request's output by brute force: the whole sequence recomputed for every token."""
    stop_ids = p.stop_ids(model.config.eos_token_ids)
    output: list[int] = []
    while len(output) < p.max_new_tokens:
        logits = dense_logits(model, prompt + output)
        output.append(next_token_reference(logits, prompt, output, p, stop_ids, seed))
        if output[-1] in stop_ids:
            break
    return output
