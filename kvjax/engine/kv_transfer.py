"""Moving a prompt's full KV pages out of one engine and into another's prefix cache.

The two halves of prefill/decode disaggregation, shared by the in-process pair
(`kvjax.router.disagg.DisaggregatedEngine`) and the HTTP endpoints between processes
(`kvjax.server.pd`):

- `PageExporter(engine).export_prefix(prompt, tenant)`: the prompt's full pages that the
  engine's prefix cache holds, gathered page-first into one staging `PageBlob` (`[L, n, ...]`
  per page leaf, so quantized states travel as codes and scales), n padded to a power of 2.
- `PageImporter(engine).import_prefix(pin, tokens, staged, num_staged, tenant)`: pages the
  engine already holds for this prefix are kept, the rest are allocated, the staged pages'
  missing part is moved to the engine's devices (`jax.device_put`, resharding between meshes
  if they differ) and scattered into them; the pages are committed to its prefix cache under
  the engine's provenance and pinned by the sequence `pin` until `release(pin)`.

Both run where the engine is stepped (its owner's thread), between steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.config import KVLayout
from kvjax.engine import compat
from kvjax.engine.engine import Engine
from kvjax.kv import pages as kv_pages
from kvjax.memory.block_manager import AllocStatus
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.shapes import pad_repeat_last, powers_of_2_up_to


def check_transferable(engine: Engine, name: str, uses: Sequence[compat.Feature] = ()) -> None:
    """Raises ValueError unless `engine` can export and import pages (paged, prefix cache):
    a feature or operation (`uses`, a decision recording) that `kvjax.engine.compat` refuses
    with disaggregation, or no prefix cache."""
    compat.check(engine.config, on_mesh=engine.mesh is not None,
                 uses=(compat.Feature.DISAGGREGATION, *uses, *compat.operations_of(engine)))
    if engine.config.kv_layout is not KVLayout.PAGED or engine.allocator.prefix_cache is None:
        raise ValueError(f"the {name} engine needs the paged layout with the prefix cache "
                         f"enabled")
    engine.operations.add(compat.Feature.DISAGGREGATION)


def _padded_sizes(engine: Engine) -> list[tuple[int, np.ndarray]]:
    """Every padded page count of one prompt, each with as many valid page ids."""
    sizes = powers_of_2_up_to(engine.max_pages_per_seq)
    return [(n, np.arange(n, dtype=np.int32) % engine.num_pages) for n in sizes]


class PageExporter:
    """Gathers prompts' full pages out of one engine's prefix cache; owns its gather program
    (one compile per padded page count), so its compile count is its own."""

    def __init__(self, engine: Engine):
        check_transferable(engine, "prefill")
        self.engine = engine
        self.gather = kvjax_jit.jit(kv_pages.gather_pages)  # pages [n] of a KV -> a PageBlob

    @property
    def num_compiles(self) -> int:
        return self.gather.num_compiles

    def export_prefix(self, prompt: Sequence[int], tenant: str | None
                      ) -> tuple[kv_pages.PageBlob | None, int]:
        """The prompt's full pages in the engine's prefix cache: (staged, their count).

        `staged` is None when none is cached (a prompt shorter than a page, or pages evicted).
        """
        cache = self.engine.allocator.prefix_cache
        pages = cache.lookup(list(prompt), self.engine.provenance(tenant))
        if not pages:
            return None, 0
        return self.gather(self.engine.kv, pad_repeat_last(pages)), len(pages)

    def warmup(self) -> None:
        """Compiles the gather for every padded page count (reads only)."""
        for _, pages in _padded_sizes(self.engine):
            self.gather(self.engine.kv, pages)


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """What one import did.

    Attributes:
      moved_bytes: KV bytes scattered into the engine (0 when it held every page already).
      reused_tokens: prompt tokens whose pages the engine held already.
      transferred_tokens: prompt tokens whose pages came in.
      is_fallback: no free pages: nothing moved, the engine recomputes the prompt.
      seconds: blocking time of the move.
    """

    moved_bytes: int
    reused_tokens: int
    transferred_tokens: int
    is_fallback: bool
    seconds: float


class PageImporter:
    """Imports staged pages into one engine's prefix cache (see the module docstring).

    Creating one commits the engine's KV to its devices' shardings, so its steps see one
    placement (and compile once per shape) from then on; create it where the engine is
    stepped.
    """

    def __init__(self, engine: Engine):
        check_transferable(engine, "importing")
        self.engine = engine
        self.page_size = engine.config.page_size
        target = jax.tree.map(lambda x: x.sharding, engine.kv)
        self.target = [x.sharding for x in engine.kv.page_leaves()]  # where a PageBlob goes
        self._scatter = kvjax_jit.jit(kv_pages.scatter_pages, donate_argnums=0,
                                      out_shardings=target)
        self._gather = kvjax_jit.jit(kv_pages.gather_pages)
        self.take = kvjax_jit.jit(kv_pages.take)  # pages [n'] of a staged PageBlob
        engine.runner.apply(KVOp(KVOpKind.PLACE), lambda kv: jax.device_put(kv, target))

    @property
    def num_compiles(self) -> int:
        return self._scatter.num_compiles + self._gather.num_compiles + self.take.num_compiles

    def check_blob(self, staged: Sequence[np.ndarray | jax.Array], num_staged: int) -> None:
        """Raises ValueError naming the leaf whose shape or dtype this engine cannot take."""
        own = self.engine.kv.page_leaves()
        if not staged and num_staged == 0:
            return
        if len(staged) != len(own):
            raise ValueError(f"the pages have {len(staged)} leaves; this engine's KV has "
                             f"{len(own)}")
        for i, (got, want) in enumerate(zip(staged, own, strict=True)):
            expect = (want.shape[0], got.shape[1], *want.shape[2:])
            if tuple(got.shape) != expect or got.dtype != want.dtype:
                raise ValueError(f"page leaf {i}: got {got.dtype}{list(got.shape)}, this "
                                 f"engine's pages are {want.dtype}{list(expect)}")
        if not 0 <= num_staged <= (staged[0].shape[1] if staged else 0):
            raise ValueError(f"num_pages {num_staged} is outside the {staged[0].shape[1]} "
                             f"staged pages")

    def warmup(self) -> None:
        """Compiles the scatter for every padded page count; the KV is unchanged."""
        for _, pages in _padded_sizes(self.engine):
            self.warm(pages)

    def warm(self, pages: np.ndarray) -> None:
        """Compiles the scatter for `len(pages)` pages by writing their own content back."""
        own = jax.device_put(self._gather(self.engine.kv, pages), self.target)
        self.engine.runner.apply(KVOp(KVOpKind.WARMUP),
                                 lambda kv: self._scatter(kv, pages, own))

    def import_prefix(self, pin: str, tokens: Sequence[int],
                      staged: Sequence[np.ndarray | jax.Array] | None, num_staged: int,
                      tenant: str | None, *, record_stats: bool = True) -> ImportResult:
        """Commits `staged`'s first `num_staged` pages as the full pages of `tokens`.

        The allocator sequence `pin` holds `tokens`' pages until `release(pin)`. Without
        `record_stats`, the pages it finds held already are not counted as prefix-cache hits
        (no prompt read them).
        """
        alloc = self.engine.allocator
        reused = alloc.add_sequence(pin, list(tokens), record_stats=record_stats,
                                    cache_key=self.engine.provenance(tenant))
        first_page, end = reused // self.page_size, num_staged * self.page_size
        if num_staged <= first_page:
            return ImportResult(0, reused, 0, False, 0.0)
        # Copy-on-write copies are not needed: every page from first_page on is overwritten.
        status, _ = alloc.ensure_writable(pin, reused, end)
        if status is not AllocStatus.OK:  # No room now: the engine recomputes the prompt.
            return ImportResult(0, reused, 0, True, 0.0)
        start = time.perf_counter()
        targets = alloc.block_table(pin)[first_page:num_staged]
        index = pad_repeat_last(range(first_page, num_staged))
        # Staged pages on a device are sliced there; pages that came as host arrays (over
        # the network) are sliced on the host, which compiles nothing.
        part = (self.take(list(staged), index) if isinstance(staged[0], jax.Array)
                else [x[:, index] for x in staged])
        part = jax.device_put(part, self.target)
        self.engine.runner.apply(KVOp(KVOpKind.SCATTER, tuple(targets)),
                                 lambda kv: self._scatter(kv, pad_repeat_last(targets), part))
        jax.block_until_ready(self.engine.kv)
        alloc.commit(pin, list(tokens[:end]))
        moved = kv_pages.blob_bytes_per_page(part) * len(targets)
        return ImportResult(moved, reused, end - reused, False, time.perf_counter() - start)

    def release(self, pin: str) -> None:
        """Unpins an import's pages (they stay in the prefix cache, evictable)."""
        self.engine.allocator.free(pin)
