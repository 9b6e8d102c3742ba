"""The project's C++ CPU kernels: built once per machine and registered as XLA FFI targets.

A kernel source is compiled with the system C++ compiler (`g++`, or `$CXX`) into a cache
folder (`$KVJAX_NATIVE_CACHE`, default `~/.cache/kvjax/native`), keyed by the source, the
flags and the jax version, then loaded and registered for the CPU platform. `register` says
why a kernel cannot be used (no compiler, a failed build); callers then keep their jnp path.
The kernels: `kvjax/kv/native/paged_decode.cc` and `paged_prefill.cc` (paged decode and
prefill attention) and `kvjax/models/linear.cc` (matmuls reading a layer of the stacked
weights in place); all include `cpu_kernels.h` (the thread-pool loop and vector helpers they
share).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import jax

# Reassociation (vectorized dot products) without -ffast-math: linking a shared library with
# that flag makes loading it switch the whole process to flushing subnormal floats to zero.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-freciprocal-math", "-std=c++17", "-shared", "-fPIC", "-w")
_HEADER = pathlib.Path(__file__).with_name("cpu_kernels.h")  # what the kernels share
_lock = threading.Lock()
_status: dict[str, str | None] = {}  # target -> None once registered, else why not


def _cache_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "kvjax" / "native"
    return pathlib.Path(os.environ.get("KVJAX_NATIVE_CACHE", default))


def build(source: pathlib.Path) -> pathlib.Path:
    """Compiles `source` if no cached build matches; returns the shared library's path."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    include = jax.ffi.include_dir()
    key = hashlib.sha256(b"\0".join([source.read_bytes(), _HEADER.read_bytes(),
                                     " ".join(FLAGS).encode(), jax.__version__.encode(),
                                     cxx.encode()])).hexdigest()[:16]
    lib = _cache_dir() / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = pathlib.Path(tmp) / lib.name
        proc = subprocess.run([cxx, *FLAGS, f"-I{include}", f"-I{_HEADER.parent}", str(source),
                               "-o", str(out)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{cxx} failed to build {source.name}: {proc.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: concurrent builders race harmlessly
    return lib


def register(target: str, source: pathlib.Path, symbol: str) -> str | None:
    """Registers `symbol` of `source`'s build as the CPU FFI target `target` (building it on
    the first call); None when registered, else a sentence saying why not."""
    with _lock:
        if target not in _status:
            try:
                library = ctypes.cdll.LoadLibrary(str(build(source)))
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                            platform="cpu")
                _status[target] = None
            except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
                _status[target] = f"the native CPU kernel {target!r} is unavailable: {e}"
        return _status[target]
