"""``lowrank``: a rank-r approximation by power iteration with a warm start,
as PowerSGD (Vogels et al., NeurIPS 2019) makes it, tensor by tensor.

Layout. A chunk whose tensors the reducer knows (``shapes.Shaped``) is
cut into its segments: each piece of a tensor of two or more dimensions is
rows of that tensor's ``shape[0] x rest`` matrix (zeros in front of a piece
that starts mid-row), each piece of a 1-D tensor (a bias, a norm's scale) a
vector. A flat vector nobody described is one n x m matrix, n =
ceil(sqrt(L)), m = ceil(L / n), zeros filling the last row; ``compress`` of
a tensor of two or more dimensions uses that tensor's own matrix.

Per matrix segment M (n x m) with r = min(rank, n, m), two schemes.

``warm_start="served"`` (the default) and ``"own"``: P = orthonormal(M Q),
Q = M^T P, ``iterations`` times; the approximation P Q^T projects M's
columns onto span(P), a contraction (error feedback suits it), biased. Q
starts from a warm start kept by the reducer (written only when the whole
step succeeded, dropped by ``reshard``), else from a seeded Gaussian. With
``"served"`` every sender of a chunk starts from the Q its owner served at
the last applied step, one Q for all, as PowerSGD's workers share theirs;
``"own"``: each sender starts from the Q it made itself, and the owner
from its own; so does "served" where no single owner serves a chunk's Q
(``owners`` > 1, ZeRO's reduce-scatter). The owner's server pass squeezes
the mean of the senders' approximations a second time.

``warm_start="basis"``: every rank keeps, per chunk, the
orthonormal bases P_s (n x r) and Q_s (m x r) of the two factors the
chunk's owner served at the last applied step (``served_basis``), the same
on every rank. A sender sends P = M Q_s and W = M^T P_s; the decoded matrix
is M's orthogonal projection onto the matrices whose columns lie in
span(P_s) or whose rows lie in span(Q_s): P Q_s^T + P_s W^T - P_s P_s^T P Q_s^T,
a contraction, and linear in M. So the owner's mean of the senders'
projections is itself such a projection, and the server pass sends it
with nothing approximated a second time (the server error keeps only the
factors' rounding), as PowerSGD's all-reduced factors are exactly rank r.
The next bases come from the served factors: one step of block power
iteration on the average, on both sides, every step. The first step, and
chunks no single owner serves (``owners`` > 1, ZeRO's reduce-scatter),
use the power-iteration scheme above. Measured on the LM (3 seeds) it ends
above "served" at ranks 1 and 4: its bases come from the last step's
average, where a sender's power iteration starts from the current
gradient, and that lag costs more than the second approximation saves
(docs/results/lm-front.md, "The low-rank operator against PowerSGD"). It is kept
for its linearity: the mean of payloads is the payload of the mean.
A segment that would not shrink (r (n + m) >= its length) and every vector
segment travel as their values: PowerSGD sends 1-D tensors exact too.

Wire format, segment after segment, no header: a matrix segment's P (n·r
values, row-major) then Q, or W with "basis" (m·r values); a value
segment's values. Each value in ``factors``: "bf16" by default, half
PowerSGD's fp32 bytes at the same rank, so that a PowerSGD user who sets
only the rank sends fewer bytes than PowerSGD, at a loss close to
PowerSGD's (docs/results/lm-front.md measures both); "fp16" the same bytes (fp16
overflows past 65504, where a loss scale can take a gradient); "fp32"
twice the bytes, for a slightly lower loss. A payload of another
length is refused; the receiver needs no seed, and no state but the bases
with "basis".

A tensor of two or more dimensions whose matrix is too small for the rank
is refused by name (``check_tensor``), unless ``small_matrices="exact"``
sends such tensors as values.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..errors import ConfigError
from .base import Compressor, Refusals, as_bytes, from_bytes, positive_int
from .shapes import Segment, Shaped, matrix_of

__all__ = ["FACTOR_DTYPES", "LowRankCompressor", "shape_of", "SMALL_MATRICES", "WARM_STARTS"]

FACTOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SMALL_MATRICES = ("error", "exact")
WARM_STARTS = ("basis", "served", "own")


def shape_of(numel: int) -> tuple[int, int]:
    """The (rows, columns) a flat vector of ``numel`` elements is laid out as."""
    if numel == 0:
        return 0, 0
    n = math.isqrt(numel - 1) + 1  # ceil(sqrt(numel))
    return n, -(-numel // n)


class LowRankCompressor(Compressor):
    """``lowrank``; the layout and wire format are in this module's docstring."""

    name = "lowrank"
    structured = True

    def __init__(self, rank: int = 4, iterations: int = 1, factors: str = "bf16", small_matrices: str = "error",
                 warm_start: str = "served", seed: int = 0):
        super().__init__(seed)
        self.rank = positive_int(rank, "lowrank: rank")
        self.iterations = positive_int(iterations, "lowrank: iterations")
        if factors not in FACTOR_DTYPES:
            raise ConfigError(f"lowrank: factors must be one of {', '.join(FACTOR_DTYPES)}, got {factors!r}")
        if small_matrices not in SMALL_MATRICES:
            raise ConfigError(f"lowrank: small_matrices must be one of {', '.join(SMALL_MATRICES)}, "
                              f"got {small_matrices!r}")
        if warm_start not in WARM_STARTS:
            raise ConfigError(f"lowrank: warm_start must be one of {', '.join(WARM_STARTS)}, got {warm_start!r}")
        self.factors, self.small_matrices, self.warm_start = factors, small_matrices, warm_start
        self._dtype = FACTOR_DTYPES[factors]

    def params(self) -> dict[str, Any]:
        return {"rank": self.rank, "iterations": self.iterations, "factors": self.factors,
                "small_matrices": self.small_matrices, "warm_start": self.warm_start}

    def is_contraction(self) -> bool:
        return True

    # -- layouts -------------------------------------------------------------
    def check_tensor(self, name: str, shape: Sequence[int]) -> None:
        matrix = matrix_of(shape)
        if matrix is not None and min(matrix) < self.rank and self.small_matrices == "error":
            what = f"tensor {name!r} of shape {tuple(shape)}" if name else f"a tensor of shape {tuple(shape)}"
            raise ConfigError(f"lowrank: rank {self.rank} is larger than {what} "
                              f"allows (a {matrix[0]} x {matrix[1]} matrix has rank at most {min(matrix)}); use "
                              f"rank <= {min(matrix)}, or small_matrices='exact' to send such tensors as values")

    def size_for_shape(self, shape: Sequence[int]) -> int:
        numel = math.prod(int(s) for s in shape)
        matrix = matrix_of(shape)
        if matrix is None or numel == 0:
            return numel
        self.check_tensor("", shape)
        return Shaped([Segment(numel, *matrix)])

    def segments(self, size: int) -> tuple[Segment, ...]:
        """The segments of a chunk of ``size`` (one near-square matrix for a plain int)."""
        if isinstance(size, Shaped):
            return size.segments
        rows, cols = shape_of(int(size))
        return (Segment(int(size), rows, cols),) if size else ()

    def _rank_of(self, segment: Segment) -> int:
        """The rank a segment is sent at; 0: as its values."""
        if segment.vector:
            return 0
        r = min(self.rank, segment.rows, segment.cols)
        return r if r * (segment.rows + segment.cols) < segment.length else 0

    def _values_of(self, segment: Segment) -> int:
        r = self._rank_of(segment)
        return r * (segment.rows + segment.cols) if r else segment.length

    def payload_nbytes(self, numel: int) -> int:
        return self._dtype.itemsize * sum(self._values_of(s) for s in self.segments(numel))

    # -- encoding ------------------------------------------------------------------
    def _encode_shaped(self, flat: torch.Tensor, seed: int | None, size: int) -> torch.Tensor:
        segments = self.segments(size)
        warm = size.warm if isinstance(size, Shaped) else None
        bases = self._bases(segments, warm)
        if bases is not None:
            return self._encode_projected(flat, segments, bases)
        starts = self._starts(segments, warm.previous if warm is not None else None, flat.device,
                              seed if seed is not None else self.seed)
        values, qs = [], []
        for (segment, piece), q in zip(_pieces(flat, segments), starts):
            if q is None:
                values.append(piece)
                continue
            matrix = _matrix(piece, segment)
            for _ in range(self.iterations):
                p = torch.linalg.qr(matrix @ q).Q  # reduced: rows x r, orthonormal columns
                q = matrix.T @ p
            values += [p.reshape(-1), q.reshape(-1)]
            qs.append(q.reshape(-1))
        if warm is not None and qs:
            warm.stage(torch.cat(qs))
        return as_bytes(torch.cat(values).to(self._dtype))

    def _starts(self, segments: Sequence[Segment], previous: torch.Tensor | None, device: torch.device,
                seed: int) -> list[torch.Tensor | None]:
        """Each segment's starting Q (cols x r), None for a value segment:
        the warm start where one of the right length was kept, else drawn."""
        shapes = [(s.cols, r) if (r := self._rank_of(s)) else None for s in segments]
        lengths = [c * r for c, r in filter(None, shapes)]
        if previous is not None and previous.numel() == sum(lengths):
            kept = iter(previous.to(device=device, dtype=torch.float32).split(lengths))
            return [None if shape is None else next(kept).view(shape) for shape in shapes]
        generator = torch.Generator().manual_seed(seed % 2**63)
        return [None if shape is None else torch.randn(shape, generator=generator).to(device) for shape in shapes]

    # -- warm_start="basis": one pair of bases per matrix segment, kept alike on every rank ------------------
    def _bases(self, segments: Sequence[Segment], warm) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """Each segment's kept (P_s, Q_s), None for a value segment; None
        where no bases were kept (the first step, or no owner serves)."""
        if self.warm_start != "basis" or warm is None or not warm.shared or warm.previous is None:
            return None
        shapes = [(s.rows, s.cols, r) if (r := self._rank_of(s)) else None for s in segments]
        lengths = [r * (n + m) for n, m, r in filter(None, shapes)]
        if warm.previous.numel() != sum(lengths):
            return None
        kept = iter(warm.previous.to(torch.float32).split(lengths))
        out = []
        for shape in shapes:
            if shape is None:
                out.append(None)
                continue
            n, m, r = shape
            pq = next(kept)
            out.append((pq[:n * r].view(n, r), pq[n * r:].view(m, r)))
        return out

    def _encode_projected(self, flat: torch.Tensor, segments: Sequence[Segment], bases: list) -> torch.Tensor:
        """Per matrix segment M: P = M Q_s and W = M^T P_s, linear in M, so
        the mean of the senders' payloads is the payload of their mean and
        the owner serves it with nothing approximated a second time."""
        values = []
        for (segment, piece), basis in zip(_pieces(flat, segments), bases):
            if basis is None:
                values.append(piece)
                continue
            p_s, q_s = (b.to(flat.device) for b in basis)
            matrix = _matrix(piece, segment)
            values += [(matrix @ q_s).reshape(-1), (matrix.T @ p_s).reshape(-1)]
        return as_bytes(torch.cat(values).to(self._dtype))

    def served_basis(self, payload: torch.Tensor, numel: int) -> torch.Tensor | None:
        """The orthonormal bases of the factors a chunk's owner served, per
        matrix segment (orth(P), then orth(Q)): what every rank projects the
        chunk onto next step (``warm_start="basis"``), a step of block power
        iteration on the served average on both sides; None without a matrix segment."""
        bases = [torch.cat([torch.linalg.qr(f).Q.reshape(-1) for f in part])
                 for _, part in self._parts(payload, numel) if not isinstance(part, torch.Tensor)]
        return torch.cat(bases) if bases else None

    def _parts(self, payload: torch.Tensor, numel: int):
        """(segment, values) for a value segment, (segment, (P, Q)) for a matrix segment, in payload order."""
        values = from_bytes(payload, self._dtype).to(torch.float32)  # its length is checked by the caller
        at = 0
        for segment in self.segments(numel):
            r = self._rank_of(segment)
            if not r:
                yield segment, values[at: at + segment.length]
                at += segment.length
                continue
            n, m = segment.rows, segment.cols  # the payload's length was checked against this layout
            yield segment, (values[at: at + n * r].view(n, r), values[at + n * r: at + r * (n + m)].view(m, r))
            at += r * (n + m)

    def _decode(self, payload: torch.Tensor, numel: int, seed: int | None, refusals: Refusals) -> torch.Tensor:
        parts = list(self._parts(payload, numel))
        bases = self._bases([segment for segment, _ in parts], numel.warm if isinstance(numel, Shaped) else None)
        bases = bases or [None] * len(parts)
        pieces = [part if isinstance(part, torch.Tensor) else
                  (_product(*part) if basis is None else _projected(*part, *basis)).reshape(-1)[
                      segment.lead: segment.lead + segment.length]
                  for (segment, part), basis in zip(parts, bases)]
        return torch.cat(pieces) if pieces else payload.new_zeros(0, dtype=torch.float32)

    def served_start(self, payload: torch.Tensor, numel: int) -> torch.Tensor | None:
        """The Q factors of a payload the owner served, as a warm start
        (``warm_start="served"``: every sender of the chunk starts its next
        power iteration from them, one Q for all, as PowerSGD's); None if the
        chunk has no matrix segment."""
        qs = [part[1].reshape(-1) for _, part in self._parts(payload, numel) if not isinstance(part, torch.Tensor)]
        return torch.cat(qs) if qs else None


