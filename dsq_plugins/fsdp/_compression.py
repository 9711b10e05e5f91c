"""``compress(model)``: DoubleSqueeze wired into every ``fully_shard``
module of a model, and the state that outlives one backward."""
from __future__ import annotations

import dataclasses
import io
import logging
from typing import Any

import torch
import torch.distributed as dist

from ..comm import TorchDistributedComm
from ..config import ReducerConfig
from ..errors import ConfigError, StateError
from ..reducer import DoubleSqueeze
from ._collectives import CompressedReduceScatter, ReplicaAverage
from ._seams import MeshRoles, Unit, find_units, mark, mesh_roles, replicas_exchange_flat, take_over_replicate
from ._steps import BackwardSteps

__all__ = ["FSDPCompression", "STATE_VERSION"]

log = logging.getLogger("dsq_plugins")
STATE_VERSION = 1


class FSDPCompression:
    """What ``compress`` wired: the reducer, the mesh it works on, and the
    state a checkpoint holds.

    * 1-D mesh: FSDP's reduce-scatter is DoubleSqueeze's worker pass on the
      whole group (``hierarchy`` applies: on several hosts the reduce-scatter
      is exact inside each host and compressed between them). The worker
      error is this rank's whole unsharded gradient, in ``error_dtype``
      (int8: one byte per parameter per rank).
    * HSDP (replicate x shard): FSDP's exact reduce-scatter inside the shard
      group, then Algorithm 1 among the replicas on this rank's shard, both
      passes with their error memories (1/shard-size of the model per rank).
    """

    def __init__(self, model: torch.nn.Module, compressor: Any = "sign", *, exact_steps: int = 0, **options: Any):
        if isinstance(exact_steps, bool) or not isinstance(exact_steps, int) or exact_steps < 0:
            raise ConfigError(f"exact_steps must be a non-negative integer, got {exact_steps!r}")
        units = find_units(model, "compress")
        self.roles: MeshRoles = mesh_roles(units, "compress")
        self.config = _config(compressor, options, self.roles)
        group = self.roles.shard if self.roles.replicate is None else self.roles.replicate
        self.comm = TorchDistributedComm(group)
        self.reducer = DoubleSqueeze(self.comm, config=self.config)
        #: exact averaging for the first ``exact_steps`` backwards (None without them: no groups made for it)
        self.exact = DoubleSqueeze.exact(self.comm, hierarchy=self.config.hierarchy,
                                         node_size=self.config.node_size) if exact_steps else None
        self.exact_steps = exact_steps
        self.steps = BackwardSteps(lambda applied: self.exact if applied < exact_steps else self.reducer,
                                   "" if self.roles.replicate is None else (
            "HSDP: the ranks named are replicas, positions on the replicate dimension; a non-finite gradient on "
            "any rank of a replica makes its shard group's exact mean non-finite"))
        self.units: list[Unit] = units
        for unit in units:
            if self.roles.replicate is None:
                unit.module.set_custom_reduce_scatter(CompressedReduceScatter(unit, self.steps.run))
                mark(unit, "compress")
            else:
                take_over_replicate(unit, ReplicaAverage(unit, self.steps.run), "compress")
        if self.roles.replicate is not None and self.roles.replicate_size == 1:
            log.warning("dsq_plugins.fsdp: HSDP with one replica: nothing crosses the replicate dimension")

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank sent in the compressed exchanges."""
        return self.comm.bytes_sent

    @property
    def bytes_received(self) -> int:
        """Payload bytes this rank received in the compressed exchanges."""
        return self.comm.bytes_received

    def state_dict(self) -> dict[str, Any]:
        """This rank's error memories and counters, tagged with its place in
        the mesh, under a key of its own: ``{"rank<r>": <bytes>}``. So each
        rank's file holds its own (``torch.save``), and the object is a
        ``Stateful`` for ``torch.distributed.checkpoint`` beside the model's
        sharded state dict: every rank's entry is saved (none is taken for a
        replica of another's), and a load reads this rank's back."""
        buffer = io.BytesIO()
        torch.save(self.local_state_dict(), buffer)
        return {f"rank{dist.get_rank()}": buffer.getvalue()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``: a ``StateError`` naming both layouts when
        it was saved by another rank or on another mesh."""
        key = f"rank{dist.get_rank()}"
        if key not in state:
            raise StateError(f"dsq_plugins.fsdp state holds {sorted(state)}, not this rank's ({key}): load each "
                             f"rank's own state on the same mesh")
        entry = state[key]
        self.load_local_state_dict(torch.load(io.BytesIO(entry), weights_only=False)
                                   if isinstance(entry, (bytes, bytearray)) else entry)

    def local_state_dict(self) -> dict[str, Any]:
        """The state itself (memories as tensors), for inspection or a format of one's own."""
        return {"version": STATE_VERSION, "rank": dist.get_rank(), "world": dist.get_world_size(),
                "mesh": self.roles.describe(), "backwards": self.steps.applied,
                "reducer": self.reducer.state_dict()}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``local_state_dict()``: a ``StateError`` naming both layouts
        when it was saved by another rank or on another mesh."""
        mine = (dist.get_rank(), dist.get_world_size(), self.roles.describe())
        saved = (state.get("rank"), state.get("world"), state.get("mesh"))
        if saved != mine:
            raise StateError(f"dsq_plugins.fsdp state saved by rank {saved[0]} of {saved[1]} ({saved[2]}); this is "
                             f"rank {mine[0]} of {mine[1]} ({mine[2]}): load each rank's own state on the same mesh")
        self.reducer.load_state_dict(state["reducer"])
        self.steps.applied = int(state.get("backwards", 0))


def _config(compressor: Any, options: dict[str, Any], roles: MeshRoles) -> ReducerConfig:
    config = ReducerConfig.build(None, dict(compressor=compressor), options)
    if config.owners != 1 or config.error_feedback == "ef21":
        raise ConfigError("dsq_plugins.fsdp keeps DoubleSqueeze's per-module memories: owners must be 1 and "
                          "error_feedback one of both, worker, none")
    if config.on_nonfinite == "skip":
        raise ConfigError("on_nonfinite='skip' cannot skip the optimizer's step from inside FSDP's backward; use "
                          "on_nonfinite='raise'")
    if roles.replicate is not None:
        config = dataclasses.replace(config, hierarchy=replicas_exchange_flat(config.hierarchy))
    return config
