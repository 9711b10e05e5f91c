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
    #: each chunk's size as the operators are told it, as a worker and as its owner: the element
    #: count, or for a structured operator a ``compressors.shapes.Shaped`` (layout and warm start)
    sizes: list[int] = field(default_factory=list)
    served_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        plain = [b - a for a, b in self.bounds]
        self.sizes = self.sizes or plain
        self.served_sizes = self.served_sizes or list(plain)


@dataclass
class Step:
    """One open (then closed) step. ``outcome`` is None while it is open,
    then ``"applied"``, ``"skipped"`` or ``"failed"``."""

    staged: list[StagedUpdate] = field(default_factory=list)
    outcome: str | None = None
    error: BaseException | None = None
    #: ranks whose non-finite gradient skipped the step
    skipped_for: list[int] = field(default_factory=list)
    #: the engine skipped the optimizer step itself (a loss scaler's overflow)
    skipped_by_engine: bool = False
    #: a deferred step (``verdict``): the buckets it agreed to exchange, and the checks it has yet to judge
    plan: Plan | None = None
    verdict: StepVerdict | None = None
    #: buckets exchanged so far
    exchanged: int = 0

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def skipped(self) -> bool:
        return (bool(self.skipped_for) or self.skipped_by_engine) and self.error is None

    @property
    def applied(self) -> bool:
        return self.outcome == APPLIED

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def skip(self, ranks: list[int]) -> None:
        if not self.skipped_for:
            self.skipped_for = list(ranks)

    def skip_by_engine(self) -> None:
        """The engine skipped its optimizer step: nothing staged is written."""
        self.skipped_by_engine = True
