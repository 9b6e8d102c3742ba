"""In-place demotion for the scheduler: what a controller reads of a mixed-precision pool, and
its `Decisions.demote_in_place` turned into `KVOpKind.DEMOTE` ops.

A controller sees, per running sequence, how many of its cold pages (full, unshared, and not
kept exact for the prefix cache: `InPlaceDemotion.protects`) sit at each precision
(`SeqState.pages_at`) and, per precision, what a page of the write class weighs over
a page at it (`ControlState.inplace_ratios`); it answers with a precision per sequence. Here a
precision b (0 exact, 8, 4) is a (key, value) class of the pool (`MixedOptions.classes`: K8V4
keeps keys at 8 bits when b is 4), and the ledger re-encodes the sequence's cold pages at it:
the op is plain data, planned into the step that is being formed, and the runner applies it in
that step's dispatch, before the model. Host only: no jax.

Pages the prefix index holds and lookups have reused (`keep_hits` times, by default once)
stay exact: a demoted page leaves the index (a hit must read exact rows), so demoting a shared
prompt's pages while one sequence alone holds them (a tenant's system prompt between two of
its requests) would make every later request recompute them. The controller is offered only
the other pages, so what it prices is what a demotion frees.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from kvjax.kv.spec import coarser
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.memory.precision import MixedOptions, PrecisionLedger, RoundedPages
from kvjax.scheduler.request import Sequence


class KVPlan(Protocol):
    """What this module needs of the KV cache manager (`kvjax.memory.kv_cache_manager`)."""

    allocator: object
    rounded: RoundedPages

    def has_sequence(self, seq_id: str) -> bool: ...

    def block_table(self, seq_id: str) -> list[int]: ...

    def plan_op(self, op: KVOp) -> None: ...


class InPlaceDemotion:
    """A mixed-precision pool's in-place demotion, as the scheduler sees it.

    Args:
      ledger: the pool's precision ledger (None: a pool of one precision; every answer is
        empty and no op is ever planned).
      kv_cache: the KV cache manager (block tables, reference counts, the step's plan).
      classes: a controller's precision -> the pool's (key bits, value bits) at it.
      pad_to: every DEMOTE op's pages are padded to this many (a sequence's most pages), so
        one program serves every demotion and warm-up compiles it.
      keep_hits: an indexed page lookups have reused this often stays exact (0: none does).
    """

    def __init__(self, ledger: PrecisionLedger | None, kv_cache: KVPlan | None = None,
                 classes: Mapping[int, tuple[int, int]] | None = None, pad_to: int = 1,
                 keep_hits: int = 1):
        self.ledger = ledger
        self.pad_to = pad_to
        self.keep_hits = keep_hits
        self.kv_cache = kv_cache
        self.classes = dict(classes or {})
        # A class may answer to several precisions (K8V4 written: 8 and 4 alike): the finest.
        self._precision = {}
        for bits, pair in self.classes.items():
            self._precision.setdefault(pair, bits)

    def ratios(self) -> dict[int, float]:
        """{precision: a write-class page's bytes over a page's at it} (ControlState.
        inplace_ratios); empty without a ledger."""
        if self.ledger is None:
            return {}
        write = self.ledger.write_page_bytes
        return {bits: write / self.ledger.spec.page_bytes_at(*pair)
                for bits, pair in self.classes.items()}

    def _cold(self, seq_id: str, num_computed: int) -> list[int]:
        """The sequence's full pages it may demote, oldest first: none another sequence
        shares, none the prefix index protects (`protects`)."""
        allocator = self.kv_cache.allocator
        full = self.kv_cache.block_table(seq_id)[:num_computed // self.ledger.spec.page_size]
        return [int(p) for p in full
                if allocator.ref_count(int(p)) == 1 and not self.protects(int(p))]

    def protects(self, page: int) -> bool:
        """Whether `page` stays exact: the prefix index holds it and lookups have reused it
        `keep_hits` times (a prefix requests share, such as a tenant's system prompt, which a
        demotion would take out of the index for every later request)."""
        cache = self.kv_cache.allocator.prefix_cache
        return (cache is not None and self.keep_hits > 0
                and cache.num_hits(page) >= self.keep_hits)

    def seq_fields(self, seq: Sequence) -> dict:
        """SeqState's pages_at and inplace_bits of a running sequence ({} without a ledger)."""
        if self.ledger is None or not self.kv_cache.has_sequence(seq.seq_id):
            return {}
        pages_at: dict[int, int] = {}
        for p in self._cold(seq.seq_id, seq.num_computed):
            pair = (int(self.ledger.k_bits[p]), int(self.ledger.v_bits[p]))
            bits = self._precision.get(pair)
            if bits is not None:
                pages_at[bits] = pages_at.get(bits, 0) + 1
        return dict(pages_at=pages_at, inplace_bits=seq.inplace_bits)

    def apply(self, demotions: Mapping[str, int], seqs: Mapping[str, Sequence]) -> int:
        """Plans a DEMOTE op re-encoding each named sequence's cold pages at its precision,
        takes the pages out of the prefix cache's index (`RoundedPages`: a hit reads exact
        rows only), and records the coarsest precision on the sequence (a swapped or
        recomputed one has spent that KL already); returns the pages demoted."""
        if self.ledger is None:
            return 0
        num_demoted = 0
        for seq_id, bits in demotions.items():
            if bits not in self.classes or not self.kv_cache.has_sequence(seq_id):
                continue
            k_bits, v_bits = self.classes[bits]
            seq = seqs[seq_id]
            op = self.ledger.demote(self._cold(seq_id, seq.num_computed), k_bits, v_bits,
                                    pad_to=self.pad_to)
            seq.inplace_bits = coarser(seq.inplace_bits, bits)
            if op is not None:
                self.kv_cache.plan_op(op)
                self.kv_cache.rounded.round_pages(seq_id, op.pages)
                num_demoted += len(op.pages)
        return num_demoted

    def warmup_ops(self) -> list[KVOp]:
        """A DEMOTE op that changes nothing (page 0 at the exact class, which no row gets
        finer by) of the padded width, for warm-up to compile the program; none without a
        ledger."""
        if self.ledger is None:
            return []
        return [KVOp(KVOpKind.DEMOTE, dst=(0,) * self.pad_to, bits=0, v_bits=0)]


def in_place_demotion(ledger: PrecisionLedger | None, kv_cache: KVPlan,
                      codec_options: Mapping, pad_to: int) -> InPlaceDemotion:
    """The scheduler's in-place demotion of an engine's pool: none without a ledger, else at
    the classes of the `kv_codec="mixed"` options, ops padded to `pad_to` pages."""
    if ledger is None:
        return InPlaceDemotion(None)
    options = MixedOptions.parse(codec_options)
    return InPlaceDemotion(ledger, kv_cache, options.classes(), pad_to, options.keep_hits)
