"""The jitted model step: one call per engine iteration, mixing decode tokens and prefill chunks.

Token layout of a step (all sizes static, padded to buckets; `kvjax.kv.layout`):

  rows 0 .. Bd-1        decode rows, Wd tokens each            tokens[0 : Bd * Wd]
  rows Bd .. Bd+Bp-1    prefill rows, packed back to back     tokens[Bd * Wd : Bd * Wd + C]

so T = Bd * Wd + C: prefill rows are not padded one by one, only their total is (to C). Wd is
1, or 1 + gamma in a speculative verify step, whose decode rows score a sequence's last token
and its draft tokens at once (`kvjax.sampling.verify_drafts`). Every row r
has a block table, a kv length (tokens in the cache after this step), a query length (1 for
decode, up to Cr for prefill; 0 marks a padded row) and the index of its first token. The step
writes the new K/V into the cache, attends, and samples one token per row from the logits of
the row's last query token. The KV state is donated, so XLA updates the pages in place.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import jit as kvjax_jit
from kvjax.config import ModelConfig
from kvjax.engine import echo, host_rows
from kvjax.kv import attention as attention_ref
from kvjax.kv import fused_write, layout, native
from kvjax.kv.retention_host import EVERY_KEY
from kvjax.kv.spec import LayerGroup, TokenKeep, layer_tables, table_groups
from kvjax.kv.state import KVState
from kvjax.models import invariant, linear, llama
from kvjax.sampling import LogitRules, sample_tokens, verify_drafts


class AttentionImpl(enum.Enum):
    """Which attention implementation the step uses."""

    AUTO = "auto"  # Pallas kernels on GPU/TPU; on CPU the native kernel where it reads the state.
    REFERENCE = "reference"  # The blockwise jnp path everywhere.
    PALLAS = "pallas"
    NATIVE = "native"  # The C++ CPU decode kernel (kvjax.kv.native), reading pages in place.


class MatmulImpl(enum.Enum):
    """Which matmuls the step's decoder layers use."""

    # On CPU the native kernel (kvjax.models.linear) for steps of at most
    # linear.NATIVE_MAX_TOKENS[dtype] tokens where it is available, else XLA's.
    AUTO = "auto"
    XLA = "xla"
    NATIVE = "native"  # The native CPU kernel at every step size.


def layer_linear(impl: MatmulImpl, num_tokens: int, dtype=jnp.float32
                 ) -> linear.LayerLinear | None:
    """The decoder's `linear` for a step of `num_tokens` tokens of `dtype` parameters (None:
    XLA's matmuls)."""
    if impl is MatmulImpl.AUTO:
        use = jax.default_backend() == "cpu" and linear.takes_step(num_tokens, dtype)
        return linear.native_linear if use else None
    return linear.native_linear if impl is MatmulImpl.NATIVE else None


