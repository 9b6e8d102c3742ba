"""Every pair of KV behaviours the compatibility table lets through runs; the others are refused.

For each pair of `kvjax.engine.compat.Feature`s an engine on the tiny model serves a few
requests with a small page pool (so sequences are preempted): exact pairs (no codec, no
retention) give the cache-free greedy reference's tokens, approximate ones finish every
request with the tokens asked for, and within a quality bound against exact KV; either way no
page stays allocated. A refused pair raises the ValueError that names the table's reason. A
handful of triples and more (e.g. int8 + snapkv + host tier + prefix cache + swap) run the
same way.

The quality bound: each generated token's regret, teacher-forced through the cache-free dense
forward pass on the tokens the engine generated, is the exact log-probability of the exact
greedy token minus that of the token chosen (0 for exact KV). Its mean over the workload stays
under `MAX_MEAN_REGRET`: measured 0.002 nats (int8), 0.13 (KIVI), 0.56-1.61 (h2o, snapkv,
streaming at a budget of 10 of about 17 tokens on this tiny random model, alone and paired);
random tokens score 5-8 nats.

All engines share one set of step shapes, so most programs compile once per session. A mesh
pair with approximate KV gives the tokens of the same features on one device. Mesh
pairs need 8 fake CPU devices, which XLA only gives a process whose XLA_FLAGS are set before
jax starts: they run in a child process (this file run as a script, as in
tests/parallel/test_sharding.py).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from kvjax.engine.compat import REFUSED, Feature, pairs, refusal

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
P = 4
NUM_NEW = 6
BASE = dict(page_size=P, num_pages=10, max_num_seqs=3, max_num_batched_tokens=16,
            max_prefill_chunk=16, min_chunk_bucket=16, max_prefill_seqs=1, max_model_len=32,
            enable_prefix_cache=False)
# A quantized codec or a retention policy changes the tokens: only their count is checked.
PRESSES = {Feature.TOVA, Feature.KNORM, Feature.EXPECTED_ATTENTION, Feature.OBSERVED_ATTENTION,
           Feature.KVZIP}
RETAINED = {Feature.STREAMING, Feature.STREAMING_ROTATED, Feature.H2O, Feature.SNAPKV,
            Feature.QUEST, Feature.ECHO, Feature.PYRAMID, Feature.ADAKV, Feature.PYRAMID_ADAKV,
            Feature.PER_HEAD, Feature.GLOBAL, *PRESSES}
APPROXIMATE = {Feature.INT8, Feature.KIVI, Feature.KIVI_RESIDUAL, Feature.LOWRANK, *RETAINED,
               Feature.CONTEXT_REUSE}
# Mean regret bounds (nats; see the module doc): codecs alone, and with a retention policy.
MAX_MEAN_REGRET = {"codec": 0.5, "retention": 2.5}
# The features each pair test runs outside the config.
RUNTIME = {Feature.MESH, Feature.SNAPSHOT, Feature.N_SAMPLES, Feature.PAUSE,
           Feature.RECORD_DECISIONS, Feature.DISAGGREGATION}
# A few pairs whose programs the others share (codec, retention, compaction of codes, tiers,
# swap, snapshot, n > 1, prefix cache; int8 + snapkv runs in the first combination); the
# other pairs (swapped KIVI windows, mesh engines, ...) run in the slow suite.
FAST = {
    frozenset(p) for p in (
        (Feature.INT8, Feature.STREAMING),
        (Feature.KIVI_RESIDUAL, Feature.N_SAMPLES),
        (Feature.QUEST, Feature.PREFIX_CACHE),
        (Feature.HOST_TIER, Feature.SNAPSHOT), (Feature.SWAP, Feature.SNAPSHOT),
        (Feature.AUTO_PREEMPTION, Feature.N_SAMPLES),
        (Feature.SPECULATIVE, Feature.SWAP),
        (Feature.CONTEXT_REUSE, Feature.HOST_TIER),
        (Feature.PAUSE, Feature.SWAP),
        (Feature.CONTROLLER, Feature.SWAP), (Feature.CONTROLLER, Feature.STREAMING),
        (Feature.EXPECTED_ATTENTION, Feature.INT8), (Feature.TOVA, Feature.SWAP),
        (Feature.KVZIP, Feature.SWAP), (Feature.KVZIP, Feature.GLOBAL),
        (Feature.HOST_ROWS, Feature.SWAP), (Feature.ECHO, Feature.SWAP),
        (Feature.RECORD_DECISIONS, Feature.SWAP), (Feature.DISAGGREGATION, Feature.INT8),
        (Feature.MIXED_PRECISION, Feature.SNAPSHOT),
    )
}


def _prompts() -> list[list[int]]:
    # Two share two full pages (prefix-cache hits); one length keeps the oracle's compiles few.
    shared = [7, 21, 3, 90, 14, 60, 33, 8]
    return [shared + [5, 41, 77], [2, 99, 64, 18, 30, 11, 45, 70, 6, 81, 19],
            shared + [12, 50, 3]]


def config_for(features) -> dict:
    """EngineConfig keyword arguments running `features` (runtime ones aside)."""
    from kvjax.engine.config import PreemptionMode
    from kvjax.memory.tiers import TierConfig

    page_bytes = 2 * 2 * 2 * 8 * 4 * P  # L * (K, V) * K * D * float32 * P
    settings = {
        Feature.INT8: dict(kv_codec="int8"),
        Feature.KIVI: dict(kv_codec="kivi4", kv_codec_options=dict(group=4)),
        Feature.KIVI_RESIDUAL: dict(kv_codec="kivi4", kv_codec_options=dict(group=4,
                                                                           residual=4)),
        # The tiny random model's keys have no low-rank structure (7 of 8 dimensions already
        # cost a mean KL of 0.9 against exact): rank 8, a rotation, with int8 coordinates.
        Feature.LOWRANK: dict(kv_codec="lowrank", kv_codec_options=dict(rank=8,
                                                                        quantize="int8")),
        Feature.STREAMING: dict(retention="streaming", retention_budget=10,
                                retention_options=dict(num_sinks=2)),
        Feature.STREAMING_ROTATED: dict(retention="streaming", retention_budget=10,
                                        retention_options=dict(num_sinks=2,
                                                               cache_positions=True)),
        Feature.H2O: dict(retention="h2o", retention_budget=10,
                          retention_options=dict(num_recent=3)),
        Feature.SNAPKV: dict(retention="snapkv", retention_budget=10,
                             retention_options=dict(window=3, kernel=3)),
        Feature.QUEST: dict(retention="quest", retention_budget=2 * P),
        Feature.ECHO: dict(retention="quest", retention_budget=2 * P,
                           retention_options=dict(echo_prefetch=0), num_host_pages=16),
        Feature.TOVA: dict(retention="tova", retention_budget=10),
        Feature.KNORM: dict(retention="knorm", retention_budget=10),
        Feature.EXPECTED_ATTENTION: dict(retention="expected_attention", retention_budget=10,
                                         retention_options=dict(num_sinks=2, num_future=16)),
        Feature.OBSERVED_ATTENTION: dict(retention="observed_attention", retention_budget=10),
        # Probes of 4 prompt tokens (the tiny model has no tokenizer: the ids are given).
        Feature.KVZIP: dict(retention="kvzip", retention_budget=10, retention_options=dict(
            chunk=4, num_sinks=2, tail=2, instruction_ids=(5, 6, 7), continue_ids=(8, 9),
            suffix_ids=(10,))),
        Feature.HOST_TIER: dict(tiers=TierConfig(host_bytes=64 * page_bytes)),
        Feature.SWAP: dict(preemption_mode=PreemptionMode.SWAP),
        Feature.AUTO_PREEMPTION: dict(preemption_mode=PreemptionMode.AUTO),
        Feature.PREFIX_CACHE: dict(enable_prefix_cache=True),
        Feature.CONTIGUOUS: dict(kv_layout="contiguous", num_pages=None,
                                 kv_budget_bytes=2 * 32 * page_bytes // P),
        # Sparse self-drafts: draft steps over a window smaller than the prompts, then verify.
        Feature.SPECULATIVE: dict(spec=dict(method="sparse_self", num_draft_tokens=2,
                                            options=dict(num_sinks=P, window=P))),
        # CacheBlend: chunk copies, re-rotation and the selective recompute together.
        Feature.KV_ARENA: dict(kv_arena=True),
        # The joint controller; the requests' SLOs (run_pair) allow exact KV only, so its
        # admission order, offloads and victims must keep the exact tokens.
        Feature.CONTROLLER: dict(controller="joint", controller_options=dict(
            retention_kl={"4": 0.3, "8": 0.1}, demote_kl=0.001)),
        Feature.BATCH_INVARIANT: dict(batch_invariant=True),
        Feature.HOST_ROWS: dict(host_split="random", num_host_pages=16),
        Feature.FUSED_KV_WRITE: dict(fused_kv_write=True),
        # Rows written exact: with no controller demoting them, the tokens stay exact.
        Feature.MIXED_PRECISION: dict(kv_codec="mixed", kv_codec_options=dict(group=4)),
        # With snapkv unless the pair names another retention policy (set below).
        Feature.PYRAMID: dict(retention_schedule="pyramid"),
        Feature.ADAKV: dict(retention_schedule="adakv"),
        Feature.PYRAMID_ADAKV: dict(retention_schedule="pyramid_adakv"),
        Feature.PER_HEAD: dict(retention_schedule="per_head"),
        Feature.GLOBAL: dict(retention_schedule="global"),
        Feature.CONTEXT_REUSE: dict(context_reuse="cacheblend",
                                    context_reuse_options=dict(ratio=0.5),
                                    enable_prefix_cache=True),
        # Pages move through the prefix caches of both engines.
        Feature.DISAGGREGATION: dict(enable_prefix_cache=True),
    }
    config = dict(BASE)
    for feature in features:
        config.update(settings.get(feature, {}))
    head_major = {Feature.ADAKV, Feature.PYRAMID_ADAKV, Feature.PER_HEAD, Feature.GLOBAL}
    if set(features) & {Feature.PYRAMID, *head_major}:
        if "retention" not in config:
            config.update(settings[Feature.SNAPKV])
        # A table per layer (and kv head), each page one layer (of one head): the same bytes
        # as BASE's pages of two layers and two heads.
        if config["num_pages"] is not None:
            config["num_pages"] = (4 if head_major & set(features) else 2) * BASE["num_pages"]
    return config


def run_pair(model, features, oracle, mesh=None) -> dict:
    """Serves the prompts with `features` on; returns the outcome the tests check."""
    from kvjax import EngineConfig, SamplingParams, Segment
    from kvjax.engine.engine import Engine
    from kvjax.engine.snapshot import restore_snapshot, save_snapshot
    from kvjax.router.disagg import DisaggregatedEngine
    from kvjax.scheduler.controller import SLO
    from kvjax.scheduler.replay import replay

    features = set(features)
    config = EngineConfig(**config_for(features))
    engine = Engine(model, config, mesh=mesh)
    # Disaggregated: prompts prefill on an engine of their own; `engine` decodes.
    server = (DisaggregatedEngine(Engine(model, config, mesh=mesh), engine)
              if Feature.DISAGGREGATION in features else engine)
    recorder = engine.record_decisions() if Feature.RECORD_DECISIONS in features else None
    prompts = _prompts()
    samplings = [SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True) for _ in prompts]
    if Feature.N_SAMPLES in features:
        samplings[0] = SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True, n=2)
    ids = [f"r{i}" for i in range(len(prompts))]
    for i, (request_id, prompt, sampling) in enumerate(zip(ids, prompts, samplings,
                                                            strict=True)):
        if Feature.CONTEXT_REUSE in features:  # tokens 2..7 are a chunk (shared by two)
            prompt = [Segment(prompt[:2]), Segment(prompt[2:8], reuse=True),
                      Segment(prompt[8:])]
        # The last request outranks the others, so the controller makes room for it.
        slo = dict(slo=SLO(ttft_s=60.0, tpot_s=60.0), priority=int(i == len(prompts) - 1)) \
            if Feature.CONTROLLER in features else {}
        if server is not engine:  # the prefill engine takes no SLO
            slo.pop("slo", None)
        server.add_request(request_id, prompt, sampling, **slo)
    finished = {}
    steps = 0
    while server.has_unfinished():
        finished.update((o.request_id, o) for o in server.step())
        steps += 1
        if steps == 2 and Feature.PAUSE in features:  # all live requests sit out two steps
            live = engine.scheduler.request_ids()
            for request_id in live:
                engine.pause(request_id, to_host=Feature.SWAP in features)
            for _ in range(2):
                finished.update((o.request_id, o) for o in server.step())
            for request_id in live:
                engine.resume(request_id)
        if steps == 3 and Feature.SNAPSHOT in features:
            with tempfile.TemporaryDirectory() as tmp:
                path = save_snapshot(engine, os.path.join(tmp, "snap"))
                live = engine.scheduler.request_ids()
                for request_id in live:
                    engine.abort(request_id)
                assert engine.allocator.num_used_pages() == 0
                restore_snapshot(engine, path)
    if recorder is not None:
        replay(recorder.stop())  # raises ReplayMismatch at a decision decided otherwise
    tokens = [[c.token_ids for c in finished[r].outputs] for r in ids]
    used_pages = engine.allocator.num_used_pages() + (
        0 if server is engine else server.prefill.allocator.num_used_pages())
    want = [[oracle(tuple(p))] * s.n for p, s in zip(prompts, samplings, strict=True)] \
        if not features & APPROXIMATE else None
    regret = [mean_regret(model, p, t) for p, samples in zip(prompts, tokens, strict=True)
              for t in samples if len(t) == NUM_NEW]
    return dict(tokens=tokens, want=want, used_pages=used_pages,
                preemptions=engine.stats.get("preemptions", 0), steps=steps,
                chunk_hits=engine.stats["chunk_hits"] + (
                    0 if server is engine else server.prefill.stats["chunk_hits"]),
                mean_regret=float(sum(regret) / max(len(regret), 1)))


def mean_regret(model, prompt, tokens) -> float:
    """Mean over `tokens` of max log-prob - the chosen token's, under the dense forward pass
    teacher-forced on prompt + tokens (see the module doc)."""
    import numpy as np

    from kvjax.models import llama

    sequence = np.asarray(list(prompt) + list(tokens), np.int32)
    logits = np.asarray(llama.forward_dense(model.params, model.config, sequence), np.float64)
    rows = logits[len(prompt) - 1:-1]  # [num_new, V]: row i predicts tokens[i]
    return float(np.mean(rows.max(-1) - rows[np.arange(len(tokens)), tokens]))


def check_outcome(features, outcome, max_mean_regret=None) -> None:
    """`max_mean_regret`: the bounds of another model than the tiny one (default
    `MAX_MEAN_REGRET`)."""
    assert outcome["used_pages"] == 0, "pages leaked"
    for samples in outcome["tokens"]:
        assert all(len(t) == NUM_NEW for t in samples)
    if outcome["want"] is not None:
        assert outcome["tokens"] == outcome["want"]
    if Feature.CONTEXT_REUSE in features:
        assert outcome["chunk_hits"] > 0, "no chunk was reused"
    retained = set(features) & RETAINED
    bound = (max_mean_regret or MAX_MEAN_REGRET)["retention" if retained else "codec"]
    assert outcome["mean_regret"] <= bound, (outcome["mean_regret"], bound)


def _case_id(pair) -> str:
    return "+".join(f.value for f in pair)


# Combinations of more than two features: the example and ones crossing every group.
COMBINATIONS = [
    (Feature.INT8, Feature.SNAPKV, Feature.HOST_TIER, Feature.PREFIX_CACHE, Feature.SWAP),
    (Feature.KIVI, Feature.QUEST, Feature.HOST_TIER, Feature.SWAP, Feature.PREFIX_CACHE),
    (Feature.INT8, Feature.H2O, Feature.SWAP, Feature.SNAPSHOT, Feature.N_SAMPLES),
    (Feature.KIVI_RESIDUAL, Feature.N_SAMPLES, Feature.HOST_TIER, Feature.SWAP),
    (Feature.STREAMING, Feature.PREFIX_CACHE, Feature.AUTO_PREEMPTION, Feature.N_SAMPLES),
    (Feature.QUEST, Feature.INT8, Feature.SNAPSHOT, Feature.HOST_TIER, Feature.AUTO_PREEMPTION),
]
MESH_COMBINATIONS = [(Feature.INT8, Feature.SNAPKV, Feature.HOST_TIER, Feature.SWAP,
                      Feature.MESH)]
_WORKING = [p for p in pairs() if refusal(*p) is None]
_REFUSED = [p for p in pairs() if refusal(*p) is not None]
_LOCAL = [p for p in _WORKING if Feature.MESH not in p]
_ON_MESH = [p for p in _WORKING if Feature.MESH in p]


@pytest.fixture(scope="module")
def model():
    from kvjax.testing import tiny_model

    return tiny_model()


def greedy_oracle(model):
    """prompt (a tuple) -> the cache-free greedy reference's NUM_NEW tokens, each computed once."""
    from kvjax.testing import greedy_reference

    cache = {}

    def tokens(prompt: tuple[int, ...]) -> list[int]:
        if prompt not in cache:
            cache[prompt] = greedy_reference(model, list(prompt), NUM_NEW)
        return cache[prompt]

    return tokens


