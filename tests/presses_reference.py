"""numpy references of the scoring presses (kvjax.kv.presses): loops and explicit matrices.

Each takes one layer's exact tensors of one sequence (queries with RoPE applied at positions
0.., keys and values of every cached token) and returns [S] float64 scores; a press's score is
their sum over layers. `keep` turns scores into the kept cache indices.
"""

from __future__ import annotations

import numpy as np


def keep(scores, budget: int, *, first: int = 0, last: int = 0) -> list[int]:
    """The `first` tokens, the `last` tokens, and the best-scored of the rest (earlier first
    among ties), sorted."""
    size = len(scores)
    middle = range(first, size - last)
    best = sorted(middle, key=lambda i: (-scores[i], i))[:budget - first - last]
    return sorted([*range(first), *best, *range(size - last, size)])


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def knorm(k: np.ndarray) -> np.ndarray:
    """k [S, K, D] -> -(sum over kv heads of ||k||)."""
    return -np.sqrt((k.astype(np.float64) ** 2).sum(-1)).sum(-1)


def tova(q_last: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The newest query's softmax over every key, summed over query heads. q_last [N, D]."""
    n, d = q_last.shape
    g = n // k.shape[1]
    out = np.zeros(len(k))
    for h in range(n):
        out += softmax_rows(k[:, h // g].astype(np.float64) @ q_last[h] / np.sqrt(d))
    return out


def observed(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Causal attention of queries q [S, N, D] summed over queries and heads, divided by the
    number of queries that see each key."""
    s, n, d = q.shape
    g = n // k.shape[1]
    out = np.zeros(s)
    for t in range(s):
        for h in range(n):
            out[:t + 1] += softmax_rows(k[:t + 1, h // g].astype(np.float64) @ q[t, h]
                                        / np.sqrt(d))
    return out / (s - np.arange(s))


def rotation(position: int, inv_freq: np.ndarray) -> np.ndarray:
    """[D, D] RoPE's rotate-half rotation at `position`."""
    c, s = np.cos(position * inv_freq), np.sin(position * inv_freq)
    return np.block([[np.diag(c), -np.diag(s)], [np.diag(s), np.diag(c)]])


def expected_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, inv_freq: np.ndarray, *,
                       num_future: int, num_sinks: int, covariance: bool, vnorm: bool
                       ) -> np.ndarray:
    """ExpectedAttention's scores (0 for the sinks) from the prompt's queries q [S, N, D] (RoPE
    applied at positions 0..S-1, the sinks' queries left out of the statistics), keys and
    values [S, K, D]."""
    s, n, d = q.shape
    k_heads = k.shape[1]
    g = n // k_heads
    raw = np.stack([rotation(p, inv_freq).T @ q[p].T for p in range(s)]).transpose(0, 2, 1)
    raw = raw[num_sinks:].astype(np.float64)  # [S - sinks, N, D]
    mu = raw.mean(axis=0)  # [N, D]
    cov = np.einsum("tnd,tne->nde", raw - mu, raw - mu) / len(raw)
    rot = np.mean([rotation(p, inv_freq) for p in range(s, s + num_future)], axis=0)
    mu = mu @ rot.T
    cov = np.einsum("ij,njk,lk->nil", rot, cov, rot)
    scores = np.zeros(s)
    keys = k[num_sinks:].astype(np.float64)
    for h in range(n):
        kk = keys[:, h // g]  # [S', D]
        logits = kk @ mu[h] / np.sqrt(d)
        if covariance:
            logits += np.einsum("sd,de,se->s", kk, cov[h], kk) / (2 * d)
        probs = softmax_rows(logits) / g
        if vnorm:
            probs *= np.linalg.norm(v[num_sinks:, h // g].astype(np.float64), axis=-1)
        scores[num_sinks:] += probs
    return scores


# ----------------------------------------------------------------------------- per kv head


def head_attention(q: np.ndarray, k: np.ndarray, first_query: int) -> np.ndarray:
    """[K, S]: the causal attention of queries first_query..S-1 (q [S, N, D]) to each key (k
    [S, K, D]), summed over those queries and the query heads of each kv head."""
    s, n, d = q.shape
    k_heads = k.shape[1]
    g = n // k_heads
    out = np.zeros((k_heads, s))
    for t in range(first_query, s):
        for h in range(n):
            out[h // g, :t + 1] += softmax_rows(k[:t + 1, h // g].astype(np.float64)
                                                @ q[t, h].astype(np.float64) / np.sqrt(d))
    return out


def head_knorm(k: np.ndarray) -> np.ndarray:
    """[K, S]: -||k|| of each kv head's key."""
    return -np.sqrt((k.astype(np.float64) ** 2).sum(-1)).T


def head_expected_attention(q, k, v, inv_freq, *, num_future: int, num_sinks: int,
                            covariance: bool, vnorm: bool) -> np.ndarray:
    """[K, S]: `expected_attention`'s score per kv head (each kv head's sum over its query
    heads), computed one kv head at a time from its own query heads."""
    n, k_heads = q.shape[1], k.shape[1]
    g = n // k_heads
    return np.stack([expected_attention(q[:, j * g:(j + 1) * g], k[:, j:j + 1], v[:, j:j + 1],
                                        inv_freq, num_future=num_future, num_sinks=num_sinks,
                                        covariance=covariance, vnorm=vnorm)
                     for j in range(k_heads)])


def adakv_keep(scores: np.ndarray, count: int, floor_fraction: float) -> list[list[int]]:
    """AdaKV over one layer's heads: scores [K, S'] -> each head's kept indices. Each head takes
    its floor(floor_fraction * count) best first, then the best (score, head, index) pairs
    left take the other K * count slots."""
    k_heads, size = scores.shape
    floor = int(np.floor(floor_fraction * count))
    chosen = [set(sorted(range(size), key=lambda i, h=h: (-scores[h, i], i))[:floor])
              for h in range(k_heads)]
    rest = sorted((-scores[h, i], h, i) for h in range(k_heads) for i in range(size)
                  if i not in chosen[h])
    for _, h, i in rest[:k_heads * count - k_heads * floor]:
        chosen[h].add(i)
    return [sorted(c) for c in chosen]


def probe_attention(q: np.ndarray, k: np.ndarray, context: int,
                    span: tuple[int, int] | None = None, sinks: int = 0) -> np.ndarray:
    """KVzip's score of the first `context` keys: the most causal attention any query after
    them (the probe's, q [S, N, D] over keys k [S, K, D]) pays each, over the query heads of its
    kv head, summed over kv heads. span (lo, hi): the softmax runs over the first `sinks` keys,
    keys lo..hi - 1 and the probe's own, and only the span's keys score (the rest 0); None:
    over every key the query sees, all scoring."""
    s, n, d = q.shape
    k_heads = k.shape[1]
    g = n // k_heads
    idx = np.arange(s)
    lo, hi = (0, context) if span is None else span
    in_span = (idx >= lo) & (idx < hi)
    read = in_span | (idx < sinks) | (idx >= context)
    most = np.zeros((k_heads, context))
    for t in range(context, s):
        for h in range(n):
            keys = np.flatnonzero(read[:t + 1])
            p = np.zeros(s)
            p[keys] = softmax_rows(k[keys, h // g].astype(np.float64) @ q[t, h] / np.sqrt(d))
            most[h // g] = np.maximum(most[h // g], np.where(in_span, p, 0)[:context])
    return most.sum(0)