class LogitsMode(enum.Enum):
    """Which logits a step returns besides the sampled tokens."""

    NONE = "none"
    LAST = "last"  # [R, V]: the logits each row sampled from.
    ALL = "all"  # [T, V]: every token's logits (teacher-forced scoring).


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static shape of a step: one compiled program per distinct value."""

    num_decode: int  # Bd
    num_prefill: int  # Bp
    chunk: int  # C, the prefill tokens of the step, all rows packed (1 without prefill rows)
    max_pages: int  # W, block table width (fixed per engine)
    all_greedy: bool = True
    needs_filter: bool = False
    logits_mode: LogitsMode = LogitsMode.NONE
    # F, the fixed width of the token feed between steps (one per engine; 0: num_rows).
    feed_rows: int = 0
    # Cr, the most tokens one prefill row has (the width of attention's per-row view; 0: C).
    row_chunk: int = 0
    # Wd, tokens per decode row: 1, or 1 + gamma in a speculative verify step.
    decode_width: int = 1
    # H, the token history each row ships for penalties, and Kb, its bias entries; both 0
    # when no row of the step has penalties, a logit bias or min_tokens (rules off).
    history_width: int = 0
    bias_width: int = 0
    # Wm, the words of each row's token bitmask: ceil(V / 32) in an engine's steps (every
    # row ships one, all bits set when unconstrained, so a grammar compiles nothing new);
    # 0: no masks.
    mask_width: int = 0

    @property
    def has_rules(self) -> bool:
        return self.bias_width > 0

    @property
    def num_rows(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def num_tokens(self) -> int:
        return self.num_decode * self.decode_width + (self.chunk if self.num_prefill else 0)


@struct.dataclass
class StepInput:
    """Per-step device inputs (small integer and float arrays built on the host).

    Attributes:
      tokens, positions, slot_mapping: [T] int32 (slot -1: a padded token writes nothing).
      block_tables: [R, Pmax] int32.
      kv_lens, q_lens: [R] int32.
      temperature, top_p, min_p: [R] float32; top_k: [R] int32.
      seeds: [R] uint32; counters: [R] int32, the index of the token each row generates.
      presence, frequency, repetition: [R] float32, the rows' penalties (0, 0, 1: off).
      history: [R, H] int32, the sequence's tokens before the row's first one (positions
        0 .. history_lens - 1; the step's own tokens are read on the device, so one still in
        flight counts); num_prompt: [R] int32, its prompt length (later positions are
        output). H = 0 when rules are off.
      bias_ids, bias_until: [R, Kb] int32; bias_values: [R, Kb] float32: the rows' logit
        bias and min_tokens masks (`kvjax.sampling.LogitRules`). Kb = 0 when rules are off.
      token_mask: [R, Wm] int32, the tokens each row may sample (`kvjax.grammar`; -1: all).
      draft_mask: [R, Wd - 1, Wm] int32 in a verify step with masks: the tokens a decode row
        may emit after each of its drafts (-1: all); [R, 0, Wm] otherwise.
      score_weights: [T] float32, each query's weight in the key scores a retention policy
        accumulates (kvjax.kv.retention); 0 for padding and for policies that score nothing.
      score_spans: [R, 2] int32, a probe row's cache indices [lo, hi) whose keys, with the
        policy's sinks and the row's own tokens, its scores' softmax runs over
        (`kvjax.kv.retention_host.Probe.span`); [0, 2^31 - 1) (every key) for other rows.
      seq_slots: [R] int32, each row's sequence slot in the KV state's sequence-slot leaves
        (`KVState.seq_slot_leaves`, per-sequence KV beside the pages, such as KIVI's exact
        windows); the engine's allocator assigns them. 0 in states without such leaves and
        for padding.
      kv_floors: [R] int32, cache positions [0, kv_floors) of each row are read from its
        pages whatever its length: the fully quantized pages it took from the prefix cache
        (KIVI with an exact window reads later tokens from the window); 0 for padding.
      token_src: [T] int32, -1 where `tokens` holds the token; else the index in
        `prev_tokens` of the token to use (asynchronous scheduling: a token the previous step
        sampled and the host has not seen yet).
      prev_tokens: [F] int32, the previous step's `StepOutput.feed_tokens` (zeros if none).
      row_starts: [R] int32, the index in `tokens` of each row's first token.
      token_rows: [T] int32, the row of each token (`kvjax.kv.layout`).
      group_tables: [G-1, R, Pmax] int32, the block tables of layer groups 1..G-1 of a model
        with several (`kvjax.kv.spec.KVCacheSpec.table_groups`; `block_tables` is group 0's).
      group_slots: [G-1, T] int32, those groups' slot mappings (`slot_mapping`: group 0's).
      group_kv_lens: [G-1, R] int32, those groups' kv lengths (`kv_lens`: group 0's); they
        differ from group 0's when table groups keep retention budgets of their own
        (`kvjax.kv.layer_retention`).
      host_tables: [Bh, Pmax] int32, Bh = Bd with a host pool (else 0): the host-pool pages
        holding cache positions [0, host_lens) of each decode row (`kvjax.engine.host_rows`);
        under ECHO, per block-table entry, its host copy, or -1 where it has none (the entry
        is read from its device page in `block_tables`; `kvjax.engine.echo`).
      layer_tables: [Bh, L, Pmax] int32 under ECHO (else [Bh, 0, Pmax]): per layer and
        block-table entry, the device page holding that layer of the entry, or -1 where the
        layer reads the entry's host copy.
      keep_frames, keep_owners: [Bh, L, V] int32 under ECHO with misses kept (else
        [Bh, 0, 0]): per layer, the block-table entries of the frames the step may write the
        pages it reads from the host pool into (-1: padding), and the entries they hold (-1:
        unknown); `kvjax.engine.echo.keep_misses`.
      kept_feed: [F, L, V] int32 under ECHO with misses kept (else [0, 0, 0]): the previous
        step's `StepOutput.kept_feed`, on the device.
      kept_rows: [Bh] int32 (Bh = 0 without misses kept): each decode row's row in the
        previous step whose kept misses it reads (-1: none); kept_pages: [Bh, L, V] int32,
        the device pages of the frames that row was offered (-1: not to be read), and
        kept_owners: [Bh, L, V] int32, the entries those frames held before (-1: unknown).
        Where the previous step wrote entry j into such a frame, layer l reads j there, else
        the entry it held (`kvjax.engine.echo.merge_kept`): under asynchronous scheduling the
        host planned this step before reading what the previous one kept.
      host_lens: [Bh] int32, how many of each decode row's first positions live in the host
        pool (a multiple of the page size; 0: all on the device). Its device block table's
        entries for them are ignored.
    """

    tokens: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    q_lens: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    counters: jax.Array
    min_p: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    history: jax.Array
    history_lens: jax.Array
    num_prompt: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    bias_until: jax.Array
    token_mask: jax.Array
    draft_mask: jax.Array
    score_weights: jax.Array
    score_spans: jax.Array
    seq_slots: jax.Array
    kv_floors: jax.Array
    token_src: jax.Array
    prev_tokens: jax.Array
    row_starts: jax.Array
    token_rows: jax.Array
    group_tables: jax.Array
    group_slots: jax.Array
    group_kv_lens: jax.Array
    host_tables: jax.Array
    host_lens: jax.Array
    layer_tables: jax.Array
    keep_frames: jax.Array
    keep_owners: jax.Array
    kept_feed: jax.Array
    kept_rows: jax.Array
    kept_pages: jax.Array
    kept_owners: jax.Array

    def for_table(self, table: jax.Array) -> StepInput:
        """This input as layer group `table` (traced) sees it: its block tables, slots and kv
        lengths."""
        tables = jnp.concatenate([self.block_tables[None], self.group_tables])  # [G, R, W]
        slots = jnp.concatenate([self.slot_mapping[None], self.group_slots])  # [G, T]
        lens = jnp.concatenate([self.kv_lens[None], self.group_kv_lens])  # [G, R]
        return self.replace(block_tables=tables[table], slot_mapping=slots[table],
                            kv_lens=lens[table])


@struct.dataclass
class StepOutput:
    """tokens, logprobs: [R]; logits: [R, V], [T, V] or None per LogitsMode.

    num_accepted: [R] int32 in a verify step (decode_width > 1): the draft tokens each row
    kept (`tokens` is the one it emits after them; 0 for prefill rows), else None.
    spec_logprobs: [R, Wd] float32 in a verify step: the logprobs of the kept drafts, then
    of `tokens` at index num_accepted; else None.

    key_scores: [R, W*P] float32 or None: with a retention policy that scores keys, the
    attention each row's cached tokens received in this step (summed over layers, query heads
    and the row's queries weighted by score_weights), in cache order; [R, G, W*P] where table
    groups keep retention budgets of their own (each group's layers summed, in its cache order).
    query_key_scores: [R, Wd, W*P] float32 in a verify step with key scores, else None: each
    decode row's queries scored alone, query c as the one query of the decode step plain
    decoding runs for its token (`kvjax.kv.retention.step_key_scores`); key_scores is its sum
    over queries.
    feed_tokens: [F] int32, `tokens` padded to the feed width: the next step's `prev_tokens`.
    page_reads: [Bd, L, W] bool with a policy that records its reads (Quest under ECHO, or
    with record_reads) in a one-token decode step: the block-table entries each decode row
    read in each layer; else None.
    kept_feed: [F, L, V] int32 under ECHO with misses kept: per decode row (padded to the feed
    width) and layer, the entry written into each frame it was offered (-1: none); the next
    step's `StepInput.kept_feed`. Else None.
    """

    tokens: jax.Array
    logprobs: jax.Array
    feed_tokens: jax.Array
    logits: jax.Array | None = None
    key_scores: jax.Array | None = None
    num_accepted: jax.Array | None = None
    spec_logprobs: jax.Array | None = None
    query_key_scores: jax.Array | None = None
    page_reads: jax.Array | None = None
    kept_feed: jax.Array | None = None


def empty_step_input(shape: StepShape, num_tables: int = 1, *, host_rows: bool = False,
                     num_layer_tables: int = 0, keep_width: int = 0) -> dict[str, np.ndarray]:
    """Host buffers for one step, filled with padding values (num_tables: G, the block tables
    of the model's layer groups; host_rows: the engine has a host pool, so decode rows ship
    host tables; num_layer_tables: L when they ship per-layer device tables too (ECHO);
    keep_width: V, the frames per layer a step may keep its misses in (ECHO), else 0)."""
    num_host = shape.num_decode if host_rows else 0
    r, t, bd, w = shape.num_rows, shape.num_tokens, shape.num_decode, shape.decode_width
    h, kb = shape.history_width, shape.bias_width
    return dict(
        tokens=np.zeros(t, np.int32),
        positions=np.zeros(t, np.int32),
        slot_mapping=np.full(t, -1, np.int32),
        block_tables=np.zeros((r, shape.max_pages), np.int32),
        kv_lens=np.zeros(r, np.int32),
        q_lens=np.zeros(r, np.int32),
        temperature=np.zeros(r, np.float32),
        top_k=np.zeros(r, np.int32),
        top_p=np.ones(r, np.float32),
        seeds=np.zeros(r, np.uint32),
        counters=np.zeros(r, np.int32),
        min_p=np.zeros(r, np.float32),
        presence=np.zeros(r, np.float32),
        frequency=np.zeros(r, np.float32),
        repetition=np.ones(r, np.float32),
        history=np.zeros((r, h), np.int32),
        history_lens=np.zeros(r, np.int32),
        num_prompt=np.zeros(r, np.int32),
        bias_ids=np.zeros((r, kb), np.int32),
        bias_values=np.zeros((r, kb), np.float32),
        bias_until=np.zeros((r, kb), np.int32),
        token_mask=np.full((r, shape.mask_width), -1, np.int32),
        draft_mask=np.full((r, shape.decode_width - 1 if shape.mask_width else 0,
                            shape.mask_width), -1, np.int32),
        score_weights=np.zeros(t, np.float32),
        score_spans=np.tile(np.array(EVERY_KEY, np.int32), (r, 1)),
        seq_slots=np.zeros(r, np.int32),
        kv_floors=np.zeros(r, np.int32),
        token_src=np.full(t, -1, np.int32),
        prev_tokens=np.zeros(max(shape.feed_rows, r), np.int32),
        row_starts=(np.minimum(np.arange(r), bd) * w).astype(np.int32),
        token_rows=np.minimum(np.arange(t) // w, bd).astype(np.int32),
        group_tables=np.zeros((num_tables - 1, r, shape.max_pages), np.int32),
        group_slots=np.full((num_tables - 1, t), -1, np.int32),
        group_kv_lens=np.zeros((num_tables - 1, r), np.int32),
        host_tables=np.zeros((num_host, shape.max_pages), np.int32),
        host_lens=np.zeros(num_host, np.int32),
        layer_tables=np.full((num_host, num_layer_tables, shape.max_pages), -1, np.int32),
        keep_frames=np.full((num_host, num_layer_tables if keep_width else 0, keep_width), -1,
                            np.int32),
        keep_owners=np.full((num_host, num_layer_tables if keep_width else 0, keep_width), -1,
                            np.int32),
        kept_feed=np.full((max(shape.feed_rows, r) if keep_width else 0,
                           num_layer_tables if keep_width else 0, keep_width), -1, np.int32),
        kept_rows=np.full(num_host if keep_width else 0, -1, np.int32),
        kept_pages=np.full((num_host if keep_width else 0, num_layer_tables if keep_width else 0,
                            keep_width), -1, np.int32),
        kept_owners=np.full((num_host if keep_width else 0,
                             num_layer_tables if keep_width else 0, keep_width), -1, np.int32),
    )


PAGES_PER_BLOCK = 8  # Block tables are padded to a multiple of this.


def attention_name(impl: AttentionImpl, kv: KVState) -> str:
    """Which attention the step runs over this KV state: 'pallas', 'native' or 'reference'.

    AUTO: the Pallas kernels on GPU/TPU and the native kernel on CPU, each where it reads the
    state, else the reference. PALLAS and NATIVE are taken as asked (`_resolve` raises
    ValueError for a state their kernels do not read).
    """
    if impl is AttentionImpl.AUTO:
        if jax.default_backend() == "cpu":
            return "native" if native.reason_for(kv) is None else "reference"
        from pallas_kernels import dispatch  # Imported lazily: kernels need a GPU/TPU backend.

        return "pallas" if dispatch.unsupported_reason(kv) is None else "reference"
    return impl.value


def _resolve(impl: AttentionImpl, kv: KVState, soft_cap: float | None):
    """The kernel chooser (state, layer, window) -> (decode_fn, prefill_fn) applying the
    attention logit `soft_cap` and the layer's sliding window (a traced int32 scalar, 0: none),
    or None: the reference."""
    name = attention_name(impl, kv)
    if name == "native":
        return native.kernels_for(kv, soft_cap=soft_cap)
    if name == "pallas":
        from pallas_kernels import dispatch

        return dispatch.kernels_for(kv, soft_cap=soft_cap)
    return None


def _attend_rows(kv: KVState, layer: jax.Array, q: jax.Array, inp: StepInput, shape: StepShape,
                 kernels, reads: tuple[jax.Array, jax.Array] | None = None, *,
                 window: jax.Array | None = None, soft_cap: float | None = None,
                 host: host_rows.HostAttention | None = None,
                 echo_kv: KVState | None = None) -> jax.Array:
    """Attention of a step's decode rows and prefill rows. q: [T, N, D] -> [T, N, D].

    kernels: `_resolve`'s kernel chooser, or None for the blockwise reference (which applies
    the attention logit `soft_cap` itself).
    reads: (indices [Bd, W], kv_lens [Bd]) of the block-table entries decode rows read (a
    retention policy's `select_reads`), or None: every page.
    window: the layer's sliding window (int32 scalar, traced or not; 0: global), or None.
    host: with a host pool, decode rows attend over their host-resident positions there and
    over the rest on the device, merged (`kvjax.engine.host_rows`); None: no host pool.
    echo_kv: the host pool of host-authoritative rows (ECHO): decode rows read each selected
    page from the device pool where resident, else from it (`kvjax.engine.echo`); None: none.
    """
    bd, bp, wd = shape.num_decode, shape.num_prefill, shape.decode_width
    if host is not None and (wd > 1 or reads is not None or window is not None):
        raise ValueError("host-resident rows are one-token decode rows reading every page "
                         "(kvjax.engine.compat refuses the rest)")
    bt, kv_lens, q_lens = inp.block_tables, inp.kv_lens, inp.q_lens
    if wd > 1 and reads is not None:
        raise ValueError("a verify step's decode rows read every page of their block tables")
    num_dec, n, d = bd * wd, q.shape[1], q.shape[2]
    decode_lens = kv_lens[:bd] if reads is None else reads[1]

    def decode_tables(tables: jax.Array) -> jax.Array:
        return tables if reads is None else jnp.take_along_axis(tables, reads[0], axis=1)

    outs = []
    if host is not None and bd:
        outs.append(host_rows.attend_split(kv, host, layer, q[:bd], inp, bd, soft_cap=soft_cap,
                                           pages_per_block=PAGES_PER_BLOCK))  # [Bd, N, D]
    if echo_kv is not None and bd:
        if wd > 1 or window is not None:
            raise ValueError("host-authoritative rows are one-token decode rows of one layer "
                             "group (kvjax.engine.compat refuses the rest)")
        outs.append(echo.attend_echo(
            kv, echo_kv, layer, q[:bd], inp, bd,
            echo.every_page(bt[:bd], kv_lens[:bd]) if reads is None else reads,
            soft_cap=soft_cap, pages_per_block=PAGES_PER_BLOCK))  # [Bd, N, D]
    decode_elsewhere = host is not None or echo_kv is not None
    if kernels is not None:
        decode_attn, prefill_attn = kernels(kv, layer, window)
        on_device = 0 if decode_elsewhere else bd  # decode rows the kernels attend
        if on_device and wd > 1:
            out = prefill_attn(q[:num_dec].reshape(bd, wd, n, d), bt[:bd], kv_lens[:bd],
                               q_lens[:bd])
            outs.append(out.reshape(num_dec, n, d))
        elif on_device:
            outs.append(decode_attn(q[:bd], decode_tables(bt[:bd]), decode_lens))
        if bp:
            out = prefill_attn(layout.prefill_view(q, inp, shape), bt[bd:], kv_lens[bd:],
                               q_lens[bd:])
            outs.append(layout.unpack_prefill(out, inp, shape))
        return jnp.concatenate(outs, axis=0)
    # The state's keys may be read in another form (low-rank coordinates): queries alike.
    blockwise = functools.partial(attention_ref.paged_attention_blockwise,
                                  pages_per_block=PAGES_PER_BLOCK, window=window,
                                  soft_cap=soft_cap, sm_scale=1.0 / np.sqrt(d))
    q = kv.project_queries(layer, q)  # [T, N, D_k]

    def reader(rows: slice):
        """(block tables, page loader) of `rows`."""
        return kv.row_loader(layer, bt[rows], kv_lens[rows], inp.seq_slots[rows],
                             inp.kv_floors[rows])

    if bd and not decode_elsewhere:
        tables, load = reader(slice(0, bd))  # the loader sees every row's full length
        out = blockwise(q[:num_dec].reshape(bd, wd, n, q.shape[-1]), load,
                        decode_tables(tables), decode_lens, q_lens[:bd])  # [Bd, Wd, N, D]
        outs.append(out.reshape(num_dec, n, d))
    if bp:
        tables, load = reader(slice(bd, None))
        out = blockwise(layout.prefill_view(q, inp, shape), load, tables, kv_lens[bd:],
                        q_lens[bd:], pages_per_block=attention_ref.PREFILL_PAGES_PER_BLOCK
                        )  # [Bp, Cr, N, D]
        outs.append(layout.unpack_prefill(out, inp, shape))  # [C, N, D]
    return jnp.concatenate(outs, axis=0)


def _attend_per_query(kv: KVState, layer: jax.Array, q: jax.Array, inp: StepInput
                      ) -> jax.Array:
    """Batch-invariant attention (`kvjax.models.invariant`): every query token of the step is
    a row of its own, reading its row's pages up to its position. q: [T, N, D] -> [T, N, D]."""
    index = jnp.arange(q.shape[0], dtype=jnp.int32)  # [T]
    starts, q_lens = inp.row_starts, inp.q_lens  # [R]
    inside = (index[:, None] >= starts) & (index[:, None] < starts + q_lens)  # [T, R]
    row = jnp.argmax(inside, axis=1)  # [T]
    lens = inp.kv_lens[row] - q_lens[row] + index - starts[row] + 1  # [T]
    decode, _ = native.kernels_for(kv, split_rows=False)(kv, layer)
    return decode(q, inp.block_tables[row], jnp.where(inside.any(axis=1), lens, 0))


def model_step(params, kv: KVState, inp: StepInput, *, config: ModelConfig, shape: StepShape,
               attention_impl: AttentionImpl = AttentionImpl.REFERENCE, retention=None,
               place_kernels=None, matmul_impl: MatmulImpl = MatmulImpl.XLA,
               batch_invariant: bool = False, host_kv: KVState | None = None,
               host_compute: bool = False, fused_kv_write: bool = False,
               layer_groups: tuple[LayerGroup, ...] | None = None
               ) -> tuple[StepOutput, KVState]:
    """Runs the model over one step's tokens, writing their K/V and sampling one token per row.

    `retention` (a kvjax.kv.retention policy, static) may narrow the pages decode rows read and
    may score the cached keys (StepOutput.key_scores); None is exact attention.
    `place_kernels` maps the Pallas kernel chooser to one that runs where the KV lives (on a
    mesh: per device over its kv heads, `kvjax.parallel.sharding.shard_kernels`); None runs
    the kernels as they are.
    `batch_invariant`: every token's logits and logprobs bitwise independent of the rest of
    the step (`kvjax.models.invariant`; overrides attention_impl and matmul_impl).
    `host_kv`: the host pool, where decode rows keep positions [0, inp.host_lens) (read, never
    written: `kvjax.engine.host_rows`); `host_compute`: its part of their attention runs under
    compute_on("device_host") (else in device memory space). None: no host pool.
    `fused_kv_write`: each layer's K/V projection writes its rows into the pages itself
    (`kvjax.kv.fused_write`; the state must be one it serves) instead of K and V computed,
    then written: where the attention is the Pallas kernels, by the Pallas kernel in every
    step; else in steps whose matmuls are native (`layer_linear`, or batch_invariant), by the
    native kernel, and steps on XLA's matmuls (larger prefill chunks under AUTO) keep XLA's
    projection and the scatter.
    `layer_groups`: the pool's layer groups (`kvjax.kv.spec`), None: the model's
    (`ModelConfig.kv_layer_groups`). Where groups keep retention budgets of their own
    (`kvjax.kv.layer_retention`), key scores are per table group: [R, G, W*P].
    """
    q_lens = inp.q_lens
    host = echo_kv = None
    is_echo = retention is not None and retention.echo_prefetch is not None
    if host_kv is not None and is_echo:
        echo_kv = host_rows.device_view(host_kv)
        if inp.keep_frames.shape[-1] and shape.num_decode:
            inp = inp.replace(layer_tables=echo.merge_kept(inp))
    elif host_kv is not None:
        decode = (native.lse_decoder(soft_cap=config.attn_logit_softcap)
                  if attention_name(attention_impl, kv) == "native" else None)
        host = host_rows.HostAttention(
            host_kv if host_compute else host_rows.device_view(host_kv), host_compute, decode)
    # Once per program, for every layer.
    kernels = _resolve(attention_impl, kv, config.attn_logit_softcap)
    if kernels is not None and place_kernels is not None:
        kernels = place_kernels(kernels)
    scores_keys = retention is not None and retention.scores_keys

    layer_groups = config.kv_layer_groups() if layer_groups is None else layer_groups
    layer_map = layer_tables(layer_groups)
    grouped = max(layer_map[0]) > 0 or any(layer_map[2])
    # [R, G, W*P] scores, one row per table group, where G > 1 groups keep budgets of their own.
    num_tables = len(table_groups([(g.layers, 0, 0, (0,) * g.format.num_kv_heads
                                    if g.head_major else ()) for g in layer_groups]))
    score_tables = num_tables if num_tables > 1 and any(
        g.keep is TokenKeep.BUDGET for g in layer_groups) else 0
    tables, slots, windows = (jnp.asarray(x, jnp.int32) for x in layer_map)

    records_reads = (retention is not None and retention.records_reads
                     and shape.num_decode > 0 and shape.decode_width == 1)

    head_major = any(g.head_major for g in layer_groups)
    num_kv = config.num_kv_heads

    # A decode-only step over head-major pages folds the kv heads into the rows: one write,
    # one attention call and one key-score call per layer over Bd * K one-head rows.
    fold_heads = head_major and shape.num_prefill == 0 and shape.decode_width == 1
    if fold_heads:  # once per step, outside the layer scan: every table group's rows
        group_rows = (jnp.concatenate([inp.block_tables[None], inp.group_tables]),  # [G, R, W]
                      jnp.concatenate([inp.slot_mapping[None], inp.group_slots]),  # [G, T]
                      jnp.concatenate([inp.kv_lens[None], inp.group_kv_lens]))  # [G, R]
        heads_shape = dataclasses.replace(shape, num_decode=shape.num_decode * num_kv)

    def attend_folded(layer, q, k, v, carry):
        """`attend_heads` of a decode-only step: row b * K + h is decode row b over kv head
        h's table (tables[layer] + h), with query heads h * G .. (h + 1) * G - 1."""
        kv, key_scores, page_reads = carry
        heads_inp = fold_head_rows(inp, tables[layer] + jnp.arange(num_kv), *group_rows)
        pool_layer = slots[layer]
        t, n, d = q.shape
        if k is not None:  # [T, K, D] -> [T * K, 1, D]
            kv = kv.write_rows(pool_layer, heads_inp, heads_shape, k.reshape(-1, 1, d),
                               v.reshape(-1, 1, v.shape[-1]))
        q_rows = q.reshape(t * num_kv, n // num_kv, d)  # [T * K, G, D]
        out = _attend_rows(kv, pool_layer, q_rows, heads_inp, heads_shape, kernels,
                           soft_cap=config.attn_logit_softcap)
        if scores_keys:
            scores = retention.key_scores(kv, pool_layer, q_rows, heads_inp, heads_shape,
                                          pages_per_block=PAGES_PER_BLOCK,
                                          soft_cap=config.attn_logit_softcap)  # [T * K, W*P]
            key_scores = key_scores.at[:, tables[layer] + jnp.arange(num_kv)].add(
                scores.reshape(t, num_kv, -1))
        return out.reshape(t, n, d), (kv, key_scores, page_reads)  # [T, N, D]

    def attend_heads(layer, q, k, v, carry):
        """A layer of head-major pages (`kvjax.kv.head_retention`): kv head h's K/V, its
        query heads' attention and key scores over its own table (tables[layer] + h)."""
        if fold_heads:
            return attend_folded(layer, q, k, v, carry)
        kv, key_scores, page_reads = carry
        g = q.shape[1] // num_kv
        heads = [(tables[layer] + h, inp.for_table(tables[layer] + h)) for h in range(num_kv)]
        pool_layer = slots[layer]
        if k is not None:  # every head's write before any read: no read waits on a write
            for h, (_, head_inp) in enumerate(heads):
                kv = kv.write_rows(pool_layer, head_inp, shape, k[:, h:h + 1], v[:, h:h + 1])
        outs = []
        for h, (table, head_inp) in enumerate(heads):
            q_h = q[:, h * g:(h + 1) * g]  # [T, G, D]
            outs.append(_attend_rows(kv, pool_layer, q_h, head_inp, shape, kernels,
                                     soft_cap=config.attn_logit_softcap))  # [T, G, D]
            if scores_keys:
                scores = retention.key_scores(kv, pool_layer, q_h, head_inp, shape,
                                              pages_per_block=PAGES_PER_BLOCK,
                                              soft_cap=config.attn_logit_softcap)  # [R, W*P]
                key_scores = key_scores.at[:, table].add(scores)
        return jnp.concatenate(outs, axis=1), (kv, key_scores, page_reads)  # [T, N, D]

    def attend(layer, q, k, v, carry):
        if head_major:
            return attend_heads(layer, q, k, v, carry)
        kv, key_scores, page_reads = carry
        table = tables[layer]
        if grouped:  # several layer groups, or windows: this layer's table and pool slot
            layer_inp, layer, window = inp.for_table(tables[layer]), slots[layer], windows[layer]
        else:
            layer_inp, window = inp, None
        if k is not None:  # else the projection wrote them (`write_kv`)
            kv = kv.write_rows(layer, layer_inp, shape, k, v)
        if echo_kv is not None:
            reads = retention.select_reads(kv, layer, q, inp, shape, host_kv=echo_kv)
        else:
            reads = None if retention is None else retention.select_reads(kv, layer, q, inp,
                                                                          shape)
        if records_reads:
            bd = shape.num_decode
            mask = echo.read_mask(echo.every_page(inp.block_tables[:bd], inp.kv_lens[:bd])
                                  if reads is None else reads, kv.page_size, shape.max_pages)
            page_reads = page_reads.at[:, layer].set(mask)  # [Bd, L, W]
        cap = config.attn_logit_softcap
        if batch_invariant:  # one layer group without windows (`invariant.check`)
            out = _attend_per_query(kv, layer, q, layer_inp)
        else:  # kernels and the reference alike take the window as a traced per-layer value
            out = _attend_rows(kv, layer, q, layer_inp, shape, kernels, reads, window=window,
                               soft_cap=cap, host=host, echo_kv=echo_kv)
        if scores_keys:  # over the layer's own table and lengths
            scores = retention.key_scores(kv, layer, q, layer_inp, shape,
                                          pages_per_block=PAGES_PER_BLOCK,
                                          soft_cap=config.attn_logit_softcap)
            key_scores = (key_scores.at[:, table].add(scores) if score_tables
                          else key_scores + scores)
        return out, (kv, key_scores, page_reads)

    per_query = (shape.decode_width,) if shape.decode_width > 1 else ()
    per_table = (score_tables,) if score_tables else ()
    if per_query and per_table:
        raise ValueError("a verify step scores keys per query, not per table group "
                         "(kvjax.engine.compat refuses the pair)")
    key_scores = (jnp.zeros((shape.num_rows, *per_query, *per_table,
                             shape.max_pages * kv.page_size), jnp.float32)
                  if scores_keys else None)  # [R, W*P]; [R, Wd, W*P] verify; [R, G, W*P]
    token_ids = jnp.where(inp.token_src >= 0,
                          inp.prev_tokens[jnp.maximum(inp.token_src, 0)], inp.tokens)  # [T]
    page_reads = (jnp.zeros((shape.num_decode, config.num_layers, shape.max_pages), bool)
                  if records_reads else None)  # [Bd, L, W]

    # The Pallas fused write goes with the Pallas attention, in every step; the native one
    # with the native matmuls (stacked weights read in place).
    pallas_write = fused_kv_write and not batch_invariant and \
        attention_name(attention_impl, kv) == "pallas"

    def write_kv(layer, x, p, positions, carry):
        kv, key_scores, page_reads = carry
        layer_inp, pool_layer = (inp.for_table(tables[layer]), slots[layer]) if grouped else (
            inp, layer)
        bk, bv = (p["bk"], p["bv"]) if config.qkv_bias else (None, None)
        kv = fused_write.write_projected(  # wk, wv: stacked [L, In, K*D], or the scan's slice
            kv, pool_layer, layer_inp.slot_mapping, x, p["wk"], p["wv"], layer, bk, bv,
            *llama.rope_tables(config, positions, layer),
            k_norm=p["k_norm"] if config.qk_norm else None, norm_eps=config.rms_norm_eps,
            norm_unit_offset=config.norm_unit_offset, invariant=batch_invariant,
            pallas=pallas_write)
        return kv, key_scores, page_reads

    linear = (invariant.linear.invariant_linear if batch_invariant
              else layer_linear(matmul_impl, shape.num_tokens, params["embed"].dtype))
    writes = fused_kv_write and (pallas_write or linear is not None)
    h, (kv, key_scores, page_reads) = llama.decode_body(
        params, config, token_ids, inp.positions, attend, (kv, key_scores, page_reads),
        linear=linear,
        row_sum=invariant.row_sum if batch_invariant else None,
        write_kv=write_kv if writes and not head_major else None)  # [T, H]
    kept_feed = None
    if echo_kv is not None and inp.keep_frames.shape[-1]:
        kept_feed = jnp.full(inp.kept_feed.shape, -1, jnp.int32)
        if page_reads is not None:
            kv, kept = echo.keep_misses(kv, echo_kv, page_reads, inp, shape.num_decode)
            kept_feed = kept_feed.at[:shape.num_decode].set(kept)
    sampling = dict(all_greedy=shape.all_greedy, needs_filter=shape.needs_filter)
    rules = _logit_rules(inp, token_ids, shape, config.vocab_size) if shape.has_rules else None
    token_mask = inp.token_mask if shape.mask_width else None
    num_accepted = spec_logprobs = None
    if shape.decode_width > 1:
        if shape.logits_mode is not LogitsMode.NONE:
            raise ValueError("verify steps return no logits (the scheduler plans no drafts "
                             "for steps that do)")
        tokens, logprobs, num_accepted, spec_logprobs = _verify_step_tokens(
            params, config, h, token_ids, inp, shape, sampling, rules, token_mask)
    else:
        last = inp.row_starts + jnp.maximum(q_lens - 1, 0)  # [R]
        logits = llama.lm_head(params, config, h[last], linear)  # [R, V]
        tokens, logprobs = sample_tokens(
            logits, inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.counters, inp.min_p,
            rules, token_mask, row_sums=invariant.ROW_SUMS if batch_invariant else None,
            **sampling)
    out_logits = None
    if shape.logits_mode is LogitsMode.LAST:
        out_logits = logits
    elif shape.logits_mode is LogitsMode.ALL:
        out_logits = llama.lm_head(params, config, h, linear if batch_invariant else None
                                   )  # [T, V]
    feed = jnp.zeros(inp.prev_tokens.shape, jnp.int32).at[:shape.num_rows].set(tokens)  # [F]
    query_key_scores = None
    if scores_keys and per_query:
        query_key_scores, key_scores = key_scores, key_scores.sum(axis=1)  # [R, W*P]
    return StepOutput(tokens=tokens, logprobs=logprobs, feed_tokens=feed, logits=out_logits,
                      key_scores=key_scores, num_accepted=num_accepted,
                      spec_logprobs=spec_logprobs, query_key_scores=query_key_scores,
                      page_reads=page_reads, kept_feed=kept_feed), kv


def fold_head_rows(inp: StepInput, heads: jax.Array, tables: jax.Array, slots: jax.Array,
                   lens: jax.Array) -> StepInput:
    """A decode-only step's input (one token per row, T = R) as K one-head rows per row: row
    b * K + h is row b over table heads[h] (heads [K] int32; tables [G, R, W], slots [G, T],
    lens [G, R]: every table group's, `StepInput.for_table`'s), the fields attention, the KV
    writes and the key scores read folded alike; the rest stay the step's."""
    k = heads.shape[0]

    def fold(x: jax.Array) -> jax.Array:  # [K, R, ...] -> [R * K, ...]
        return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])

    def repeat(x: jax.Array) -> jax.Array:  # [R, ...] -> [R * K, ...]
        return jnp.repeat(x, k, axis=0)

    rows = jnp.arange(inp.kv_lens.shape[0] * k, dtype=jnp.int32)
    return inp.replace(block_tables=fold(tables[heads]), slot_mapping=fold(slots[heads]),
                       kv_lens=fold(lens[heads]), q_lens=repeat(inp.q_lens),
                       seq_slots=repeat(inp.seq_slots), kv_floors=repeat(inp.kv_floors),
                       positions=repeat(inp.positions), score_weights=repeat(inp.score_weights),
                       score_spans=repeat(inp.score_spans),
                       row_starts=rows, token_rows=rows)


