"""A predicted decode roofline for GPUs and TPUs, from deviceless compiles (no hardware).

Every figure here is PREDICTED: no step ran. For each (target, model, KV codec, batch B,
context S) the engine's decode step (`kvjax.engine.step.model_step`, bfloat16, one token per
row, every row holding S tokens) is compiled for the target without the device
(`kvjax.bench.deviceless`), and its bytes and FLOPs give the roofline floor
(`kvjax.bench.roofline.step_floor`) at the target's published HBM bandwidth and peak bf16
FLOP/s:

  predicted step time = max(bytes / HBM bandwidth, FLOPs / peak FLOP/s)

Where the bytes and FLOPs come from, and what XLA's `compiled.cost_analysis()` does not see:

- TPU (libtpu): the analysis counts XLA's own ops, but a Pallas kernel is one opaque Mosaic
  custom call whose HBM reads it does not count (an 8B paged decode kernel reading 67 MB of
  pages reports about 1.4 MB). It also counts the body of the step's `lax.scan` over layers
  once, whatever the trip count (a 2-layer step reports the FLOPs of a 1-layer one). So each
  point compiles the one-layer step twice: at the model's vocabulary (everything once: the
  step's bytes with one layer) and at a 128-token vocabulary (the output head and sampling
  then cost next to nothing: one layer's bytes, embedding rows and norm included); the
  kernel's K/V reads come from its own arithmetic (live tokens x bytes per token per layer,
  codes and scales for a quantized codec):

    bytes = xla(1 layer) + (L - 1) * xla(1 layer, vocab 128) + L * kernel K/V bytes

  A point whose KV state the dispatch refuses on the target compiles the step with the
  blockwise jnp attention (`attention_impl=reference`), whose page reads XLA does count; no
  kernel bytes are added there.
- GPU (the CUDA plugin's compile-only client): `cost_analysis()` returns nothing in this
  jax. The step still compiles (proving the shapes build), but its bytes and FLOPs are the
  independent arithmetic of `roofline.decode_step_cost` (every weight once, every live
  token's K/V once per layer), so the GPU rows are a pure bandwidth bound.

Both models compile with one layer and are scaled to their depth (the 8B-like model to 32
layers, SmolLM2 to its 30) by the formula above: two compiles per point whatever the depth.
The page pool of a compile holds the live tokens up to `MAX_POOL_BYTES_PER_LAYER` (compiling
for more than a chip's HBM fails); `fits_hbm` says whether weights and K/V of all layers fit
one chip.

The peer: JAX's own TPU kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`)
and kvjax's `paged_decode` compiled alone on the same shapes (exact bf16 pages, one decode
token per row), with what XLA reports around each.

Published rates (dense, no sparsity; bf16 peak):

  target  HBM B/s    bf16 FLOP/s  HBM bytes  source
  h100    3.35e12    989e12       80 GiB     NVIDIA H100 Tensor Core GPU datasheet (SXM5)
  a100    2.039e12   312e12       80 GiB     NVIDIA A100 datasheet (SXM4 80GB)
  v5e     8.19e11    197e12       16 GiB     cloud.google.com/tpu/docs/v5e (per chip)
  v6e     1.64e12    918e12       32 GiB     cloud.google.com/tpu/docs/v6e (per chip)

(The GPU rows are `pallas_kernels.targets.GPU_SPECS`.)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from kvjax.bench import deviceless as dl
from kvjax.bench import roofline
from kvjax.engine import step as step_lib
from kvjax.kv import codecs
from kvjax.kv.quantized import init_quantized_kv
from kvjax.kv.state import init_paged_kv
from kvjax.models import llama
from pallas_kernels import dispatch
from pallas_kernels import targets as kernel_targets


@dataclasses.dataclass(frozen=True)
class PublishedRates:
    """A target's published per-chip figures (module docstring's table).

    Attributes:
      hbm_bytes_per_s: HBM bandwidth.
      peak_bf16_flops: dense bfloat16 matmul peak.
      hbm_bytes: HBM capacity.
    """

    hbm_bytes_per_s: float
    peak_bf16_flops: float
    hbm_bytes: int

    def machine(self) -> roofline.MachineRates:
        return roofline.MachineRates(self.hbm_bytes_per_s, self.peak_bf16_flops, 0, 0)


def _gpu(name: str) -> PublishedRates:
    spec = kernel_targets.GPU_SPECS[name]
    return PublishedRates(spec.hbm_bytes_per_s, spec.peak_flops["bfloat16"], 80 << 30)


PUBLISHED: dict[str, PublishedRates] = {
    "h100": _gpu("H100"),
    "a100": _gpu("A100"),
    "v5e": PublishedRates(8.19e11, 197e12, 16 << 30),
    "v6e": PublishedRates(1.64e12, 918e12, 32 << 30),
}

FULL_LAYERS = {"smollm2": 30, "8b": 32}  # the real models' depths the step is scaled to
BATCHES = (1, 32, 256)
CONTEXTS = (2048, 32768)
KV_CODECS = ("exact", "int8", "int4")
DTYPE = jnp.bfloat16
MAX_POOL_BYTES_PER_LAYER = 1 << 30  # K and V of one layer in a compile's pool
SMALL_VOCAB = 128  # the vocabulary of the compile that measures one layer (module docstring)


@dataclasses.dataclass(frozen=True)
class Point:
    """One predicted decode step: B rows, each holding `context` tokens."""

    target: str
    shape: str
    kv: str
    batch: int
    context: int

    @property
    def id(self) -> str:
        return f"{self.target}-{self.shape}-{self.kv}-b{self.batch}-s{self.context}"


def all_points(target_names=("h100", "v5e"), shapes=tuple(FULL_LAYERS), kvs=KV_CODECS,
               batches=BATCHES, contexts=CONTEXTS) -> list[Point]:
    """The product, in a stable order."""
    return [Point(t, s, k, b, c) for t in target_names for s in shapes for k in kvs
            for b in batches for c in contexts]


def kv_bytes_per_token_layer(shape: str, kv: str) -> int:
    """Bytes one cached token takes in one layer, K and V (codes and scales if quantized)."""
    m = dl.SHAPES[shape]
    if kv == "exact":
        return 2 * m.num_kv_heads * m.head_dim * jnp.dtype(DTYPE).itemsize
    spec = codecs.get_codec(kv).storage_spec(1, m.num_kv_heads, m.head_dim)
    return 2 * sum(math.prod(s.shape[1:]) * jnp.dtype(s.dtype).itemsize
                   for s in spec.values())


def must_read_bytes_and_flops(point: Point) -> tuple[float, float]:
    """Independent arithmetic (`roofline.decode_step_cost`) for the full-depth model: every
    weight once and every live token's K/V once per layer; 2 FLOPs per weight per row plus
    attention."""
    config = dataclasses.replace(dl.SHAPES[point.shape],
                                 num_layers=FULL_LAYERS[point.shape]).config()
    params = jax.eval_shape(functools.partial(llama.init_params, config, dtype=DTYPE),
                            jax.random.key(0))
    sized = jax.tree.map(lambda x: _Sized(x.size * jnp.dtype(x.dtype).itemsize,
                                          jnp.dtype(x.dtype)), params)
    per_token = kv_bytes_per_token_layer(point.shape, point.kv) * config.num_layers
    return roofline.decode_step_cost(config, sized, point.batch,
                                     point.batch * point.context, per_token)


@dataclasses.dataclass(frozen=True)
class _Sized:
    """A leaf that knows its bytes (what `decode_step_cost` sums), from a shape only."""

    nbytes: int
    dtype: jnp.dtype


def _config(shape: str, vocab_size: int | None = None):
    """The model's config at one layer (and `vocab_size` if given)."""
    m = dataclasses.replace(dl.SHAPES[shape], num_layers=1)
    if vocab_size is not None:
        m = dataclasses.replace(m, vocab_size=vocab_size)
    return m.config()


