"""Host-authoritative sparse KV (ECHO): which (layer, page) pairs a decode row keeps on the
device.

With Quest's `echo_prefetch` option every full page of a decoding sequence has a copy in the
host pool, and the device keeps, in each layer, `num_read - 1 + echo_prefetch` of them
(`kvjax.engine.echo` has the step's side, `kvjax.memory.echo_pages` the page moves). Quest
selects per layer, so residency is per layer too: the row holds `num_keep` device pages as
frames, and a frame's layer l holds whichever page layer l wants, independently of the other
layers. The plan for step t + 1 comes from the selection of the row's last step the host has
seen (step t, or t - 1 under asynchronous scheduling): in layer l, the pages that layer
selected come first, then the pages most other layers selected (the prefetch margin), ties to
the most recent; each layer then fetches the wanted pages it lacks into the slots of pages it
no longer wants, one layer of one page at a time (`KVOpKind.HOST_IN` with `layers`). Before
the first selection the row's own pages stay where they are (every layer reads them there);
at the first plan those most wanted become frames in place where the row alone holds them
(no prefix cache, no fork sharing them), the rest go back to the allocator and fresh frames
replace them. The step computes
the exact selection whatever the plan, so a wrong guess costs bytes over the link, never a
changed token.

Misses stay in frames (Quest's `echo_keep_misses`, on by default): a page a layer selected but
had not on the device is read from the host pool in the step, and the step also writes that
layer of it into a frame, so the next step finds it there instead of fetching it again. Which
frames a step may overwrite is the host's decision, carried as data (`ScheduledRow.keep_frames`,
least wanted first, with the pages they hold, `keep_owners`); the step writes its i-th miss (in
table order) into the i-th offered frame whose page it did not select (`kept_misses`, the same
rule as `kvjax.engine.echo.keep_misses`), so the host knows every frame's page from the
selection it reads back anyway, and never reads the device for it. Until it has read that
selection a frame the step was offered holds a page the host does not know: it fills nothing
into it and offers it to no other step. Synchronous scheduling reads the selection before it
plans the next step, so every frame is offered each step. Under asynchronous scheduling the
next step is planned first: a row then offers, per layer, as many frames as that layer missed
in its last seen step, and the next step reads what the previous one kept from a device-side
feed, and the frames it did not write still hold what they held (`ScheduledRow.kept_pages`,
`kept_owners`, `kvjax.engine.echo.merge_kept`); the host applies the same
merge when it reads the selections back, so it knows every table the device used.

Plain Python and numpy.

Stats (in the engine's): `echo_selected_pages`, the (layer, page) reads of decode rows whose
pages could be released; `echo_resident_reads`, those whose layer of the page was on the
device (prefetch recall = their ratio); `echo_refetched_layer_pages`, the (layer, page) fills
of pairs the same observed step had just read from the host pool as misses (bytes a step that
kept its misses in the frames would not move again; it does not: the step reads misses, only
plans write frames); `echo_layer_pages_prefetched` (layers of pages moved in),
`echo_frames_adopted` (own pages that became frames in place); `echo_misses_kept` (misses
the step wrote into frames); `echo_pages_mirrored`,
`_released`, `echo_frames_taken` (fresh frames; from the KV cache manager).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

RELEASED = -1  # `kvjax.memory.block_manager.RELEASED`: an entry that holds no device page


def wanted_pages(reads: np.ndarray, num_pages: int, num_keep: int) -> list[np.ndarray]:
    """Per layer, the pages [0, num_pages) it keeps on the device, most wanted first.

    Args:
      reads: [L, W] bool, the entries each layer read in the row's last seen step.
      num_pages: the row's pages with a host copy.
      num_keep: how many each layer keeps.
    """
    n = min(num_pages, reads.shape[1])
    own = np.zeros((reads.shape[0], num_pages), np.int64)
    own[:, :n] = reads[:, :n]
    votes = own.sum(axis=0)  # [F]: how many layers read each page
    score = own * (reads.shape[0] + 1) + votes[None, :]  # [L, F]: own reads first
    newest = np.arange(num_pages)
    return [np.lexsort((-newest, -s))[:num_keep] for s in score]


def num_frames(num_read: int, prefetch: int) -> int:
    """A decode row's frames: Quest's reads less the page it writes, plus the margin."""
    return max(num_read - 1, 0) + prefetch


def echo_keep_width(policy) -> int:
    """V, the frames per layer a decode row's step may keep its misses in, under the
    retention policy (0: not ECHO, or misses not kept)."""
    if policy.echo_prefetch is None or not policy.echo_keep_misses:
        return 0
    return num_frames(policy.num_read_pages, policy.echo_prefetch)


def kept_misses(reads: np.ndarray, layer_tables: np.ndarray, host_table: np.ndarray,
                frames: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """[L, V] int64: the entry a step wrote into each frame it was offered (-1: none).

    Args:
      reads: [L, W] bool, the step's selection; layer_tables: [L, n] (or [1, n]) and
        host_table: [n], the row's tables in that step; frames, owners: [L, V], the offered
        frames' entries (-1: padding) and the entries they held (-1: unknown).

    A miss (an entry read with a host copy and no device page in its layer) goes, in table
    order, to the offered frames whose page the step did not read, in offer order.
    """
    n = layer_tables.shape[1]
    read = reads[:, :n]
    miss = read & (np.broadcast_to(layer_tables, read.shape) < 0) & (host_table[None, :] >= 0)
    owner_read = (owners >= 0) & np.take_along_axis(read, np.clip(owners, 0, n - 1), axis=1)
    eligible = (frames >= 0) & ~owner_read
    out = np.full(frames.shape, -1, np.int64)
    for layer in range(frames.shape[0]):
        missed, free = np.flatnonzero(miss[layer]), np.flatnonzero(eligible[layer])
        k = min(len(missed), len(free))
        out[layer, free[:k]] = missed[:k]
    return out


class _Frames:
    """One row's frames: the entries holding them; owner [L, n]: at frame entry k, the entry
    whose layer l the frame holds (-1: nothing, or not known yet); pending [L, n]: the offer
    (`EchoPlanner.row_fields`) whose step may have written layer l of frame k and whose
    selection the host has not read yet (-1: none)."""

    def __init__(self, num_layers: int):
        self.entries: list[int] = []
        self.owner = np.full((num_layers, 0), -1, np.int64)
        self.pending = np.full((num_layers, 0), -1, np.int64)

    def grow(self, width: int) -> None:
        if self.owner.shape[1] < width:
            extra = np.full((self.owner.shape[0], width - self.owner.shape[1]), -1, np.int64)
            self.owner = np.concatenate([self.owner, extra], axis=1)
            self.pending = np.concatenate([self.pending, extra], axis=1)


@dataclasses.dataclass
class _RowState:
    """What the planner knows of one decode row.

    Attributes:
      reads: [L, W] bool, the selection of its last observed step (the next plan's input).
      frames: its frames (None: not planned yet).
      missed: [L, F] bool, the observed step's misses.
      wanted: the last plan's pages, per layer, most wanted first.
      offered: its last offer (number, [L, V] frame entries, the entries they held).
      kept: what its step kept there (offer number, [L, V] entries written, -1: none), once
        read back.
    """

    reads: np.ndarray | None = None
    frames: _Frames | None = None
    missed: np.ndarray | None = None
    wanted: list[np.ndarray] | None = None
    offered: tuple[int, np.ndarray, np.ndarray] | None = None
    kept: tuple[int, np.ndarray] | None = None

    def forget_plan(self) -> None:
        """The row starts afresh (new, or recomputed): its selection, frames and plan go;
        what its last steps missed, were offered and kept stays."""
        self.reads = self.frames = self.wanted = None


class EchoPlanner:
    """Plans each decode row's device-resident (layer, page) pairs and counts prefetch recall.

    Attributes:
      num_keep: full pages each layer of a decode row keeps on the device (Quest's reads less
        the page it writes, plus the prefetch margin); also the row's frames.
    """

    def __init__(self, kv_cache, page_size: int, num_read: int, prefetch: int, stats: dict,
                 keep_misses: bool = True):
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.num_keep = num_frames(num_read, prefetch)
        self.keep_misses = keep_misses
        self.stats = stats
        self._rows: dict[str, _RowState] = {}
        self._offers = 0
        stats.update(echo_selected_pages=0, echo_resident_reads=0,
                     echo_refetched_layer_pages=0, echo_frames_adopted=0, echo_misses_kept=0)

    def place(self, rows: Sequence[tuple[str, int]], live: Sequence[str]) -> None:
        """Moves pages for this step's decode rows (seq_id, cached tokens before the step)."""
        live = set(live)
        self._rows = {k: v for k, v in self._rows.items() if k in live}
        for seq_id, cached in rows:
            state = self._rows.get(seq_id)
            if state is not None and self.kv_cache.num_host_pages(seq_id) == 0:
                state.forget_plan()  # new, or recomputed afresh
            held = self.kv_cache.host.echo_mirror(seq_id, cached // self.page_size)
            if state is not None and state.reads is not None:
                self._plan(seq_id, held, state)

    def _row(self, seq_id: str) -> _RowState:
        """The row's state, made the first time the planner learns something of it."""
        return self._rows.setdefault(seq_id, _RowState())

    def _plan(self, seq_id: str, held: int, state: _RowState) -> None:
        reads = state.reads
        frames = state.frames = state.frames or _Frames(reads.shape[0])
        frames.grow(held)
        table = self.kv_cache.block_table(seq_id)
        own = [j for j in range(held) if table[j] != RELEASED and j not in frames.entries]
        wanted_by_layer = wanted_pages(reads, held, self.num_keep)
        state.wanted = wanted_by_layer
        need = min(self.num_keep, held) - len(frames.entries)
        if own and need > 0:  # own pages the row alone holds become frames where they are
            demand = np.bincount(np.concatenate(wanted_by_layer), minlength=held)
            adopted = sorted(self.kv_cache.host.echo_adoptable(seq_id, own),
                             key=lambda j: (-demand[j], -j))[:need]
            for j in adopted:
                frames.entries.append(j)
                frames.owner[:, j] = j
            self.stats["echo_frames_adopted"] += len(adopted)
            own = [j for j in own if j not in adopted]
        self.kv_cache.host.echo_release(seq_id, own)
        free = [j for j in range(held) if j not in frames.entries]
        need = min(self.num_keep, held) - len(frames.entries)
        if need > 0:
            frames.entries += self.kv_cache.host.echo_frames(seq_id, free[:need])
        fills = []
        for layer, wanted in enumerate(wanted_by_layer):
            owner = frames.owner[layer]
            have = {owner[k] for k in frames.entries}
            wanted_set = set(wanted.tolist())
            # A frame an unseen step may have written is neither claimed nor filled.
            slots = [k for k in frames.entries
                     if owner[k] not in wanted_set and frames.pending[layer, k] < 0]
            missing = [j for j in wanted.tolist() if j not in have]
            for j, k in zip(missing, slots, strict=False):
                fills.append((layer, j, k))
                owner[k] = j
        missed = state.missed
        if missed is not None:
            self.stats["echo_refetched_layer_pages"] += sum(
                j < missed.shape[1] and bool(missed[layer, j]) for layer, j, _ in fills)
        self.kv_cache.host.echo_fill(seq_id, fills)

    def row_fields(self, seq_id: str, feed_index: int = -1) -> dict:
        """The row's `ScheduledRow.host_table` [n] and `layer_tables` ([L, n], or [1, n] for
        every layer alike before its first plan); with misses kept, the frames its step may
        write its misses into (`keep_frames`, `keep_owners`, `keep_offer`; called once per
        scheduled row: those frames' pages are unknown until `observe` reads the step's
        selection), and for a row whose previous step is unseen (its token in flight,
        `feed_index` >= 0), the pages of the frames that step was offered and the entries
        they held (`kept_pages`, `kept_owners`, `kept_offer`), where the step reads what that
        step kept there, else what they held."""
        table = np.asarray(self.kv_cache.block_table(seq_id), np.int64)
        state = self._rows.get(seq_id)
        frames = None if state is None else state.frames
        layer_tables = table[None, :].copy()  # own pages: every layer reads them in place
        if frames is not None:
            layer_tables = np.repeat(layer_tables, frames.owner.shape[0], axis=0)
            for k in frames.entries:
                layer_tables[:, k] = RELEASED  # a frame holds other entries' layers
            for k in frames.entries:
                owner = frames.owner[:, k]
                layers = np.flatnonzero(owner >= 0)
                layer_tables[layers, owner[layers]] = table[k]
        fields = dict(host_table=self.kv_cache.host.echo_host_table(seq_id),
                      layer_tables=layer_tables.astype(np.int32))
        if self.keep_misses and frames is not None and frames.entries:
            last = state.offered
            if feed_index >= 0 and last is not None:
                offer, entries, owners = last
                unseen = np.zeros(entries.shape, bool)
                for layer, v in zip(*np.nonzero(entries >= 0), strict=True):
                    unseen[layer, v] = frames.pending[layer, entries[layer, v]] == offer
                fields.update(kept_pages=np.where(unseen, table[np.maximum(entries, 0)],
                                                  RELEASED).astype(np.int32),
                              kept_owners=np.where(unseen, owners, -1).astype(np.int32),
                              kept_offer=offer)
            fields.update(self._offer(state, frames))
        return fields

    def _offer(self, state: _RowState, frames: _Frames) -> dict:
        """Per layer, the frames the row's step may write its misses into, least wanted
        first: all of them where no earlier step is unseen (synchronous scheduling), else as
        many as the layer missed in its last seen step (at least one), so that most frames
        keep pages the host can still fill around."""
        self._offers += 1
        num_layers = frames.owner.shape[0]
        ahead = bool((frames.pending >= 0).any())
        missed, wanted = state.missed, state.wanted
        entries = np.full((num_layers, self.num_keep), -1, np.int32)
        owners = np.full((num_layers, self.num_keep), -1, np.int32)
        for layer in range(num_layers):
            owner = frames.owner[layer]
            rank = {} if wanted is None else {j: i for i, j in enumerate(wanted[layer].tolist())}
            free = sorted((k for k in frames.entries if frames.pending[layer, k] < 0),
                          key=lambda k: (owner[k] >= 0, owner[k] in rank,
                                         -rank.get(owner[k], 0)))
            count = len(free)
            if ahead:
                count = max(1, 0 if missed is None else int(missed[layer].sum()))
            chosen = free[:count]
            entries[layer, :len(chosen)] = chosen
            owners[layer, :len(chosen)] = owner[chosen]
            owner[chosen] = -1
            frames.pending[layer, chosen] = self._offers
        state.offered = (self._offers, entries, owners)
        return dict(keep_frames=entries, keep_owners=owners, keep_offer=self._offers)

    def _tables(self, row) -> np.ndarray:
        """[L, n]: the layer tables the row's step read, with what its previous step kept
        (`kvjax.engine.echo.merge_kept`)."""
        tables = np.array(np.broadcast_to(row.layer_tables, (self._num_layers(row),
                                                             row.layer_tables.shape[1])))
        state = self._rows.get(row.seq_id)
        kept = None if state is None else state.kept
        if row.kept_pages is None or row.feed_index < 0 or kept is None \
                or kept[0] != row.kept_offer:
            return tables
        entry = np.where(kept[1] >= 0, kept[1], row.kept_owners)
        for layer, v in zip(*np.nonzero((entry >= 0) & (row.kept_pages >= 0)), strict=True):
            tables[layer, entry[layer, v]] = row.kept_pages[layer, v]
        return tables

    @staticmethod
    def _num_layers(row) -> int:
        return row.layer_tables.shape[0] if row.keep_frames is None else \
            row.keep_frames.shape[0]

    def _resolve(self, row, reads: np.ndarray | None) -> None:
        """What the row's step wrote into the frames it was offered (`kept_misses`; nothing
        without a selection): their pages, for those still waiting on this offer."""
        kept = (np.full(row.keep_frames.shape, -1, np.int64) if reads is None else
                kept_misses(reads, self._tables(row), row.host_table, row.keep_frames,
                            row.keep_owners))
        state = self._row(row.seq_id)
        state.kept = (row.keep_offer, kept)  # the next step merged it
        self.stats["echo_misses_kept"] += int((kept >= 0).sum())
        frames = state.frames
        if frames is None:
            return
        for layer, v in zip(*np.nonzero(row.keep_frames >= 0), strict=True):
            k = row.keep_frames[layer, v]
            if k < frames.pending.shape[1] and frames.pending[layer, k] == row.keep_offer:
                frames.owner[layer, k] = kept[layer, v] if kept[layer, v] >= 0 \
                    else row.keep_owners[layer, v]
                frames.pending[layer, k] = -1

    def observe(self, rows: Sequence, page_reads: np.ndarray | None) -> None:
        """Takes a step's selection (`RunnerOutput.page_reads` [Rd, L, W] of its decode rows
        `rows`) as the next plan's, counts the reads of resident (layer, page) pairs, and
        learns which pages the step kept in the frames it was offered."""
        for i, row in enumerate(rows):
            reads = None if page_reads is None else page_reads[i]
            tables = None if row.layer_tables is None else self._tables(row)
            if row.keep_frames is not None:
                self._resolve(row, reads)
            if reads is None or row.layer_tables is None or row.is_draft:
                continue
            n = row.layer_tables.shape[1]
            full = (row.start - row.num_evicted) // self.page_size  # before its write
            selected = reads[:, :min(n, full)]  # [L, F]: pages that could be released
            resident = np.broadcast_to(tables[:, :selected.shape[1]] >= 0, selected.shape)
            self.stats["echo_selected_pages"] += int(selected.sum())
            self.stats["echo_resident_reads"] += int((selected & resident).sum())
            state = self._row(row.seq_id)
            state.reads = reads
            state.missed = selected & ~resident
