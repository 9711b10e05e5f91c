"""The step scope: which step of a reducer is open, and when its staged
state is judged and written.

A step may exchange many buckets (``reduce_many``, an engine's buckets as
backward produces them, ZeRO's groups from the accumulation boundary to the
optimizer step). ``open`` starts one, every exchange joins it, and ``close``
ends it: only a step that closes with every bucket exchanged and its
verdict in (``Step.outcome`` "applied") writes what its buckets staged.
``with scope():`` is the same as a block; a caller that must hold a step
across calls of its own (ZeRO, a DDP hook) uses ``open`` and ``close``.

A deferred step can also close *unjudged* (``close_unjudged``), for a caller
whose optimizer skips a step on the device (a fused torch optimizer handed a
``found_inf``): its state is written at once, undoably, the device learns
whether the verdict will condemn it, and the host reads the verdict only at
the next ``open`` (or ``judge_pending``), when the device is long past it.
A condemned step is then undone and raised there, one step late, so that no
host read waits for the device inside a step.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TypeVar

import torch

from ..state import ReducerState, StagedUpdate
from ._statuses import Skipped
from ._step import Step
from ._verdict import Plan, StepVerdict

T = TypeVar("T")


class StepScope:
    """The steps of one reducer over its ``state``. ``defers_verdicts``:
    steps that adopt a plan judge their verdicts once, when they settle."""

    def __init__(self, state: ReducerState, defers_verdicts: bool, before_first: Callable[[], None] | None = None):
        self.state = state
        self.defers_verdicts = defers_verdicts
        #: run once, as the first step opens (the ranks agreeing on their settings), then dropped
        self._before_first = before_first
        #: the open step, if any
        self.current: Step | None = None
        #: the last closed step (its ``outcome``: applied, skipped or failed)
        self.last: Step | None = None
        #: a step closed unjudged (``close_unjudged``) and what puts its state back, until ``judge_pending``
        self.pending: tuple[Step, Callable[[], None]] | None = None

    def open(self, plan: Plan | None = None) -> Step:
        """Start a step (``plan``: the buckets it will exchange, for a scope
        that defers verdicts). A ``RuntimeError`` if one is open."""
        if self.current is not None:
            raise RuntimeError("a step is already open: close() it first")
        self.judge_pending()
        if self._before_first is not None:
            self._before_first()
            self._before_first = None
        current = self.current = Step()
        if plan is not None:
            self.adopt_plan(current, plan)
        return current

    def close(self, error: BaseException | None = None) -> Step:
        """End the open step: failed with ``error``, else judged (what a
        deferred verdict raises is raised here, after the step is closed
        with nothing written); a step that succeeded writes its state."""
        current = self.current
        if current is None:
            raise RuntimeError("no step is open")
        try:
            if error is not None:
                current.fail(error)
            else:
                self.settle(current)
        finally:
            self.current = None
            self._write(current)
        return current

    def close_unjudged(self, device: torch.device) -> torch.Tensor:
        """End the open step without waiting for its verdict: a device float,
        1 if the step will not be applied (its verdict condemns or skips it)
        and 0 if it will, for an optimizer that skips a step on the device.
        A deferred step's state is written now and its verdict read at the
        next ``open`` or ``judge_pending``, which undo the write if it was
        condemned (and raise) or skipped. A step judged at its collectives
        (no plan) closes as ``close`` does: what failed is raised here."""
        current = self.current
        if current is None:
            raise RuntimeError("no step is open")
        if current.verdict is None or current.failed or current.skipped:
            self.close()
            return torch.full((), float(not current.applied), device=device)
        condemned = current.verdict.alarm_since(0, device).to(torch.float32)
        current.verdict.fetch()  # its readings' values now, on their way to the host while the device goes on
        self.current = None
        self.pending = (current, self.state.snapshot())
        for update in current.staged:
            self.state.write(update)
        current.staged = []
        return condemned

    def judge_pending(self) -> Step | None:
        """Read the verdict of the step ``close_unjudged`` ended, if any, and
        close it: applied, or its state put back (skipped: counted; failed:
        its error raised, the same on every rank). Returns it."""
        if self.pending is None:
            return None
        current, restore = self.pending
        self.pending = None
        try:
            self.settle(current)
        finally:
            if current.problem is not None:
                restore()
                if current.skipped:
                    self.state.skipped_steps += 1
            current.closed = True
            self.last = current
        return current

    @contextlib.contextmanager
    def __call__(self, plan: Plan | None = None) -> Iterator[Step]:
        """A step for the duration of a block; nested blocks join the open step."""
        if self.current is not None:
            yield self.current
            return
        current = self.open(plan)
        try:
            yield current
        except BaseException as exc:
            self.close(exc)
            raise
        self.close()

    def adopt_plan(self, current: Step, plan: Plan) -> None:
        """Make ``current`` a deferred step over ``plan``, if verdicts are
        deferred and the step has exchanged nothing yet (a step that already
        did keeps the collective protocol to its end)."""
        if self.defers_verdicts and current.plan is None and current.exchanged == 0:
            current.plan, current.verdict = plan, StepVerdict()

    def settle(self, current: Step) -> None:
        """Judge what a deferred step has left to judge (nothing otherwise):
        a non-finite gradient with "skip" skips the step, anything else
        fails it and is raised."""
        if current.verdict is None or current.failed or current.skipped:
            return
        try:
            current.verdict.settle()
        except Skipped as skip:
            current.skip(skip.ranks)
        except BaseException as exc:
            current.fail(exc)
            raise

    def exchange(self, run: Callable[[], tuple[StagedUpdate, T]], zeros: Callable[[], torch.Tensor]
                 ) -> T | torch.Tensor:
        """One bucket of the open step: ``run()``'s result, its update
        staged. A step that already failed raises its error again and one
        that was skipped returns ``zeros()``, without moving a byte (every
        rank knows the verdict)."""
        current = self.current
        if current.failed:
            raise current.error
        if current.skipped:
            return zeros()
        current.exchanged += 1
        try:
            update, out = run()
        except Skipped as skip:
            current.skip(skip.ranks)
            return zeros()
        except BaseException as exc:
            current.fail(exc)
            raise
        current.staged.append(update)
        return out

    def exchange_unstaged(self, run: Callable[[], T], zeros: Callable[[], torch.Tensor]) -> T | torch.Tensor:
        """``exchange`` for a bucket that keeps no memory (an exact one): ``run()``'s result, nothing staged."""
        return self.exchange(lambda: (StagedUpdate("unstaged"), run()), zeros)

    def _write(self, current: Step) -> None:
        if current.skipped:
            self.state.skipped_steps += 1
        elif not current.failed:
            for update in current.staged:
                self.state.write(update)
        current.staged = []
        current.closed = True
        self.last = current