@pytest.fixture(scope="module")
def oracle(model):
    return greedy_oracle(model)


def _marks(pair):
    return () if frozenset(pair) in FAST else (pytest.mark.slow,)


@pytest.mark.parametrize("pair", [pytest.param(p, id=_case_id(p), marks=_marks(p))
                                  for p in _LOCAL])
def test_working_pair_serves_every_request(model, oracle, pair):
    check_outcome(pair, run_pair(model, pair, oracle))


@pytest.mark.parametrize("combination", [
    pytest.param(c, id=_case_id(c), marks=() if i == 0 else (pytest.mark.slow,))
    for i, c in enumerate(COMBINATIONS)])
def test_combination_serves_every_request(model, oracle, combination):
    assert not [p for p in itertools.combinations(combination, 2) if refusal(*p)]
    check_outcome(set(combination), run_pair(model, combination, oracle))


@pytest.mark.parametrize("pair", [pytest.param(p, id=_case_id(p)) for p in _REFUSED])
def test_refused_pair_raises_the_tables_reason(model, pair, tmp_path):
    from kvjax import EngineConfig, SamplingParams
    from kvjax.engine.engine import Engine
    from kvjax.engine.snapshot import save_snapshot
    from kvjax.parallel.sharding import make_mesh
    from kvjax.router.disagg import DisaggregatedEngine

    with pytest.raises(ValueError, match=re.escape(refusal(*pair))):
        if Feature.MESH in pair:  # a one-device mesh takes the sharded engine's checks
            Engine(model, EngineConfig(**config_for(pair)), mesh=make_mesh(tp=1))
        elif Feature.RECORD_DECISIONS in pair:
            engine = Engine(model, EngineConfig(**config_for(pair)))
            engine.record_decisions()
            if Feature.SNAPSHOT in pair:
                save_snapshot(engine, tmp_path / "snap")
            if Feature.DISAGGREGATION in pair:
                server = DisaggregatedEngine(Engine(model, engine.config), engine)
                server.add_request("r", [1, 2, 3])
        elif Feature.SNAPSHOT in pair:
            engine = Engine(model, EngineConfig(**config_for(pair)))
            if Feature.DISAGGREGATION in pair:
                DisaggregatedEngine(Engine(model, engine.config), engine)
            save_snapshot(engine, tmp_path / "snap")
        elif Feature.DISAGGREGATION in pair:
            config = EngineConfig(**config_for(pair))
            server = DisaggregatedEngine(Engine(model, config), Engine(model, config))
            server.add_request("r", [1, 2, 3], SamplingParams(n=2))
        else:
            EngineConfig(**config_for(pair))


