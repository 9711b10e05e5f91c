"""What a structured operator (``lowrank``) is told about each chunk: the
tensors it holds, as matrices, and the warm start its sender kept for it.

A caller says which tensors a bucket's flat vector is made of
(``describe``; the reducer does it for ``reduce_many`` and friends). Each
round then gets its chunks' sizes as ``compressors.shapes.Shaped``: the
worker's, with the warm start this rank keeps for every chunk it sends
(``<bucket>@w<k>``), and the owner's, with the one it keeps for the chunk
it serves (``<bucket>@s<k>``). With ``lowrank(warm_start="served")`` every
rank keeps the Q each owner served (``<bucket>@served<k>``) and every
sender of chunk k starts from that one, as PowerSGD's workers share one Q;
with ``warm_start="basis"`` every rank keeps the orthonormal bases of the
factors each owner served (``<bucket>@basis<k>``), which senders, owner and
receivers of chunk k all project onto.
What an operator stages there is written with the step's other state, only
if the whole step succeeded. Operators that are not structured, and
buckets nobody described, get plain counts.
"""
from __future__ import annotations

from typing import Sequence

from ..compressors import Compressor
from ..compressors.shapes import Segment, Shaped, TensorMap, WarmStart
from ..errors import LayoutError
from ..state import ReducerState
from ..step import Round


class ChunkSizes:
    """The described buckets of one reducer, and their chunks' sizes."""

    def __init__(self, compressors: tuple[Compressor, Compressor], state: ReducerState):
        self.worker_q, self.server_q = compressors
        self.state = state
        #: every sender starts from the Q its chunk's owner served (``lowrank(warm_start="served")``)
        self.shares_served_start = (getattr(self.worker_q, "warm_start", None) == "served"
                                    and hasattr(self.server_q, "served_start"))
        #: senders and receivers project onto the bases the chunk's owner served (``warm_start="basis"``)
        self.shares_basis = {role: getattr(q, "warm_start", None) == "basis" and hasattr(self.server_q, "served_basis")
                             for role, q in (("worker", self.worker_q), ("server", self.server_q))}
        #: the tensors each described bucket is made of, by bucket name
        self.tensor_maps: dict[str, TensorMap] = {}
        self._segments: dict[tuple[str, int], list[tuple[Segment, ...]]] = {}

    def describe(self, name: str, entries: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Bucket ``name`` is these tensors (name, shape), in order. A
        ``ConfigError`` names a tensor an operator cannot compress. Nothing
        is kept for operators that are not structured (the exchange of every
        bucket calls this, so that costs them nothing)."""
        if not (self.worker_q.structured or self.server_q.structured):
            return
        tensors = TensorMap(tuple((str(n), tuple(int(s) for s in shape)) for n, shape in entries))
        if self.tensor_maps.get(name) == tensors:
            return
        for q in {id(q): q for q in (self.worker_q, self.server_q)}.values():
            for tensor, shape in tensors.entries:
                q.check_tensor(tensor, shape)
        self.tensor_maps[name] = tensors
        self._segments = {key: value for key, value in self._segments.items() if key[0] != name}

    def fill(self, rnd: Round) -> None:
        """Set ``rnd.sizes`` and ``rnd.served_sizes`` for structured operators."""
        if rnd.name not in self.tensor_maps:
            return
        segments = self.segments(rnd.name, rnd.numel, rnd.bounds)
        if self.worker_q.structured:
            rnd.sizes = [self._sized(rnd, f"{rnd.name}@w{k}", s, self._start(rnd.name, k, "worker"),
                                     self.shares_basis["worker"]) for k, s in enumerate(segments)]
        if self.server_q.structured:
            rnd.served_sizes = [self._sized(rnd, f"{rnd.name}@s{k}", s, self._start(rnd.name, k, "server"),
                                            self.shares_basis["server"]) for k, s in enumerate(segments)]

    def _start(self, name: str, k: int, role: str) -> str | None:
        """Where ``role``'s operator finds a start kept from what chunk k's owner served, or None."""
        if self.shares_basis[role]:
            return f"{name}@basis{k}"
        return f"{name}@served{k}" if role == "worker" and self.shares_served_start else None

    def segments(self, name: str, numel: int, bounds: Sequence[tuple[int, int]]) -> list[tuple[Segment, ...]]:
        """Each chunk's segments by bucket ``name``'s tensors (cached)."""
        key = (name, numel)
        if key not in self._segments:
            tensors = self.tensor_maps[name]
            if tensors.numel != numel:
                raise LayoutError(f"bucket {name!r} was described as {len(tensors.entries)} tensors of "
                                  f"{tensors.numel} elements in all, but {numel} elements were given")
            self._segments[key] = [tensors.segments(a, b) for a, b in bounds]
        return self._segments[key]

    def _sized(self, rnd: Round, key: str, segments: tuple[Segment, ...], start: str | None,
               basis: bool) -> Shaped:
        """A chunk's size with the warm start kept under ``start`` (default
        ``key``), this step's staged under ``key``; ``basis``: ``start``
        holds bases every rank shares, once kept."""
        kept = self.state.operator
        return Shaped(segments, WarmStart(kept.get(start, kept.get(key)),
                                          lambda q: rnd.update.operator.__setitem__(key, q),
                                          basis and start in kept))

    def keep_served(self, rnd: Round) -> None:
        """Stage, on every rank, the Q each owner served (``rnd.gathered``,
        one chunk per owner): the next step's one warm start for every sender
        of that chunk."""
        bases = any(self.shares_basis.values())
        if rnd.name not in self.tensor_maps or not (self.shares_served_start or bases) or rnd.gathered is None:
            return
        for k, payload in enumerate(rnd.gathered):
            if payload is None:
                continue
            start = self.server_q.served_start(payload, rnd.served_sizes[k]) if self.shares_served_start else None
            if start is not None:
                rnd.update.operator[f"{rnd.name}@served{k}"] = start
            basis = self.server_q.served_basis(payload, rnd.served_sizes[k]) if bases else None
            if basis is not None:
                rnd.update.operator[f"{rnd.name}@basis{k}"] = basis
