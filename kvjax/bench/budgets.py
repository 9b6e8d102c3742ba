"""Budget schemes (uniform, PyramidKV per layer, AdaKV per head) at long context: quality and
pages held, what `scripts/bench_retention.py --schemes` runs; `run` is the whole benchmark.

The engine serves the uniform scheme, and for the presses that compress once the pyramid
schedule (`kvjax.kv.layer_retention`) and the adakv split (`kvjax.kv.head_retention`), not
pyramid+adakv. The schemes are measured on a simulated cache, for each needle probe
(`kvjax.bench.retention.make_probe`), which the engine's rows equal:
  * one dense forward pass over the prompt captures every layer's queries, keys and values;
  * each press scores every prompt token per layer and kv head from them
    (`layer_head_scores`, the scores the engine's presses sum over layers and heads), and the
    scheme picks each (layer, kv head)'s kept tokens (`BudgetScheme.select`), compressing once
    at the end of prefill (h2o and tova too, which the engine instead evicts as it decodes);
  * the forced continuation (the exact run's tokens) is decoded over the captured prompt K/V
    with every layer's head reading only its kept prompt tokens and every generated token
    (`continuation_logits`), and compared with the same decode over every prompt token:
    KL(exact || scheme) mean, p99 and worst, top-1 agreement, retrieval;
  * pages held: a `GroupedBlockManager` with one block table per layer (pages of one layer)
    allocates the prompt and keeps each layer's slots (`GroupedBlockManager.retain_groups`);
    the count is read back from the allocator, in pages of all layers for comparison with
    exact KV. Heads share a layer's slots, so a per-head scheme holds its longest head's
    tokens; `pages_fraction_head_tables` is what one block table per (layer, kv head), pages
    of one head, would hold instead (the same allocator, L * K tables).
A uniform row of the engine (its real retention, `kvjax.bench.retention.run_variant`) beside
the simulated uniform row checks the simulation, and for the presses that compress once a
pyramid row of the engine (`engine_pyramid_row`) beside the simulated pyramid row.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.bench import retention as retention_bench
from kvjax.bench.metrics import quality_stats
from kvjax.jit import Program
from kvjax.kv import presses
from kvjax.kv.budgets import BudgetScheme, layer_slots
from kvjax.kv.retention_host import Pooling, pool_scores
from kvjax.memory.block_manager import AllocStatus
from kvjax.memory.groups import GroupedBlockManager
from kvjax.models import llama
from kvjax.models.rope import RoPE

PRESSES = ("snapkv", "tova", "h2o", "knorm", "expected_attention", "observed_attention")


@dataclasses.dataclass(frozen=True)
class PressSpec:
    """A press's scoring options and the tokens every layer and head keeps.

    Attributes:
      name: the press (`PRESSES`).
      window: snapkv's observation window, kept (and h2o's recent tokens when num_recent is
        None: half the budget).
      kernel, pooling: snapkv's pooling of scores over neighbouring tokens.
      num_sinks, num_future, covariance, vnorm: expected_attention's options.
    """

    name: str
    window: int = 64
    kernel: int = 5
    pooling: Pooling = Pooling.MAX
    num_sinks: int = 4
    num_future: int = 512
    covariance: bool = True
    vnorm: bool = True

    def __post_init__(self):
        if self.name not in PRESSES:
            raise ValueError(f"unknown press {self.name!r}; budget schemes score with "
                             f"{list(PRESSES)}")

    def protected(self, budget: int) -> tuple[int, int]:
        """(first, last) tokens every layer and head keeps."""
        return dict(snapkv=(0, self.window), tova=(0, 1), h2o=(0, budget // 2),
                    expected_attention=(self.num_sinks, 0)).get(self.name, (0, 0))

    def rank(self, row: np.ndarray) -> np.ndarray:
        """The press's transform of a summed row of unprotected scores before ranking."""
        if self.name == "snapkv":
            return pool_scores(row, self.kernel, self.pooling)
        if self.name == "observed_attention":  # token i is seen by the S - i queries after it
            return row / (len(row) - np.arange(len(row)))
        return row


