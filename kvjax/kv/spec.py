"""KV specs: what each group of layers keeps, stores and costs, declared once.

A model declares its layers' KV as `LayerGroup`s (which layers, which tokens they keep, what
they store per token); an engine turns each into a `KVCacheGroupSpec` by adding its codec and
page size, and sizes everything from the resulting `KVCacheSpec`: pages for a byte budget,
bytes per token and per page, the budget admission and the benchmarks count against. No other
module multiplies layers by heads by head dim.

Most models declare one group of all their layers keeping every token (G = 1): every page
holds its tokens in every layer. A model with sliding-window layers declares one group per
window (`ModelConfig.layer_windows`); the pool then keeps one block table per *table group*
(`KVCacheSpec.table_groups`): every group is cut into runs of the same number of layers (the
gcd of the group sizes), so every page of the pool holds the same bytes (that many layers of P
tokens) whichever group owns it, and all groups draw pages from one free list and one byte
budget (`kvjax.memory.groups`). A sliding-window group gives back the pages that fall out of
its window. A model with multi-head latent attention declares one group storing an MLA latent
(`TokenStore.MLA_LATENT`: d_c + d_r values per token and layer, no separate V), which a pool of
`kvjax.kv.state.LatentPagedKV` pages holds. The enums also name what later groups need (a token
budget for `TokenKeep`); a pool refuses a spec it cannot serve yet (`check_servable`).

Per-head budgets. A group keeping a retention budget can give its kv heads budgets of their
own (AdaKV: `LayerGroup.head_major`, `head_budgets`) through *head-major pages*: a page holds P
tokens of ONE kv head of a run of layers, and every (run, kv head) has a block table of its own
(`TableGroup.head`), so a sequence holds sum over tables of ceil(B_h / P) pages of a K-th of
the size: about its budget, whatever the split. The alternative, pages of every head with each
head's kept tokens compacted into the same slots (read through a per-head gather), holds per
layer ceil(max_h B_h / P) pages of every head: a head-wise split then frees no more than its
largest head allows, and at the same total budget holds at least the pages of the uniform split
(AdaKV's point is that heads differ). Head-major pages pay for it with K block tables per run
(and in steps with prefill rows one attention call per kv head; a decode-only step folds the K
heads into its rows, one call per layer: `kvjax.engine.step.fold_head_rows`): 1.10x the decode
step of one table on the embedded model before the fold (docs/benchmarks.md,
`kvjax.bench.head_tables`). Budget classes of heads (a
few budgets, heads of a class sharing pages) would sit in between and fix the classes before
the scores are known, which AdaKV's per-sequence split cannot.

Bytes, for a group of Lg layers and page size P (one tensor's codec bytes per token: c(K, D)):

    token_bytes       per layer: c_k(K, D) + c_v(K, D), or c(1, d_c + d_r) for an MLA latent
    bytes_per_token   Lg * token_bytes
    page_bytes        Lg * (P * token_bytes + page_extra_bytes)   (Quest's key summaries);
                      Lg * P * token_bytes / K with head-major pages (one head)
    seq_slot_bytes    Lg * per-sequence bytes beside the pages     (KIVI's exact window)
    pages_held        sum over tables of ceil(tokens the table keeps / P)

This module imports nothing from jax: the host side (scheduler, memory) reads specs freely.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence

PRECISION_BITS = (0, 8, 4)  # a mixed-precision pool's row classes, finest first (0: exact)


def coarseness(bits: int, what: str = "precision") -> int:
    """The class's rank, finest first (exact 0, int8 1, int4 2); ValueError naming `bits`
    when it is no class."""
    if isinstance(bits, bool) or bits not in PRECISION_BITS:
        raise ValueError(f"{what} bits={bits!r}; expected one of {PRECISION_BITS} (0: exact)")
    return PRECISION_BITS.index(bits)


def coarser(a: int, b: int) -> int:
    """The coarser of two classes."""
    return a if coarseness(a) >= coarseness(b) else b


class TokenKeep(enum.Enum):
    """Which of a sequence's tokens a layer keeps in its cache."""

    ALL = "all"  # every token (global attention)
    SLIDING_WINDOW = "sliding_window"  # the last `num_keep_tokens` tokens
    BUDGET = "budget"  # at most `num_keep_tokens` tokens, chosen by a retention policy


class TokenStore(enum.Enum):
    """What a layer stores per token."""

    KV_HEADS = "kv_heads"  # K and V, each [K, D]
    MLA_LATENT = "mla_latent"  # one latent [d_c] plus a shared RoPE key part [d_r] (MLA)


