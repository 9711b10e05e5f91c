"""The arithmetic of Algorithm 1 on one vector, shared by the sharded
reducer (``DoubleSqueeze``) and the replicated one (``ReplicatedDoubleSqueeze``):

    worker:  v = g + d_worker;  c = Q(v);   d_worker' = v - c
    server:  u = mean + d_server;  r = Q'(u);  d_server' = u - r

Nothing here stores state: callers stage what these return and write it
only when their whole step succeeded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .compressors import Compressor
from .finite import all_finite

Bounds = Sequence[tuple[int, int]]


@dataclass
class Compensated:
    """A worker's vector, ready to compress."""

    v: torch.Tensor                  # g (+ momentum) + worker error: what is compressed
    momentum: torch.Tensor | None    # the new momentum to stage, if there is one
    finite: bool
    owned: bool                      # v is a fresh tensor of ours (the residual may be formed in it)


def compensate(g: torch.Tensor, *, worker_error: torch.Tensor | None, momentum: torch.Tensor | None = None,
               beta: float = 0.0) -> Compensated:
    """v = (momentum of) g plus the worker error. ``worker_error`` None: no
    error feedback on the worker side."""
    new_momentum = None
    if beta:
        new_momentum = beta * momentum + (1 - beta) * g
        g = new_momentum
    v = g + worker_error if worker_error is not None else g
    return Compensated(v, new_momentum, all_finite(v), owned=worker_error is not None)


def compress_chunks(q: Compressor, v: torch.Tensor, bounds: Bounds, seed_of: Callable[[int], int | None]
                    ) -> list[torch.Tensor]:
    """One payload per chunk of ``v``, chunk k encoded with ``seed_of(k)``;
    a scale shared by the whole vector (``q.prepare``) is computed once."""
    shared: Any = q.prepare(v)
    return [q.compress(v[a:b], seed=seed_of(k), shared=shared).payload for k, (a, b) in enumerate(bounds)]


def worker_residual_(c: Compensated, q: Compressor, payloads: Sequence[torch.Tensor], bounds: Bounds,
                     seed_of: Callable[[int], int | None], decoded: dict[int, torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """d_worker' = v - Q(v), formed in ``c.v`` when it is ours. ``decoded``
    holds chunks already decoded elsewhere (an owner's own chunk), by index."""
    residual = c.v if c.owned else c.v.clone()
    for k, (p, (a, b)) in enumerate(zip(payloads, bounds)):
        sent = (decoded or {}).get(k)
        if sent is None:
            sent = q.decompress_flat(p, b - a, seed_of(k))
        residual[a:b].sub_(sent)
    return residual


def decoded_chunks(q: Compressor, payloads: Sequence[torch.Tensor], bounds: Bounds,
                   seed_of: Callable[[int], int | None], decoded: dict[int, torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """Q(v): the payloads of every chunk decoded into one vector (chunks in
    ``decoded`` reused)."""
    decoded = decoded or {}
    return torch.cat([decoded[k] if decoded.get(k) is not None else q.decompress_flat(p, b - a, seed_of(k))
                      for k, (p, (a, b)) in enumerate(zip(payloads, bounds))])


@dataclass
class Squeezed:
    """The server pass over one chunk."""

    payload: torch.Tensor
    u: torch.Tensor      # aggregate + server error: what was compressed


def server_squeeze(qs: Compressor, aggregate: torch.Tensor, server_error: torch.Tensor | None, seed: int | None
                   ) -> Squeezed:
    """u = aggregate + server error (None: no server error feedback); Q'(u)."""
    u = aggregate + server_error if server_error is not None else aggregate
    return Squeezed(qs.compress(u, seed=seed).payload, u)


def server_residual(sq: Squeezed, served: torch.Tensor) -> torch.Tensor:
    """d_server' = u - Q'(u), given the decoded Q'(u)."""
    return sq.u - served
