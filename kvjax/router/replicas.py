"""The server replicas behind an HTTP router, as its routing policies see them.

Each replica is a kvjax server (`scripts/serve.py`) given by its base URL. The router polls
every replica's GET /health and GET /kv_state (`kvjax.server.kv_state`) every
`poll_interval_s`; a replica whose /health fails (refused, non-200, or several timeouts in a
row), or whose connection fails a request, leaves the rotation until a poll finds it healthy.
A policy sees one `InstanceState` per healthy replica: the load the replica last reported,
or what the router itself has in flight there when that is more (requests sent since the
poll), and how many leading pages of the prompt the replica's prefix cache holds or is
computing for a request the router sent it.

Prefix pages are matched by hash: the prompt's page-hash chain (`kvjax.memory.prefix_cache`,
seeded by the replica's root for the request's tenant) tested against the hashes the replica
reported. A tenant's root (its provenance, or its cache_salt's key) is the replica's to compute,
since only it knows which tenant an API key runs as and what a salt names; it reports the root
of each affinity key it served lately (`kvjax.server.kv_state.affinity_key`: a digest of the
Authorization header, the named tenant and the cache_salt, which the router computes from the
same request). Before a replica has reported a key's root, the router chains that key's prompts
from a root of its own: they match no cached page there, but do match the key's requests the
router sent there and that have not ended, so a tenant's burst still lands together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

import httpx

from kvjax.memory.prefix_cache import hash_page, hash_root
from kvjax.router.policies import InstanceState
from kvjax.server.kv_state import DEFAULT_AFFINITY, HASH_PREFIX_BYTES

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ReplicaState:
    """One poll of a replica's GET /kv_state (see `kvjax.server.kv_state.kv_state`)."""

    page_size: int
    num_pages: int
    num_free_pages: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    prefix_root: bytes
    prefix_hashes: frozenset[str]
    prefix_roots: dict[str, bytes] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> ReplicaState:
        return cls(page_size=int(data["page_size"]), num_pages=int(data["num_pages"]),
                   num_free_pages=int(data["num_free_pages"]),
                   num_running=int(data["num_running"]), num_waiting=int(data["num_waiting"]),
                   queued_prefill_tokens=int(data["queued_prefill_tokens"]),
                   prefix_root=bytes.fromhex(data["prefix_root"]),
                   prefix_hashes=frozenset(data["prefix_hashes"]),
                   prefix_roots={str(k): bytes.fromhex(v)
                                 for k, v in data.get("prefix_roots", {}).items()})

    def root(self, affinity: str) -> bytes:
        """The chain root of the affinity key's prompts here (see the module docstring)."""
        if affinity in self.prefix_roots:
            return self.prefix_roots[affinity]
        if affinity == DEFAULT_AFFINITY:
            return self.prefix_root
        return hash_root(b"kvjax-router-unreported|" + affinity.encode())