@dataclasses.dataclass(frozen=True)
class TokenFormat:
    """What one layer stores per token, before any codec.

    Attributes:
      store: the kind of storage.
      num_kv_heads, head_dim: K and D (KV_HEADS).
      latent_dim, rope_dim: d_c and d_r (MLA_LATENT).
    """

    store: TokenStore = TokenStore.KV_HEADS
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    rope_dim: int = 0

    def __post_init__(self):
        if self.store is TokenStore.KV_HEADS:
            _check_positive("num_kv_heads", self.num_kv_heads)
            _check_positive("head_dim", self.head_dim)
        else:
            _check_positive("latent_dim", self.latent_dim)
            if not isinstance(self.rope_dim, int) or self.rope_dim < 0:
                raise ValueError(f"rope_dim must be an int >= 0, got {self.rope_dim!r}")

    @classmethod
    def kv_heads(cls, num_kv_heads: int, head_dim: int) -> TokenFormat:
        return cls(TokenStore.KV_HEADS, num_kv_heads=num_kv_heads, head_dim=head_dim)

    @classmethod
    def mla_latent(cls, latent_dim: int, rope_dim: int) -> TokenFormat:
        return cls(TokenStore.MLA_LATENT, latent_dim=latent_dim, rope_dim=rope_dim)

    @property
    def tensors(self) -> tuple[tuple[str, int, int], ...]:
        """(name, heads, width) of each tensor a token stores per layer; a codec sizes each."""
        if self.store is TokenStore.KV_HEADS:
            return (("k", self.num_kv_heads, self.head_dim),
                    ("v", self.num_kv_heads, self.head_dim))
        return (("latent", 1, self.latent_dim + self.rope_dim),)

    @property
    def values_per_token(self) -> int:
        """Scalars one token stores per layer (2 K D, or d_c + d_r)."""
        return sum(heads * width for _, heads, width in self.tensors)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers with the same KV needs, as a model declares them.

    Attributes:
      layers: the layer indices, increasing.
      format: what each of these layers stores per token.
      keep: which tokens they keep.
      num_keep_tokens: the window (SLIDING_WINDOW) or the budget (BUDGET); 0 for ALL. With
        per-head budgets, the budget of a head on average.
      head_major: pages hold one kv head's tokens, with one block table per (run of layers,
        kv head), so the heads of a layer can keep different tokens and numbers of tokens
        (BUDGET only; see "Per-head budgets" above).
      head_budgets: tokens each kv head keeps (head_major; [K]); empty: `num_keep_tokens` each,
        or, in an engine whose press splits the budget per sequence (AdaKV), at most that on
        average.
    """

    layers: tuple[int, ...]
    format: TokenFormat
    keep: TokenKeep = TokenKeep.ALL
    num_keep_tokens: int = 0
    head_major: bool = False
    head_budgets: tuple[int, ...] = ()

    def __post_init__(self):
        _check_heads(self.format, self.keep, self.head_major, self.head_budgets)
        if not self.layers or list(self.layers) != sorted(set(self.layers)) \
                or self.layers[0] < 0:
            raise ValueError(f"a layer group's layers must be increasing indices >= 0, got "
                             f"{self.layers!r}")
        if (self.keep is TokenKeep.ALL) != (self.num_keep_tokens == 0):
            raise ValueError(f"keep={self.keep.value} with num_keep_tokens="
                             f"{self.num_keep_tokens!r}: a window or budget needs a positive "
                             f"count, keeping all tokens takes none")
        if self.keep is not TokenKeep.ALL:
            _check_positive("num_keep_tokens", self.num_keep_tokens)

    def max_tokens_held(self, num_tokens: int) -> int:
        """Tokens of a sequence of `num_tokens` tokens these layers keep (a window or budget
        bounds it)."""
        return _tokens_kept(self.keep, self.num_keep_tokens, num_tokens)


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """How one layer of a group holds its KV in a pool: the group's needs plus the codec, the
    page size and the bytes they cost (per layer).

    Attributes:
      format: what a token stores (`TokenFormat`).
      keep, num_keep_tokens: which tokens the layer keeps (`LayerGroup`).
      codec_name: the codec with its options ('none' for exact float storage).
      page_size: P, tokens per page.
      token_bytes: bytes one token takes in one layer, every tensor, codes and metadata.
      page_extra_bytes: bytes a page holds per layer beside its tokens (Quest's key summaries).
      seq_slot_bytes: bytes a sequence slot holds per layer beside its pages (KIVI's exact
        window); 0 for pools with no per-sequence state.
      head_major, head_budgets: pages of one kv head, and each head's budget (`LayerGroup`).
      class_token_bytes: ((key bits, value bits), token bytes) of each precision class a row
        of a mixed-precision pool may take (`kvjax.kv.mixed`; 0 bits: exact); empty: one class,
        `token_bytes`.
    """

    format: TokenFormat
    codec_name: str
    page_size: int
    token_bytes: float
    keep: TokenKeep = TokenKeep.ALL
    num_keep_tokens: int = 0
    page_extra_bytes: int = 0
    seq_slot_bytes: int = 0
    head_major: bool = False
    head_budgets: tuple[int, ...] = ()
    class_token_bytes: tuple[tuple[tuple[int, int], float], ...] = ()

    def __post_init__(self):
        _check_positive("page_size", self.page_size)
        if not self.token_bytes > 0:
            raise ValueError(f"token_bytes must be positive, got {self.token_bytes!r}")
        _check_heads(self.format, self.keep, self.head_major, self.head_budgets)

    @property
    def heads_per_page(self) -> int:
        """kv heads one page holds: every head, or one (head-major pages)."""
        return 1 if self.head_major else max(1, self.format.num_kv_heads)

    @property
    def page_bytes(self) -> float:
        """Bytes one page takes in one layer (one head's share of the tokens' bytes when
        head-major)."""
        return (self.page_size * self.token_bytes * self.heads_per_page
                / max(1, self.format.num_kv_heads) if self.head_major else
                self.page_size * self.token_bytes) + self.page_extra_bytes

    def head_tokens(self, num_tokens: int) -> tuple[int, ...]:
        """Tokens each table of one run of these layers keeps of a sequence of `num_tokens`
        tokens: one entry (every head), or one per kv head (head-major)."""
        if not self.head_major:
            return (_tokens_kept(self.keep, self.num_keep_tokens, num_tokens),)
        budgets = self.head_budgets or (self.num_keep_tokens,) * self.format.num_kv_heads
        return tuple(min(num_tokens, b) for b in budgets)

    def token_bytes_at(self, k_bits: int, v_bits: int) -> float:
        """Bytes one token takes in one layer with its key at `k_bits` and value at `v_bits`
        (ValueError: the pool has no such class)."""
        classes = dict(self.class_token_bytes)
        if (k_bits, v_bits) not in classes:
            raise ValueError(f"precision class k{k_bits}v{v_bits} is not one of this pool's "
                             f"{sorted(classes)} ({self.codec_name})")
        return classes[(k_bits, v_bits)]


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """A group's layers paired with the spec each of them follows.

    Attributes:
      layers: the layer indices.
      spec: the per-layer `KVSpec`.
    """

    layers: tuple[int, ...]
    spec: KVSpec

    @property
    def bytes_per_token(self) -> float:
        return len(self.layers) * self.spec.token_bytes

    @property
    def page_bytes(self) -> float:
        return len(self.layers) * self.spec.page_bytes

    @property
    def seq_slot_bytes(self) -> int:
        return len(self.layers) * self.spec.seq_slot_bytes

    def page_bytes_at(self, k_bits: int, v_bits: int) -> float:
        """Bytes one page of rows of one precision class takes over the group's layers."""
        spec = self.spec
        return len(self.layers) * (spec.page_size * spec.token_bytes_at(k_bits, v_bits)
                                   + spec.page_extra_bytes)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Every layer's KV in a pool: the groups, which together cover layers 0..L-1 once.

    Pages today span every group (one page id addresses a page of each group), so a page costs
    the sum of the groups' page bytes. Groups with their own block tables will draw pages of
    their own size from the same byte budget.

    Attributes:
      groups: the `KVCacheGroupSpec`s, in layer order of their first layer.
    """

    groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self):
        if not self.groups:
            raise ValueError("a KV cache spec needs at least one layer group")
        layers = sorted(i for g in self.groups for i in g.layers)
        if layers != list(range(len(layers))):
            raise ValueError(f"the layer groups must cover layers 0..L-1 exactly once, got "
                             f"{[g.layers for g in self.groups]}")

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def layers_per_table(self) -> int:
        """Layers one page holds: the gcd of the group sizes (every layer when G = 1)."""
        return math.gcd(*(len(g.layers) for g in self.groups))

    def table_groups(self) -> tuple[TableGroup, ...]:
        """The groups cut into runs of `layers_per_table` layers, each with a block table of
        its own (group order, then layer order)."""
        return table_groups([(g.layers, _window(g.spec.keep, g.spec.num_keep_tokens),
                              _budget(g.spec.keep, g.spec.num_keep_tokens),
                              _head_budgets(g.spec))
                             for g in self.groups])

    @property
    def is_head_major(self) -> bool:
        """Whether pages hold one kv head (`check_servable`: all groups or none)."""
        return any(g.spec.head_major for g in self.groups)

    @property
    def is_grouped(self) -> bool:
        """Whether the pool needs more than one block table, or gives back window pages."""
        return len(self.table_groups()) > 1 or any(t.window for t in self.table_groups())

    def bytes_held(self, num_tokens: int) -> float:
        """Bytes a sequence of `num_tokens` tokens holds at token granularity: each group's
        layers times the tokens it keeps (a window keeps at most its window)."""
        return sum(g.bytes_per_token * sum(g.spec.head_tokens(num_tokens))
                   / (max(1, g.spec.format.num_kv_heads) if g.spec.head_major else 1)
                   for g in self.groups)

    def pages_held(self, num_tokens: int) -> int:
        """Pages a sequence's block tables hold once it has decoded to `num_tokens` tokens (its
        last token written alone): every page of a global table; a window's table the pages
        from the one holding the first token its last query reads; a budget's table the pages
        of its budget, right after a compaction to it (with per-head budgets, each (run, kv
        head) table the pages of its head's budget)."""
        return sum(_ceil_div(min(num_tokens, t.budget), self.page_size) if t.budget else
                   _table_pages(t.window, num_tokens - 1, num_tokens, self.page_size)
                   for t in self.table_groups())

    def max_pages_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most pages a sequence of at most `num_tokens` tokens holds at once over its block
        tables, when a step writes at most `max_step_tokens` of its tokens (a prefill chunk, a
        verify row): a window's table then holds the pages from the first token the step's first
        query reads to the step's last token, never more than a global table's."""
        p = self.page_size
        full = _ceil_div(num_tokens, p)
        return sum(min(full, (max_step_tokens + t.window - 2) // p + 2) if t.window else full
                   for t in self.table_groups())

    @property
    def page_size(self) -> int:
        """P, shared by every group while pages span them all."""
        sizes = {g.spec.page_size for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"groups with different page sizes {sorted(sizes)} have no "
                             f"single page size")
        return sizes.pop()

    @property
    def codec_name(self) -> str:
        names = [g.spec.codec_name for g in self.groups]
        return names[0] if len(set(names)) == 1 else "/".join(names)

    @property
    def bytes_per_token(self) -> float:
        """Bytes one cached token takes over every layer (codes and metadata, K and V)."""
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def page_bytes(self) -> float:
        """Bytes one page takes. Groups whose layers' pages are alike (a sliding window beside
        global layers) share one pool of pages of `layers_per_table` layers; groups that
        differ in what a page holds (an MLA latent beside K and V heads, which no pool
        serves yet) would span one page across every group's layers."""
        per_layer = {g.spec.page_bytes for g in self.groups}
        if len(self.groups) > 1 and len(per_layer) == 1:
            return self.layers_per_table * per_layer.pop()
        return sum(g.page_bytes for g in self.groups)

    def page_bytes_at(self, k_bits: int, v_bits: int) -> float:
        """Bytes one page takes with every row at one precision class (a mixed-precision pool,
        whose pages span every group)."""
        return sum(g.page_bytes_at(k_bits, v_bits) for g in self.groups)

    @property
    def seq_slot_bytes(self) -> int:
        """Bytes one sequence slot takes beside the pages over every layer (KIVI windows)."""
        return sum(g.seq_slot_bytes for g in self.groups)

    def nbytes(self, num_pages: int, num_seq_slots: int = 0) -> int:
        """Bytes of a pool of `num_pages` pages and `num_seq_slots` sequence slots."""
        return math.ceil(num_pages * self.page_bytes) + num_seq_slots * self.seq_slot_bytes

    def num_pages_for_budget(self, budget_bytes: float) -> int:
        """Pages that fit in `budget_bytes` (ValueError: not one)."""
        num_pages = int(budget_bytes // self.page_bytes)
        if num_pages < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no page of "
                             f"{self.page_bytes} bytes")
        return num_pages

    def with_specs(self, fn: Callable[[KVSpec], KVSpec]) -> KVCacheSpec:
        """This spec with every group's spec replaced by fn(spec) (a state wrapper's bytes)."""
        return KVCacheSpec(tuple(dataclasses.replace(g, spec=fn(g.spec)) for g in self.groups))

    def check_single_group(self) -> None:
        """ValueError unless this is one group of all layers keeping every token, K and V heads
        (what arenas and windowed KIVI pools serve)."""
        spec = self.groups[0].spec
        if len(self.groups) != 1 or spec.keep is not TokenKeep.ALL \
                or spec.format.store is not TokenStore.KV_HEADS:
            raise ValueError(f"this KV pool holds one group of global-attention layers with K "
                             f"and V heads; got groups {self.describe()}")

    def check_servable(self) -> None:
        """ValueError unless paged pools serve this spec: every group keeping all tokens, a
        sliding window, or a retention budget (`kvjax.kv.layer_retention`), but not windows
        beside budgets, and groups differing in nothing else (one page format for the whole
        pool: K and V heads, or MLA latents)."""
        first = self.groups[0].spec
        keeps = {g.spec.keep for g in self.groups}
        if {TokenKeep.BUDGET, TokenKeep.SLIDING_WINDOW} <= keeps:
            raise ValueError(f"paged pools hold sliding-window layers or layers with retention "
                             f"budgets, not both; got groups {self.describe()}")
        for g in self.groups:
            if dataclasses.replace(g.spec, keep=first.keep, num_keep_tokens=first.num_keep_tokens,
                                   head_budgets=first.head_budgets) != first:
                raise ValueError(f"layer groups of one pool share a page format; got groups "
                                 f"{self.describe()}")

    def describe(self) -> list[dict]:
        """The groups as plain data (reports, JSON)."""
        return [dict(layers=list(g.layers), keep=g.spec.keep.value,
                     num_keep_tokens=g.spec.num_keep_tokens, store=g.spec.format.store.value,
                     codec=g.spec.codec_name, page_size=g.spec.page_size,
                     token_bytes=g.spec.token_bytes, page_bytes=g.page_bytes,
                     seq_slot_bytes=g.seq_slot_bytes, head_major=g.spec.head_major,
                     head_budgets=list(g.spec.head_budgets)) for g in self.groups]


