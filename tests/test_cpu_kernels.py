"""The native CPU kernels' build cache (keyed by the target CPU, refused on a CPU that lacks
its flags) and the kernels' AVX2 and generic branches (and the matmul's bfloat16 paths with
and without AVX-512 BF16), built for named x86-64 levels on this host, against numpy."""

from __future__ import annotations

import ctypes
import functools
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv.test_attention import F32_TOL, make_case, numpy_attention

import kvjax
from kvjax import cpu_kernels
from kvjax.cpu_kernels import Isa
from kvjax.kv import native
from kvjax.models import linear

pytestmark = pytest.mark.skipif(linear.unavailable_reason() is not None,
                                reason=str(linear.unavailable_reason()))

_TINY_SOURCE = 'extern "C" int kvjax_answer() { return 42; }\n'
AVX512_HOST = ("avx", "avx2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "bmi2", "f16c",
               "fma", "sse4_2")
AVX2_HOST = ("avx", "avx2", "bmi2", "f16c", "fma", "sse4_2")


@pytest.fixture
def tiny_source(tmp_path, monkeypatch):
    """A trivial kernel source and an empty cache folder of its own."""
    monkeypatch.setenv("KVJAX_NATIVE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "answer.cc"
    source.write_text(_TINY_SOURCE)
    return source


def _pretend_host(monkeypatch, flags):
    monkeypatch.setattr(cpu_kernels, "host_flags", lambda: frozenset(flags))


def _record_loads(monkeypatch) -> list[str]:
    loads = []
    real = ctypes.cdll.LoadLibrary
    monkeypatch.setattr(ctypes.cdll, "LoadLibrary", lambda path: loads.append(path) or real(path))
    return loads


def test_the_cache_key_holds_the_target_cpu(tiny_source, monkeypatch):
    """Another CPU (other predefined ISA macros from -march=native) caches its build under
    another name, so neither machine finds the other's library."""
    here = cpu_kernels.library_path(tiny_source)
    real_macros = cpu_kernels.target_macros

    def other_cpu(cxx, isa):  # this CPU's macros with AVX-512's toggled
        macros = real_macros(cxx, isa)
        without = tuple(m for m in macros if "AVX512" not in m)
        return without if without != macros else (*macros, "#define __AVX512F__ 1")

    monkeypatch.setattr(cpu_kernels, "target_macros", other_cpu)
    assert cpu_kernels.library_path(tiny_source) != here
    assert "-native-" in here.name
    assert cpu_kernels.library_path(tiny_source, Isa.X86_64) != here


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 levels")
def test_a_build_this_cpu_lacks_flags_for_is_never_loaded(tiny_source, monkeypatch):
    """A library whose manifest needs AVX-512 (an AVX-512 machine's build, found under this
    machine's key in a copied cache) on an AVX2 machine: refused while the build for this
    target would still need AVX-512, else rebuilt; never loaded."""
    _pretend_host(monkeypatch, AVX512_HOST)
    lib = cpu_kernels.build(tiny_source, Isa.X86_64_V3)
    manifest = json.loads(lib.with_suffix(".json").read_text())
    assert "avx2" in manifest["required_flags"] and "avx512f" not in manifest["required_flags"]
    lib.with_suffix(".json").write_text(json.dumps(dict(manifest, required_flags=["avx512f"])))
    _pretend_host(monkeypatch, AVX2_HOST)
    loads = _record_loads(monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "required_flags", lambda macros: ("avx512f",))
        with pytest.raises(RuntimeError, match="lacks: avx512f"):
            cpu_kernels.load(tiny_source, Isa.X86_64_V3)
    assert loads == []
    assert cpu_kernels.load(tiny_source, Isa.X86_64_V3).kvjax_answer() == 42
    assert loads == [str(lib)]  # the rebuilt AVX2 library
    assert "avx512f" not in json.loads(lib.with_suffix(".json").read_text())["required_flags"]


def test_a_library_without_its_manifest_is_rebuilt(tiny_source):
    """A stray file under the key (an older cache, a torn copy) is not loaded as a build."""
    lib = cpu_kernels.library_path(tiny_source)
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not a library")
    assert cpu_kernels.load(tiny_source).kvjax_answer() == 42


# ---- the AVX2 (x86-64-v3) and generic (x86-64) branches of the three kernels ---------------

LEVELS = [Isa.X86_64_V3, Isa.X86_64]


def _skip_unless_runs(isa):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("named levels are x86-64's")
    needs = cpu_kernels.required_flags(cpu_kernels.target_macros(cpu_kernels._compiler(), isa))
    if cpu_kernels.missing_flags(needs):
        pytest.skip(f"this CPU cannot run {isa.name}")


# float32: every level takes the packed product untransposed from 1024 rows of x (kGemmXF32),
# below it the row blocks. Shapes either side of it: 1023 rows; 1026, past blocks of 64 rows
# of x with a short last tile, In past one pass of a tile (256 rows), Out off the strips and
# vectors. From 16 rows with Out a multiple of the vector width, the threads split the strips
# of columns (kStripsX): a short last tile of x, In past chunks of 64 weight rows with a short
# last chunk, Out off the strips; and 16 rows exactly, one chunk.
F32_SHAPES = [(1, 576, 576), (5, 16, 8), (33, 100, 70), (26, 150, 200), (1023, 40, 70),
              (1026, 301, 200), (17, 130, 112), (64, 200, 208), (16, 40, 96)]


@pytest.mark.parametrize("isa", [Isa.NATIVE, Isa.X86_64_V4, *LEVELS], ids=lambda i: i.name)
def test_linear_branches_of_each_level_match_numpy(isa):
    if isa is not Isa.NATIVE:
        _skip_unless_runs(isa)
    target = linear.target_for(isa)
    rng = np.random.default_rng(0)
    for t, k, n in F32_SHAPES:
        x = rng.standard_normal((t, k)).astype(np.float32)
        w = np.full((2, k, n), np.nan, np.float32)
        w[1] = rng.standard_normal((k, n))
        got = jax.jit(linear.call_kernel, static_argnums=(0, 4))(target, x, w, 1, False)
        np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w[1], rtol=1e-4,
                                   atol=1e-4)
        wt = np.ascontiguousarray(np.swapaxes(w, 1, 2))
        got = jax.jit(linear.call_kernel, static_argnums=(0, 4))(target, x, wt, 1, True)
        np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w[1], rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("isa", [Isa.NATIVE, Isa.X86_64_V4, *LEVELS], ids=lambda i: i.name)