def test_pausing_to_host_memory_swaps_every_budget_table(model):
    """`Engine.pause(to_host=True)` swaps the request's pages out: under the per-layer
    schedule, once the press kept each table group's own budget, every group's pages and
    record leave and come back, and the request continues with an unpaused run's tokens."""
    from kvjax import EngineConfig, SamplingParams
    from kvjax.engine.engine import Engine

    def serve(pause: bool) -> tuple[list[int], Engine]:
        engine = Engine(model, EngineConfig(**config_for({Feature.PYRAMID})))
        engine.add_request("r", _prompts()[1], SamplingParams(max_new_tokens=NUM_NEW,
                                                               ignore_eos=True))
        outputs = engine.step()
        if pause:
            assert len(set(engine.retention.group_shifts("r#0"))) > 1, \
                "the table groups must hold their own lengths when paused"
            engine.pause("r", to_host=True)
            outputs += engine.step()
            engine.resume("r")
        while engine.has_unfinished():
            outputs += engine.step()
        return outputs[-1].outputs[0].token_ids, engine

    paused, engine = serve(pause=True)
    assert engine.stats["swaps_out"] == engine.stats["swaps_in"] == 1
    assert paused == serve(pause=False)[0]
    assert engine.allocator.num_used_pages() == 0


def test_the_table_refuses_only_pairs_that_can_meet():
    assert set(REFUSED) <= {frozenset(p) for p in pairs()}