@dataclasses.dataclass(frozen=True)
class TableGroup:
    """Layers that share one block table: their pages hold the same tokens.

    Attributes:
      layers: the layer indices (`KVCacheSpec.layers_per_table` of them).
      window: the layers' sliding window in tokens, 0 when they keep every token.
      budget: the tokens the layers keep (per-layer retention budgets; the head's with
        head-major pages), 0 when unbounded.
      head: the kv head its pages hold (head-major pages), None: every head.
    """

    layers: tuple[int, ...]
    window: int = 0
    budget: int = 0
    head: int | None = None


def table_groups(groups: Sequence[tuple]) -> tuple[TableGroup, ...]:
    """(layers, window[, budget[, head_budgets]]) groups cut into runs of the gcd of their
    sizes, in order; a group with head budgets (head-major pages) into one table per run and kv
    head, heads consecutive."""
    n = math.gcd(*(len(g[0]) for g in groups))
    tables = []
    for g in groups:
        layers, window = g[0], g[1]
        budget = g[2] if len(g) > 2 else 0
        heads = g[3] if len(g) > 3 else ()
        for i in range(0, len(layers), n):
            if heads:
                tables += [TableGroup(layers[i:i + n], window, b, h) for h, b in enumerate(heads)]
            else:
                tables.append(TableGroup(layers[i:i + n], window, budget))
    return tuple(tables)


