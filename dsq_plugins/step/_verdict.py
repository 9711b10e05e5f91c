"""Verdicts judged once per step instead of once per collective.

The collective protocol (``comm``) reads every header table on the host
before any payload moves, and a decoder reads its checks back before it
returns. On a GPU each such read is a host sync that drains the launch
queue: about ten per bucket. A *deferred* step first agrees its ``Plan``
with the other ranks (every bucket's name and size, hence every payload
length: one host read at the step's start, or none once an unchanging plan
was agreed). Every collective then moves the lengths the plan fixes, while
headers, decoder checks and finiteness stay device values. ``StepVerdict``
reads them all back together when the step closes and runs the judges in
the order the collective protocol would have, so the first problem raises
the same error on every rank before any state is written.

The price: a step that fails has done all its buckets' work, and a rank
that could not build its payloads still sends zeros of the plan's lengths
until the step's end.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from ..comm.header import make_tag
from ..compressors.finite import extremes_not_finite, extremes_not_finite_fusable, status_of
from ..compressors.kernels import FusedKernel


class Reading:
    """A device tensor whose values a judge needs: ``values`` (a flat list
    of ints) once the verdict has settled."""

    def __init__(self, tensor: torch.Tensor, words: bool = False, bad: Callable[[], torch.Tensor] | None = None):
        #: rows of int64 words as bytes (headers that travelled inside a payload's message), kept as rows: one
        #: copy at ``settle`` turns all of a width back into words, where a copy per collective would cost a launch
        self.words = words
        self.tensor = tensor.detach() if words else tensor.detach().reshape(-1)  # bool or integer otherwise
        self.values: list[int] | None = None
        #: device flags, made when asked (``StepVerdict.alarm_since``): its judge will condemn the step if any is set
        self.bad = bad

    def rows(self, width: int) -> list[list[int]]:
        """``values`` cut into rows of ``width`` (a header table)."""
        assert self.values is not None, "read before the verdict settled"
        return [self.values[i: i + width] for i in range(0, len(self.values), width)]


class StepVerdict:
    """The deferred checks of one step: readings to bring back, and judges
    that raise, in the order they were added, once they are back."""

    def __init__(self) -> None:
        self._readings: list[Reading] = []
        self._judges: list[tuple[Callable[[], None], Callable[[BaseException], None] | None]] = []
        self._explain: Callable[[BaseException], None] | None = None
        #: readings on their way back (``fetch``): each device's group, its values' host copy, and the event
        #: the copy is done at (None where the copy was synchronous)
        self._fetched: list[tuple[list[Reading], torch.Tensor, torch.cuda.Event | None]] = []
        #: host reads this verdict has made (one per device per ``settle`` with new readings)
        self.host_reads = 0

    def read(self, tensor: torch.Tensor, bad: Callable[[], torch.Tensor] | None = None) -> Reading:
        """Bring ``tensor``'s values back at the next ``settle``. ``bad``
        makes, on the device, flags of which any set means the judge of these
        values will condemn the step (for ``alarm_since``; if None, a bool
        tensor's own)."""
        reading = Reading(tensor, bad=bad)
        self._readings.append(reading)
        return reading

    def read_words(self, table: torch.Tensor, bad: Callable[[], torch.Tensor] | None = None) -> Reading:
        """``read`` of a (rows, 8·H) uint8 table whose rows are H int64 words
        each, as bytes; its values are the words."""
        if table.dim() != 2 or table.dtype != torch.uint8 or table.shape[1] % 8:
            raise ValueError(f"read_words needs rows of int64 words as uint8 bytes, got {table.dtype} "
                             f"{tuple(table.shape)}")
        reading = Reading(table, words=True, bad=bad)
        self._readings.append(reading)
        return reading

    def mark(self) -> int:
        """Where the readings added from now on start (for ``alarm_since``)."""
        return len(self._readings)

    def alarm_since(self, mark: int, device: torch.device) -> torch.Tensor:
        """A device bool: whether any reading added since ``mark`` holds
        something its judge will condemn, known before the step settles. A
        stage that only some ranks saw passes it on in its next header (the
        two-level exchange's host groups)."""
        flags = [r.bad() if r.bad is not None else r.tensor for r in self._readings[mark:]]
        if not flags:
            return torch.zeros((), dtype=torch.bool, device=device)
        # one reduction over every flag (two ops however many readings: each its own any() was three a bucket)
        return torch.cat([f.reshape(-1).to(device=device, dtype=torch.bool) for f in flags]).any()

    def then(self, judge: Callable[[], None]) -> None:
        """Run ``judge`` at the next ``settle`` (after the judges added before
        it); it raises to condemn the step."""
        self._judges.append((judge, self._explain))

    @contextlib.contextmanager
    def explained_by(self, explain: Callable[[BaseException], None]) -> Iterator[None]:
        """Judges added inside this block have what they raise passed to
        ``explain``, which raises the error the caller means by it (a
        communicator's ``PeerStatusError`` becomes the reducer's
        ``NonFiniteGradientError``, say)."""
        outer, self._explain = self._explain, explain
        try:
            yield
        finally:
            self._explain = outer

    def fetch(self) -> None:
        """Start bringing back the readings added since the last ``fetch``,
        without waiting for them: their values are copied on the device as
        they are now (a later step may reuse the buffers they live in), and on
        a GPU copied on to pinned host memory behind the work already queued.
        ``settle`` then waits for that copy alone, not for the device's queue."""
        readings, self._readings = self._readings, []
        by_device: dict[torch.device, list[Reading]] = {}
        for reading in readings:
            by_device.setdefault(reading.tensor.device, []).append(reading)
        for group in by_device.values():
            values = torch.cat(_as_words(group)).to(torch.int64)
            event = None
            if values.is_cuda:
                host = torch.empty(values.shape, dtype=torch.int64, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                values = host
            self._fetched.append((group, values, event))

    def settle(self) -> None:
        """Read back everything added since the last settle (one host read
        per device), then run the new judges in order: the first that raises
        ends it. May be called again as the step goes on."""
        self.fetch()
        fetched, self._fetched = self._fetched, []
        judges, self._judges = self._judges, []
        for group, host, event in fetched:
            if event is not None:
                event.synchronize()
            values = host.tolist()
            self.host_reads += 1
            start = 0
            for r in group:
                size = r.tensor.numel() // 8 if r.words else r.tensor.numel()
                r.values, start = values[start: start + size], start + size
        for judge, explain in judges:
            try:
                judge()
            except Exception as exc:  # noqa: BLE001 - explained, then raised
                if explain is None:
                    raise
                explain(exc)  # raises what the caller means by it; returning leaves it to a later judge


def _as_words(readings: list[Reading]) -> list[torch.Tensor]:
    """Each reading as one flat tensor; the word tables of one width turned
    back into int64 words together (one copy per width, not per table)."""
    flat: list[torch.Tensor | None] = [None if r.words else r.tensor for r in readings]
    widths: dict[int, list[int]] = {}
    for i, r in enumerate(readings):
        if r.words:
            widths.setdefault(r.tensor.shape[1], []).append(i)
    for at in widths.values():
        words = torch.cat([readings[i].tensor for i in at]).view(torch.int64).reshape(-1)
        for i, piece in zip(at, words.split([readings[i].tensor.numel() // 8 for i in at])):
            flat[i] = piece
    return flat


class Plan:
    """The buckets a step will exchange, in order, agreed with the other
    ranks before the step's first payload moves. A plan the caller reuses
    for every step (an overlapped exchange's fixed buckets) is agreed once:
    ``agreed`` stays set."""

    def __init__(self, buckets: Sequence[tuple[str, int]]):
        self.buckets = [(str(name), int(numel)) for name, numel in buckets]
        self._members = set(self.buckets)
        self.agreed = False

    def covers(self, name: str, numel: int) -> bool:
        """Whether bucket ``name`` of ``numel`` elements is one of the plan's
        (a bucket outside it keeps the collective protocol)."""
        return (name, numel) in self._members

    def tag(self, *compressors: object) -> int:
        """A tag that differs between plans whose payload lengths could differ:
        the buckets and the operators with their parameters."""
        text = ";".join(f"{name}:{numel}" for name, numel in self.buckets) + "|" + "|".join(map(repr, compressors))
        return make_tag(text, sum(numel for _, numel in self.buckets))


class LearnedPlans:
    """The buckets a caller exchanges in every step, learned from its first
    step that went through: an engine's backward reduces the same buckets
    each time, one at a time, with no list of them up front. From then on
    that reducer's steps open with them as their plan, so that a reducer
    that defers verdicts judges a step once, at its end. A bucket outside
    the plan keeps the collective protocol, so a layout that changes costs
    host reads, never a wrong verdict. Kept per reducer (a warm-up's exact
    one and the compressed one plan apart)."""

    def __init__(self) -> None:
        self._plans: dict[int, Plan] = {}
        self._exchanged: list[tuple[str, int]] = []

    def opening(self, reducer: object) -> "Plan | None":
        """A step of ``reducer`` opens: its plan, once learned."""
        self._exchanged = []
        return self._plans.get(id(reducer))

    def exchanging(self, name: str, numel: int) -> None:
        """The open step exchanges bucket ``name`` of ``numel`` elements."""
        self._exchanged.append((name, numel))

    def closed(self, reducer: Any) -> None:
        """``reducer``'s step closed; one that went through (``last_step``
        applied) teaches its plan, if it has none yet."""
        if reducer.last_step.applied and self._exchanged and id(reducer) not in self._plans:
            self._plans[id(reducer)] = Plan(self._exchanged)


def nonfinite(t: torch.Tensor) -> torch.Tensor:
    """A device bool: whether ``t`` holds a NaN or an Inf. Exact in one read
    (NaN propagates into min and max, an Inf is one of them), with no host
    sync. Zero times either extreme is zero unless it is NaN or infinite,
    and their sum cannot overflow: four small ops where ``isfinite`` of both
    takes ten, and one fused kernel where compiled (it is called on every
    vector a step sends; a minimum and a maximum do not depend on order)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return _nonfinite_kernel(t, None, numel=t.numel())


def nonfinite_status(t: torch.Tensor) -> torch.Tensor:
    """``nonfinite(t)`` as a device int64 (1: not finite, 0: finite), in the
    same one kernel where compiled: what a header's status word holds."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    return _nonfinite_status_kernel(t, numel=t.numel())


def nonfinite_rows(t: torch.Tensor) -> torch.Tensor:
    """``nonfinite`` of each row of a 2-D ``t``: a device bool per row, in the same ops."""
    if t.shape[1] == 0:
        return torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
    return _nonfinite_kernel(t, 1, numel=t.numel())


# one kernel on a GPU where it was five launches; a CPU's eager reductions are as fast
_nonfinite_kernel = FusedKernel(extremes_not_finite, extremes_not_finite_fusable, compile_on_cpu=False)


def _status_of_extremes(t: torch.Tensor) -> torch.Tensor:
    return status_of(extremes_not_finite(t, None))


def _status_of_extremes_fusable(t: torch.Tensor) -> torch.Tensor:
    return status_of(extremes_not_finite_fusable(t, None))


_nonfinite_status_kernel = FusedKernel(_status_of_extremes, _status_of_extremes_fusable, compile_on_cpu=False)


def first_true(flags: torch.Tensor, base: int) -> torch.Tensor:
    """A device int64: ``base + i`` for the first True in ``flags``, else 0
    (one kernel where compiled: five small launches otherwise, at every bucket)."""
    return _first_true_kernel(flags, base, numel=flags.numel())


def first_true_of(flags: torch.Tensor, base: int) -> torch.Tensor:
    """``first_true``'s ops, for a kernel that forms its flags and their status together."""
    flags = flags.reshape(-1).bool()  # callers pass bool or uint8 flags; where() takes a bool condition
    return torch.where(flags.any(), base + flags.to(torch.int64).argmax(), 0)


# a few flags: compiling pays for the launches it saves, whatever the size (not on a CPU)
_first_true_kernel = FusedKernel(first_true_of, compile_on_cpu=False, compile_from=1)
