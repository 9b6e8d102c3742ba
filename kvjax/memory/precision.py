"""The precision ledger: each page's class in a mixed-precision pool, and the bytes pages hold.

A mixed-precision pool (`kvjax.kv.mixed`) stores every row in words sized for its exact form,
so demoting a page in place frees no device memory by itself; what it frees is counted here,
in bytes, against the pool's byte budget. The pool is given more page slots than the budget
buys at the write class (`num_page_slots`: as many as it buys with every page at the coarsest
class), and a page may be allocated only while the bytes held leave room for it at the write
class (`can_hold`). Demoting a page lowers the bytes it holds by the difference of the two
classes' page bytes (`kvjax.kv.spec.KVCacheSpec.page_bytes_at`), and that room goes to new
pages. Counting bytes, rather than cutting frames into class-sized sub-pages, keeps a demoted
page where it is: same page id, same block-table entry, no copy and no allocator of several
page sizes; the price is device buffers sized for the slots, not for the budget.

A block manager draws its pages through `LedgerPages`, so what it reports free
(`BlockManager.num_free_pages`, which admission and preemption read) is what the byte budget has
room for: demoting a running sequence's pages makes room for more. The ledger is host data
(numpy, no jax): `demote` returns the `KVOpKind.DEMOTE` op the runner
applies in the step's dispatch. A page's class is the class its full rows take; a sequence's
last, partial page takes new rows at the write class, so only full pages are demoted
(`cold_pages`), and pages other sequences share (prefix-cache hits, forks) never are: their
other readers did not choose the rounding (the scheduler also keeps reused prefix-cache pages
exact: `kvjax.scheduler.inplace.InPlaceDemotion.protects`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvjax.kv.spec import PRECISION_BITS, KVCacheSpec, coarseness, coarser
from kvjax.memory.block_manager import FreeList
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.shapes import next_power_of_2

MIXED_CODEC = "mixed"  # EngineConfig.kv_codec of a mixed-precision pool


@dataclasses.dataclass(frozen=True)
class MixedOptions:
    """`EngineConfig.kv_codec_options` of `kv_codec="mixed"`.

    Attributes:
      write_bits: (key bits, value bits) new tokens are written at (0: exact; (8, 4): K8V4
        from the start).
      coarsest_k_bits: the coarsest class keys are ever demoted to (8: DiffKV's K8V4, keys
        kept at 8 bits while values go to 4).
      coarsest_v_bits: likewise for values.
      group: channels per scale and zero of the int4 class.
      keep_hits: in-place demotion keeps a prefix-cache page exact once lookups have reused
        it this often (`kvjax.scheduler.inplace.InPlaceDemotion.protects`); 0: keeps none.
    """

    write_bits: tuple[int, int] = (0, 0)
    coarsest_k_bits: int = 4
    coarsest_v_bits: int = 4
    group: int = 32
    keep_hits: int = 1

    def __post_init__(self):
        if not isinstance(self.write_bits, (tuple, list)) or len(self.write_bits) != 2:
            raise ValueError(f"kv_codec_options write_bits={self.write_bits!r}; expected "
                             f"(key bits, value bits)")
        object.__setattr__(self, "write_bits", tuple(self.write_bits))
        coarseness(self.write_bits[0], "write_bits key")
        coarseness(self.write_bits[1], "write_bits value")
        coarseness(self.coarsest_k_bits, "coarsest_k_bits")
        coarseness(self.coarsest_v_bits, "coarsest_v_bits")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group <= 0:
            raise ValueError(f"kv_codec_options group={self.group!r}; expected a positive int")
        if (isinstance(self.keep_hits, bool) or not isinstance(self.keep_hits, int)
                or self.keep_hits < 0):
            raise ValueError(f"kv_codec_options keep_hits={self.keep_hits!r}; expected an "
                             f"int >= 0")

    @classmethod
    def parse(cls, options: Mapping) -> MixedOptions:
        """The options of a config (ValueError naming an unknown one)."""
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"kv_codec='mixed' takes no option {sorted(unknown)}; expected "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**options)

    def classes(self) -> dict[int, tuple[int, int]]:
        """A controller's precision (0 exact, 8, 4) -> the (key, value) class pages demoted to
        it take: no finer than the write class, no coarser than the coarsest classes."""
        def at(bits: int, coarsest: int, written: int) -> int:
            capped = bits if coarseness(bits) <= coarseness(coarsest) else coarsest
            return coarser(capped, written)

        return {b: (at(b, self.coarsest_k_bits, self.write_bits[0]),
                    at(b, self.coarsest_v_bits, self.write_bits[1])) for b in PRECISION_BITS}


def num_page_slots(spec: KVCacheSpec, budget_bytes: float) -> int:
    """Page slots of a mixed-precision pool of `budget_bytes`: what it holds at the coarsest
    class (keys and values at 4 bits)."""
    coarsest = PRECISION_BITS[-1]
    num = int(budget_bytes // spec.page_bytes_at(coarsest, coarsest))
    if num < 1:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds no page")
    return num


class PrecisionLedger:
    """Each page's (key, value) class and the bytes the held pages take.

    Attributes:
      spec: the pool's spec (bytes per page of each class).
      budget_bytes: what the held pages may take.
      write_bits: the class newly written pages take.
      k_bits, v_bits: [num_pages] int8, each page's class (its full rows').
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int, budget_bytes: float,
                 write_bits: tuple[int, int] = (0, 0)):
        for bits in write_bits:
            coarseness(bits)
        self.spec = spec
        self.budget_bytes = float(budget_bytes)
        self.write_bits = (int(write_bits[0]), int(write_bits[1]))
        self.k_bits = np.full(num_pages, write_bits[0], np.int8)
        self.v_bits = np.full(num_pages, write_bits[1], np.int8)
        self._held: set[int] = set()
        self._page_bytes = {(kb, vb): spec.page_bytes_at(kb, vb)
                            for kb in PRECISION_BITS for vb in PRECISION_BITS}
        self.bytes_held = 0.0
        self.bytes_freed = 0.0  # by demotion, so far

    def page_bytes(self, page: int) -> float:
        return self._page_bytes[(int(self.k_bits[page]), int(self.v_bits[page]))]

    @property
    def write_page_bytes(self) -> float:
        return self._page_bytes[self.write_bits]

    def can_hold(self, num_pages: int) -> bool:
        """Whether `num_pages` new pages at the write class fit in the budget."""
        return self.bytes_held + num_pages * self.write_page_bytes <= self.budget_bytes + 1e-9

    def hold(self, pages: Iterable[int]) -> None:
        """Pages just allocated: they hold the write class's bytes (ValueError past the
        budget, naming the pages)."""
        pages = [int(p) for p in pages if int(p) not in self._held]
        if not self.can_hold(len(pages)):
            raise ValueError(f"pages {pages} at class k{self.write_bits[0]}v"
                             f"{self.write_bits[1]} exceed the KV budget of "
                             f"{self.budget_bytes:.0f} bytes ({self.bytes_held:.0f} held)")
        for p in pages:
            self.k_bits[p], self.v_bits[p] = self.write_bits
            self._held.add(p)
            self.bytes_held += self.write_page_bytes

    def release(self, pages: Iterable[int]) -> None:
        """Pages freed: their bytes return to the budget and their class to the write class
        (their rows are written again at it before anyone reads them)."""
        for p in (int(p) for p in pages):
            if p in self._held:
                self.bytes_held -= self.page_bytes(p)
                self._held.discard(p)
                self.k_bits[p], self.v_bits[p] = self.write_bits

    def cold_pages(self, block_table: Sequence[int], num_tokens: int, k_bits: int, v_bits: int,
                   *, shared: Iterable[int] = ()) -> list[int]:
        """A sequence's full pages that `demote` would change, oldest first (the coldest under
        recency: decode reads the newest tokens' neighbourhood most), none of `shared`."""
        shared = set(int(p) for p in shared)
        full = list(block_table[:num_tokens // self.spec.page_size])
        return [int(p) for p in full if int(p) not in shared
                and (coarser(int(self.k_bits[p]), k_bits) != self.k_bits[p]
                     or coarser(int(self.v_bits[p]), v_bits) != self.v_bits[p])]

    def demote(self, pages: Sequence[int], k_bits: int, v_bits: int, *,
               pad_to: int | None = None) -> KVOp | None:
        """Pages held re-encoded at the coarser of their class and (k_bits, v_bits): the
        bytes they free return to the budget; returns the `KVOpKind.DEMOTE` op (None when no
        page changes), its pages padded to the next power of two or to `pad_to` (one program
        for any count up to it). ValueError for a page not held, naming it."""
        coarseness(k_bits), coarseness(v_bits)
        changed = []
        for p in dict.fromkeys(int(p) for p in pages):
            if p not in self._held:
                raise ValueError(f"page {p} is not held: only a running sequence's pages are "
                                 f"demoted")
            new = (coarser(int(self.k_bits[p]), k_bits), coarser(int(self.v_bits[p]), v_bits))
            if new == (self.k_bits[p], self.v_bits[p]):
                continue
            before = self.page_bytes(p)
            self.k_bits[p], self.v_bits[p] = new
            freed = before - self.page_bytes(p)
            self.bytes_held -= freed
            self.bytes_freed += freed
            changed.append(p)
        if not changed:
            return None
        width = max(pad_to or next_power_of_2(len(changed)), len(changed))
        padded = changed + [changed[-1]] * (width - len(changed))
        return KVOp(KVOpKind.DEMOTE, pages=tuple(changed), dst=tuple(padded), bits=int(k_bits),
                    v_bits=int(v_bits))


class LedgerPages:
    """A block manager's page source (`kvjax.memory.block_manager.PageSource`) over a
    mixed-precision pool: free page slots, handed out while the ledger's budget has room for
    one more page at the write class; a page handed out is held in the ledger until given
    back. Pages the prefix cache keeps after their sequence ends stay held (they keep their
    bytes until evicted and reused)."""

    def __init__(self, ledger: PrecisionLedger):
        self.ledger = ledger
        self._free = FreeList(len(ledger.k_bits))

    def num_free(self) -> int:
        room = self.ledger.budget_bytes - self.ledger.bytes_held
        return max(min(len(self._free), int(room // self.ledger.write_page_bytes + 1e-9)), 0)

    def take(self) -> int | None:
        if not self.num_free():
            return None
        page = self._free.take()
        self.ledger.hold([page])
        return page

    def give(self, page: int) -> None:
        self.ledger.release([page])
        self._free.give(page)

    def capacity(self) -> int:
        """Pages the budget holds at the write class (what admission plans with; demotion
        lets the pool hold more)."""
        return int(self.ledger.budget_bytes // self.ledger.write_page_bytes + 1e-9)


class RoundedPages:
    """What the prefix cache may name in a mixed-precision pool: pages whose rows hold exact
    tokens at the write class, never a page demoted in place.

    A page's prefix-cache hash names the KV of exact tokens, so a hit must read rows written
    at the write class. `round_pages` takes a demoted page out of the index (its sequence keeps
    reading it; it goes to the free list when released, not to the cache), and a sequence
    with rounded pages that comes back from a swap or a snapshot (`indexable`) neither reads
    nor feeds the index: its pages hold its rounded rows again, in fresh pages. Only pages no
    other sequence holds are demoted (`PrecisionLedger.cold_pages`), so no hit that already
    happened reads them; the scheduler keeps indexed pages a lookup has reused exact, so
    only pages never reused leave the index. Host data only.
    """

    def __init__(self, allocator):
        self.allocator = allocator  # a block manager, with its `prefix_cache` (None: none)
        self._seqs: set[str] = set()

    def round_pages(self, seq_id: str, pages: Iterable[int]) -> None:
        """`seq_id`'s pages re-encoded at a coarser class: they leave the index, and the
        sequence feeds it no more (a demoted page may be full before its sequence commits it,
        and the sequence's later pages continue a chain the index no longer holds)."""
        cache, tracer = self.allocator.prefix_cache, self.allocator.tracer
        for page in pages if cache is not None else ():
            page_hash = (self.allocator.page_hash(seq_id, int(page))
                         if tracer.enabled and self.allocator.has_sequence(seq_id) else None)
            indexed = cache.forget(int(page))
            tracer.emit("demote_page", "page", "pages/device", page=int(page), indexed=indexed,
                        hash=page_hash.hex() if page_hash else None)
        if self.allocator.has_sequence(seq_id):
            self.allocator.stop_indexing(seq_id)
        self._seqs.add(seq_id)

    def indexable(self, seq_id: str) -> bool:
        """Whether a returning `seq_id` may read and feed the index (no rounded page)."""
        return seq_id not in self._seqs

    def discard(self, seq_id: str) -> None:
        """The sequence ended, or restarts from its tokens (exact again)."""
        self._seqs.discard(seq_id)
