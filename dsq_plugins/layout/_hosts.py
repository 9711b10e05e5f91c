"""Which ranks share a host, and so whether the exchange goes in two levels.

On a cluster the link between hosts is the slow one. A flat exchange sends
each rank's compressed bytes across it, so a host of L ranks sends L times
what one rank does; the two-level exchange (``algorithm.two_level``) sends a
host's once. Hosts are what the launcher says, read from its environment:
torchrun's node rank (``GROUP_RANK``), horovodrun's cross rank
(``HOROVOD_CROSS_RANK``), the DeepSpeed launcher's (``CROSS_RANK``), Slurm's
node id. Ranks launched as separate nodes are separate hosts, even when the
nodes are network namespaces of one machine. ``node_size`` overrides them
with groups of consecutive ranks.

Every rank's view is gathered before the first exchange, so ranks that
disagree (on the options, or on the hosts) get one ``ConfigError`` each,
the same on every rank.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from ..errors import ConfigError

__all__ = ["HOST_VARIABLES", "HostLayout", "choose_layout", "launcher_host", "resolve_hosts"]

log = logging.getLogger("dsq_plugins")

#: environment variables naming this process's host (node), by launcher, in the order they are read
HOST_VARIABLES = ("GROUP_RANK", "HOROVOD_CROSS_RANK", "CROSS_RANK", "SLURM_NODEID")


@dataclass(frozen=True)
class HostLayout:
    """The hosts of a group: ``hosts[h]`` lists the ranks (the group's
    numbering) on host h. Two-level when ``two_level``: then every host has
    ``per_host`` ranks, and local index i of every host forms cross group i."""

    hosts: tuple[tuple[int, ...], ...]
    two_level: bool

    @property
    def per_host(self) -> int:
        return len(self.hosts[0])

    def host_of(self, rank: int) -> int:
        return next(h for h, members in enumerate(self.hosts) if rank in members)

    def local_index(self, rank: int) -> int:
        return self.hosts[self.host_of(rank)].index(rank)

    def position(self, rank: int) -> tuple[int, int, int, int]:
        """``(hosts, per_host, host, local)`` of ``rank`` in the exchange;
        flat counts every rank a host of one: ``(size, 1, rank, 0)``."""
        if not self.two_level:
            return sum(map(len, self.hosts)), 1, rank, 0
        return len(self.hosts), self.per_host, self.host_of(rank), self.local_index(rank)

    def node_groups(self) -> list[list[int]]:
        """The ranks of each host: the exact stages' groups."""
        return [list(members) for members in self.hosts]

    def cross_groups(self) -> list[list[int]]:
        """For each local index i, the rank with index i on every host: the groups DoubleSqueeze runs in."""
        return [[members[i] for members in self.hosts] for i in range(self.per_host)]

    def describe(self) -> dict[str, int]:
        """What a saved state records of the layout (``hosts`` x ``per_host``; flat: 1 x size)."""
        if not self.two_level:
            return {"hosts": 1, "per_host": sum(map(len, self.hosts))}
        return {"hosts": len(self.hosts), "per_host": self.per_host}


def launcher_host() -> str | None:
    """This process's host as its launcher named it, or None when no launcher said."""
    for variable in HOST_VARIABLES:
        if os.environ.get(variable, "") != "":
            return f"{variable}={os.environ[variable]}"
    return None


def resolve_hosts(comm, hierarchy: str, node_size: int | None) -> HostLayout:
    """The host layout of ``comm``'s ranks for ``hierarchy`` ("flat", "node"
    or "auto") and ``node_size``; one small all-gather unless the layout is
    flat without asking (a flat hierarchy, one rank, or a launcher that put
    every rank on one host)."""
    size = comm.size
    flat = HostLayout((tuple(range(size)),), False)
    if hierarchy == "flat" or size == 1:
        return flat
    if node_size is not None and size % node_size:
        raise ConfigError(f"node_size={node_size} does not divide the {size} ranks: hosts must be equal groups of "
                          f"consecutive ranks")
    mine = {"hierarchy": hierarchy, "node_size": node_size, "host": launcher_host()}
    if hierarchy == "auto" and ((node_size is None and launched_on_one_host(size)) or not comm.can_split):
        return flat
    views = _gather_views(comm, mine)
    if any(view[key] != mine[key] for view in views for key in ("hierarchy", "node_size")):
        raise ConfigError(f"the ranks disagree on the host layout options: {_by_rank(views, 'hierarchy', 'node_size')}")
    if node_size is not None:
        hosts = [tuple(range(h, h + node_size)) for h in range(0, size, node_size)]
    else:
        if any(view["host"] is None for view in views) and any(view["host"] is not None for view in views):
            raise ConfigError(f"some ranks were launched on named hosts and some not: {_by_rank(views, 'host')}")
        names: dict[str, list[int]] = {}
        for rank, view in enumerate(views):
            names.setdefault(str(view["host"]), []).append(rank)
        hosts = [tuple(members) for members in names.values()]
    return choose_layout(hosts, hierarchy, size)


def choose_layout(hosts: list[tuple[int, ...]], hierarchy: str, size: int) -> HostLayout:
    """The layout for ``hosts`` (each host's ranks): two-level for two or more
    equal hosts of two or more ranks, flat otherwise (unequal hosts with one
    warning line); "node" on one host: its exact mean (said once in the log)."""
    flat = HostLayout((tuple(range(size)),), False)
    counts = sorted({len(members) for members in hosts})
    if len(hosts) == 1:
        if hierarchy == "node":
            log.warning("dsq_plugins: hierarchy='node' on one host: the %d ranks average exactly among themselves "
                        "(nothing crosses a host link, nothing is compressed)", size)
            return HostLayout(tuple(hosts), True)
        return flat
    if len(counts) > 1:
        log.warning("dsq_plugins: the hosts have different numbers of ranks (%s): the exchange stays flat (every "
                    "rank its own worker and server)", ", ".join(str(len(m)) for m in hosts))
        return flat
    if counts[0] == 1:
        return flat  # one rank per host: flat already sends each host's bytes once
    return HostLayout(tuple(hosts), True)


#: (ranks on this host, ranks in the job) as torchrun, Horovod and MPI-style launchers name them
_LAUNCHER_SIZES = (("LOCAL_WORLD_SIZE", "WORLD_SIZE"), ("HOROVOD_LOCAL_SIZE", "HOROVOD_SIZE"),
                   ("LOCAL_SIZE", "WORLD_SIZE"))


def launcher_sizes() -> tuple[int, int] | None:
    """(ranks on this host, ranks in the job) as the launcher's environment says, or None where it says nothing."""
    for local, world in _LAUNCHER_SIZES:
        if os.environ.get(local) and os.environ.get(world):
            return int(os.environ[local]), int(os.environ[world])
    return None


def launched_on_one_host(size: int) -> bool:
    """The launcher says every rank of this job (``size`` ranks) is on this one host."""
    sizes = launcher_sizes()
    if sizes is not None:
        return sizes[0] >= sizes[1] >= size
    return launcher_host() is None


def _gather_views(comm, mine: dict) -> list[dict]:
    payload = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
    gathered = comm.allgather(payload.to(comm.device), tag=0x486F7374)  # "Host"
    return [json.loads(bytes(p.cpu().tolist()).decode()) for p in gathered]


def _by_rank(views: list[dict], *keys: str) -> str:
    return "; ".join(f"rank {r}: " + ", ".join(f"{k}={v[k]!r}" for k in keys) for r, v in enumerate(views))
