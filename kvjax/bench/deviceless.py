"""Deviceless compiles: every Pallas kernel and the engine step, compiled for GPUs and TPUs here.

XLA compiles for a target it does not have when given that target's topology: for CUDA, a
`GpuTargetConfigProto` (the GPU's facts) runs the real Triton -> PTX -> ptxas pipeline; for TPU,
libtpu's Mosaic compiler runs on the topology `get_topology_desc("v5e:1x1")` describes. Plain
lowering (`jax.export`) passes where these compiles fail: only a compile finds shared memory
that does not fit, Mosaic layouts it cannot infer, or instructions the GPU lacks.

Needs the `deviceless` extra (`jax[tpu,cuda12-local]` of the installed jax and a `ptxas`), in
its own environment (`make test-deviceless`): with the CUDA plugin installed `import jax` looks
for a GPU, so the main test environment does not carry it. `JAX_PLATFORMS=cpu` keeps the
default backend the CPU while the plugins provide the topologies.

A case is one (program, target, dtype, shape); `compile_case` returns its record: "compiled"
with the compiled program's facts (per GPU kernel: grid, threads, shared memory, registers
and spills from ptxas; per program: XLA's memory and cost analyses), "refused" with the
dispatch's one-sentence reason, or "failed" with the compiler's message.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.config import ModelConfig
from kvjax.engine import step as step_lib
from kvjax.kv import codecs
from kvjax.kv.state import init_paged_kv
from kvjax.models import llama
from pallas_kernels import dispatch, targets
from pallas_kernels.paged_decode.kernel import paged_decode_attention
from pallas_kernels.quantized_decode.kernel import quantized_decode_attention
from pallas_kernels.ragged_prefill.kernel import ragged_prefill_attention
from pallas_kernels.sparse_decode.kernel import sparse_decode_attention


@dataclasses.dataclass(frozen=True)
class Target:
    """A machine to compile for.

    Attributes:
      name: short name used in case ids ("h100").
      platform: "cuda" or "tpu".
      topology: the TPU topology name ("v5e:1x1"); unused for CUDA.
      gpu: the GPU's spec (targets.GPU_SPECS) for CUDA; None for TPU.
    """

    name: str
    platform: str
    topology: str = ""
    gpu: targets.GpuSpec | None = None


TARGETS: dict[str, Target] = {
    "h100": Target("h100", "cuda", gpu=targets.GPU_SPECS["H100"]),
    "a100": Target("a100", "cuda", gpu=targets.GPU_SPECS["A100"]),
    "v5e": Target("v5e", "tpu", topology="v5e:1x1"),
    "v6e": Target("v6e", "tpu", topology="v6e:1x1"),
}

# The device kind each GPU reports (targets.current_gpu matches on it).
_GPU_KINDS = {"H100": "NVIDIA H100 80GB HBM3", "A100": "NVIDIA A100-SXM4-80GB"}
# Published per-SM and clock facts beside targets.GpuSpec, only for XLA's cost model.
_GPU_CLOCK_GHZ = {"H100": 1.98, "A100": 1.41}
_GPU_L2_BYTES = {"H100": 50 << 20, "A100": 40 << 20}
_GPU_MEMORY_BYTES = {"H100": 80 << 30, "A100": 80 << 30}


def gpu_target_config(spec: targets.GpuSpec) -> str:
    """XLA's GpuTargetConfigProto (text format) for one GPU model: what ptxas targets."""
    major, minor = spec.compute_capability
    return f"""
gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {spec.shared_memory_per_block}
  shared_memory_per_core: {spec.shared_memory_per_block + 1024}
  threads_per_core_limit: 2048
  core_count: {spec.num_sms}
  fpus_per_core: {128 if major >= 9 else 64}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(spec.hbm_bytes_per_s)}
  l2_cache_size: {_GPU_L2_BYTES[spec.name]}
  clock_rate_ghz: {_GPU_CLOCK_GHZ[spec.name]}
  device_memory_size: {_GPU_MEMORY_BYTES[spec.name]}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 3 }}
device_description_str: "{_GPU_KINDS[spec.name]}"
"""


