"""Seeds of the randomized compressors, derived instead of sent.

Every payload a randomized operator (random-k, QSGD, TernGrad) builds is
encoded with a seed that every rank derives from the same inputs: the
reducer's base seed, the bucket, the step, the pass, the sender and the
chunk. The receiver therefore decodes with the sender's seed without one
byte of it travelling, and a rerun draws the same numbers.
"""
from __future__ import annotations

from ..compressors import derive_seed

WORKER, SERVER, AGGREGATOR = "w", "s", "a"  # the sides a seed is drawn for
SHARED = "shared"  # both passes' one seed per chunk and step, for operators with ``shared_draw``


class Seeds:
    """The seeds of one reducer (``base``: its ``seed`` option).

    ``shared_draw``: every sender and the owner encode a chunk at a step with
    one seed (the compressors' ``shared_draw``, e.g. ``randomsign``: the
    workers' payloads then cover the same positions, and the server pass
    squeezes those rather than a fresh draw of them)."""

    def __init__(self, base: int, shared_draw: bool = False):
        self.base = int(base)
        self.shared_draw = bool(shared_draw)

    def of(self, *parts: object) -> int:
        """The seed for ``parts`` (the reducer's base seed first)."""
        return derive_seed(self.base, *parts)

    def chunk(self, name: str, step: int, side: str, sender: int, chunk: int) -> int:
        """The seed ``sender`` encodes ``chunk`` of bucket ``name`` with at
        ``step`` on ``side`` (``WORKER``, ``SERVER`` or ``AGGREGATOR``)."""
        if self.shared_draw and side in (WORKER, SERVER):
            return derive_seed(self.base, name, step, SHARED, chunk)
        return derive_seed(self.base, name, step, side, sender, chunk)

    def whole(self, name: str, step: int, side: str, *sender: int) -> int:
        """The seed of a whole vector, not cut into chunks (the replicated reducer)."""
        if self.shared_draw and side in (WORKER, SERVER):
            return self.of(name, step, SHARED)
        return self.of(name, step, side, *sender)

    def worker(self, name: str, step: int, sender: int, chunk: int) -> int:
        return self.chunk(name, step, WORKER, sender, chunk)

    def server(self, name: str, step: int, chunk: int) -> int:
        """The owner of ``chunk`` encodes its squeezed result with this (one owner or many alike)."""
        return self.chunk(name, step, SERVER, chunk, chunk)


def shared_draw(*compressors: object) -> bool:
    """Whether a reducer of these compressors draws one seed per chunk and step."""
    return any(getattr(c, "shared_draw", False) for c in compressors)
