"""How the flat vector is cut into chunks, who serves which chunk, and how
a receiver combines the copies it gets.

The flat vector has ``size`` chunks. With ``owners=r``, chunk k is served by
the r ranks k, k+1, ..., k+r-1 (mod size), each keeping its own server error
for it; rank j serves chunks j, j-1, ..., j-r+1, and every message a rank
sends or receives lists its chunks in that order. ``owners=1`` is the plain
sharded exchange. ``owners="all"``: every rank receives every worker's
payloads and aggregates every chunk itself, so there is no server pass and no
server to trust.

A receiver gets the r served copies of a chunk through an all-gather, which
delivers the same bytes to everyone, so the combination below is a
deterministic function of bytes every honest rank holds and honest ranks end
bit-identical. The rule: bytes that more than half of the owners served
identically win (honest owners with the same inputs produce the same bytes);
otherwise the coordinate-wise median of the copies that decode to finite
values (``torch.median``: the lower middle value for an even count). Up to
⌊(r−1)/2⌋ faulty owners of a chunk can therefore change nothing while the
honest owners agree, and stay bounded by honest values when they do not.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..errors import ConfigError, PayloadError


def chunk_bounds(numel: int, size: int) -> list[tuple[int, int]]:
    """The ``size`` contiguous chunks of a flat vector, the first ``numel % size`` one element longer."""
    base, extra = divmod(numel, size)
    bounds, start = [], 0
    for k in range(size):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class Ownership:
    """The chunk-to-owner map for ``owners`` (1, r, or "all") in a group of ``size``."""

    def __init__(self, owners: int | str, size: int):
        if owners != "all" and not (isinstance(owners, int) and not isinstance(owners, bool) and 1 <= owners <= size):
            raise ConfigError(f'owners must be between 1 and the group size {size}, or "all"; got {owners!r}')
        self.everyone = owners == "all"
        self.size = size
        self.r = size if self.everyone else int(owners)

    def served_by(self, rank: int) -> list[int]:
        """The chunks ``rank`` serves, in message order."""
        return [(rank - i) % self.size for i in range(self.r)]

    def owners_of(self, chunk: int) -> list[int]:
        return [(chunk + i) % self.size for i in range(self.r)]


def split(message: torch.Tensor | None, chunks: Sequence[int], nbytes: Callable[[int], int]
          ) -> dict[int, torch.Tensor | None]:
    """A message holding ``chunks`` in order, cut into one payload per chunk
    (all None when the message itself was refused)."""
    if message is None:
        return {k: None for k in chunks}
    out, start = {}, 0
    for k in chunks:
        length = nbytes(k)
        out[k] = message[start: start + length]
        start += length
    return out


def combine(copies: Sequence[tuple[int, torch.Tensor | None]], decode: Callable[[torch.Tensor], torch.Tensor],
            what: str) -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """One chunk from its owners' copies: (the chunk, [(owner, why left
    out)]). ``decode`` raises ``PayloadError`` for a copy it cannot use."""
    r = len(copies)
    left_out: list[tuple[int, str]] = [(j, "wrong length") for j, p in copies if p is None]
    valid = [(j, p) for j, p in copies if p is not None]
    groups: list[tuple[torch.Tensor, list[int]]] = []
    for j, p in valid:
        for payload, members in groups:
            if torch.equal(payload, p):
                members.append(j)
                break
        else:
            groups.append((p, [j]))
    decoded: dict[int, torch.Tensor] = {}
    for j, p in valid:
        try:
            decoded[j] = decode(p)
        except PayloadError as exc:
            left_out.append((j, str(exc)))
    if groups:
        payload, members = max(groups, key=lambda item: len(item[1]))
        if 2 * len(members) > r and members[0] in decoded:
            return decoded[members[0]], left_out
    if not decoded:
        raise PayloadError(f"no owner served a usable copy of {what}", rank=copies[0][0] if copies else None)
    stacked = torch.stack([decoded[j] for j in sorted(decoded)])
    return stacked.median(dim=0).values, left_out
