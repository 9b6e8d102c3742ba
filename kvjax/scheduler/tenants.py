"""Which tenants contend for the engine now, and which of them has had more than its share.

Host bookkeeping for the scheduler's contended-chunk rule (`EngineConfig.contended_prefill_chunk`):
a step is not preemptible, so a request that arrives while another tenant's long prefill chunk
runs waits for that chunk. While another tenant is active, the tenant served more than it gets
shorter chunks: the other's requests wait at most one short step, and the busy tenant alone
keeps full chunks (its throughput is spent only while someone else is waiting or just was).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvjax.shapes import pages_for

if TYPE_CHECKING:
    from kvjax.scheduler.config import SchedulerConfig
    from kvjax.scheduler.request import Sequence
    from kvjax.scheduler.requests import RequestTable

_FORGET_WINDOWS = 8  # exp(-8): under 0.04% of a tenant's service is left


class TenantActivity:
    """Recent activity and recent service of each tenant, on the scheduler's clock.

    A tenant is active while it has an unfinished request, and for `window_s` seconds after
    its last one. Its recent service is the tokens computed for it, decayed with time constant
    `window_s`, so a tenant busy long ago is not held back today and a newcomer starts at 0.

    Attributes:
      window_s: seconds a tenant stays active after its last unfinished request, and the
        time constant of the decay of its service.
    """

    def __init__(self, window_s: float):
        if not window_s > 0:
            raise ValueError(f"contention window must be > 0 seconds, got {window_s!r}")
        self.window_s = window_s
        self._last_active: dict[str | None, float] = {}
        self._served: dict[str | None, tuple[float, float]] = {}  # tenant: (tokens, as of)

    def observe(self, tenants: Iterable[str | None], now: float) -> None:
        """Marks the tenants with unfinished requests as active at `now`, and forgets those
        idle for `_FORGET_WINDOWS` windows (their decayed service is then negligible), so
        tenant names do not accumulate."""
        for tenant in tenants:
            self._last_active[tenant] = now
        horizon = now - _FORGET_WINDOWS * self.window_s
        for tenant in [t for t, last in self._last_active.items() if last < horizon]:
            del self._last_active[tenant]
            self._served.pop(tenant, None)

    def on_tokens(self, tenant: str | None, num_tokens: int, now: float) -> None:
        """Counts `num_tokens` computed for the tenant at `now`."""
        self._served[tenant] = (self.served(tenant, now) + num_tokens, now)

    def served(self, tenant: str | None, now: float) -> float:
        """The tenant's tokens computed, each weighted by exp(-age / window_s)."""
        tokens, since = self._served.get(tenant, (0.0, now))
        return tokens * math.exp(-max(now - since, 0.0) / self.window_s)

    def is_over_share(self, tenant: str | None, now: float) -> bool:
        """Whether another tenant active within the window has been served less recently."""
        mine = self.served(tenant, now)
        return any(other != tenant and now - last <= self.window_s
                   and self.served(other, now) < mine
                   for other, last in self._last_active.items())


class TenantShares:
    """The scheduler's tenant rules: the page share a tenant may hold while another waits
    (`max_tenant_page_share`), and shorter prefill chunks for a tenant served more than a
    contending one (`contended_prefill_chunk`, through `TenantActivity`).

    Attributes:
      config: the SchedulerConfig.
      kv_cache: the KVCacheManager whose pages are counted.
      table: the RequestTable whose queues hold the tenants' sequences.
      activity: the TenantActivity, None without `contended_prefill_chunk`.
    """

    def __init__(self, config: SchedulerConfig, kv_cache, table: RequestTable, *,
                 clock: Callable[[], float]):
        self.config = config
        self.kv_cache = kv_cache
        self.table = table
        self._clock = clock
        self.activity = (None if config.contended_prefill_chunk is None
                         else TenantActivity(config.contention_window_s))

    def observe(self) -> float:
        """Marks the tenants with queued sequences active now; returns now (0.0 without the
        contended-chunk rule, the only reader)."""
        if self.activity is None:
            return 0.0
        now = self._clock()
        t = self.table
        self.activity.observe({s.tenant for s in t.running + t.waiting + t.swapped}, now)
        return now

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        if self.activity is not None:
            self.activity.on_tokens(seq.tenant, num_tokens, self._clock())

    def chunk_limit(self, seq: Sequence, now: float) -> int:
        """The longest prefill chunk the sequence may run in this step: `max_prefill_chunk`,
        or `contended_prefill_chunk` while its tenant has been served more than another
        tenant active now or within the contention window (`TenantActivity`)."""
        if self.activity is not None and self.activity.is_over_share(seq.tenant, now):
            return self.config.contended_prefill_chunk
        return self.config.max_prefill_chunk

    def _pages(self, tenant: str | None) -> int:
        """Distinct device pages the tenant's running sequences hold (a shared prefix once)."""
        return len(set().union(*(self.kv_cache.block_table(s.seq_id) for s in self.table.running
                                 if s.tenant == tenant)))

    def is_over_share(self, seq: Sequence) -> bool:
        """Whether a waiting sequence's tenant already holds its share of the pool
        (`max_tenant_page_share`) while another tenant waits: then it waits too. Alone, a
        tenant may take the whole pool (the limit never idles pages)."""
        share = self.config.max_tenant_page_share
        if share is None or all(s.tenant == seq.tenant for s in self.table.waiting):
            return False
        return self._pages(seq.tenant) >= share * self.kv_cache.num_pages

    def reclaim_candidates(self, ranked_waiting: list[Sequence]) -> list[Sequence]:
        """The running sequences of tenants over their share, one of which is preempted when
        the first waiting sequence (in `ranked_waiting` order) of a tenant under it finds no
        room for its first chunk; none without a share or when it fits."""
        share = self.config.max_tenant_page_share
        if share is None:
            return []
        limit = share * self.kv_cache.num_pages
        running = self.table.running
        held = {t: self._pages(t) for t in {s.tenant for s in running + self.table.waiting}}
        under = next((s for s in ranked_waiting if held[s.tenant] < limit), None)
        if under is None:
            return []
        first_chunk = min(under.num_pending, self.config.max_prefill_chunk)
        if self.kv_cache.can_admit(pages_for(first_chunk, self.config.page_size)):
            return []
        return [s for s in running if s.tenant != under.tenant
                and held[s.tenant] > limit and not s.awaits_step_in_flight]
