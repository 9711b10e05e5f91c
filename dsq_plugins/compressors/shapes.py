"""What a structured operator (``lowrank``) needs to know about a chunk
beyond its length: which tensors its elements come from, as matrices, and
where its last step's factors are kept for a warm start.

A bucket's flat vector is cut into chunks without regard to tensors, so a
chunk holds pieces of several. A ``TensorMap`` (the bucket's tensors, in
order) turns chunk ``[a, b)`` into ``Segment``s: each piece of a tensor of
two or more dimensions is rows of its ``shape[0] x rest`` matrix (a piece
that starts mid-row is padded with zeros in front, ``lead``), and each piece
of a 1-D tensor is a vector. The chunk's length is then a ``Shaped``: an int
(every other operator and every size computation sees its element count)
that carries the segments, and on the sender's side the ``WarmStart``.

A vector whose tensors nobody described is a plain int: structured
operators lay it out as one matrix of their own choosing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["matrix_of", "Segment", "Shaped", "TensorMap", "WarmStart", "without_warm"]


@dataclass(frozen=True)
class Segment:
    """``length`` consecutive elements of a chunk, all from one tensor.
    A matrix piece (``vector`` False) is ``rows x cols`` row-major after
    ``lead`` zeros; a vector piece is its ``length`` values as they are."""

    length: int
    rows: int
    cols: int
    lead: int = 0
    vector: bool = False
    tensor: str = ""


@dataclass
class WarmStart:
    """The sender's operator state for one chunk: what its last applied step
    left (``previous``, None at first) and where to stage this step's, which
    the reducer writes only if the whole step succeeds."""

    previous: torch.Tensor | None
    stage: Callable[[torch.Tensor], None]
    #: ``previous`` is the bases every rank kept from what the chunk's owner served (``lowrank(warm_start=
    #: "basis")``): the same on every rank, so that senders and receivers project onto them alike
    shared: bool = False


class Shaped(int):
    """A chunk's element count that also carries its ``segments`` and, when
    it is the sender's, its ``warm`` start. Equal to the count as an int, so
    only the operators that ask for the segments see a difference."""

    segments: tuple[Segment, ...]
    warm: WarmStart | None

    def __new__(cls, segments: Sequence[Segment], warm: WarmStart | None = None) -> "Shaped":
        self = super().__new__(cls, sum(s.length for s in segments))
        self.segments, self.warm = tuple(segments), warm
        return self

    def with_warm(self, warm: WarmStart | None) -> "Shaped":
        return Shaped(self.segments, warm)

    def __repr__(self) -> str:
        return f"Shaped({int(self)}, {len(self.segments)} segments)"


def without_warm(size: int) -> int:
    """``size`` without the sender's warm start: for an encoding that must
    not stage state (a fault's), or a size kept beyond its round. Shared
    bases stay: encoding and decoding need them, and nothing is staged."""
    if not isinstance(size, Shaped):
        return size
    shared = size.warm is not None and size.warm.shared
    return size.with_warm(WarmStart(size.warm.previous, _stage_nothing, True) if shared else None)


def _stage_nothing(_: torch.Tensor) -> None:
    """The stage of a warm start that must not write (a module-level function: sizes kept in a state pickle)."""


def matrix_of(shape: Sequence[int]) -> tuple[int, int] | None:
    """(rows, columns) of a tensor as a matrix (``shape[0] x rest``, as
    PowerSGD lays tensors out), or None for a vector: fewer than two
    dimensions, or a side of length 1."""
    if len(shape) < 2:
        return None
    rows, cols = int(shape[0]), math.prod(int(s) for s in shape[1:])
    return (rows, cols) if min(rows, cols) > 1 else None


@dataclass(frozen=True)
class TensorMap:
    """The tensors a flat vector is made of, in order: (name, shape)."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.entries)

    def segments(self, a: int, b: int) -> tuple[Segment, ...]:
        """The segments of the chunk ``[a, b)`` of the flat vector."""
        out, offset = [], 0
        for name, shape in self.entries:
            numel = math.prod(shape)
            start, end = max(a, offset), min(b, offset + numel)
            if start < end:
                out.append(_piece(name, shape, start - offset, end - offset))
            offset += numel
        return tuple(out)


def _piece(name: str, shape: tuple[int, ...], start: int, end: int) -> Segment:
    """Elements ``[start, end)`` of a tensor of ``shape`` as a segment."""
    matrix = matrix_of(shape)
    if matrix is None:
        return Segment(end - start, 1, end - start, vector=True, tensor=name)
    cols = matrix[1]
    lead = start % cols
    return Segment(end - start, -(-(lead + end - start) // cols), cols, lead, tensor=name)
