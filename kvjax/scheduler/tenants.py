"""Which tenants contend for the engine now, and which of them has had more than its share.

Host bookkeeping for the scheduler's contended-chunk rule (`EngineConfig.contended_prefill_chunk`):
a step is not preemptible, so a request that arrives while another tenant's long prefill chunk
runs waits for that chunk. While another tenant is active, the tenant served more than it gets
shorter chunks: the other's requests wait at most one short step, and the busy tenant alone
keeps full chunks (its throughput is spent only while someone else is waiting or just was).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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