def _logit_rules(inp: StepInput, token_ids: jax.Array, shape: StepShape, vocab: int
                 ) -> LogitRules:
    """Each row's `LogitRules`, its prompt mask and output counts rebuilt on the device from
    its shipped history and the step's own tokens up to the one it samples after (a verify
    row: its first token; `verify_drafts` counts its drafts per position)."""
    r, t = shape.num_rows, shape.num_tokens
    rows = jnp.arange(r)[:, None]  # [R, 1]
    pos = jnp.arange(shape.history_width)[None, :]  # [1, H]
    known = pos < inp.history_lens[:, None]  # [R, H]
    is_output = pos >= inp.num_prompt[:, None]  # [R, H]
    counts = jnp.zeros((r, vocab), jnp.int32).at[rows, inp.history].add(
        (known & is_output).astype(jnp.int32))  # [R, V]
    in_prompt = jnp.zeros((r, vocab), jnp.int32).at[rows, inp.history].add(
        (known & ~is_output).astype(jnp.int32))  # [R, V]
    t_rows = inp.token_rows  # [T]
    offset = jnp.arange(t) - inp.row_starts[t_rows]  # [T]
    q = inp.q_lens[t_rows]
    counted = offset < jnp.where(t_rows < shape.num_decode, jnp.minimum(q, 1), q)  # [T]
    step_output = inp.positions >= inp.num_prompt[t_rows]  # [T]
    counts = counts.at[t_rows, token_ids].add((counted & step_output).astype(jnp.int32))
    in_prompt = in_prompt.at[t_rows, token_ids].add((counted & ~step_output).astype(jnp.int32))
    return LogitRules(prompt_mask=in_prompt > 0, output_counts=counts, presence=inp.presence,
                      frequency=inp.frequency, repetition=inp.repetition,
                      bias_ids=inp.bias_ids, bias_values=inp.bias_values,
                      bias_until=inp.bias_until)


