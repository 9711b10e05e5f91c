"""Resharding: every rank's ``DoubleSqueeze.state_dict()`` at n ranks into
the states of m ranks, so that a job restarted at another world size keeps
the compensation its error memories still owe the model.

What is owed after a step is the mean of the worker errors (each rank's
compensation enters the average with weight 1/n) plus the server error
(the vector the owners' chunks make together). Resharding keeps both:

* every new rank gets the mean of the old worker errors (and of worker
  momenta), so the new mean is the old one;
* the server error of each bucket is put together from its n chunks and cut
  again into m chunks (``layout.chunk_bounds``);
* step counters and skipped steps carry over (they must agree on every rank).

Refused by name, with a ``StateError``: states of different versions,
configurations, world sizes or step counts, a missing rank, and state that
has no meaning at another size (EF21's replicated states, robust rules'
previous aggregates, several owners per chunk). Memories stored compactly
(``error_dtype``) come out in fp32; loading converts them back.

``CompressedAdam.state_dict()``s reshard too: their moments are the same on
every rank and carry over, their two reducers' states are resharded. And
offline, a folder of per-rank files:

    python -m dsq_plugins.state.reshard IN OUT --size m

reads every ``*rank<r>.pt`` of IN (a reducer's or CompressedAdam's state,
or a dict holding one under ``"reducer"``, ``"hook"`` or ``"doublesqueeze"``)
and writes ``m`` files of the same names to OUT.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Sequence

import torch

from ..errors import StateError
from ..layout import chunk_bounds
from ._reducer_state import STATE_VERSION
from .compact import from_state, load

__all__ = ["main", "reshard"]

_SAME = ("version", "compressor", "server_compressor", "error_feedback", "steps")


def reshard(states: Sequence[dict[str, Any]], size: int, *, survivors: bool = False) -> list[dict[str, Any]]:
    """The states of ``size`` ranks from every rank's state at the old size
    (each ``DoubleSqueeze.state_dict()``, or each ``CompressedAdam.state_dict()``).

    ``survivors=True`` accepts the states of only some of the old ranks (the
    others died, as in a Horovod Elastic reset): the worker errors' mean is
    the survivors', and the server-error chunks the dead ranks owned are
    zero. What the dead ranks held is lost with them."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"reshard: size must be a positive integer, got {size!r}")
    if states and all("compressed" in s for s in states):
        return _reshard_adam(list(states), size, survivors)
    for key in ("reducer", "hook", "doublesqueeze"):  # a frontend's file holding a reducer's state
        if states and all(isinstance(s, dict) and isinstance(s.get(key), dict) for s in states):
            inner = reshard([s[key] for s in states], size, survivors=survivors)
            return [{**states[0], key: part} for part in inner]
    if any(s.get("hosts") is not None for s in states):
        raise StateError("reshard: these states were saved by a two-level exchange (hierarchy='node'), whose "
                         "error memories are per host shard; reshard handles flat states only: load them at the "
                         "same host layout")
    states = _checked(states, survivors)
    out = []
    worker = {role: _mean(states, role) for role in ("worker_error", "momentum")}
    server = _whole_server_errors(states)
    for rank in range(size):
        new = {key: value for key, value in states[0].items() if key not in ("worker_error", "momentum",
                                                                            "server_error", "rank", "size")}
        new["operator"] = {}  # structured operators' warm starts belong to the old chunks: they start afresh
        new.update(rank=rank, size=size, worker_error=_clone(worker["worker_error"]),
                   momentum=_clone(worker["momentum"]),
                   server_error={name: whole[slice(*chunk_bounds(whole.numel(), size)[rank])].clone()
                                 for name, whole in server.items()})
        out.append(new)
    return out