@pytest.mark.parametrize("transpose", [False, True])
def test_invariant_rows_of_each_level_are_the_same_alone_and_beside_others(isa, transpose):
    """The invariant order at every level: a row's product is bitwise the same alone and among
    37 rows. Out = 200 ends in a strip of one vector at AVX2's 8 lanes, and the 1-row and 4-row
    tiles of it must round alike."""
    if isa is not Isa.NATIVE:
        _skip_unless_runs(isa)
    target = linear.target_for(isa)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((37, 300)).astype(np.float32)
    w = rng.standard_normal((2, 200, 300) if transpose else (2, 300, 200)).astype(np.float32)
    call = jax.jit(functools.partial(linear.call_kernel, invariant=True),
                   static_argnums=(0, 4))
    rows = np.asarray(call(target, x, w, 1, transpose))
    for t in (0, 17, 36):
        np.testing.assert_array_equal(np.asarray(call(target, x[t:t + 1], w, 1, transpose)),
                                      rows[t:t + 1])


# The bfloat16 matmul's paths: NATIVE here takes AVX-512 BF16's pairs (vdpbf16ps) where Out is
# a multiple of 32 and the transposed product, X86_64_V4 (AVX-512 without BF16), X86_64_V3
# and X86_64 widen to float32. Shapes: one row and whole pieces; threads' partials added
# (T x Out >= 16K); odd In (a last pair with a zero row; a masked tail of the transposed
# rows); Out off the 32-column pieces (widened under NATIVE too); 4 x 4 transposed tiles.
# From 32 rows NATIVE packs the weights into pairs first: blocks of rows of x with a short
# last tile, a strip and a transposed panel past Out, In past one pass of a tile (256 rows)
# and odd (a last pair with a zero row, x's word past In unread).
BF16_LEVELS = [Isa.NATIVE, Isa.X86_64_V4, *LEVELS]
BF16_SHAPES = [(1, 576, 576), (16, 64, 1536), (3, 41, 64), (5, 16, 8), (33, 100, 70),
               (26, 150, 200), (133, 70, 100), (129, 301, 200)]


@pytest.mark.parametrize("isa", BF16_LEVELS, ids=lambda i: i.name)
def test_linear_bfloat16_paths_of_each_level_match_numpy(isa):
    """bfloat16 x and w summed in float32: the float32 result within float32 accumulation
    error of float64 sums of the same bfloat16 values; the bfloat16 result is that float32
    result rounded to nearest even (so within half a bfloat16 ulp of it)."""
    if isa is not Isa.NATIVE:
        _skip_unless_runs(isa)
    target = linear.target_for(isa)
    call = jax.jit(linear.call_kernel, static_argnums=(0, 4), static_argnames="out_dtype")
    rng = np.random.default_rng(4)
    for t, k, n in BF16_SHAPES:
        x = rng.standard_normal((t, k)).astype(jnp.bfloat16)
        w = np.full((2, k, n), np.nan, jnp.bfloat16)  # layer 0 must not be read
        w[1] = rng.standard_normal((k, n)).astype(jnp.bfloat16)
        x64, w64 = x.astype(np.float64), w[1].astype(np.float64)
        want = x64 @ w64
        tol = np.finfo(np.float32).eps * k * (np.abs(x64) @ np.abs(w64))
        for transpose in (False, True):
            wk = np.ascontiguousarray(np.swapaxes(w, 1, 2)) if transpose else w
            sums = np.asarray(call(target, x, wk, 1, transpose, out_dtype=jnp.float32))
            assert sums.dtype == np.float32
            assert np.all(np.abs(sums - want) <= tol), (t, k, n, transpose)
            rounded = np.asarray(call(target, x, wk, 1, transpose))
            assert rounded.dtype == jnp.bfloat16
            np.testing.assert_array_equal(rounded, sums.astype(jnp.bfloat16))


