"""One reducer step per backward: FSDP reduces each ``fully_shard`` module
separately, as its gradients are ready, so the step opens at the first
module's exchange and closes when autograd finishes the backward (a final
callback, as FSDP's own is). The error memories are written then, and only
if every module's exchange succeeded; a failure closes the step unapplied
and is raised from ``backward()`` on every rank.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from torch.autograd import Variable

from ..errors import DSQError
from ..reducer import DoubleSqueeze
from ..step import LearnedPlans

__all__ = ["BackwardSteps"]

T = TypeVar("T")


class BackwardSteps:
    """Runs a module's exchange inside the backward's one step, on the
    reducer ``pick()`` chose when the step opened (exact during warm-up).

    A backward exchanges the same modules every time, so after the first
    one that went through on a reducer, its modules become that reducer's
    plan: a reducer that defers verdicts (``verdict="step"``, "auto" on a
    GPU) then reads the device once per backward, when it closes, instead
    of at each module (not with ``on_nonfinite="skip"``: a skip found at
    the end would come after FSDP wrote the gradients)."""

    def __init__(self, pick: Callable[[int], DoubleSqueeze], ranks_are: str = ""):
        self.pick = pick            # backwards applied so far -> the reducer of the next one
        self.applied = 0            # backwards whose exchanges all went through
        self.ranks_are = ranks_are  # what the ranks an error names are, where they are not global ranks
        self.current: DoubleSqueeze | None = None
        self.plans = LearnedPlans()  # the modules every backward exchanges, per reducer

    def run(self, exchange: Callable[[DoubleSqueeze], T], bucket: tuple[str, int] | None = None) -> T:
        """``exchange(reducer)`` inside the open backward's step; ``bucket``:
        the (name, elements) it exchanges, for the plan."""
        alone = False  # called outside autograd's backward (directly): the step is this exchange
        if self.current is None:
            self.current = self.pick(self.applied)
            skips = self.current.config.on_nonfinite == "skip"
            self.current.open_step(None if skips else self.plans.opening(self.current))
            try:
                Variable._execution_engine.queue_callback(self.close)
            except RuntimeError:
                alone = True
        reducer = self.current
        if bucket is not None:
            self.plans.exchanging(*bucket)
        try:
            result = exchange(reducer)
        except BaseException as exc:
            self.current = None
            reducer.close_step(exc)
            self._explain(exc)
            raise
        if alone:
            self.close()
        return result

    def _explain(self, exc: BaseException) -> None:
        """Say in the error what its ranks are, where they are not global ranks (HSDP: replicas)."""
        if self.ranks_are and isinstance(exc, DSQError) and exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]} ({self.ranks_are})", *exc.args[1:])

    def close(self) -> None:
        """End the backward's step (autograd's final callback): written if it succeeded."""
        reducer, self.current = self.current, None
        if reducer is not None and reducer.scope.current is not None:
            reducer.close_step()
            self.applied += 1
            self.plans.closed(reducer)
