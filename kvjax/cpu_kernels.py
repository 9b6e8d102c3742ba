"""The project's C++ CPU kernels: built once per CPU and registered as XLA FFI targets.

A kernel source is compiled with the system C++ compiler (`g++`, or `$CXX`) for an
instruction-set level (`Isa`: this CPU's `-march=native` by default, or a named x86-64 level)
into a cache folder (`$KVJAX_NATIVE_CACHE`, default `~/.cache/kvjax/native`). The cache key
holds the source, the flags, the jax version, the compiler and the compiler's predefined macros
for the target, which name every ISA extension it may use (`__AVX512F__`, `__AVX2__`,
`__FMA__`, ...) and the CPU it tunes for: a cache shared with another CPU (a container image, a
network home) holds that CPU's build under another key. Beside each library a manifest lists
the CPU flags its code needs; a library whose flags this CPU lacks is rebuilt, and refused if
the build still needs them, never loaded (loading it would end the process on an illegal
instruction). `register` says why a kernel cannot be used (no compiler, a failed build, a
CPU the build does not run on); callers then keep their jnp path.
The kernels: `kvjax/kv/native/paged_decode.cc` and `paged_prefill.cc` (paged decode and
prefill attention) and `kvjax/models/linear.cc` (matmuls reading a layer of the stacked
weights in place); all include `cpu_kernels.h` (the thread-pool loop and vector helpers they
share). Their AVX-512, AVX2 and generic branches are chosen at compile time by these macros.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import json
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax

# Reassociation (vectorized dot products) without -ffast-math: linking a shared library with
# that flag makes loading it switch the whole process to flushing subnormal floats to zero.
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-freciprocal-math", "-std=c++17", "-shared", "-fPIC", "-w")
_HEADER = pathlib.Path(__file__).with_name("cpu_kernels.h")  # what the kernels share
_lock = threading.Lock()
_status: dict[str, str | None] = {}  # target -> None once registered, else why not

# Predefined macro of an ISA extension -> the flag /proc/cpuinfo names it by (the extensions
# the kernels' branches test, and those -march levels of this and the previous CPUs add).
MACRO_FLAGS = {
    "__SSE4_2__": "sse4_2", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
    "__F16C__": "f16c", "__BMI2__": "bmi2", "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl",
    "__AVX512CD__": "avx512cd", "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
    "__AVX512VBMI__": "avx512vbmi", "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8", "__AVXVNNI__": "avx_vnni",
}


class Isa(enum.Enum):
    """The instruction-set level a kernel is built for (its compiler flags)."""

    NATIVE = ("-march=native",)  # this CPU: the kernels' AVX-512 branches where it has them
    # AVX-512 F/BW/DQ/VL without BF16: the AVX-512 branches, bfloat16 matmuls widened.
    X86_64_V4 = ("-march=x86-64-v4",)
    X86_64_V3 = ("-march=x86-64-v3",)  # AVX2 and FMA: the kernels' AVX2 branches
    X86_64 = ("-march=x86-64",)  # SSE2 only: the generic (vector-extension) branches

    @property
    def flags(self) -> tuple[str, ...]:
        return self.value


def _cache_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "kvjax" / "native"
    return pathlib.Path(os.environ.get("KVJAX_NATIVE_CACHE", default))


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    return cxx


@functools.cache
def target_macros(cxx: str, isa: Isa) -> tuple[str, ...]:
    """The compiler's predefined macros for `isa` (sorted `#define` lines): what the target
    CPU has (ISA extensions) and what the code is tuned for, as the kernels will see it."""
    proc = subprocess.run([cxx, *isa.flags, "-dM", "-E", "-x", "c++", os.devnull],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cxx} does not target {isa.name}: {proc.stderr[-500:]}")
    return tuple(sorted(proc.stdout.splitlines()))


def required_flags(macros: tuple[str, ...]) -> tuple[str, ...]:
    """The CPU flags (as /proc/cpuinfo names them) code built with `macros` may execute."""
    defined = {line.split()[1] for line in macros if line.startswith("#define ")}
    return tuple(sorted(flag for macro, flag in MACRO_FLAGS.items() if macro in defined))


@functools.cache
def _cpuinfo() -> dict[str, str] | None:
    """/proc/cpuinfo's fields, each at its first occurrence (the first processor's, or a
    line some ARM kernels print once after the processors); None where it cannot be read."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def host_flags() -> frozenset[str] | None:
    """This CPU's flags from /proc/cpuinfo; None where it cannot be read (the compiler's
    -march=native is then trusted)."""
    fields = _cpuinfo() or {}
    flags = fields.get("flags", fields.get("Features"))
    return None if flags is None else frozenset(flags.split())


