"""Admission: a waiting sequence's prefix-cache lookup, and through the host and disk tiers,
prefix hits that continue below the device pool, prefetches that overlap a step, and swap-ins
that arrive as checked tier loads."""

from __future__ import annotations

from kvjax.memory.prefix_cache import page_hash_chain
from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.keys import CacheKeys
from kvjax.scheduler.policies import SchedulingPolicy, rank
from kvjax.scheduler.request import SeqStatus, Sequence
from kvjax.scheduler.requests import RequestTable
from kvjax.shapes import pages_for


class TierAdmission:
    """Brings sequences' KV onto the device for the scheduler: prefix hits, tier loads and
    swap-ins.

    Attributes:
      config: the SchedulerConfig.
      kv_cache: the KVCacheManager (and its `tiers`, None without tiers).
      table: the RequestTable whose queues the sequences move between.
      keys: the CacheKeys a lookup hashes under.
      policy: the SchedulingPolicy ranking the prefetches.
    """

    def __init__(self, config: SchedulerConfig, kv_cache, table: RequestTable, keys: CacheKeys,
                 policy: SchedulingPolicy, stats: dict):
        self.config = config
        self.kv_cache = kv_cache
        self.table = table
        self.keys = keys
        self.policy = policy
        self.stats = stats
        self._tier_first_page: dict[str, int] = {}  # swapped sequence -> its first loaded page
        self.stats.update(tier_hit_tokens=0, tier_swap_restarts=0, prefix_waits=0)

    @property
    def _tiers(self):
        return self.kv_cache.tiers

    def receive(self, landed) -> None:
        """The runner's reports of tier transfers that landed (`TierLanded`) go to the tiers'
        ledger; the next poll verifies and commits them."""
        if self._tiers is not None and landed:
            self._tiers.receive(landed)

    def poll(self, owner: str | None = None) -> None:
        """Advances tier transfers; sequences whose loads finished get their pages counted."""
        page_size = self.config.page_size
        for result in self.kv_cache.poll_tiers(owner):
            seq = self.table.sequence(result.owner)
            swapped = seq.status is SeqStatus.SWAPPED
            first = (self._tier_first_page.pop(seq.seq_id) if swapped
                     else seq.num_computed // page_size)
            table = self.kv_cache.block_table(seq.seq_id)
            self.kv_cache.mark_written(table[first:first + result.num_loaded],
                                       seq.weights_version)
            if swapped:
                if self._finish_swap_in(seq, first + result.num_loaded):
                    self.table.swapped.remove(seq)
                    self.table.running.append(seq)
                continue
            gained = result.num_loaded * page_size
            if gained:
                seq.num_computed += gained
                self.kv_cache.floors.attach_loaded(seq.seq_id, seq.num_computed)
                self.kv_cache.commit(seq.seq_id, seq.tokens[:seq.num_computed])
                self.stats["tier_hit_tokens"] += gained
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt_tokens = min(seq.num_computed, seq.num_prompt_tokens)

    def prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether a running sequence under the same cache key is still computing a full page of
        `seq`'s prompt (several prompts with one system prompt arriving together): `seq` then
        waits and hits those pages once they are committed, instead of computing them again in
        the same steps. Only a plain prompt not yet preempted waits, and not under a shared salt
        whose hits are hidden (`hide_shared_prefix_hits`: its wait would time another tenant's
        prefill)."""
        if (not self.kv_cache.has_prefix_cache or seq.num_preemptions or seq.is_chunk_fill
                or self.keys.hides_hits(seq)):
            return False
        # The page another prefill computes next is `seq`'s when their hash chains (which
        # seed on the cache key) meet there: one hash per sequence, not their tokens compared.
        page, key, chain = self.config.page_size, None, []
        for other in self.table.running:
            upto = other.num_computed // page * page + page  # through its next full page
            if (other.num_computed >= other.num_prompt_tokens
                    or upto > min(seq.num_prompt_tokens, other.num_prompt_tokens)):
                continue
            key = key if key is not None else self.keys.cache_key(seq)
            chain = page_hash_chain(seq.tokens[:upto], key, page, chain)
            if chain[upto // page - 1] == self.kv_cache.last_page_hash(other.seq_id,
                                                                       other.tokens[:upto]):
                self.stats["prefix_waits"] += 1
                return True
        return False

    def admit(self, seq: Sequence, *, is_due: bool = True) -> bool:
        """Registers a waiting sequence with the KV cache (prefix-cache lookup).

        With tiers on, the hash chain continues in the host and disk tiers; False while pages
        found there are loading (the sequence is scheduled only once they are committed).
        `is_due`: the scheduler wants to run it this step (False: a prefetch).
        """
        if self._tiers is not None and self.kv_cache.has_sequence(seq.seq_id):
            return not self._tiers.is_loading(seq.seq_id)
        key = self.keys.cache_key(seq)
        cached = self.kv_cache.lookup(seq.seq_id, seq.tokens, key,
                                      max_hit=self.keys.hit_cap(seq, key))
        seq.num_computed = cached
        if self.kv_cache.has_prefix_cache:
            self.table.tracer.emit("prefix_hit" if cached else "prefix_miss", "page",
                             f"request/{seq.request_id}", seq_id=seq.seq_id,
                             tenant=str(self.table.request_meta(seq.request_id)["tenant"]),
                             tokens=len(seq.tokens), hit_tokens=cached)
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
        return self._load_from_tiers(seq, is_due=is_due)

    def swap_in(self, seq: Sequence) -> bool:
        """Brings a swapped sequence's KV back (through the tiers with tiers on); True when it
        can run now."""
        if self._tiers is not None:
            return self._swap_in_from_tiers(seq)
        if not self.kv_cache.swap_in(seq.seq_id, seq.tokens, seq.num_computed,
                                     self.keys.cache_key(seq), seq.weights_version):
            return False
        seq.status = SeqStatus.RUNNING
        self.table.tracer.emit("resume", "request", f"request/{seq.request_id}", seq_id=seq.seq_id)
        return True

    def _tier_hit(self, seq: Sequence, cache_key: bytes, first_page: int) -> list[bytes]:
        """Hashes of the pages after `first_page` that the tiers hold, in chain order (within
        what the sequence may hit, `CacheKeys.hit_cap`)."""
        hashes = page_hash_chain(seq.tokens[:len(seq.tokens) - 1], cache_key,
                                 self.config.page_size)[first_page:]
        hashes = hashes[:self._tiers.lookup(hashes)]
        cap = self.keys.hit_cap(seq, cache_key)
        return hashes if cap is None else hashes[:max(0, cap // self.config.page_size
                                                      - first_page)]

    def _load_from_tiers(self, seq: Sequence, *, is_due: bool) -> bool:
        """Issues loads of the pages continuing an admitted sequence's device prefix hit.

        A sequence due to run now waits for its load at once: there is no compute to overlap
        the wait with, and joining the next step instead costs a whole step and staggers the
        batch. Prefetches (and spills) stay asynchronous.

        Returns False while a load is in flight (the sequence waits for it), else True.
        """
        tiers = self._tiers
        if (tiers is None or not self.kv_cache.has_prefix_cache
                or tiers.num_loading >= self.config.max_inflight_loads):
            return True
        page_size = self.config.page_size
        first = seq.num_computed // page_size
        hashes = self._tier_hit(seq, self.kv_cache.cache_key_of(seq.seq_id), first)
        # Load only when the whole sequence then fits: loaded pages held by a sequence that
        # cannot run would only squeeze the running ones into preemption.
        if not hashes or not self.kv_cache.can_admit(pages_for(len(seq.tokens), page_size)
                                                     - first):
            return True
        if not self.kv_cache.allocate(seq.seq_id, seq.num_computed,
                                      seq.num_computed + len(hashes) * page_size):
            return True
        pages = self.kv_cache.block_table(seq.seq_id)[first:first + len(hashes)]
        if tiers.load(seq.seq_id, hashes, pages) == 0:
            return True
        if is_due:
            self.poll(owner=seq.seq_id)
        return not tiers.is_loading(seq.seq_id)

    def prefetch(self, *, idle: bool) -> None:
        """Admits the next waiting sequences, in queue order, whose prefix continues in the
        tiers, so their loads overlap this step instead of starting when the scheduler reaches
        them; it never passes a sequence it cannot prefetch, so it takes no pages ahead of it.

        A step with nothing to run waits for the transfers in flight instead of spinning, and
        releases waiting sequences that hold pages without loading: the queue's head may need
        them, and their loaded pages stay in the device prefix cache.
        """
        tiers = self._tiers
        if tiers is None:
            return
        if idle:
            tiers.block_until_landed()
            for seq in list(self.table.waiting):
                if self.kv_cache.has_sequence(seq.seq_id) and not tiers.is_loading(seq.seq_id):
                    self.kv_cache.free(seq.seq_id)
                    seq.num_computed = 0
        if not self.kv_cache.has_prefix_cache:
            return
        max_loads = self.config.max_inflight_loads
        for seq in rank(self.policy, self.table.waiting)[:max_loads]:
            if (tiers.num_loading >= max_loads
                    or len(self.table.running) >= self.config.max_num_seqs):
                break
            if self.kv_cache.has_sequence(seq.seq_id):
                continue
            key = self.keys.cache_key(seq)
            first = self.kv_cache.peek_cached_tokens(seq.tokens, key) // self.config.page_size
            hit = self._tier_hit(seq, key, first)
            if not hit or not self.kv_cache.can_admit(
                    pages_for(len(seq.tokens), self.config.page_size) - first):
                break
            self.admit(seq, is_due=False)

    def _swap_in_from_tiers(self, seq: Sequence) -> bool:
        """Starts (or finishes) bringing a swapped sequence back through the tiers.

        Pages still on the device through the prefix cache are reused; the rest are loaded from
        the tiers, and whatever the tiers lost or failed to move is recomputed. True when the
        sequence can run now; False while its load is in flight (`poll` resumes it).
        """
        tiers = self._tiers
        if (tiers.is_loading(seq.seq_id) or tiers.swap_pending(seq.seq_id)
                or len(self.table.running) + tiers.num_loading >= self.config.max_num_seqs):
            return False
        keys = tiers.swap_keys(seq.seq_id)
        cached = self.kv_cache.returning.register(seq.seq_id, seq.tokens, seq.num_computed,
                                                  tiers.swap_cache_key(seq.seq_id))
        if cached is None:
            return False
        self.kv_cache.restore_window(seq.seq_id)
        first = cached // self.config.page_size
        available = keys[first:][:tiers.lookup(keys[first:])]
        pages = self.kv_cache.block_table(seq.seq_id)[first:first + len(available)]
        issued = tiers.load(seq.seq_id, available, pages)
        self.stats["swaps_in"] += 1
        self.stats["swap_bytes"] += issued * tiers.page_bytes
        if issued:
            self._tier_first_page[seq.seq_id] = first
            return False
        return self._finish_swap_in(seq, first)

    def _finish_swap_in(self, seq: Sequence, num_valid_pages: int) -> bool:
        """The first `num_valid_pages` pages hold the sequence's KV; the rest is recomputed.

        A lost tail cannot be recomputed from a page boundary when retention compacted the
        sequence (its pages hold a subset of its tokens, in the policy's order) or when its
        state beside the pages (a KIVI window) belongs to its last token: it restarts from its
        tokens instead. False then.
        """
        self._tiers.drop(seq.seq_id)
        valid = num_valid_pages * self.config.page_size
        held = self.kv_cache.cached_len(seq.seq_id, seq.num_computed)
        if valid < held:
            if held < seq.num_computed or self.kv_cache.keeps_windows:
                self.stats["tier_swap_restarts"] += 1
                self.table.restart(seq)
                return False
            seq.num_computed = valid
        seq.status = SeqStatus.RUNNING
        self.table.tracer.emit("resume", "request", f"request/{seq.request_id}", seq_id=seq.seq_id,
                         num_valid_pages=num_valid_pages)
        return True
