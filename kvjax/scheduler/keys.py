"""The provenance keys a sequence's pages are cached under, and what a tenant may hit under a
shared cache salt (`HitLedger`)."""

from __future__ import annotations

from collections.abc import Callable

from kvjax.memory.prefix_cache import HitLedger, page_hash_chain
from kvjax.scheduler.chunks import ChunkReuse
from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.request import SeqStatus, Sequence
from kvjax.scheduler.requests import RequestTable


class CacheKeys:
    """Cache keys of the scheduler's sequences, and the hit caps of shared salts.

    Attributes:
      ledger: the HitLedger of the pages each tenant paid for under a shared salt (None
        without `hide_shared_hits`).
    """

    def __init__(self, config: SchedulerConfig, kv_cache, table: RequestTable,
                 chunks: ChunkReuse, *, cache_key: Callable[[str | None, str], bytes]):
        self.config = config
        self.kv_cache = kv_cache
        self.table = table
        self.chunks = chunks
        self._cache_key = cache_key
        self.ledger = HitLedger() if config.hide_shared_hits else None

    def cache_key(self, seq: Sequence) -> bytes:
        """The provenance fingerprint a sequence's pages are cached under.

        A chunk fill's pages are chunk-cache entries (the chunk marker); a sequence that copies
        chunks in holds KV that depends on the strategy and the spans, which its key names."""
        if seq.is_chunk_fill:
            return self.chunks.chunk_key(seq)
        key = self.prefix_cache_key(seq.tenant, self.table.cache_salt(seq), seq.weights_version)
        strategy = self.chunks.strategy(seq.context_reuse)
        if seq.chunk_spans and strategy.reuses:
            spans = ",".join(f"{a}-{b}" for a, b in seq.chunk_spans)
            key += f"|reuse={strategy.fingerprint}|spans={spans}".encode()
        return key

    def prefix_cache_key(self, tenant: str | None, cache_salt: str | None,
                         weights_version: str) -> bytes:
        """The cache key of a plain prompt's pages: its tenant's provenance, or under a shared
        `cache_salt`, the default tenant's with the salt (shared by every tenant naming it)."""
        if cache_salt is None:
            return self._cache_key(tenant, weights_version)
        return self._cache_key(None, weights_version) + b"|salt=" + cache_salt.encode()

    def hides_hits(self, seq: Sequence) -> bool:
        """Whether the sequence's hits are capped to what its tenant paid for: a shared salt
        under `hide_shared_hits`."""
        return self.ledger is not None and self.table.cache_salt(seq) is not None

    def hit_cap(self, seq: Sequence, key: bytes) -> int | None:
        """At most how many leading tokens the sequence may hit (None: any): under a shared
        salt with `hide_shared_hits`, the pages its tenant has paid for (`HitLedger`)."""
        if not self.hides_hits(seq):
            return None
        hashes = page_hash_chain(seq.tokens[:-1], key, self.config.page_size)
        return self.ledger.allowed_pages(seq.tenant, hashes) * self.config.page_size

    def pay_for_pages(self, seq: Sequence) -> None:
        """Records the full prompt pages a sequence computed as paid for by its tenant."""
        if self.ledger is None or seq.is_chunk_fill or self.table.cache_salt(seq) is None:
            return
        # Each chunk hashes only its new full pages: the chain so far is kept on the sequence
        # (until its cache key changes with the weights).
        key, (paid_key, known) = self.cache_key(seq), seq.paid_chain
        known = known if paid_key == key else []
        done = seq.tokens[:min(seq.num_computed, seq.num_prompt_tokens)]
        hashes = page_hash_chain(done, key, self.config.page_size, known)
        self.ledger.record(seq.tenant, hashes[len(known):])
        seq.paid_chain = (key, hashes)

    def peek_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence the prefix cache would hit now (0 for any other)."""
        if seq.status is not SeqStatus.WAITING:
            return 0
        key = self.cache_key(seq)
        return self.kv_cache.peek_cached_tokens(seq.tokens, key, self.hit_cap(seq, key))
