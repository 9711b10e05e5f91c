"""The header every collective carries, and what its fields mean.

Before any payload moves, each rank's header ``[tag, status, length...]``
reaches every rank (see ``comm.Communicator``), so every rank judges the same
table and takes the same branch: an error on one rank becomes the same clear
error on every rank instead of a hang.

* ``tag`` identifies the tensor being reduced (its name and element count).
  Tags that differ mean ranks reduce different tensors.
* ``status`` is what the sending rank has to say before the payloads count:

  ====================  ====================================================
  ``OK`` (0)            nothing
  ``NONFINITE`` (1)     my gradient holds NaN or Inf
  ``LOCAL_FAILURE`` (2) I could not build my payloads (an exception here)
  ``BAD_PAYLOAD + j``   as the owner of a chunk, I could not decode the
                        payload rank j sent me
  ``OVERFLOW`` (-1)     as the owner of a chunk, the mean of the payloads
                        I was sent, with my server error, holds NaN or Inf
  ====================  ====================================================

* ``length...`` are the payload lengths the sender declares, one per
  destination (all-to-all) or one (all-gather).
"""
from __future__ import annotations

import zlib

from ..errors import CollectiveMismatchError, PeerStatusError

__all__ = ["BAD_PAYLOAD", "bad_payload", "describe", "judge", "LENGTHS", "LOCAL_FAILURE", "make_tag", "NONFINITE",
    "OK", "OVERFLOW", "STATUS", "TAG"]

TAG, STATUS, LENGTHS = 0, 1, 2  # field positions

OK = 0
NONFINITE = 1  # (a device bool "not finite" is this status as it stands: ``step.Deferred.finite_status``)
LOCAL_FAILURE = 2
BAD_PAYLOAD = 3  # + the rank whose payload could not be decoded
OVERFLOW = -1  # (below every other code, so that the codes before it kept their values)

_NUMEL_BITS = 30


def make_tag(name: str, numel: int) -> int:
    """A 62-bit tag for a collective over tensor ``name`` of ``numel``
    elements: a checksum of the name and the element count modulo 2**30.
    It only has to differ between tensors that could be confused."""
    return (zlib.crc32(name.encode()) << _NUMEL_BITS) | (numel & ((1 << _NUMEL_BITS) - 1))


def bad_payload(sender: int) -> int:
    """The status an owner sends when it could not decode ``sender``'s payload."""
    return BAD_PAYLOAD + sender


def describe(status: int) -> tuple[str, int | None]:
    """``(kind, sender)`` for a status: kind is "ok", "nonfinite",
    "local_failure", "bad_payload" (sender: whose payload) or "overflow",
    else "unknown"."""
    if status == OK:
        return "ok", None
    if status == OVERFLOW:
        return "overflow", None
    if status == NONFINITE:
        return "nonfinite", None
    if status == LOCAL_FAILURE:
        return "local_failure", None
    if status >= BAD_PAYLOAD:
        return "bad_payload", status - BAD_PAYLOAD
    return "unknown", None


def judge(table: list[list[int]], tag: int, rank: int) -> list[list[int]]:
    """The verdict every rank reaches from the same header table: raises
    ``CollectiveMismatchError`` (tags differ) or ``PeerStatusError`` (some
    status is not OK); otherwise returns the declared lengths, one row per
    sender."""
    tags = [row[TAG] for row in table]
    if len(set(tags)) != 1:
        others = [j for j, t in enumerate(tags) if t != tag]
        raise CollectiveMismatchError(
            f"rank {rank} entered a collective for a different tensor (name or size) than ranks {others}")
    statuses = {j: row[STATUS] for j, row in enumerate(table) if row[STATUS] != OK}
    if statuses:
        raise PeerStatusError(statuses)
    return [row[LENGTHS:] for row in table]
