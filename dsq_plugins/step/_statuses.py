"""The status protocol: what the statuses every rank read from the same
header table mean, turned into the same exception on every rank.

A collective's headers carry each sender's status (``header``). Every rank
reads the same table, so every rank calls ``raise_for_statuses`` with the
same statuses and raises the same error (or skips the step), whatever it
was doing itself: that is how a NaN on one rank, or a payload one owner
could not decode, becomes one clear error everywhere instead of a hang.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from ..comm import header
from ..errors import NonFiniteGradientError, PayloadError, PeerFailedError, PeerStatusError

UNCHANGED = "the step was not applied and error-feedback state is unchanged"


class Skipped(Exception):
    """A non-finite gradient with ``on_nonfinite="skip"``: the step is
    skipped on every rank (caught by the step scope, never seen by users)."""

    def __init__(self, ranks: list[int]):
        super().__init__(f"skipped: non-finite gradient on rank(s) {ranks}")
        self.ranks = ranks


def raise_for_statuses(name: str, statuses: dict[int, int], *, rank: int, on_nonfinite: str,
                       local_error: BaseException | None = None, refusal: str = "") -> None:
    """Raise what ``statuses`` (sender -> non-OK status) stand for, in this
    order: a rank that could not build its payloads, a non-finite gradient
    (or ``Skipped``), a payload an owner could not decode, an owner's mean
    that overflowed (as a non-finite gradient is, a cause found elsewhere
    first: a payload this owner trusted, its own, may be what made it overflow). ``local_error``:
    what this rank itself raised (re-raised as it was); ``refusal``: why this
    rank, as an owner, refused a payload (added to its own message)."""
    kinds = {j: header.describe(code) for j, code in statuses.items()}
    failed = sorted(j for j, (kind, _) in kinds.items() if kind == "local_failure")
    if failed:
        if local_error is not None:
            raise local_error
        raise PeerFailedError(f"rank(s) {failed} could not build their payloads for {name!r} (see their logs); "
                              f"{UNCHANGED}", failed)
    nonfinite = sorted(j for j, (kind, _) in kinds.items() if kind == "nonfinite")
    if nonfinite:
        if on_nonfinite == "skip":
            raise Skipped(nonfinite)
        raise NonFiniteGradientError(f"gradient {name!r} holds NaN or Inf on rank(s) {nonfinite}; the step was not "
                                     f"applied and error-feedback state is unchanged on every rank", nonfinite)
    others = {j: described for j, described in kinds.items() if described[0] != "overflow"}
    if not others:  # only owners whose mean overflowed: the gradients were finite, but too large to average
        overflowed = sorted(kinds)
        if on_nonfinite == "skip":
            raise Skipped(overflowed)
        raise NonFiniteGradientError(f"the mean of the payloads for {name!r} overflowed to Inf on its owner rank(s) "
                                     f"{overflowed}: gradients near the largest float; {UNCHANGED} on every rank",
                                     overflowed)
    owner, (kind, sender) = min(others.items())
    if kind != "bad_payload":
        raise PeerFailedError(f"rank {owner} sent an unknown status {statuses[owner]} for {name!r}", [owner])
    detail = f": {refusal}" if owner == rank and refusal else ""
    raise PayloadError(f"rank {owner} could not decode the payload rank {sender} sent for {name!r}{detail}; "
                       f"{UNCHANGED}", rank=sender)


@contextlib.contextmanager
def statuses_meant(name: str, *, rank: int, on_nonfinite: str) -> Iterator[None]:
    """A block whose collectives' statuses (``PeerStatusError``) raise what they stand for
    (``raise_for_statuses``): for a caller that moves ``name`` with the communicator itself."""
    try:
        yield
    except PeerStatusError as exc:
        raise_for_statuses(name, exc.statuses, rank=rank, on_nonfinite=on_nonfinite)
        raise