def _run_mesh_pairs() -> dict:
    from kvjax.parallel import sharding
    from kvjax.testing import tiny_model

    model = tiny_model()
    mesh = sharding.replica_meshes(sharding.make_mesh(2))[0]
    oracle = greedy_oracle(model)
    results = {}
    for pair in _ON_MESH + MESH_COMBINATIONS:
        try:
            outcome = run_pair(model, pair, oracle, mesh=mesh)
            if outcome["want"] is None:  # Approximate KV: the same features on one device.
                outcome["want"] = run_pair(model, set(pair) - {Feature.MESH}, oracle)["tokens"]
            results[_case_id(pair)] = outcome
        except Exception as e:  # noqa: BLE001 - reported to the test in the parent
            results[_case_id(pair)] = dict(error=f"{type(e).__name__}: {e}")
    return results


@pytest.fixture(scope="module")
def mesh_outcomes():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                   [ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "mesh"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("pair", [pytest.param(p, id=_case_id(p))
                                  for p in _ON_MESH + MESH_COMBINATIONS])
def test_working_pair_serves_every_request_on_a_tp2_mesh(mesh_outcomes, pair):
    outcome = mesh_outcomes[_case_id(pair)]
    assert "error" not in outcome, outcome.get("error")
    check_outcome(pair, outcome)


if __name__ == "__main__":
    # XLA_FLAGS came with the environment (see mesh_outcomes).
    print(json.dumps(_run_mesh_pairs()))