@functools.cache
def target_mesh(name: str) -> Mesh:
    """A one-device mesh of compile-only devices of the target."""
    from jax.experimental import topologies

    target = TARGETS[name]
    if target.platform == "cuda":
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=gpu_target_config(target.gpu), topology="1x1x1")
    else:
        # One chip on one host: libtpu's default host bounds are 2x2 chips.
        topo = topologies.get_topology_desc(target.topology, platform="tpu",
                                            chips_per_host_bounds=(1, 1, 1), num_slices=1)
    return Mesh(np.array(topo.devices[:1]), ("x",))


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Attention shapes of a model (ModelConfig's fields the kernels see)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int

    def config(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size,
                           num_layers=self.num_layers, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           name=self.name)


# SmolLM2-135M as it is, and a Llama-3-8B-like model with 4 of its 32 layers: the step scans
# over layers, so the layer count changes no compiled kernel, only whether the weights fit one
# chip (all 32 layers' 16 GB of bf16 weights exceed a v5e's 15.75 GiB HBM, and in float32 a
# v6e's 31.25 GiB, which the compile reports as RESOURCE_EXHAUSTED).
SHAPES: dict[str, ModelShape] = {
    "smollm2": ModelShape("smollm2", 9, 3, 64, 576, 1536, 30, 49152),
    "8b": ModelShape("8b", 32, 8, 128, 4096, 14336, 4, 128256),
}

# Kernel programs: the float-page kernels, the quantized kernel per codec, the sparse kernel.
QUANT_CODECS = ("int8", "fp8_e4m3", "int4", "int2")
KERNELS = ("paged_decode", "ragged_prefill", *(f"quantized_decode_{c}" for c in QUANT_CODECS),
           "sparse_decode")
# The float-page kernels with a traced sliding window (the engine's per-layer value, 0 for a
# global layer): compiled by their own test, not the full matrix.
WINDOWED = ("paged_decode_window", "ragged_prefill_window")
# The quantized kernel over asymmetric 8-bit codes with a scale and zero per 32 channels
# (`kv_codec_options={"group": 32}`): compiled by its own test, not the full matrix.
GROUPED = ("quantized_decode_int8_g32",)
# The engine's jitted step with attention_impl=pallas over exact paged KV.
STEPS = ("step_decode", "step_mixed")
PROGRAMS = KERNELS + STEPS
# The same steps with fused_kv_write (the Pallas fused KV write) and a qk_norm model (the
# keys' norm inside the kernel), and the unfused steps of that model to compare their bytes:
# compiled by their own test and the fused write's bytes, not the full matrix.
FUSED_STEPS = ("step_decode_fused", "step_mixed_fused")
QK_NORM_STEPS = ("step_decode_qk", "step_mixed_qk", *FUSED_STEPS)
DTYPES = ("bfloat16", "float32")

# Case sizes: a decode batch of 8 rows over 2048-token block tables (16-token pages), a
# prefill of 2 rows of 256-token chunks, 1024 pages in the pool.
PAGE_SIZE = 16
DECODE_ROWS = 8
PREFILL_ROWS = 2
CHUNK = 256
MAX_PAGES = 128
NUM_PAGES = 1024
SPARSE_READ = 32  # pages a sparse decode row reads


@dataclasses.dataclass(frozen=True)
class Case:
    """One (program, target, dtype, shape) of the matrix."""

    program: str
    target: str
    dtype: str
    shape: str

    @property
    def id(self) -> str:
        return f"{self.program}-{self.target}-{self.dtype}-{self.shape}"


def all_cases(target_names=tuple(TARGETS), programs=PROGRAMS, dtypes=DTYPES,
              shapes=tuple(SHAPES)) -> list[Case]:
    """The full product, in a stable order."""
    return [Case(p, t, d, s) for t in target_names for p in programs for d in dtypes
            for s in shapes]


def _abstract(tree, sharding: NamedSharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        tree)


# Codec name and options by program suffix: the kernel reads fp8 with per-token (dynamic)
# scales only; int8_g32 is int8 with a scale and zero per 32 channels.
_CODEC_OPTIONS = {"fp8_e4m3": ("fp8_e4m3", {"scaling": "dynamic"}),
                  "int8_g32": ("int8", {"group": 32})}


def _codec_args(suffix: str) -> tuple[str, dict]:
    return _CODEC_OPTIONS.get(suffix, (suffix, {}))


def _codec(suffix: str) -> codecs.KVCodec:
    name, options = _codec_args(suffix)
    return codecs.get_codec(name, **options)


def _kernel_fn_and_args(case: Case) -> tuple[Any, list]:
    """The jitted kernel call and abstract (shape-only) arguments for a kernel case."""
    m = SHAPES[case.shape]
    dtype = jnp.dtype(case.dtype)
    k, d = m.num_kv_heads, m.head_dim
    pages = jax.ShapeDtypeStruct((NUM_PAGES, PAGE_SIZE, k, d), dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    if case.program in WINDOWED:
        fn, args = _kernel_fn_and_args(
            dataclasses.replace(case, program=case.program.removesuffix("_window")))
        windowed = lambda *a: fn(*a[:-1], sliding_window=a[-1])  # noqa: E731
        return jax.jit(windowed), [*args, i32()]
    if case.program == "ragged_prefill":
        q = jax.ShapeDtypeStruct((PREFILL_ROWS, CHUNK, m.num_heads, d), dtype)
        return (jax.jit(ragged_prefill_attention),
                [q, pages, pages, i32(PREFILL_ROWS, MAX_PAGES), i32(PREFILL_ROWS),
                 i32(PREFILL_ROWS)])
    q = jax.ShapeDtypeStruct((DECODE_ROWS, m.num_heads, d), dtype)
    tables, lens = i32(DECODE_ROWS, MAX_PAGES), i32(DECODE_ROWS)
    if case.program == "paged_decode":
        return jax.jit(paged_decode_attention), [q, pages, pages, tables, lens]
    if case.program == "sparse_decode":
        return (jax.jit(sparse_decode_attention),
                [q, pages, pages, tables, lens, i32(DECODE_ROWS, SPARSE_READ)])
    codec = _codec(case.program.removeprefix("quantized_decode_"))
    spec = codec.storage_spec(NUM_PAGES * PAGE_SIZE, k, d)
    stored = {name: jax.ShapeDtypeStruct((NUM_PAGES, PAGE_SIZE) + s.shape[1:], s.dtype)
              for name, s in spec.items()}
    fn = jax.jit(functools.partial(quantized_decode_attention, codec=codec))
    return fn, [q, stored, stored, tables, lens]


def _kernel_refusal(case: Case) -> str | None:
    """The dispatch's reason for refusing this kernel on the target, or None."""
    if case.program.startswith("quantized_decode_"):
        kv = jax.eval_shape(functools.partial(
            _quantized_state, codec_name=case.program.removeprefix("quantized_decode_"),
            shape=SHAPES[case.shape]))
        return dispatch.unsupported_reason(kv)
    return None


def _quantized_state(*, codec_name: str, shape: ModelShape):
    from kvjax.kv.quantized import init_quantized_kv

    name, options = _codec_args(codec_name)
    return init_quantized_kv(dataclasses.replace(shape, num_layers=1).config(), 8, PAGE_SIZE,
                             name, **options)


def step_shape(program: str) -> step_lib.StepShape:
    """The StepShape a step case compiles: decode rows only, or decode rows and prefill."""
    if program.startswith("step_decode"):
        return step_lib.StepShape(DECODE_ROWS, 0, 1, MAX_PAGES)
    return step_lib.StepShape(DECODE_ROWS, PREFILL_ROWS, CHUNK, MAX_PAGES)


def _step_fn_and_args(case: Case) -> tuple[Any, list]:
    """The engine's jitted step (attention_impl=pallas, exact paged KV) and abstract args."""
    fused = case.program in FUSED_STEPS
    config = SHAPES[case.shape].config()
    if case.program in QK_NORM_STEPS:
        config = dataclasses.replace(config, qk_norm=True)
    dtype = jnp.dtype(case.dtype)
    shape = step_shape(case.program)
    params = jax.eval_shape(functools.partial(llama.init_params, config, dtype=dtype),
                            jax.random.key(0))
    kv = jax.eval_shape(functools.partial(init_paged_kv, config, NUM_PAGES, PAGE_SIZE, dtype))
    inp = step_lib.StepInput(**{name: jax.ShapeDtypeStruct(x.shape, x.dtype)
                                for name, x in step_lib.empty_step_input(shape).items()})
    fn = jax.jit(functools.partial(step_lib.model_step, config=config, shape=shape,
                                   attention_impl=step_lib.AttentionImpl.PALLAS,
                                   fused_kv_write=fused),
                 donate_argnames=("kv",))
    return fn, [params, kv, inp]


_THUNK = re.compile(r"kCustomKernel .*?\] (\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]"
                    r"\s+shared_memory: (\d+) bytes")
_PTXAS = re.compile(r"Compiling entry function '(\S+)'.*?Used (\d+) registers.*?(?=Compiling|\Z)",
                    re.S)
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas() -> str | None:
    """A ptxas: the CUDA toolkit's on PATH or in /usr/local/cuda, else the nvcc wheel's."""
    found = shutil.which("ptxas")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/ptxas",):
        if os.path.exists(candidate):
            return candidate
    try:
        import nvidia.cuda_nvcc  # the nvidia-cuda-nvcc-cu12 wheel

        path = os.path.join(os.path.dirname(nvidia.cuda_nvcc.__file__), "bin", "ptxas")
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def _pallas_kernel_facts(dump_dir: str, target: Target) -> list[dict]:
    """Grid, threads and shared memory of every Pallas kernel XLA launched (its thunk
    sequence), with registers and spills from ptxas over the kernel's PTX."""
    kernels = {}
    pallas_names = ("paged_decode", "ragged_prefill", "quantized_decode", "sparse_decode",
                    "fused_kv_write")
    for path in sorted(os.listdir(dump_dir)):
        if not path.endswith("thunk_sequence.txt"):
            continue
        for line in open(os.path.join(dump_dir, path)):
            m = _THUNK.search(line)
            if m and m.group(1).startswith(pallas_names):
                kernels[m.group(1)] = dict(
                    kernel=m.group(1), grid=[int(x) for x in m.group(2).split(",")],
                    threads=int(m.group(3).split(",")[0]), shared_memory=int(m.group(4)))
    ptxas = _ptxas()
    if ptxas is None or not kernels:
        return list(kernels.values())
    major, minor = target.gpu.compute_capability
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    for path in sorted(os.listdir(dump_dir)):
        if not path.endswith(".ptx"):
            continue
        text = open(os.path.join(dump_dir, path)).read()
        names = [k for k in kernels if f".entry {k}" in text or f".entry {k}(" in text]
        if not names:
            continue
        res = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", os.devnull,
                              os.path.join(dump_dir, path)], capture_output=True, text=True)
        for m in _PTXAS.finditer(res.stderr):
            if m.group(1) in kernels:
                spills = _SPILLS.search(m.group(0))
                kernels[m.group(1)].update(
                    registers=int(m.group(2)),
                    spill_store_bytes=int(spills.group(1)) if spills else 0,
                    spill_load_bytes=int(spills.group(2)) if spills else 0)
    return list(kernels.values())