def pages_for_tokens(tokens_per_table: Sequence[int], page_size: int) -> int:
    """Pages block tables holding `tokens_per_table` tokens each take: sum of ceil(n / P)."""
    return sum(_ceil_div(int(n), page_size) for n in tokens_per_table)


def layer_tables(groups: Sequence[LayerGroup]
                 ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per layer of a model declaring `groups`: its table group's index (with head-major
    pages, its kv head 0's; head h's is that plus h), its index among that group's layers (the
    layer axis of the pool's arrays) and its window (0: global)."""
    table, slot, window = {}, {}, {}
    tables = table_groups([(g.layers, _window(g.keep, g.num_keep_tokens), 0,
                            (0,) * g.format.num_kv_heads if g.head_major else ())
                           for g in groups])
    for t, group in enumerate(tables):
        for j, layer in enumerate(group.layers):
            if group.head in (None, 0):
                table[layer], slot[layer], window[layer] = t, j, group.window
    layers = range(len(table))
    return (tuple(table[i] for i in layers), tuple(slot[i] for i in layers),
            tuple(window[i] for i in layers))


def _window(keep: TokenKeep, num_keep_tokens: int) -> int:
    return num_keep_tokens if keep is TokenKeep.SLIDING_WINDOW else 0


def _budget(keep: TokenKeep, num_keep_tokens: int) -> int:
    return num_keep_tokens if keep is TokenKeep.BUDGET else 0