@functools.cache
def cpu_model() -> str:
    """This CPU as benchmarks report it: /proc/cpuinfo's model name, x86 family and model, and
    the widest vector extension the kernels use ('AMD EPYC, family 23 model 49, avx2'); '' where
    /proc/cpuinfo cannot be read. Timings compare only between runs on the same model."""
    fields = _cpuinfo()
    if fields is None:
        return ""
    flags = host_flags() or frozenset()
    widest = next((f for f in ("avx512f", "avx2", "sse4_2", "asimd") if f in flags), "")
    parts = [fields.get("model name", platform.processor()),
             f"family {fields['cpu family']} model {fields['model']}"
             if "cpu family" in fields and "model" in fields else "", widest]
    return ", ".join(p for p in parts if p)


def missing_flags(required: tuple[str, ...] | list[str]) -> list[str]:
    """The flags of `required` this CPU lacks (none when its flags cannot be read)."""
    have = host_flags()
    return [] if have is None else [flag for flag in required if flag not in have]


def library_path(source: pathlib.Path, isa: Isa = Isa.NATIVE) -> pathlib.Path:
    """Where the build of `source` for `isa` on this machine is cached."""
    cxx = _compiler()
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), _HEADER.read_bytes(), " ".join(isa.flags + FLAGS).encode(),
        jax.__version__.encode(), cxx.encode(), platform.machine().encode(),
        "\n".join(target_macros(cxx, isa)).encode()])).hexdigest()[:16]
    return _cache_dir() / f"{source.stem}-{isa.name.lower()}-{key}.so"


def _manifest(lib: pathlib.Path) -> pathlib.Path:
    return lib.with_suffix(".json")


def _cached_flags(lib: pathlib.Path) -> list[str] | None:
    """The flags a cached build's manifest says it needs; None when there is no usable
    build (no library, no manifest, or one not written by this module)."""
    try:
        return list(json.loads(_manifest(lib).read_text())["required_flags"]) \
            if lib.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build(source: pathlib.Path, isa: Isa = Isa.NATIVE) -> pathlib.Path:
    """Compiles `source` for `isa` unless a cached build for this CPU exists; returns the
    shared library's path.

    Raises:
      RuntimeError: no compiler, a failed build, or a build this CPU cannot run.
    """
    cxx = _compiler()
    lib = library_path(source, isa)
    cached = _cached_flags(lib)
    if cached is not None and not missing_flags(cached):
        return lib
    required = required_flags(target_macros(cxx, isa))
    missing = missing_flags(required)
    if missing:
        raise RuntimeError(f"{source.name} built for {isa.name} needs CPU flags this CPU "
                           f"lacks: {', '.join(missing)}")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = pathlib.Path(tmp) / lib.name
        proc = subprocess.run([cxx, *isa.flags, *FLAGS, f"-I{jax.ffi.include_dir()}",
                               f"-I{_HEADER.parent}", str(source), "-o", str(out)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{cxx} failed to build {source.name}: {proc.stderr[-2000:]}")
        manifest = pathlib.Path(tmp) / _manifest(lib).name
        manifest.write_text(json.dumps({"isa": isa.name, "required_flags": list(required)}))
        # Library first, manifest last (both atomic): a manifest always describes a library
        # in place, and concurrent builders race harmlessly.
        os.replace(out, lib)
        os.replace(manifest, _manifest(lib))
    return lib


def load(source: pathlib.Path, isa: Isa = Isa.NATIVE) -> ctypes.CDLL:
    """The build of `source` for `isa`, loaded (built first where needed).

    Raises:
      RuntimeError: as `build`, or the library's manifest names flags this CPU lacks.
    """
    lib = build(source, isa)
    missing = missing_flags(_cached_flags(lib) or [])
    if missing:  # rewritten between build and load by a builder for another CPU
        raise RuntimeError(f"{lib.name} needs CPU flags this CPU lacks: {', '.join(missing)}")
    return ctypes.cdll.LoadLibrary(str(lib))


def register(target: str, source: pathlib.Path, symbol: str, isa: Isa = Isa.NATIVE
             ) -> str | None:
    """Registers `symbol` of `source`'s build for `isa` as the CPU FFI target `target`
    (building it on the first call); None when registered, else a sentence saying why not."""
    with _lock:
        if target not in _status:
            try:
                library = load(source, isa)
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                            platform="cpu")
                _status[target] = None
            except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
                _status[target] = f"the native CPU kernel {target!r} is unavailable: {e}"
        return _status[target]


def register_sources(sources: list[str], symbol: str, prefix: str) -> list[str]:
    """Registers `symbol` of each of `sources` (kernel sources, e.g. an older revision saved
    beside the current one, for benchmarks that time them side by side) under its own FFI
    target `{prefix}_{i}`; returns the targets in order.

    Raises:
      RuntimeError: a source cannot be registered (`register`'s reason).
    """
    targets = []
    for i, source in enumerate(sources):
        target = f"{prefix}_{i}"
        reason = register(target, pathlib.Path(source), symbol)
        if reason is not None:
            raise RuntimeError(reason)
        targets.append(target)
    return targets