def _kv_state(point: Point, num_pages: int):
    config = _config(point.shape)
    if point.kv == "exact":
        return jax.eval_shape(functools.partial(init_paged_kv, config, num_pages, dl.PAGE_SIZE,
                                                DTYPE))
    return jax.eval_shape(functools.partial(init_quantized_kv, config, num_pages,
                                            dl.PAGE_SIZE, point.kv))


def pool_pages(point: Point) -> int:
    """Pages of the compiled pool: the live ones, capped at MAX_POOL_BYTES_PER_LAYER."""
    live = point.batch * point.context // dl.PAGE_SIZE
    cap = MAX_POOL_BYTES_PER_LAYER // (
        kv_bytes_per_token_layer(point.shape, point.kv) * dl.PAGE_SIZE)
    return max(1, min(live, cap))


def attention_impl(point: Point) -> tuple[step_lib.AttentionImpl, str | None]:
    """PALLAS where the dispatch runs a kernel on the target, else REFERENCE with the
    dispatch's reason."""
    mesh = dl.target_mesh(point.target)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        reason = dispatch.unsupported_reason(_kv_state(point, 1))
    return (step_lib.AttentionImpl.PALLAS if reason is None
            else step_lib.AttentionImpl.REFERENCE), reason


def compile_step(point: Point, impl: step_lib.AttentionImpl, vocab_size: int | None = None
                 ) -> dict:
    """Compiles the one-layer decode step of `point` (at `vocab_size` if given); XLA's
    analyses."""
    config = _config(point.shape, vocab_size)
    mesh = dl.target_mesh(point.target)
    sharding = NamedSharding(mesh, PartitionSpec())
    shape = step_lib.StepShape(point.batch, 0, 1, point.context // dl.PAGE_SIZE)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        params = jax.eval_shape(functools.partial(llama.init_params, config, dtype=DTYPE),
                                jax.random.key(0))
        kv = _kv_state(point, pool_pages(point))
        inp = step_lib.StepInput(**{n: jax.ShapeDtypeStruct(x.shape, x.dtype)
                                    for n, x in step_lib.empty_step_input(shape).items()})
        fn = jax.jit(functools.partial(step_lib.model_step, config=config, shape=shape,
                                       attention_impl=impl), donate_argnames=("kv",))
        lowered = fn.lower(*dl._abstract([params, kv, inp], sharding))
    compiled = lowered.compile()
    record = dl._analyses(compiled)
    if dl.TARGETS[point.target].platform == "tpu":
        record["mosaic_calls"] = compiled.as_text().count("tpu_custom_call")
    return record


