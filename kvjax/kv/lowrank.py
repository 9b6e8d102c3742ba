"""Low-rank key pool: pages hold each key's coordinates in a calibrated rank-r basis.

`LowRankPagedKV` implements `kvjax.kv.state.KVState`. Per layer l and kv head h a basis
U = basis[l, :, :, h] [D, r] with orthonormal columns (`kvjax.kv.calibration.key_bases`) turns
a post-RoPE key k [D] into its coordinates k U [r], which the pages store (float32, or int8
with a scale per token and kv head: `codecs.LowRankCodec`); values are stored exactly. Reading
keys, the state gives attention those coordinates, and `project_queries` gives it the queries
in the same basis, q U: a score is (q U) . (k U) = q . (k U U^T), the exact score against the
key's projection, computed at width r without rebuilding a key (r multiply-adds per key and
query head instead of D). At r = D the basis is orthogonal and the scores are exact up to
float rounding.

Why after RoPE: RoPE turns each key by its own position, so a projection taken before it
(lower rank for the same error, as Loki and ShadowKV observe) gives no score without turning
the rebuilt key; taking the basis of the turned keys keeps every read at width r. Keys cannot
be turned again once projected (a rotation leaves the basis's span), so `map_keys` refuses,
and with it retention re-rotation and context reuse (the compatibility table).

The basis is an array of the state ([L, D, r, K]: its kv-head axis is axis 3, where a mesh
shards page leaves), not a page leaf: swapping, tiers and snapshots move pages, and the basis
stays. The codec's name carries its digest, so prefix-cache hits and restored pages need the
same basis.

Bytes per token (all L layers): L K (r e_k + D e_v), e_k = 4 (float32 coordinates) or 1 + 4 /
r (int8 and its scale), e_v the values' dtype bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.config import ModelConfig
from kvjax.kv import codecs
from kvjax.kv import spec as kv_spec
from kvjax.kv import state as kv_state


def basis_digest(basis: np.ndarray) -> str:
    """A short hash of a basis [L, D, r, K]: its shape and float32 bytes."""
    basis = np.ascontiguousarray(basis, np.float32)
    return hashlib.blake2b(repr(basis.shape).encode() + basis.tobytes(),
                           digest_size=6).hexdigest()


@struct.dataclass
class LowRankPagedKV(kv_state.SlotAddressed):
    """A pool of pages of key coordinates and exact values (see the module docstring).

    Attributes:
        k_stored: the coordinates' storage, name -> [L, num_pages, P, K, r] (and for int8 a
            scale [L, num_pages, P, K]).
        v_pages: [L, num_pages, P, K, D] values.
        basis: [L, D, r, K] float32, orthonormal columns per layer and kv head (zeros until
            calibrated).
        codec: the key codec (static); its digest names the basis.
    """

    k_stored: dict[str, jax.Array]
    v_pages: jax.Array
    basis: jax.Array
    codec: codecs.LowRankCodec = struct.field(pytree_node=False)

    @property
    def codec_name(self) -> str:
        return f"k:{self.codec.name}/v:none-{self.v_pages.dtype.name}"

    @property
    def num_pages(self) -> int:
        return self.v_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.v_pages.shape[2]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def check_ready(self) -> None:
        if self.codec.digest is None:
            raise ValueError(f"kv codec {self.codec.name!r} has no key basis yet: call "
                             f"Engine.calibrate_kv(prompts) (calibration='manual')")

    def project_queries(self, layer: jax.Array, q: jax.Array) -> jax.Array:
        """Queries [..., N, D] -> their coordinates in the layer's bases [..., N, r] float32
        (query head n uses kv head n // G)."""
        basis = self.basis[layer]  # [D, r, K]
        k_heads = basis.shape[-1]
        qg = q.astype(jnp.float32).reshape(*q.shape[:-2], k_heads, -1, q.shape[-1])
        out = jnp.einsum("...kgd,drk->...kgr", qg, basis)  # [..., K, G, r]
        return out.reshape(*q.shape[:-2], q.shape[-2], basis.shape[1])

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Key coordinates [B, n, P, K, r] float32 and values [B, n, P, K, D] of `pages`
        [B, n] of `layer`; reads only those pages."""
        stored = {name: x[layer, pages] for name, x in self.k_stored.items()}
        return self.codec.decode_coordinates(stored), self.v_pages[layer, pages]

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array
              ) -> LowRankPagedKV:
        """Projects, encodes and writes k [T, K, D]; writes v [T, K, D]; slots [T] (-1:
        dropped)."""
        encoded = self.codec.encode(k, basis=self.basis[layer])
        return self.replace(
            k_stored={n: kv_state.scatter_rows(x, layer, slots, encoded[n])
                      for n, x in self.k_stored.items()},
            v_pages=kv_state.scatter_rows(self.v_pages, layer, slots, v))

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> LowRankPagedKV:
        """Copy-on-write: page dst[i] becomes a copy of page src[i] in all layers."""
        def copy(x):
            return x.at[:, dst].set(x[:, src])

        return self.replace(k_stored=jax.tree.map(copy, self.k_stored),
                            v_pages=copy(self.v_pages))

    def with_basis(self, basis: np.ndarray) -> LowRankPagedKV:
        """This state reading and writing through `basis` [L, D, r, K]. Pages written under
        another basis would read wrongly: call it on an empty pool."""
        if tuple(basis.shape) != tuple(self.basis.shape):
            raise ValueError(f"basis of shape {tuple(basis.shape)}, expected "
                             f"{tuple(self.basis.shape)} [L, D, r, K]")
        codec = dataclasses.replace(self.codec, digest=basis_digest(basis))
        # Placed where the old basis lies: a pool committed to a device (or a mesh) stays so,
        # and the step programs see inputs of the same placement as ever (no recompile).
        placed = jax.device_put(np.asarray(basis, np.float32), self.basis.sharding)
        return self.replace(basis=placed, codec=codec)

    def page_leaves(self) -> list[jax.Array]:
        """The coordinates' storage entries (by name), then the values."""
        return [*jax.tree.leaves(self.k_stored), self.v_pages]

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> LowRankPagedKV:
        *k_leaves, v_pages = leaves
        k_stored = jax.tree.unflatten(jax.tree.structure(self.k_stored), k_leaves)
        return self.replace(k_stored=k_stored, v_pages=v_pages)

    def nbytes(self) -> int:
        """Device bytes of the pages and the basis."""
        return sum(x.nbytes for x in jax.tree.leaves(self))


def cache_spec(config: ModelConfig, page_size: int, codec: codecs.LowRankCodec, v_dtype,
               groups=None) -> kv_spec.KVCacheSpec:
    """The pool's spec: keys at the codec's bytes (r coordinates), values exact at v_dtype."""
    values = codecs.IdentityCodec(jnp.dtype(v_dtype).name)
    groups = config.kv_layer_groups() if groups is None else groups
    return kv_spec.cache_spec(groups, codec_name=codec.name, page_size=page_size,
                              tensor_bytes=(codec.bytes_per_token, values.bytes_per_token))


def kv_bytes_per_token(config: ModelConfig, codec: codecs.LowRankCodec, v_dtype=jnp.float32
                       ) -> float:
    """Bytes one token takes in a low-rank pool: all layers, key coordinates and values."""
    return cache_spec(config, 1, codec, v_dtype).bytes_per_token


def init_lowrank_kv(config: ModelConfig, num_pages: int, page_size: int,
                    codec: codecs.LowRankCodec, v_dtype=jnp.float32, *,
                    num_layers: int | None = None) -> LowRankPagedKV:
    """A zeroed pool of `num_pages` pages of `page_size` tokens, its basis not yet calibrated
    (zeros: `LowRankPagedKV.with_basis` sets it)."""
    if num_pages <= 0 or page_size <= 0:
        raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be positive")
    if config.mla is not None:
        raise ValueError(f"model {config.name!r} caches MLA latents, not K heads to project")
    num_layers = config.num_layers if num_layers is None else num_layers
    heads, head_dim = config.num_kv_heads, config.head_dim
    spec = codec.storage_spec(num_pages * page_size, heads, head_dim)
    k_stored = {name: jnp.zeros((num_layers, num_pages, page_size, *s.shape[1:]), s.dtype)
                for name, s in spec.items()}
    return LowRankPagedKV(
        k_stored=k_stored,
        v_pages=jnp.zeros((num_layers, num_pages, page_size, heads, head_dim), v_dtype),
        basis=jnp.zeros((num_layers, head_dim, codec.rank, heads), jnp.float32),
        codec=dataclasses.replace(codec, digest=None))
