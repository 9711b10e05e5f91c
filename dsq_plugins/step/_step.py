"""The step: the unit in which a reducer's state changes.

An optimizer step may exchange many buckets. Every error memory (worker,
server, momentum) and step counter they touch is *staged* while the step
runs and written only when the step closes with every bucket exchanged; a
step that fails (any error, on any bucket) or is skipped (a non-finite
gradient with ``on_nonfinite="skip"``) writes nothing, so the state stays
bit for bit as it was. Once a step has failed or been skipped, its later
buckets are not exchanged at all: every rank reached the same verdict, so
every rank stops exchanging at the same bucket. (A deferred step, see
``verdict``, exchanges all its buckets and learns its verdict at the end.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm import header
from ..state import StagedUpdate
from ._verdict import Plan, StepVerdict

APPLIED, SKIPPED, FAILED = "applied", "skipped", "failed"


@dataclass
class Round:
    """One bucket's exchange inside a step: what every part of Algorithm 1
    needs to know about it, and what it stages."""

    name: str
    numel: int
    bounds: list[tuple[int, int]]   # the chunks (``owners.chunk_bounds``)
    tag: int                        # its collectives' header tag
    step: int                       # exchanges of this bucket applied so far (seeds are drawn for it)
    device: torch.device
    update: StagedUpdate
    #: what this rank raised building its part (announced to every rank, raised here)
    local_error: BaseException | None = None
    #: the server pass's messages as gathered, one per owner (kept for callers that store them)
    gathered: list | None = None
    #: each chunk's size as the operators are told it, as a worker and as its owner, which is the
    #: element count, or for a structured operator a ``compressors.shapes.Shaped`` (layout and warm start)
    sizes: list[int] = field(default_factory=list)
    served_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        plain = [b - a for a, b in self.bounds]
        self.sizes = self.sizes or plain
        self.served_sizes = self.served_sizes or list(plain)

    def fail_locally(self, error: BaseException) -> int:
        """This rank could not do its part of the round: keep ``error`` (the
        first) to raise once every rank has heard, and return the header
        status that tells them (``header.LOCAL_FAILURE``). The one way a
        local failure is announced, on either pass."""
        if self.local_error is None:
            self.local_error = error
        return header.LOCAL_FAILURE


@dataclass(frozen=True)
class Problem:
    """Why a step was not applied, in one place: an ``error`` (the step failed,
    raised on every rank), or a skip: the ranks whose non-finite gradient
    skipped it (``on_nonfinite="skip"``), or the engine's own (a loss
    scaler's overflow)."""

    error: BaseException | None = None
    skipped_for: tuple[int, ...] = ()
    by_engine: bool = False


@dataclass
class Step:
    """One open (then closed) step. ``problem`` is None while nothing went
    wrong; ``outcome`` is None while it is open, then ``"applied"``,
    ``"skipped"`` or ``"failed"``."""

    staged: list[StagedUpdate] = field(default_factory=list)
    problem: Problem | None = None
    closed: bool = False
    #: a deferred step (``verdict``): the buckets it agreed to exchange, and the checks it has yet to judge
    plan: Plan | None = None
    verdict: StepVerdict | None = None
    #: buckets exchanged so far
    exchanged: int = 0

    @property
    def error(self) -> BaseException | None:
        return None if self.problem is None else self.problem.error

    @property
    def skipped_for(self) -> list[int]:
        """Ranks whose non-finite gradient skipped the step."""
        return [] if self.problem is None else list(self.problem.skipped_for)

    @property
    def skipped_by_engine(self) -> bool:
        return self.problem is not None and self.problem.by_engine

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def skipped(self) -> bool:
        return self.problem is not None and self.error is None

    @property
    def applied(self) -> bool:
        return self.outcome == APPLIED

    @property
    def outcome(self) -> str | None:
        if not self.closed:
            return None
        return FAILED if self.failed else SKIPPED if self.skipped else APPLIED

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.problem = Problem(error=error)

    def skip(self, ranks: list[int]) -> None:
        if self.problem is None:
            self.problem = Problem(skipped_for=tuple(ranks))

    def skip_by_engine(self) -> None:
        """The engine skipped its optimizer step: nothing staged is written."""
        if self.problem is None:
            self.problem = Problem(by_engine=True)