def _pieces(flat: torch.Tensor, segments: Sequence[Segment]):
    """(segment, its elements of ``flat``), in order."""
    offset = 0
    for segment in segments:
        yield segment, flat[offset: offset + segment.length]
        offset += segment.length


def _matrix(piece: torch.Tensor, segment: Segment) -> torch.Tensor:
    """A matrix segment's rows x cols matrix: zeros in front of a piece that starts mid-row and after it."""
    return torch.nn.functional.pad(piece, (segment.lead, segment.rows * segment.cols - segment.lead
                                           - segment.length)).view(segment.rows, segment.cols)


def _projected(p: torch.Tensor, w: torch.Tensor, p_s: torch.Tensor, q_s: torch.Tensor) -> torch.Tensor:
    """M's orthogonal projection onto the matrices whose columns lie in
    span(P_s) or whose rows lie in span(Q_s), from P = M Q_s and W = M^T P_s:
    P Q_s^T + P_s W^T - P_s (P_s^T P) Q_s^T. A contraction, linear in M."""
    p_s, q_s = p_s.to(p.device), q_s.to(p.device)
    return _product(p, q_s) + _product(p_s, w) - _product(p_s, q_s @ (p.T @ p_s))


def _product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P Q^T. At rank 1 an outer product by broadcasting: the same values
    (one product each), several times faster on a CPU than a matrix product
    whose inner dimension is 1."""
    return p * q.T if p.shape[1] == 1 else p @ q.T