def _reshard_adam(states: list[dict[str, Any]], size: int, survivors: bool) -> list[dict[str, Any]]:
    """CompressedAdam: the replicated moments as they are, both reducers resharded."""
    extras = [s["compressed"] for s in sorted(states, key=lambda s: s["compressed"].get("rank", -1))]
    for key in ("names", "global_step", "freeze_step"):
        if any(e.get(key) != extras[0].get(key) for e in extras):
            raise StateError(f"reshard: the ranks' CompressedAdam states differ in {key!r}")
    exact = reshard([e["exact"] for e in extras], size, survivors=survivors)
    momentum = reshard([e["momentum"] for e in extras], size, survivors=survivors)
    return [{**states[0], "compressed": {**extras[0], "rank": r, "size": size, "exact": exact[r],
                                         "momentum": momentum[r]}} for r in range(size)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dsq_plugins.state.reshard IN OUT --size m``."""
    p = argparse.ArgumentParser(description="Reshard per-rank DoubleSqueeze state files to another world size.")
    p.add_argument("source")
    p.add_argument("target")
    p.add_argument("--size", type=int, required=True)
    args = p.parse_args(argv)
    files: dict[str, dict[int, str]] = {}
    for entry in sorted(os.listdir(args.source)):
        match = re.fullmatch(r"(.*rank)(\d+)\.pt", entry)
        if match:
            files.setdefault(match.group(1), {})[int(match.group(2))] = os.path.join(args.source, entry)
    if not files:
        raise StateError(f"reshard: no *rank<r>.pt files in {args.source}")
    os.makedirs(args.target, exist_ok=True)
    for prefix, by_rank in files.items():
        if sorted(by_rank) != list(range(len(by_rank))):
            raise StateError(f"reshard: {prefix}<r>.pt is missing ranks: found {sorted(by_rank)}")
        states = reshard([torch.load(by_rank[r]) for r in range(len(by_rank))], args.size)
        for rank, state in enumerate(states):
            torch.save(state, os.path.join(args.target, f"{prefix}{rank}.pt"))
        print(f"{prefix}<r>.pt: {len(by_rank)} ranks -> {args.size}")
    return 0


def _checked(states: Sequence[dict[str, Any]], survivors: bool = False) -> list[dict[str, Any]]:
    if not states:
        raise StateError("reshard: no states given")
    states = sorted(states, key=lambda s: s.get("rank", -1))
    n = states[0].get("size") if survivors else len(states)
    ranks = [s.get("rank") for s in states]
    allowed = list(range(n)) if isinstance(n, int) else []
    # every rank once, or (survivors) some of them once each
    complete = ranks == allowed or (survivors and len(set(ranks)) == len(ranks) and set(ranks) <= set(allowed))
    if not complete or any(s.get("size") != n for s in states):
        raise StateError(f"reshard: need every rank's state of one job{' (or some of them)' if survivors else ''}: "
                         f"got ranks {ranks} with sizes {sorted({str(s.get('size')) for s in states})}")
    for key in _SAME:
        values = [s.get(key) for s in states]
        if any(v != values[0] for v in values):
            raise StateError(f"reshard: the ranks' states differ in {key!r} ({values[0]!r} on rank 0)")
    if states[0]["version"] != STATE_VERSION:
        raise StateError(f"reshard: state version {states[0]['version']} is not {STATE_VERSION}")
    for role, why in (("tracked", "EF21's states"), ("replicas", "EF21's replicated states"),
                      ("aggregates", "a robust rule's previous aggregates")):
        if any(s.get(role) for s in states):
            raise StateError(f"reshard: {why} ({role!r}) belong to this world size and cannot be resharded")
    if any("@chunk" in name for s in states for name in s["server_error"]):
        raise StateError("reshard: server errors of several owners per chunk (owners > 1) cannot be resharded")
    return states


def _mean(states: list[dict[str, Any]], role: str) -> dict[str, torch.Tensor]:
    names = set().union(*(s.get(role, {}).keys() for s in states))
    out = {}
    for name in sorted(names):
        values = [load(from_state(name, s[role][name])).cpu() if name in s.get(role, {}) else None for s in states]
        numel = next(v.numel() for v in values if v is not None)
        out[name] = torch.stack([torch.zeros(numel) if v is None else v for v in values]).to(torch.float64) \
            .mean(0).to(torch.float32)
    return out


def _whole_server_errors(states: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Each bucket's server error put together from its owners' chunks (a
    missing owner's chunk, with ``survivors=True``, is zero)."""
    n, by_rank = states[0]["size"], {s["rank"]: s for s in states}
    names = set().union(*(s["server_error"].keys() for s in states))
    out = {}
    for name in sorted(names):
        numel = _bucket_numel(states, name)
        pieces = []
        for rank, (a, b) in enumerate(chunk_bounds(numel, n)):
            stored = by_rank[rank]["server_error"].get(name) if rank in by_rank else None
            pieces.append(torch.zeros(b - a) if stored is None else load(from_state(name, stored)).cpu())
        out[name] = torch.cat(pieces)
    return out


def _bucket_numel(states: list[dict[str, Any]], name: str) -> int:
    """A bucket's size: its worker error's, else the sum of its server-error chunks."""
    for s in states:
        if name in s.get("worker_error", {}):
            return load(from_state(name, s["worker_error"][name])).numel()
    n = len(states)
    if any(name not in s["server_error"] for s in states):
        raise StateError(f"reshard: bucket {name!r} has no worker error and not every rank holds its server-error "
                         f"chunk, so its size is unknown")
    numel = sum(load(from_state(name, s["server_error"][name])).numel() for s in states)
    if [b - a for a, b in chunk_bounds(numel, n)] != [load(from_state(name, s["server_error"][name])).numel()
                                                       for s in states]:
        raise StateError(f"reshard: the server-error chunks of {name!r} are not a {n}-way cut of {numel} elements")
    return numel


def _clone(memories: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in memories.items()}


if __name__ == "__main__":
    sys.exit(main())