def _head_budgets(spec: KVSpec) -> tuple[int, ...]:
    """Each head's budget of a head-major spec (empty: pages of every head)."""
    if not spec.head_major:
        return ()
    return spec.head_budgets or (spec.num_keep_tokens,) * spec.format.num_kv_heads


def _check_heads(token_format: TokenFormat, keep: TokenKeep, head_major: bool,
                 head_budgets: tuple[int, ...]) -> None:
    """ValueError unless head-major pages keep a budget of K and V heads, and head budgets
    come one per kv head with head-major pages."""
    if head_major and (keep is not TokenKeep.BUDGET
                       or token_format.store is not TokenStore.KV_HEADS):
        raise ValueError(f"head-major pages hold a retention budget of K and V heads; got "
                         f"keep={keep.value}, store={token_format.store.value}")
    if not head_budgets:
        return
    if not head_major:
        raise ValueError(f"head_budgets={head_budgets!r} need head-major pages (one block table "
                         f"per kv head)")
    if len(head_budgets) != token_format.num_kv_heads:
        raise ValueError(f"head_budgets={head_budgets!r} must give one budget per kv head "
                         f"({token_format.num_kv_heads})")
    for b in head_budgets:
        _check_positive("a head budget", b)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _table_pages(window: int, start: int, end: int, page_size: int) -> int:
    """Pages one block table holds right after a step wrote tokens [start, end): all of them
    up to `end`, or with a window those from the first token the query at `start` reads."""
    first = max(0, start - window + 1) // page_size if window else 0
    return _ceil_div(end, page_size) - first


