"""Transfers of KV pages between tiers: a checked state machine, page checksums, injected faults.

Every movement of pages (device -> host, host -> device, host -> disk, disk -> host) is a
`Transfer` that walks

    QUEUED -> IN_FLIGHT -> LANDED -> VERIFIED -> COMMITTED
        \\__________\\__________\\__________\\____> FAILED

and nothing else: `advance` raises `IllegalTransition` on any other step. The data it carries
is readable (`Transfer.result`) only once COMMITTED; LANDED means the bytes are at the
destination, VERIFIED that their checksum equals the source's.

Page checksums are a position-weighted sum of the pages' 32-bit words modulo 2^32, computed the
same way by jnp (on the device, beside the gather that produces the source) and by numpy (on the
landed host bytes), so a transfer is checked end to end. Each word is weighted by an odd number,
so changing any single word always changes the checksum.

A `FaultInjector` makes a seeded fraction of transfers fail outright, land corrupted (one byte
flipped) or land late; the tier manager turns each into a fallback to recompute. Disk transfers
run on worker threads; LANDED means the worker finished, and states still change only on the
tier manager's thread.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from kvjax.trace import NULL_TRACER, Tracer


class TransferState(enum.Enum):
    """Where a transfer stands; only COMMITTED data may be read."""

    QUEUED = "queued"  # created, nothing moved yet.
    IN_FLIGHT = "in_flight"  # the copy was issued (async dispatch, or a disk worker thread).
    LANDED = "landed"  # the bytes are at the destination, unchecked.
    VERIFIED = "verified"  # the destination's checksum equals the source's.
    COMMITTED = "committed"  # visible to readers (indexed, or scattered into the KV pool).
    FAILED = "failed"  # failed, corrupted, timed out or cancelled; its data is never read.


_LEGAL_NEXT = {
    TransferState.QUEUED: (TransferState.IN_FLIGHT, TransferState.FAILED),
    TransferState.IN_FLIGHT: (TransferState.LANDED, TransferState.FAILED),
    TransferState.LANDED: (TransferState.VERIFIED, TransferState.FAILED),
    TransferState.VERIFIED: (TransferState.COMMITTED, TransferState.FAILED),
    TransferState.COMMITTED: (),
    TransferState.FAILED: (),
}


def is_legal_transition(src: TransferState, dst: TransferState) -> bool:
    """Whether a transfer may go from `src` to `dst` in one step."""
    return dst in _LEGAL_NEXT[src]


class IllegalTransition(RuntimeError):
    """A transfer was asked to skip a state, go back, or leave a final state."""


class TransferKind(enum.Enum):
    """The two tiers a transfer connects."""

    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"
    HOST_TO_DISK = "host_to_disk"
    DISK_TO_HOST = "disk_to_host"


class Fault(enum.Enum):
    """What the injector does to one transfer."""

    NONE = "none"
    FAIL = "fail"  # the transfer fails before moving anything.
    CORRUPT = "corrupt"  # one byte of the landed data is flipped.
    DELAY = "delay"  # the transfer lands `delay_polls` polls late (or times out).


_transfer_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Transfer:
    """One movement of pages between two tiers.

    Attributes:
        kind: which tiers it connects.
        keys: the page keys it carries, in order.
        nbytes: bytes it moves.
        owner: who waits for it (a sequence id for loads), or None.
        fault: the fault injected into it.
        state: the current state; `history` lists every state it has been in, in order.
        error: why it failed, else None.
        polls: how many times the tier manager looked at it while in flight.
        issue_time, land_time: clock readings when it was issued and seen landed.
    """

    kind: TransferKind
    keys: tuple[Hashable, ...]
    nbytes: int
    owner: Hashable | None = None
    fault: Fault = Fault.NONE
    state: TransferState = TransferState.QUEUED
    history: list[TransferState] = dataclasses.field(
        default_factory=lambda: [TransferState.QUEUED])
    error: str | None = None
    polls: int = 0
    issue_time: float = 0.0
    land_time: float = 0.0
    transfer_id: int = dataclasses.field(default_factory=lambda: next(_transfer_ids))
    payload: Any = dataclasses.field(default=None, repr=False)
    # Where each state change is reported (the ledger sets the tiers' tracer).
    tracer: Tracer = dataclasses.field(default=NULL_TRACER, repr=False, compare=False)

    @property
    def is_done(self) -> bool:
        return self.state in (TransferState.COMMITTED, TransferState.FAILED)

    def advance(self, state: TransferState) -> None:
        """Moves to `state`; raises IllegalTransition unless it is the next legal state."""
        if not is_legal_transition(self.state, state):
            raise IllegalTransition(
                f"transfer {self.transfer_id} ({self.kind.value}) cannot go from "
                f"{self.state.value} to {state.value}")
        self.state = state
        self.history.append(state)
        self.tracer.emit(state.value, "transfer", f"tier/{self.kind.value}",
                         transfer_id=self.transfer_id, owner=str(self.owner),
                         num_pages=len(self.keys), nbytes=self.nbytes)

    def fail(self, reason: str) -> None:
        """Moves to FAILED (from any non-final state) and drops the data it carried."""
        self.advance(TransferState.FAILED)
        self.error = reason
        self.payload = None

    def result(self) -> Any:
        """The carried data; raises unless the transfer is COMMITTED."""
        if self.state is not TransferState.COMMITTED:
            raise IllegalTransition(
                f"transfer {self.transfer_id} is {self.state.value}; only committed data is "
                f"readable")
        return self.payload


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    """Seeded fault injection into tier transfers (all zero: off).

    Attributes:
        fail_fraction: fraction of transfers that fail before moving anything.
        corrupt_fraction: fraction that land with one byte flipped (caught by the checksum).
        delay_fraction: fraction that land `delay_polls` polls late; a delay beyond the tier
            manager's `timeout_polls` makes them time out.
        delay_polls: how late a delayed transfer lands, in polls (engine steps).
        seed: seeds the choice of transfers and of flipped bytes.
        kinds: the transfer kinds faults are injected into.
    """

    fail_fraction: float = 0.0
    corrupt_fraction: float = 0.0
    delay_fraction: float = 0.0
    delay_polls: int = 3
    seed: int = 0
    kinds: tuple[TransferKind, ...] = tuple(TransferKind)

    def __post_init__(self):
        for name in ("fail_fraction", "corrupt_fraction", "delay_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultConfig.{name} must be in [0, 1], got {value!r}")
        total = self.fail_fraction + self.corrupt_fraction + self.delay_fraction
        if total > 1.0:
            raise ValueError(f"FaultConfig fractions sum to {total!r} > 1")
        if not isinstance(self.delay_polls, int) or self.delay_polls < 1:
            raise ValueError(f"FaultConfig.delay_polls must be a positive int, got "
                             f"{self.delay_polls!r}")
        object.__setattr__(self, "kinds", tuple(TransferKind(k) for k in self.kinds))

    @property
    def enabled(self) -> bool:
        return self.fail_fraction + self.corrupt_fraction + self.delay_fraction > 0


class FaultInjector:
    """Draws a seeded fault for each transfer and corrupts data on request.

    Attributes:
        config: the FaultConfig.
        counts: faults injected so far, by Fault.
    """

    def __init__(self, config: FaultConfig):
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self.counts = {fault: 0 for fault in Fault}

    def draw(self, kind: TransferKind) -> Fault:
        """The fault for the next transfer of `kind`."""
        cfg = self.config
        fault = Fault.NONE
        if cfg.enabled and kind in cfg.kinds:
            u = self._rng.random()
            if u < cfg.fail_fraction:
                fault = Fault.FAIL
            elif u < cfg.fail_fraction + cfg.corrupt_fraction:
                fault = Fault.CORRUPT
            elif u < cfg.fail_fraction + cfg.corrupt_fraction + cfg.delay_fraction:
                fault = Fault.DELAY
        self.counts[fault] += 1
        return fault

    def corrupt(self, leaves: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Copies of `leaves` with one byte of one of them flipped (xor 0xFF)."""
        out = [np.array(x, copy=True) for x in leaves]
        sizes = [x.nbytes for x in out]
        flat = int(self._rng.integers(sum(sizes)))
        for x, size in zip(out, sizes, strict=True):
            if flat < size:
                x.reshape(-1).view(np.uint8)[flat] ^= 0xFF
                break
            flat -= size
        return out

    def flip_position(self, nbytes: int) -> int:
        """Which byte of an `nbytes` buffer to flip (drawn here, so a transfer whose bytes are
        handled on a worker thread still draws in issue order: runs stay reproducible)."""
        return int(self._rng.integers(nbytes))


