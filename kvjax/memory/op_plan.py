"""The KV cache manager's op plan: every `KVOp` it issues is recorded (and traced), and the ops
of `DATA_KINDS` are either applied when issued or, while a step is formed or committed, kept as
data for the runner to apply before the step's model (`kvjax.memory.ops`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvjax.memory.ops import KVDevice, KVOp
from kvjax.shapes import pad_repeat_last
from kvjax.trace import NULL_TRACER, Tracer


class OpPlan:
    """Issues KV ops to the device that owns the pool, or plans them as data.

    Attributes:
      device: the KVDevice (the model runner) that applies ops.
      tracer: where each op is reported.
    """

    def __init__(self, device: KVDevice):
        self.device = device
        self.tracer: Tracer = NULL_TRACER
        self._ops: list[KVOp] = []
        self._plan: list[KVOp] | None = None  # data ops deferred to the step; None: apply now

    def _record(self, op: KVOp) -> None:
        self._ops.append(op)
        self.tracer.emit(op.kind.value, "page", "pages/device", num_pages=len(op.pages))

    def issue(self, op: KVOp) -> None:
        """A data op (`DATA_KINDS`): into the step's plan while one is formed, else applied."""
        self._record(op)
        if self._plan is None:
            self.device.apply_ops((op,))
        else:
            self._plan.append(op)

    def _flush(self) -> None:
        """Applies the data ops planned so far: an op that runs now must come after them."""
        if self._plan:
            self.device.apply_ops(tuple(self._plan))
            self._plan.clear()

    def apply(self, op: KVOp, fn: Callable) -> None:
        """Applies `fn(kv) -> kv` on the device now, after the data ops planned so far."""
        self._flush()
        self._record(op)
        self.device.apply(op, fn)

    def defer_ops(self) -> None:
        """From now until `take_plan`, ops of `DATA_KINDS` are planned as data (a step is
        being formed or committed) instead of applied when issued."""
        self._flush()
        self._plan = []

    def take_plan(self) -> tuple[KVOp, ...]:
        """The data ops planned since `defer_ops`, in order, for the runner to apply before
        the step's model; ops are applied when issued again afterwards."""
        plan, self._plan = tuple(self._plan or ()), None
        return plan

    def end_plan(self) -> None:
        """Applies the data ops still planned (none once `take_plan` took them) and applies
        ops when issued again."""
        self._flush()
        self._plan = None

    def take_ops(self) -> tuple[KVOp, ...]:
        """The KV operations issued since the last call, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops


def padded(pages: Sequence[int]) -> tuple[int, ...]:
    """Pages padded to a power of two by repeating the last (a repeated copy is harmless)."""
    return tuple(pad_repeat_last(list(pages)).tolist())
