"""What a router weighs when it sends a request to this server: GET /kv_state.

A router in front of several servers (`kvjax.router.http`) polls it to choose a replica with
its live state instead of its own guesses: load (running and waiting sequences, prompt tokens
still to prefill), free KV pages, and the prefix cache's index. Prefix-cache page hashes are
BLAKE2b hash chains (`kvjax.memory.prefix_cache`), equal across processes, so a router that
knows the chain's root and the page size tests a prompt's pages against the set without asking
the replica again.
"""

from __future__ import annotations

from typing import Any

from kvjax.engine.engine import Engine
from kvjax.memory.prefix_cache import hash_root

# Leading bytes of each page hash sent: 64 bits keep collisions out of reach for any cache
# size a replica holds, at half the bytes per poll.
HASH_PREFIX_BYTES = 8


def kv_state(engine: Engine) -> dict[str, Any]:
    """The engine's load and prefix-cache index as JSON (call it on the engine thread).

    Keys: page_size; num_pages, num_free_pages (allocatable: free, or cached and
    unreferenced); num_running, num_waiting (sequences); queued_prefill_tokens (prompt tokens
    of running and waiting sequences not computed yet); prefix_root (hex hash of the default
    tenant's chain root); prefix_hashes (hex of the first `HASH_PREFIX_BYTES` bytes of every
    indexed page's hash; empty without a prefix cache).
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
        prefix_hashes=[h[:HASH_PREFIX_BYTES].hex() for h in hashes])