def flip_byte(data: bytes, position: int) -> bytes:
    """`data` with the byte at `position` flipped (xor 0xFF)."""
    buf = bytearray(data)
    buf[position] ^= 0xFF
    return bytes(buf)


# ----------------------------------------------------------------------------- checksums

_WORD = {4: np.uint32, 2: np.uint16, 1: np.uint8}
_MIX = 0x01000193  # FNV prime: mixes the per-leaf sums into one word per page.


def _check_itemsize(dtype) -> None:
    if np.dtype(dtype).itemsize not in _WORD:
        raise ValueError(f"page checksums need 1-, 2- or 4-byte dtypes, got {dtype}")


def _leaf_checksum_jnp(x):
    import jax  # The device twin: the host side of the tiers runs without jax.
    import jax.numpy as jnp

    _check_itemsize(x.dtype)
    num_layers, n = x.shape[:2]
    words = jax.lax.bitcast_convert_type(x, _WORD[x.dtype.itemsize]).astype(jnp.uint32)
    words = words.reshape(num_layers, n, -1)  # [L, n, R]
    # Word (l, r) of a page is its word l * R + r; odd weights, so no single word cancels.
    weights = 2 * jnp.arange(num_layers * words.shape[2], dtype=jnp.uint32) + 1
    weights = weights.reshape(num_layers, 1, -1)  # [L, 1, R]
    return jnp.sum(words * weights, axis=(0, 2), dtype=jnp.uint32)  # [n]


def page_checksums(leaves: Sequence):
    """Checksums of n pages, [n] uint32, from page-major leaves [L, n, ...] (jnp, traceable)."""
    import jax.numpy as jnp

    total = jnp.zeros([leaves[0].shape[1]], jnp.uint32)
    for x in leaves:
        total = total * jnp.uint32(_MIX) + _leaf_checksum_jnp(x)
    return total


def page_checksums_np(leaves: Sequence[np.ndarray]) -> np.ndarray:
    """The numpy twin of `page_checksums`: bit-identical on the same bytes."""
    total = np.zeros([leaves[0].shape[1]], np.uint32)
    for x in leaves:
        x = np.asarray(x)
        _check_itemsize(x.dtype)
        num_layers, n = x.shape[:2]
        words = x.view(_WORD[x.dtype.itemsize]).astype(np.uint32).reshape(num_layers, n, -1)
        weights = 2 * np.arange(words.shape[0] * words.shape[2], dtype=np.uint32) + 1
        weights = weights.reshape(num_layers, 1, -1)  # [L, 1, R]
        total = total * np.uint32(_MIX) + np.sum(words * weights, axis=(0, 2), dtype=np.uint32)
    return total