def predict(point: Point) -> dict:
    """The predicted decode step of one point (module docstring): a JSON-ready record."""
    rates = PUBLISHED[point.target]
    impl, reason = attention_impl(point)
    layers = FULL_LAYERS[point.shape]
    kv_token_bytes = kv_bytes_per_token_layer(point.shape, point.kv)
    live_tokens = point.batch * point.context
    must_bytes, must_flops = must_read_bytes_and_flops(point)
    record = dict(dataclasses.asdict(point), id=point.id, attention=impl.value,
                  refusal=reason, layers=layers, pool_pages=pool_pages(point),
                  kv_bytes=float(live_tokens * kv_token_bytes * layers),
                  must_read_bytes=must_bytes, must_flops=must_flops)
    record["fits_hbm"] = bool(must_bytes <= rates.hbm_bytes)
    try:
        one = compile_step(point, impl)
        small = compile_step(point, impl, SMALL_VOCAB) if "cost" in one else {}
    except Exception as e:  # The compiler's message is the finding.
        return dict(record, status="failed", reason=dl._first_line(e))
    record.update(status="compiled", memory=one.get("memory"),
                  mosaic_calls=one.get("mosaic_calls"))
    if "cost" in one and "cost" in small:
        # The kernel is a custom call XLA does not count: add its K/V reads and attention FLOPs.
        kernel = impl is step_lib.AttentionImpl.PALLAS
        m = dl.SHAPES[point.shape]
        kernel_bytes = live_tokens * kv_token_bytes if kernel else 0
        kernel_flops = 4.0 * m.num_heads * m.head_dim * live_tokens if kernel else 0.0
        layer_bytes, layer_flops = small["cost"]["bytes accessed"], small["cost"]["flops"]
        record.update(
            source="xla_cost+kernel_arith" if kernel else "xla_cost",
            xla_step_bytes=one["cost"]["bytes accessed"], xla_layer_bytes=layer_bytes,
            kernel_layer_bytes=float(kernel_bytes),
            bytes=one["cost"]["bytes accessed"] + (layers - 1) * layer_bytes
            + layers * kernel_bytes,
            flops=one["cost"]["flops"] + (layers - 1) * layer_flops + layers * kernel_flops)
    else:
        record.update(source="arithmetic (no XLA cost analysis on this target)",
                      bytes=must_bytes, flops=must_flops)
    floor = roofline.step_floor(record["bytes"], record["flops"], rates.machine())
    record.update(predicted_step_s=floor.floor_s, bound=floor.bound,
                  predicted_tokens_per_s=point.batch / floor.floor_s,
                  hbm_fraction=floor.memory_s / floor.floor_s,
                  useful_fraction=must_bytes / record["bytes"])
    return record


PEERS = ("kvjax_paged_decode", "jax_ragged_paged_attention")
RPA_KV_PAGES_PER_BLOCK = 8  # 128 tokens of 16-token pages per step of JAX's kernel
RPA_QUERIES_PER_BLOCK = 8