def prompt_page_hashes(prompt_ids: Sequence[int], root: bytes, page_size: int) -> list[str]:
    """The hex hash prefixes of the prompt's full pages, chained from `root`, as a replica's
    prefix cache would index them (never the page holding the prompt's last token: the
    replica computes that token again)."""
    hashes, parent = [], root
    usable = len(prompt_ids) - 1
    for start in range(0, usable - page_size + 1, page_size):
        parent = hash_page(parent, prompt_ids[start:start + page_size])
        hashes.append(parent[:HASH_PREFIX_BYTES].hex())
    return hashes


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A request the router sent to a replica and has not seen end.

    Attributes:
      num_tokens: prompt tokens plus max new tokens (0 when the router did not tokenize it).
      page_hashes: its prompt's page hashes on that replica (empty when not tokenized).
    """

    num_tokens: int
    page_hashes: tuple[str, ...] = ()


class Replica:
    """A server replica: its URL, health, last polled state and the router's requests there.

    Attributes:
      url: base URL (http://host:port).
      is_healthy: in the rotation.
      state: the last successful /kv_state poll, or None before the first.
      in_flight: request id -> InFlight, the router's requests not yet ended.
    """

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.is_healthy = False
        self.state: ReplicaState | None = None
        self.in_flight: dict[str, InFlight] = {}

    def prompt_hashes(self, prompt_ids: Sequence[int] | None,
                      affinity: str = DEFAULT_AFFINITY) -> tuple[str, ...]:
        """The prompt's page hashes as this replica would index them for requests with this
        affinity key (`kvjax.server.kv_state.affinity_key`)."""
        if not prompt_ids or self.state is None:
            return ()
        return tuple(prompt_page_hashes(prompt_ids, self.state.root(affinity),
                                        self.state.page_size))

    def instance_state(self, page_hashes: Sequence[str]) -> InstanceState:
        """What a policy sees of this replica for a prompt with these page hashes."""
        routed_seqs = len(self.in_flight)
        routed_tokens = sum(r.num_tokens for r in self.in_flight.values())
        s = self.state
        if s is None:
            return InstanceState(num_seqs=routed_seqs, num_tokens=routed_tokens)
        held = (s.num_pages - s.num_free_pages) * s.page_size + s.queued_prefill_tokens
        computing = {h for r in self.in_flight.values() for h in r.page_hashes}
        num_pages = 0
        for h in page_hashes:  # A chain hash matches only if every page before it does.
            if h not in s.prefix_hashes and h not in computing:
                break
            num_pages += 1
        return InstanceState(num_seqs=max(s.num_running + s.num_waiting, routed_seqs),
                             num_tokens=max(held, routed_tokens),
                             prefix_tokens=num_pages * s.page_size)


class ReplicaSet:
    """The replicas and the poll loop that keeps their health and state current.

    Attributes:
      replicas: in the order given (a policy's instance index is into the healthy ones).
      poll_interval_s: seconds between polls of each replica.
    """

    def __init__(self, urls: Sequence[str], client: httpx.AsyncClient, *,
                 poll_interval_s: float = 0.1, poll_timeout_s: float = 2.0,
                 max_missed_polls: int = 3, headers: dict[str, str] | None = None):
        if not urls:
            raise ValueError("a router needs at least one replica URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"replica URLs repeat: {list(urls)}")
        if max_missed_polls < 1:
            raise ValueError(f"max_missed_polls must be >= 1, got {max_missed_polls!r}")
        self.replicas = [Replica(url) for url in urls]
        self.poll_interval_s = poll_interval_s
        self.max_missed_polls = max_missed_polls
        self._client = client
        self._timeout = httpx.Timeout(poll_timeout_s)
        self._headers = headers or {}
        self._missed = {r.url: 0 for r in self.replicas}
        self._tasks: list[asyncio.Task] = []

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.is_healthy]

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Takes a replica out of the rotation until a poll finds it healthy."""
        if replica.is_healthy:
            logger.warning("replica %s left the rotation: %s", replica.url, reason)
        replica.is_healthy = False

    async def poll_replica(self, replica: Replica) -> None:
        """Health first: a refused connection or a non-200 /health (draining, failed) takes
        the replica out at once; `max_missed_polls` timeouts in a row (a process stopped,
        not dead) too. Then its state: a slow /kv_state (it waits for the engine's step)
        keeps the last one and says nothing of health."""
        try:
            health = await self._client.get(replica.url + "/health", timeout=self._timeout)
        except httpx.TimeoutException:
            self._missed[replica.url] += 1
            if self._missed[replica.url] >= self.max_missed_polls:
                self.mark_down(replica, f"{self._missed[replica.url]} health polls timed out")
            return
        except httpx.HTTPError as e:
            self.mark_down(replica, f"health poll failed: {e!r}")
            return
        self._missed[replica.url] = 0
        if health.status_code != 200:
            self.mark_down(replica, f"/health answered {health.status_code}")
            return
        try:
            answer = await self._client.get(replica.url + "/kv_state", timeout=self._timeout,
                                            headers=self._headers)
            answer.raise_for_status()
            replica.state = ReplicaState.from_json(answer.json())
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.info("replica %s: /kv_state poll failed (%r); keeping its last state",
                        replica.url, e)
        if not replica.is_healthy:
            logger.info("replica %s is in the rotation", replica.url)
        replica.is_healthy = True

    async def poll_once(self) -> None:
        """Polls every replica once, concurrently."""
        await asyncio.gather(*(self.poll_replica(r) for r in self.replicas))

    async def _poll_forever(self, replica: Replica) -> None:
        while True:  # One loop per replica: a slow one delays no other's polls.
            try:
                await self.poll_replica(replica)
            except Exception as e:  # The loop must outlive any failure, or it never returns.
                logger.exception("polling replica %s failed", replica.url)
                self.mark_down(replica, f"poll failed: {e!r}")
            await asyncio.sleep(self.poll_interval_s)

    def start(self) -> None:
        """Starts polling in the running event loop."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_forever(r)) for r in self.replicas]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
