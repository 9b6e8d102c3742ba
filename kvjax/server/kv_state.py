"""What a router weighs when it sends a request to this server: GET /kv_state.

A router in front of several servers (`kvjax.router.http`) polls it to choose a replica with
its live state instead of its own guesses: load (running and waiting sequences, prompt tokens
still to prefill), free KV pages, and the prefix cache's index. Prefix-cache page hashes are
BLAKE2b hash chains (`kvjax.memory.prefix_cache`), equal across processes, so a router that
knows the chain's root and the page size tests a prompt's pages against the set without asking
the replica again.

A tenant's chain has its own root (its provenance, or a shared `cache_salt`'s key), which only
the replica can compute: it knows which tenant an API key runs as, and a salt is the tenants'
secret. So the replica reports the roots by *affinity key* (`affinity_key`): a digest of what a
request carries that decides its cache key (the Authorization header, the tenant it names, its
cache_salt), which a router in front computes from the same request without learning any of it.
The digest is keyed (BLAKE2b's keyed mode, a MAC): whoever reads /kv_state without the key
cannot test guessed API keys or salts against it. A replica's key is random per process unless
configured (`ServerConfig.affinity_secret`); a router that should find tenants' pages on its
replicas is configured with the same secret (`RouterConfig.affinity_secret`). Requests carrying
none of the three share the fixed key `DEFAULT_AFFINITY`, which hides nothing.
The replica remembers the affinity keys of the requests it served last (`AffinityBook`) and
reports each one's root, recomputed at every poll (a weights update changes them all).
"""

from __future__ import annotations

import collections
import hashlib
import secrets
from collections.abc import Iterable
from typing import Any

from kvjax.engine.engine import Engine
from kvjax.memory.prefix_cache import hash_root

# Leading bytes of each page hash sent: 64 bits keep collisions out of reach for any cache
# size a replica holds, at half the bytes per poll.
HASH_PREFIX_BYTES = 8
# The affinity key of a request carrying no API key, tenant or salt (the replica's prefix_root).
DEFAULT_AFFINITY = "default"
# The key of this process's affinity digests when none is configured: they then match no
# other process's, so they say nothing about the requests to anyone without it.
_PROCESS_SECRET = secrets.token_bytes(32)


def affinity_secret(secret: str | None) -> bytes:
    """The digest key of a configured secret (any length; None: this process's random key)."""
    if secret is None:
        return _PROCESS_SECRET
    if not secret:
        raise ValueError("affinity_secret must be a non-empty string or None")
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"kvjax-aff-key").digest()


def read_affinity_secret(path: str | None) -> str | None:
    """The secret in the file at `path` (surrounding whitespace dropped), or None without one."""
    if path is None:
        return None
    with open(path) as f:
        return f.read().strip()


def affinity_key(authorization: str | None, tenant: str | None, cache_salt: str | None, *,
                 secret: str | None = None) -> str:
    """The key under which a replica reports the prefix-chain root of requests carrying this
    Authorization header, naming this tenant (X-Tenant, else the body's `user`) and this
    cache_salt: hex of a BLAKE2b digest keyed by `affinity_secret(secret)`, or
    `DEFAULT_AFFINITY` when all three are None. Requests with equal keys have their pages cached
    under one root on a replica."""
    if authorization is None and tenant is None and cache_salt is None:
        return DEFAULT_AFFINITY
    digest = hashlib.blake2b(digest_size=HASH_PREFIX_BYTES, key=affinity_secret(secret),
                             person=b"kvjax-affinity")
    for part in (authorization, tenant, cache_salt):  # None and "" differ; lengths delimit
        data = b"" if part is None else part.encode()
        digest.update(bytes([part is not None]) + len(data).to_bytes(4, "little") + data)
    return digest.hexdigest()


class AffinityBook:
    """The (tenant, cache_salt) of the `capacity` affinity keys a replica served last.

    Written by the server as it admits requests, read (as a copy) by `kv_state`."""

    def __init__(self, capacity: int = 1024):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, tuple[str | None, str | None]] = (
            collections.OrderedDict())

    def record(self, key: str, tenant: str | None, cache_salt: str | None) -> None:
        self._entries[key] = (tenant, cache_salt)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def entries(self) -> list[tuple[str, str | None, str | None]]:
        """(affinity key, tenant, cache_salt), least recently served first."""
        return [(key, tenant, salt) for key, (tenant, salt) in self._entries.items()]


def kv_state(engine: Engine,
             affinities: Iterable[tuple[str, str | None, str | None]] = ()) -> dict[str, Any]:
    """The engine's load and prefix-cache index as JSON (call it on the engine thread).

    Keys: page_size; num_pages, num_free_pages (allocatable: free, or cached and
    unreferenced); num_running, num_waiting (sequences); queued_prefill_tokens (prompt tokens
    of running and waiting sequences not computed yet); prefix_root (hex hash of the default
    tenant's chain root); prefix_hashes (hex of the first `HASH_PREFIX_BYTES` bytes of every
    indexed page's hash; empty without a prefix cache); prefix_roots (affinity key -> hex of
    the chain root its requests' pages hash under, for each of `affinities`: (affinity key,
    tenant, cache_salt) triples, `AffinityBook.entries`).
    """
    scheduler = engine.scheduler
    queued = sum(max(0, s.num_prompt_tokens - s.num_computed)
                 for s in (*scheduler.running, *scheduler.waiting))
    prefix_cache = getattr(engine.allocator, "prefix_cache", None)
    hashes = [] if prefix_cache is None else prefix_cache.page_hashes()
    return dict(
        page_size=engine.config.page_size, num_pages=engine.num_pages,
        num_free_pages=engine.allocator.num_free_pages(), num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting), queued_prefill_tokens=queued,
        prefix_root=hash_root(engine.provenance(None)).hex(),
        prefix_hashes=[h[:HASH_PREFIX_BYTES].hex() for h in hashes],
        prefix_roots={key: hash_root(scheduler.prefix_cache_key(
            tenant, salt, engine.model.weights_version)).hex()
            for key, tenant, salt in affinities})