def _tokens_kept(keep: TokenKeep, num_keep_tokens: int, num_tokens: int) -> int:
    """Of a sequence's `num_tokens` tokens, how many a layer keeping `keep` holds."""
    return num_tokens if keep is TokenKeep.ALL else min(num_tokens, num_keep_tokens)


TokenBytes = Callable[[int, int], float]  # (heads, width) -> bytes of one tensor per token


def group_spec(group: LayerGroup, *, codec_name: str, page_size: int,
               tensor_bytes: TokenBytes | Sequence[TokenBytes], page_extra_bytes: int = 0,
               seq_slot_bytes: int = 0) -> KVCacheGroupSpec:
    """The pool spec of a model's layer group.

    Args:
      group: what the model declares.
      codec_name: the codec with its options.
      page_size: P.
      tensor_bytes: a codec's bytes per token of one tensor, (heads, width) -> bytes
        (`KVCodec.bytes_per_token`), or one per tensor of `group.format.tensors` (keys and
        values with codecs of their own).
      page_extra_bytes, seq_slot_bytes: per layer, as in `KVSpec`.
    """
    tensors = group.format.tensors
    sizers = [tensor_bytes] * len(tensors) if callable(tensor_bytes) else list(tensor_bytes)
    if len(sizers) != len(tensors):
        raise ValueError(f"{len(sizers)} tensor sizes for the {len(tensors)} tensors "
                         f"{[t[0] for t in tensors]} a token stores")
    token_bytes = float(sum(size(heads, width)
                            for size, (_, heads, width) in zip(sizers, tensors, strict=True)))
    spec = KVSpec(format=group.format, codec_name=codec_name, page_size=page_size,
                  token_bytes=token_bytes, keep=group.keep,
                  num_keep_tokens=group.num_keep_tokens, page_extra_bytes=page_extra_bytes,
                  seq_slot_bytes=seq_slot_bytes, head_major=group.head_major,
                  head_budgets=group.head_budgets)
    return KVCacheGroupSpec(group.layers, spec)


def cache_spec(groups: Sequence[LayerGroup], **kwargs) -> KVCacheSpec:
    """`group_spec` of each group with the same codec and page size (kwargs), as one spec."""
    return KVCacheSpec(tuple(group_spec(g, **kwargs) for g in groups))


def _check_positive(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field} must be a positive int, got {value!r}")