def _verify_step_tokens(params, config: ModelConfig, h, token_ids, inp: StepInput,
                        shape: StepShape, sampling: dict, rules: LogitRules | None,
                        token_mask: jax.Array | None):
    """A verify step's tokens: decode rows score every token (`verify_drafts`), prefill rows
    sample from their last token. Returns (tokens, logprobs, num_accepted, spec_logprobs),
    each over all rows."""
    bd, bp, wd = shape.num_decode, shape.num_prefill, shape.decode_width
    logits = llama.lm_head(params, config, h[:bd * wd]).reshape(bd, wd, -1)  # [Bd, Wd, V]
    dec = slice(0, bd)

    def rows_of(part: slice) -> LogitRules | None:
        return None if rules is None else jax.tree.map(lambda x: x[part], rules)

    def mask_of(part: slice) -> jax.Array | None:
        return None if token_mask is None else token_mask[part]

    draft_mask = None if token_mask is None else inp.draft_mask[dec]
    accepted, tokens, spec_logprobs = verify_drafts(
        logits, token_ids[:bd * wd].reshape(bd, wd)[:, 1:],
        jnp.maximum(inp.q_lens[dec] - 1, 0), inp.temperature[dec], inp.top_k[dec],
        inp.top_p[dec], inp.seeds[dec], inp.counters[dec], inp.min_p[dec], rows_of(dec),
        mask_of(dec), draft_mask=draft_mask, **sampling)
    logprobs = jnp.take_along_axis(spec_logprobs, accepted[:, None], axis=1)[:, 0]
    if bp:
        pre = slice(bd, None)
        last = inp.row_starts[pre] + jnp.maximum(inp.q_lens[pre] - 1, 0)  # [Bp]
        pre_tokens, pre_logprobs = sample_tokens(
            llama.lm_head(params, config, h[last]), inp.temperature[pre], inp.top_k[pre],
            inp.top_p[pre], inp.seeds[pre], inp.counters[pre], inp.min_p[pre], rows_of(pre),
            mask_of(pre), **sampling)
        tokens = jnp.concatenate([tokens, pre_tokens])
        logprobs = jnp.concatenate([logprobs, pre_logprobs])
    return (tokens, logprobs, jnp.concatenate([accepted, jnp.zeros(bp, jnp.int32)]),
            jnp.concatenate([spec_logprobs, jnp.zeros((bp, wd), jnp.float32)]))