def _analyses(compiled) -> dict:
    """XLA's memory and cost analyses of a compiled program, where the target gives them."""
    out = {}
    try:
        mem = compiled.memory_analysis()
    except Exception:  # Some compile-only clients implement no analysis.
        mem = None
    if mem is not None:
        out["memory"] = {k: getattr(mem, k) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes") if hasattr(mem, k)}
    try:
        cost = compiled.cost_analysis()
    except Exception:
        cost = None
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if cost:
        out["cost"] = {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [x for x in text.splitlines() if x.strip()]
    # Mosaic puts the failing op on the lines after its headline.
    return " ".join(lines[:3])[:600]


def compile_case(case: Case) -> dict:
    """Compiles one case for its target; returns its record (module docstring)."""
    target = TARGETS[case.target]
    mesh = target_mesh(case.target)
    sharding = NamedSharding(mesh, PartitionSpec())
    record = dict(dataclasses.asdict(case), id=case.id)
    start = time.perf_counter()
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            is_step = case.program in STEPS + QK_NORM_STEPS
            reason = None if is_step else _kernel_refusal(case)
            if reason is not None:
                return dict(record, status="refused", reason=reason,
                            seconds=round(time.perf_counter() - start, 2))
            fn, args = _step_fn_and_args(case) if is_step else _kernel_fn_and_args(case)
            lowered = fn.lower(*_abstract(args, sharding))
        with tempfile.TemporaryDirectory() as dump_dir:
            options = {"xla_dump_to": dump_dir} if target.platform == "cuda" else {}
            compiled = lowered.compile(compiler_options=options)
            if target.platform == "cuda":
                record["kernels"] = _pallas_kernel_facts(dump_dir, target)
            else:
                # Each Pallas call compiled by Mosaic is one TPU custom call.
                record["mosaic_calls"] = compiled.as_text().count("tpu_custom_call")
        record.update(_analyses(compiled), status="compiled")
    except ValueError as e:  # The kernels' own checks, before anything compiles.
        record.update(status="refused", reason=str(e))
    except Exception as e:  # The compiler's error is the finding: keep its message.
        record.update(status="failed", reason=_first_line(e))
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def run(cases: list[Case]) -> list[dict]:
    """Compiles every case (one after another: compiles use both cores already)."""
    return [compile_case(c) for c in cases]


def format_table(records: list[dict]) -> str:
    """A markdown table: one line per case, the status and the facts that matter."""
    lines = ["| program | target | dtype | shape | status | smem B | regs | spills B | "
             "seconds | reason |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        kernels = r.get("kernels", [])
        smem = max((k["shared_memory"] for k in kernels), default=None)
        regs = max((k.get("registers", 0) for k in kernels), default=None)
        spills = sum(k.get("spill_store_bytes", 0) for k in kernels) if kernels else None
        show = lambda x: "" if x is None else str(x)
        reason = r.get("reason", "").replace("|", "/")
        lines.append(f"| {r['program']} | {r['target']} | {r['dtype']} | {r['shape']} | "
                     f"{r['status']} | {show(smem)} | {show(regs)} | {show(spills)} | "
                     f"{r['seconds']} | {reason} |")
    return "\n".join(lines)


def format_summary(records: list[dict]) -> str:
    """A markdown table: one line per program, one column per target, each cell the number
    of (dtype, shape) cases compiled, or the refusal's reason when every case was refused."""
    names = list(dict.fromkeys(r["target"] for r in records))
    lines = [f"| program | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for program in dict.fromkeys(r["program"] for r in records):
        cells = []
        for target in names:
            rs = [r for r in records if r["program"] == program and r["target"] == target]
            done = sum(r["status"] == "compiled" for r in rs)
            refused = [r for r in rs if r["status"] == "refused"]
            if refused and len(refused) == len(rs):
                cells.append(f"refused: {refused[0]['reason']}".replace("|", "/"))
            else:
                failed = len(rs) - done - len(refused)
                cells.append(f"{done}/{len(rs)} compiled" + (f", {failed} FAILED" if failed
                                                             else ""))
        lines.append(f"| {program} | {' | '.join(cells)} |")
    return "\n".join(lines)