def _peer_fn_and_args(peer: str, point: Point) -> tuple:
    """The kernel call and abstract arguments: B decode rows over exact bf16 pages."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    from pallas_kernels.paged_decode.kernel import paged_decode_attention

    m = dl.SHAPES[point.shape]
    b, w = point.batch, point.context // dl.PAGE_SIZE
    pages = pool_pages(point)
    q = jax.ShapeDtypeStruct((b, m.num_heads, m.head_dim), DTYPE)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    if peer == "kvjax_paged_decode":
        kv = jax.ShapeDtypeStruct((pages, dl.PAGE_SIZE, m.num_kv_heads, m.head_dim), DTYPE)
        return jax.jit(paged_decode_attention), [q, kv, kv, i32(b, w), i32(b)]
    # K and V heads interleaved in one pool: [pages, P, 2K, D].
    kv = jax.ShapeDtypeStruct((pages, dl.PAGE_SIZE, 2 * m.num_kv_heads, m.head_dim), DTYPE)
    # Block sizes given: its tuned table reads the TPU generation from jax.devices() (this
    # machine's CPU), not from the target, and refuses ("TPU version must be 4 or higher").
    fn = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=m.head_dim ** -0.5,
                                   num_kv_pages_per_block=RPA_KV_PAGES_PER_BLOCK,
                                   num_queries_per_block=RPA_QUERIES_PER_BLOCK))
    return fn, [q, kv, i32(b), i32(b, w), i32(b + 1), i32(1)]


def predict_peer(peer: str, point: Point) -> dict:
    """One attention kernel alone on a TPU target: compiled or not, what XLA reports, and
    the predicted kernel time from its K/V reads (arithmetic: XLA does not count them)."""
    rates = PUBLISHED[point.target]
    kv_bytes = float(point.batch * point.context * kv_bytes_per_token_layer(point.shape,
                                                                            "exact"))
    record = dict(dataclasses.asdict(point), peer=peer, id=f"{peer}-{point.id}",
                  kv_layer_bytes=kv_bytes)
    mesh = dl.target_mesh(point.target)
    sharding = NamedSharding(mesh, PartitionSpec())
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            fn, args = _peer_fn_and_args(peer, point)
            lowered = fn.lower(*dl._abstract(args, sharding))
        compiled = lowered.compile()
    except Exception as e:
        return dict(record, status="failed", reason=dl._first_line(e))
    cost = dl._analyses(compiled).get("cost", {})
    xla_bytes = cost.get("bytes accessed", 0.0)
    # XLA's bytes are the ops around the custom call (and the call's own operands/results);
    # a relayout of the pool outside the kernel shows up here.
    layer_bytes = max(xla_bytes, 0.0) + kv_bytes
    return dict(record, status="compiled", xla_bytes=xla_bytes,
                mosaic_calls=compiled.as_text().count("tpu_custom_call"),
                predicted_layer_s=layer_bytes / rates.hbm_bytes_per_s)


def _fmt_s(x) -> str:
    return "" if x is None else f"{x * 1e3:.3g} ms"


def format_table(records: list[dict]) -> str:
    """Markdown: one line per point, every figure predicted."""
    lines = ["| target | model | KV | B | S | attention | predicted step | predicted tok/s | "
             "bound | HBM frac. | useful frac. | fits 1 chip | source |",
             "|---" * 13 + "|"]
    for r in records:
        if r["status"] != "compiled":
            lines.append(f"| {r['target']} | {r['shape']} | {r['kv']} | {r['batch']} | "
                         f"{r['context']} | {r['attention']} | FAILED: "
                         f"{r['reason'][:120].replace('|', '/')} |||||||")
            continue
        lines.append(
            f"| {r['target']} | {r['shape']} | {r['kv']} | {r['batch']} | {r['context']} | "
            f"{r['attention']} | {_fmt_s(r['predicted_step_s'])} (pred.) | "
            f"{r['predicted_tokens_per_s']:.4g} (pred.) | {r['bound']} | "
            f"{r['hbm_fraction']:.2f} | {r['useful_fraction']:.2f} | "
            f"{'yes' if r['fits_hbm'] else 'no'} | {r['source']} |")
    return "\n".join(lines)


def format_peer_table(records: list[dict]) -> str:
    """Markdown: one line per kernel and shape, per layer, every time predicted."""
    lines = ["| kernel | target | model | B | S | status | XLA bytes | K/V bytes (arith.) | "
             "predicted per layer |", "|---" * 9 + "|"]
    for r in records:
        status = r["status"] if r["status"] == "compiled" else \
            f"FAILED: {r['reason'][:100].replace('|', '/')}"
        lines.append(f"| {r['peer']} | {r['target']} | {r['shape']} | {r['batch']} | "
                     f"{r['context']} | {status} | {r.get('xla_bytes', ''):.4g} | "
                     f"{r['kv_layer_bytes']:.4g} | {_fmt_s(r.get('predicted_layer_s'))} "
                     "(pred.) |" if r["status"] == "compiled" else
                     f"| {r['peer']} | {r['target']} | {r['shape']} | {r['batch']} | "
                     f"{r['context']} | {status} | | {r['kv_layer_bytes']:.4g} | |")
    return "\n".join(lines)


def _step_input(point: Point) -> dict:
    """Host inputs of a decode step where each of B rows writes its token S - 1 and reads S
    tokens from its own pages (row r holds pages r*W .. r*W + W - 1)."""
    import numpy as np

    w = point.context // dl.PAGE_SIZE
    shape = step_lib.StepShape(point.batch, 0, 1, w)
    host = step_lib.empty_step_input(shape)
    tables = np.arange(point.batch * w, dtype=np.int32).reshape(point.batch, w)
    last = point.context - 1
    host.update(block_tables=tables, kv_lens=np.full(point.batch, point.context, np.int32),
                q_lens=np.ones(point.batch, np.int32),
                positions=np.full(point.batch, last, np.int32),
                slot_mapping=(tables[:, last // dl.PAGE_SIZE] * dl.PAGE_SIZE
                              + last % dl.PAGE_SIZE).astype(np.int32))
    return host


def measure_decode_step(point: Point, *, repeats: int = 10) -> dict:
    """MEASURED on the default device (a GPU): the full-depth decode step of `point` with
    random weights, best of `repeats`, beside the arithmetic prediction for that GPU (every
    weight and live K/V byte once at its published bandwidth: the rows whose `source` is
    arithmetic)."""
    import time

    import numpy as np

    if jax.default_backend() != "gpu":
        raise ValueError(f"measure_decode_step({point.id}) needs a GPU; the default backend is "
                         f"{jax.default_backend()!r} (set JAX_PLATFORMS=cuda on a GPU machine)")
    gpu = kernel_targets.current_gpu()
    config = dataclasses.replace(dl.SHAPES[point.shape],
                                 num_layers=FULL_LAYERS[point.shape]).config()
    num_pages = point.batch * point.context // dl.PAGE_SIZE
    params = llama.init_params(config, jax.random.key(0), dtype=DTYPE)
    if point.kv == "exact":
        kv = init_paged_kv(config, num_pages, dl.PAGE_SIZE, DTYPE)
    else:
        kv = init_quantized_kv(config, num_pages, dl.PAGE_SIZE, point.kv)
    shape = step_lib.StepShape(point.batch, 0, 1, point.context // dl.PAGE_SIZE)
    inp = step_lib.StepInput(**{k: jnp.asarray(v) for k, v in _step_input(point).items()})
    fn = jax.jit(functools.partial(step_lib.model_step, config=config, shape=shape,
                                   attention_impl=step_lib.AttentionImpl.PALLAS),
                 donate_argnames=("kv",))
    out, kv = fn(params, kv, inp)
    jax.block_until_ready(out.tokens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out, kv = fn(params, kv, inp)
        jax.block_until_ready(out.tokens)
        times.append(time.perf_counter() - start)
    must_bytes, must_flops = must_read_bytes_and_flops(point)
    floor = roofline.step_floor(must_bytes, must_flops, roofline.MachineRates(
        gpu.hbm_bytes_per_s, gpu.peak_flops["bfloat16"], 0, 0))
    measured = float(np.min(times))
    return dict(dataclasses.asdict(point), id=point.id, gpu=gpu.name,
                device_kind=jax.devices()[0].device_kind, must_read_bytes=must_bytes,
                predicted_step_s=floor.floor_s, measured_step_s=measured,
                measured_over_predicted=measured / floor.floor_s,
                measured_hbm_fraction=must_bytes / measured / gpu.hbm_bytes_per_s)


def format_measured(records: list[dict]) -> str:
    """Markdown: measured beside predicted, one line per point."""
    lines = ["| GPU | model | KV | B | S | predicted step | measured step | measured / "
             "predicted | measured HBM frac. |", "|---" * 9 + "|"]
    for r in records:
        lines.append(f"| {r['gpu']} | {r['shape']} | {r['kv']} | {r['batch']} | {r['context']} "
                     f"| {_fmt_s(r['predicted_step_s'])} (pred.) | "
                     f"{_fmt_s(r['measured_step_s'])} (measured) | "
                     f"{r['measured_over_predicted']:.2f} | {r['measured_hbm_fraction']:.2f} |")
    return "\n".join(lines)