@dataclasses.dataclass(frozen=True)
class BlendShape:
    """The static shape of a CacheBlend recompute: one compiled program per value."""

    num_tokens: int  # the chunk's tokens, padded
    num_select: int  # the tokens recomputed, padded
    max_pages: int  # W, block table width


def _rows_input(tokens, positions, slots, kv_lens, block_table) -> StepInput:
    """A StepInput of one-token rows of one sequence (kv_lens 0: a padded row)."""
    n = tokens.shape[0]
    zeros = jnp.zeros(n, jnp.int32)
    return StepInput(
        tokens=tokens, positions=positions, slot_mapping=slots,
        block_tables=jnp.broadcast_to(block_table, (n, block_table.shape[0])), kv_lens=kv_lens,
        q_lens=(kv_lens > 0).astype(jnp.int32), temperature=jnp.zeros(n, jnp.float32),
        top_k=zeros, top_p=jnp.ones(n, jnp.float32), seeds=jnp.zeros(n, jnp.uint32),
        counters=zeros, min_p=jnp.zeros(n, jnp.float32), presence=jnp.zeros(n, jnp.float32),
        frequency=jnp.zeros(n, jnp.float32), repetition=jnp.ones(n, jnp.float32),
        history=jnp.zeros((n, 0), jnp.int32), history_lens=zeros, num_prompt=zeros,
        bias_ids=jnp.zeros((n, 0), jnp.int32), bias_values=jnp.zeros((n, 0), jnp.float32),
        bias_until=jnp.zeros((n, 0), jnp.int32), token_mask=jnp.zeros((n, 0), jnp.int32),
        draft_mask=jnp.zeros((n, 0, 0), jnp.int32),
        score_weights=jnp.zeros(n, jnp.float32),
        score_spans=jnp.tile(jnp.array(EVERY_KEY, jnp.int32), (n, 1)),
        seq_slots=zeros,
        kv_floors=zeros, token_src=jnp.full(n, -1, jnp.int32), prev_tokens=zeros,
        row_starts=jnp.arange(n, dtype=jnp.int32), token_rows=jnp.arange(n, dtype=jnp.int32),
        group_tables=jnp.zeros((0, n, block_table.shape[0]), jnp.int32),
        group_slots=jnp.zeros((0, n), jnp.int32),
        group_kv_lens=jnp.zeros((0, n), jnp.int32),
        host_tables=jnp.zeros((0, block_table.shape[0]), jnp.int32),
        host_lens=jnp.zeros(0, jnp.int32),
        layer_tables=jnp.zeros((0, 0, block_table.shape[0]), jnp.int32),
        keep_frames=jnp.zeros((0, 0, 0), jnp.int32), keep_owners=jnp.zeros((0, 0, 0), jnp.int32),
        kept_feed=jnp.zeros((0, 0, 0), jnp.int32), kept_rows=jnp.zeros(0, jnp.int32),
        kept_pages=jnp.zeros((0, 0, 0), jnp.int32), kept_owners=jnp.zeros((0, 0, 0), jnp.int32))