def _layered(pages: np.ndarray, layer: int) -> np.ndarray:
    out = np.full((3, *pages.shape), np.nan, pages.dtype)
    out[layer] = pages
    return out


@pytest.mark.parametrize("isa", LEVELS, ids=lambda i: i.name)
def test_decode_branches_of_each_level_match_numpy(isa):
    """Float pages (the specialized D 64 and the generic D 8), packed int4 codes and int8
    codes (each decoded by the level's own code-unpacking branch)."""
    _skip_unless_runs(isa)
    decode_target, _ = native.targets_for(isa)
    run = jax.jit(native.paged_decode_attention, static_argnames=("target", "bits", "group"))
    rng = np.random.default_rng(3)
    for page_size, k_heads, group, head_dim in [(16, 3, 3, 64), (4, 2, 5, 8)]:
        kv_lens, tables, kp, vp, ks, vs = make_case(
            rng, num_seqs=4, max_len=37, page_size=page_size, num_kv_heads=k_heads,
            group=group, head_dim=head_dim)
        q = rng.standard_normal((4, k_heads * group, head_dim)).astype(np.float32)
        got = np.asarray(run(q, _layered(kp, 1), _layered(vp, 1), 1, tables, kv_lens,
                             target=decode_target))
        for b in range(4):
            np.testing.assert_allclose(
                got[b], numpy_attention(q[b], ks[b], vs[b], kv_lens[b] - 1), **F32_TOL)
    codec = kvjax.kv.codecs.get_codec("int4", group=32)
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=3, max_len=45, page_size=16,
                                              num_kv_heads=2, group=3, head_dim=64)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    q = rng.standard_normal((3, 6, 64)).astype(np.float32)
    k_stored, v_stored = codec.encode(jnp.asarray(kp)), codec.encode(jnp.asarray(vp))
    want = kvjax.kv.attention.paged_decode_attention_reference(
        q, codec.decode(k_stored), codec.decode(v_stored), tables, kv_lens)
    pool = lambda x: jnp.stack([x, jnp.zeros_like(x)])  # noqa: E731  (layer 0 of 2)
    got = run(q, pool(k_stored["codes"]), pool(v_stored["codes"]), 0, tables, kv_lens,
              k_scale=pool(k_stored["scale"]), v_scale=pool(v_stored["scale"]),
              k_zero=pool(k_stored["zero"]), v_zero=pool(v_stored["zero"]), bits=codec.bits,
              group=32, target=decode_target)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)
    # int8 codes with one scale per token and kv head (the level's sign-extending branch).
    scale = np.abs(kp).max(-1) / 127
    kc = np.round(kp / np.where(scale > 0, scale, 1)[..., None]).astype(np.int8)
    vscale = np.abs(vp).max(-1) / 127
    vc = np.round(vp / np.where(vscale > 0, vscale, 1)[..., None]).astype(np.int8)
    scale, vscale = scale.astype(np.float32), vscale.astype(np.float32)
    want = kvjax.kv.attention.paged_decode_attention_reference(
        q, kc * scale[..., None], vc * vscale[..., None], tables, kv_lens)
    got = run(q, pool(kc), pool(vc), 0, tables, kv_lens, k_scale=pool(scale),
              v_scale=pool(vscale), target=decode_target)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


@pytest.mark.parametrize("isa", LEVELS, ids=lambda i: i.name)
def test_prefill_branches_of_each_level_match_numpy(isa):
    _skip_unless_runs(isa)
    _, prefill_target = native.targets_for(isa)
    rng = np.random.default_rng(6)
    kv_lens, tables, kp, vp, ks, vs = make_case(rng, num_seqs=3, max_len=40, page_size=16,
                                                num_kv_heads=2, group=3, head_dim=64)
    q_lens = np.minimum(np.array([20, 40, 5], np.int32), kv_lens)
    q = rng.standard_normal((3, 40, 6, 64)).astype(np.float32)
    run = jax.jit(native.paged_prefill_attention, static_argnames="target")
    got = np.asarray(run(q, _layered(kp, 0), _layered(vp, 0), 0, tables, kv_lens, q_lens,
                         target=prefill_target))
    for b in range(3):
        for i in range(40):
            want = (numpy_attention(q[b, i], ks[b], vs[b], kv_lens[b] - q_lens[b] + i)
                    if i < q_lens[b] else np.zeros_like(q[b, i]))
            np.testing.assert_allclose(got[b, i], want, **F32_TOL)
