"""Seeds of the randomized compressors, derived instead of sent.

Every payload a randomized operator (random-k, QSGD, TernGrad) builds is
encoded with a seed that every rank derives from the same inputs: the
reducer's base seed, the bucket, the step, the pass, the sender and the
chunk. The receiver therefore decodes with the sender's seed without one
byte of it travelling, and a rerun draws the same numbers.
"""
from __future__ import annotations

from .compressors import derive_seed

WORKER, SERVER, AGGREGATOR = "w", "s", "a"  # the sides a seed is drawn for


class Seeds:
    """The seeds of one reducer (``base``: its ``seed`` option)."""

    def __init__(self, base: int):
        self.base = int(base)

    def of(self, *parts: object) -> int:
        """The seed for ``parts`` (the reducer's base seed first)."""
        return derive_seed(self.base, *parts)

    def chunk(self, name: str, step: int, side: str, sender: int, chunk: int) -> int:
        """The seed ``sender`` encodes ``chunk`` of bucket ``name`` with at
        ``step`` on ``side`` (``WORKER``, ``SERVER`` or ``AGGREGATOR``)."""
        return derive_seed(self.base, name, step, side, sender, chunk)

    def worker(self, name: str, step: int, sender: int, chunk: int) -> int:
        return self.chunk(name, step, WORKER, sender, chunk)

    def server(self, name: str, step: int, chunk: int) -> int:
        """The owner of ``chunk`` encodes its squeezed result with this (one owner or many alike)."""
        return self.chunk(name, step, SERVER, chunk, chunk)