def blend_step(params, kv: KVState, tokens: jax.Array, positions: jax.Array, slots: jax.Array,
               block_table: jax.Array, num_select: jax.Array, *, config: ModelConfig,
               shape: BlendShape, attention_impl: AttentionImpl = AttentionImpl.REFERENCE
               ) -> KVState:
    """CacheBlend's selective recompute of a chunk whose KV was copied in without its context.

    The chunk's tokens (tokens, positions, slots [S], slot -1 for padding) run through the
    first decoder layer attending to the sequence's whole cache (block_table [W]); the
    `num_select` tokens whose second-layer K/V deviate most (squared L2) from what the cache
    holds are then recomputed in every layer, each attending to the cache up to its own
    position, which overwrites their K/V. Layer 0's K/V need no correction: they depend on the
    token and its position only, which the copy already restored exactly.
    """
    valid = slots >= 0
    kv_lens = jnp.where(valid, positions + 1, 0)
    probe = _rows_input(tokens, positions, slots, kv_lens, block_table)
    probe_shape = StepShape(shape.num_tokens, 0, 1, shape.max_pages)
    kernels = _resolve(attention_impl, kv, config.attn_logit_softcap)

    def attend(layer, q, k, v, kv):
        kv = kv.write_rows(layer, probe, probe_shape, k, v)
        return _attend_rows(kv, layer, q, probe, probe_shape, kernels,
                            soft_cap=config.attn_logit_softcap), kv

    layers = params["layers"]
    h, kv = llama.decoder_layer(config, attend, llama.embed(params, config, tokens), positions,
                                jax.tree.map(lambda x: x[0], layers), jnp.int32(0), kv)
    probe_layer = min(1, config.num_layers - 1)
    _, k1, v1 = llama.qkv(config, jax.tree.map(lambda x: x[probe_layer], layers), h, positions,
                          jnp.int32(probe_layer))
    rows = jnp.arange(tokens.shape[0])
    kc, vc = kv.load_pages(jnp.int32(probe_layer), (jnp.maximum(slots, 0) // kv.page_size)[:, None])
    offsets = jnp.maximum(slots, 0) % kv.page_size
    kc, vc = kc[rows, 0, offsets], vc[rows, 0, offsets]  # [S, K, D]
    deviation = (jnp.sum(jnp.square(k1.astype(jnp.float32) - kc.astype(jnp.float32)), (1, 2))
                 + jnp.sum(jnp.square(v1.astype(jnp.float32) - vc.astype(jnp.float32)), (1, 2)))
    _, picked = jax.lax.top_k(jnp.where(valid, deviation, -jnp.inf), shape.num_select)
    keep = (jnp.arange(shape.num_select) < num_select) & valid[picked]
    redo = _rows_input(tokens[picked], positions[picked], jnp.where(keep, slots[picked], -1),
                       jnp.where(keep, kv_lens[picked], 0), block_table)
    _, kv = model_step(params, kv, redo, config=config,
                       shape=StepShape(shape.num_select, 0, 1, shape.max_pages),
                       attention_impl=attention_impl)
    return kv


class StepPrograms:
    """The jitted step and page-copy programs for one model; counts their compilations.

    Only static configuration lives here (the model runner owns and threads the KV state), so
    runners of one configuration may share one instance and compile each shape once.
    """

    def __init__(self, config: ModelConfig, *,
                 attention_impl: AttentionImpl = AttentionImpl.REFERENCE, retention=None,
                 matmul_impl: MatmulImpl = MatmulImpl.XLA, batch_invariant: bool = False,
                 host_compute: bool = False, fused_kv_write: bool = False, dtype=jnp.float32,
                 layer_groups: tuple[LayerGroup, ...] | None = None):
        self.config = config
        self.dtype = dtype  # the params' dtype: it picks XLA options (`kvjax.jit`)
        self.attention_impl = attention_impl
        self.retention = retention
        self._step = kvjax_jit.jit(
            functools.partial(model_step, config=config, attention_impl=attention_impl,
                              retention=retention, matmul_impl=matmul_impl,
                              batch_invariant=batch_invariant, host_compute=host_compute,
                              fused_kv_write=fused_kv_write, layer_groups=layer_groups),
            static_argnames=("shape",), donate_argnames=("kv",), dtype=dtype)
        self._copy = kvjax_jit.jit(lambda kv, src, dst: kv.copy_pages(src, dst), donate_argnums=0)
        self._demote = kvjax_jit.jit(lambda kv, pages, k_bits, v_bits: kv.demote(
            pages, k_bits, v_bits), donate_argnums=0)
        self._blend = kvjax_jit.jit(
            functools.partial(blend_step, config=config, attention_impl=attention_impl),
            static_argnames=("shape",), donate_argnames=("kv",), dtype=dtype)

    @property
    def num_compiles(self) -> int:
        """Programs compiled so far (one per distinct step shape and KV layout)."""
        return (self._step.num_compiles + self._copy.num_compiles
                + self._blend.num_compiles + self._demote.num_compiles)

    def step(self, params, kv: KVState, host_input: dict[str, np.ndarray], shape: StepShape,
             host_kv: KVState | None = None) -> tuple[StepOutput, KVState]:
        """Dispatches one step asynchronously; returns device arrays (host_kv: the host pool,
        or None)."""
        return self._step(params, kv, StepInput(**host_input), shape=shape, host_kv=host_kv)

    def copy_pages(self, kv: KVState, src: np.ndarray, dst: np.ndarray) -> KVState:
        """Applies copy-on-write page copies (src[i] -> dst[i])."""
        return self._copy(kv, src, dst)

    def demote(self, kv: KVState, pages: np.ndarray, k_bits: int, v_bits: int) -> KVState:
        """Re-encodes pages [M] of a mixed-precision pool in place at coarser classes
        (`kvjax.kv.mixed.MixedPrecisionKV.demote`); the classes are data (one program per M)."""
        return self._demote(kv, pages, np.int32(k_bits), np.int32(v_bits))

    def blend(self, params, kv: KVState, host: dict[str, np.ndarray], shape: BlendShape
              ) -> KVState:
        """Dispatches one CacheBlend recompute (`blend_step`; host: its padded arrays)."""
        return self._blend(params, kv, host["tokens"], host["positions"], host["slots"],
                           host["block_table"], host["num_select"], shape=shape)