def _probs(q: jax.Array, k: jax.Array, q_pos: jax.Array) -> jax.Array:
    """Causal softmax of queries q [C, N, D] at positions q_pos [C] over keys k [S, K, D] at
    0..S-1: [K, G, C, S] float32."""
    c, n, d = q.shape
    k_heads = k.shape[1]
    qg = q.astype(jnp.float32).reshape(c, k_heads, n // k_heads, d)
    logits = jnp.einsum("ckgd,skd->kgcs", qg, k.astype(jnp.float32)) / np.sqrt(d)
    visible = jnp.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [C, S]
    return jax.nn.softmax(jnp.where(visible[None, None], logits, -jnp.inf), axis=-1)


@functools.partial(jax.jit, static_argnames=("press", "rope"))
def _layer_scores(q: jax.Array, k: jax.Array, v: jax.Array, press: PressSpec, rope: RoPE
                  ) -> jax.Array:
    """One layer's per-kv-head scores [K, S] of a prompt: q [S, N, D], k, v [S, K, D]."""
    s = q.shape[0]
    pos = jnp.arange(s, dtype=jnp.int32)
    if press.name == "knorm":
        return -jnp.sqrt(jnp.sum(k.astype(jnp.float32) ** 2, axis=-1)).T  # [K, S]
    if press.name == "expected_attention":
        weights = (pos >= press.num_sinks).astype(jnp.float32)[None]  # [1, S]
        mu, cov = presses.query_statistics(q[None], pos[None], weights, rope)
        rot = presses.mean_rotation(rope, jnp.array([s], jnp.int32), press.num_future,
                                    q.shape[-1])[0]  # [D, D]
        k_heads, d = k.shape[1], q.shape[-1]
        g = q.shape[1] // k_heads
        mu = jnp.einsum("ij,nj->ni", rot, mu[0]).reshape(k_heads, g, d)  # [K, G, D]
        cov = jnp.einsum("ij,njk,lk->nil", rot, cov[0], rot).reshape(k_heads, g, d, d)
        kf = k.astype(jnp.float32)
        logits = jnp.einsum("kgd,skd->kgs", mu, kf) / np.sqrt(d)  # [K, G, S]
        if press.covariance:
            logits = logits + jnp.einsum("skd,kgde,ske->kgs", kf, cov, kf) / (2 * d)
        logits = jnp.where(pos[None, None] >= press.num_sinks, logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1).sum(axis=1) / g  # [K, S]
        if press.vnorm:
            probs = probs * jnp.sqrt(jnp.sum(v.astype(jnp.float32) ** 2, axis=-1)).T
        return jnp.where(pos[None] >= press.num_sinks, probs, 0.0)
    first = {"snapkv": s - press.window, "tova": s - 1}.get(press.name, 0)
    return _probs(q[first:], k, pos[first:]).sum(axis=(1, 2))  # [K, S]


def layer_head_scores(q: np.ndarray, k: np.ndarray, v: np.ndarray, press: PressSpec,
                      rope: RoPE) -> np.ndarray:
    """Every layer's per-kv-head press scores of a prompt: q [L, S, N, D], k, v [L, S, K, D]
    (RoPE applied) -> [L, K, S] float32."""
    return np.stack([np.asarray(_layer_scores(jnp.asarray(q[i]), jnp.asarray(k[i]),
                                              jnp.asarray(v[i]), press, rope))
                     for i in range(len(q))])


def capture_qkv(model: kvjax.Model, tokens: list[int]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A dense causal forward pass over `tokens`: (q [L, S, N, D], k, v [L, S, K, D], logits of
    the last token [V]), float32, RoPE applied."""
    config = model.config
    s = len(tokens)
    pos = jnp.arange(s, dtype=jnp.int32)

    def attend(layer, q, k, v, captured):
        probs = _probs(q, k, pos)  # [K, G, S, S]
        out = jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32))
        captured = tuple(c.at[layer].set(x.astype(c.dtype)) for c, x in zip(
            captured, (q, k, v), strict=True))
        return out.reshape(q.shape).astype(q.dtype), captured

    shapes = ((config.num_heads, config.head_dim), (config.num_kv_heads, config.head_dim),
              (config.num_kv_heads, config.head_dim))
    init = tuple(jnp.zeros((config.num_layers, s, *shape), jnp.float32) for shape in shapes)

    @jax.jit
    def run(params, ids):
        h, captured = llama.decode_body(params, config, ids, pos, attend, init)
        return captured, llama.lm_head(params, config, h[-1:])[0]

    (q, k, v), logits = run(model.params, jnp.asarray(tokens, jnp.int32))
    return np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(logits)


@functools.partial(Program, static_argnames=("config",))
def _continuation(params, config, k_prompt, v_prompt, kept, tokens):
    s, t = k_prompt.shape[1], tokens.shape[0]
    positions = s + jnp.arange(t, dtype=jnp.int32)

    def attend(layer, q, k, v, cache):
        keys = jnp.concatenate([k_prompt[layer], k.astype(jnp.float32)])  # [S + T, K, D]
        values = jnp.concatenate([v_prompt[layer], v.astype(jnp.float32)])
        visible = jnp.concatenate([jnp.broadcast_to(kept[layer][:, None], (kept.shape[1], t, s)),
                                   jnp.broadcast_to(jnp.tri(t, dtype=bool)[None],
                                                    (kept.shape[1], t, t))], axis=2)  # [K, T, S+T]
        c, n, d = q.shape
        k_heads = keys.shape[1]
        qg = q.astype(jnp.float32).reshape(c, k_heads, n // k_heads, d)
        logits = jnp.einsum("ckgd,skd->kgcs", qg, keys) / np.sqrt(d)  # [K, G, T, S+T]
        probs = jax.nn.softmax(jnp.where(visible[:, None], logits, -jnp.inf), axis=-1)
        out = jnp.einsum("kgcs,skd->ckgd", probs, values)  # [T, K, G, D]
        return out.reshape(q.shape).astype(q.dtype), cache

    h, _ = llama.decode_body(params, config, tokens, positions, attend, None)
    return llama.lm_head(params, config, h)  # [T, V]


def continuation_logits(model: kvjax.Model, k: np.ndarray, v: np.ndarray, kept: np.ndarray,
                        tokens: list[int]) -> np.ndarray:
    """Logits [T, V] of decoding `tokens` after a prompt whose K/V [L, S, K, D] each layer's
    kv head reads only where kept [L, K, S] (every decoded token is read)."""
    if model.config.attn_logit_softcap is not None or model.config.mla is not None \
            or any(model.config.layer_window(i) > 0 for i in range(model.config.num_layers)):
        raise ValueError("the simulated cache models plain global attention with K and V heads")
    return np.asarray(_continuation(model.params, model.config, jnp.asarray(k), jnp.asarray(v),
                                    jnp.asarray(kept), jnp.asarray(tokens, jnp.int32)))


def allocator_pages(kept: np.ndarray, page_size: int) -> int:
    """Pages of one layer a sequence holds once each layer keeps its slots (`layer_slots`):
    read from a `GroupedBlockManager` with one block table per layer that allocated the
    prompt and compacted every layer to its slots."""
    num_layers, _, size = kept.shape
    per_layer = -(-size // page_size)
    # Twice the prompt's pages: `retain_groups` wants the new layouts' pages free up front.
    manager = GroupedBlockManager(2 * num_layers * per_layer, page_size, [0] * num_layers,
                                  enable_prefix_cache=False)
    manager.add_sequence("probe", list(range(size)), indexable=False)
    manager.ensure_writable("probe", 0, size)
    manager.commit("probe", list(range(size)))
    status, _, _ = manager.retain_groups("probe", [np.arange(int(n))
                                                   for n in layer_slots(kept)])
    if status is not AllocStatus.OK:
        raise RuntimeError(f"the allocator could not compact the probe: {status}")
    return manager.num_held_pages("probe")


@dataclasses.dataclass(frozen=True)
class SchemeBench:
    """What one run compares: presses x schemes at one budget.

    Attributes:
      presses: press names (`PRESSES`).
      schemes: budget scheme names (`BudgetScheme.named`).
      budget_fraction: tokens kept per layer and head on average, as a fraction of the prompt.
      depths, context, num_tokens, page_size, chunk, seed: the probes and the engine rows
        (`kvjax.bench.retention.RetentionBench`).
      engine_presses: presses whose uniform scheme (and pyramid, where the engine serves it:
        `ENGINE_PYRAMID`) also runs in the engine, beside the simulated row.
    """

    presses: tuple[str, ...]
    schemes: tuple[str, ...] = ("uniform", "pyramid", "adakv")
    budget_fraction: float = 0.25
    depths: tuple[float, ...] = (0.25, 0.5, 0.75)
    context: int = 2048
    num_tokens: int = 16
    page_size: int = 16
    chunk: int = 2048
    seed: int = 0
    engine_presses: tuple[str, ...] = ()


# Presses whose pyramid schedule the engine serves (`kvjax.kv.layer_retention`): those that
# compress the prompt once.
ENGINE_PYRAMID = ("snapkv", "knorm", "expected_attention", "observed_attention")


def engine_pyramid_row(model: kvjax.Model, name: str, budget: int, probes, exact, max_len: int,
                       settings: SchemeBench) -> dict:
    """The engine's own pyramid row (`retention_schedule='pyramid'`): quality against the
    exact engine runs, and the most pages its sequence held in a decode step (read from the
    allocator at dispatch: the compacted prompt and the decoded tokens, every table group) as
    a fraction of exact KV's pages of every layer for the same tokens."""
    engine = retention_bench.make_engine(model, f"{name}:{budget}:schedule=pyramid", max_len,
                                         page_size=settings.page_size, chunk=settings.chunk)
    layers_per_page = engine.kv_spec.layers_per_table
    refs, tests, passed, fractions = [], [], [], []
    for i, ((prompt, answer), ex) in enumerate(zip(probes, exact, strict=True)):
        run_ = retention_bench.forced_run(engine, prompt, ex["tokens"], settings.num_tokens,
                                          f"pyramid-{i}")
        refs.append(ex["logits"])
        tests.append(run_["logits"])
        passed.append(bool(np.all(run_["logits"][:len(answer)].argmax(-1) == answer)))
        exact_pages = -(-(len(prompt) + settings.num_tokens) // settings.page_size)
        fractions.append(run_["decode_peak_pages"] * layers_per_page
                         / (exact_pages * model.config.num_layers))
    return dict(quality_stats(np.concatenate(refs), np.concatenate(tests)),
                retrieval_pass=float(np.mean(passed)),
                decode_pages_fraction=float(np.mean(fractions)), simulated=False)


COLUMNS = (("kl_mean", "KL mean", "{:.3f}"), ("kl_p99", "KL p99", "{:.3f}"),
           ("kl_max", "KL worst", "{:.3f}"), ("top1_agreement", "top-1", "{:.3f}"),
           ("retrieval_pass", "retrieval", "{:.2f}"), ("pages_held", "pages held", "{:.1f}"),
           ("pages_fraction", "pages vs exact", "{:.3f}"),
           ("pages_fraction_head_tables", "per-head tables vs exact", "{:.3f}"),
           ("decode_pages_fraction", "decode peak pages vs exact", "{:.3f}"))


def run(model: kvjax.Model, settings: SchemeBench) -> dict:
    """Every press x scheme on the probes (simulated), and the engine's uniform rows.

    Returns dict(rows={'press/scheme': row}, budget=tokens, prompt_tokens=[...]).
    """
    t0 = time.perf_counter()
    config = model.config
    probes = [retention_bench.make_probe(model, settings.context, depth, settings.seed + i)
              for i, depth in enumerate(settings.depths)]
    budget = int(settings.budget_fraction * min(len(p) for p, _ in probes))
    max_len = max(len(p) for p, _ in probes) + settings.num_tokens
    exact_engine = retention_bench.make_engine(model, "none", max_len,
                                               page_size=settings.page_size, chunk=settings.chunk)
    captured, exact = [], []
    for i, (prompt, answer) in enumerate(probes):
        run_ = retention_bench.forced_run(exact_engine, prompt, answer, settings.num_tokens,
                                          f"exact-{i}")
        q, k, v, last = capture_qkv(model, prompt)
        every = np.ones((config.num_layers, config.num_kv_heads, len(prompt)), bool)
        logits = np.concatenate([last[None], continuation_logits(
            model, k, v, every, run_["tokens"][:-1])])
        captured.append((q, k, v))
        exact.append(dict(run_, sim_logits=logits))
    print(f"captured {len(probes)} probes ({time.perf_counter() - t0:.0f}s)", flush=True)
    rows = {}
    for name in settings.presses:
        press = PressSpec(name)
        first, last = press.protected(budget)
        scores = [layer_head_scores(q, k, v, press, config.rope) for q, k, v in captured]
        for scheme_name in settings.schemes:
            scheme = BudgetScheme.named(scheme_name)
            refs, tests, passed, pages, head_pages, exact_pages = [], [], [], [], [], []
            for (prompt, answer), (_, k, v), ex, sc in zip(probes, captured, exact, scores,
                                                           strict=True):
                kept = scheme.select(sc, budget, first=first, last=last, rank=press.rank)
                logits = np.concatenate([ex["sim_logits"][:1], continuation_logits(
                    model, k, v, kept, ex["tokens"][:-1])])
                refs.append(ex["sim_logits"])
                tests.append(logits)
                passed.append(bool(np.all(logits[:len(answer)].argmax(-1) == answer)))
                pages.append(allocator_pages(kept, settings.page_size) / config.num_layers)
                head_pages.append(allocator_pages(kept.reshape(-1, 1, kept.shape[2]),
                                                  settings.page_size) / kept.shape[0]
                                  / kept.shape[1])
                exact_pages.append(-(-len(prompt) // settings.page_size))
            rows[f"{name}/{scheme_name}"] = dict(
                quality_stats(np.concatenate(refs), np.concatenate(tests)),
                retrieval_pass=float(np.mean(passed)), pages_held=float(np.mean(pages)),
                pages_fraction=float(np.mean(pages) / np.mean(exact_pages)),
                pages_fraction_head_tables=float(np.mean(head_pages) / np.mean(exact_pages)),
                simulated=True)
            print(f"{name}/{scheme_name}: {rows[f'{name}/{scheme_name}']} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
        if name in settings.engine_presses and name in ENGINE_PYRAMID and \
                "pyramid" in settings.schemes:
            rows[f"{name}/pyramid (engine)"] = engine_pyramid_row(
                model, name, budget, probes, exact, max_len, settings)
            print(f"{name}/pyramid (engine): {rows[f'{name}/pyramid (engine)']}", flush=True)
        if name in settings.engine_presses:
            row = retention_bench.run_variant(model, f"{name}:{budget}", probes, exact, max_len,
                                              retention_bench.RetentionBench(
                                                  variants=(), depths=settings.depths,
                                                  context=settings.context,
                                                  num_tokens=settings.num_tokens,
                                                  page_size=settings.page_size,
                                                  chunk=settings.chunk, seed=settings.seed))
            rows[f"{name}/uniform (engine)"] = dict(
                {key: row[key] for key in ("kl_mean", "kl_p99", "kl_max", "top1_agreement",
                                           "retrieval_pass")}, simulated=False)
            print(f"{name}/uniform (engine): {rows[f'{name}/uniform (engine)']}", flush=True)
    return dict(rows=rows, budget=budget, prompt_tokens=[len(p) for p, _ in probes])
