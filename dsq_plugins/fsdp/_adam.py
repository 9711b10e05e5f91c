"""``compressed_adam(model)``: CompressedAdam on HSDP's shards.

Each rank steps only its own parameter shard. FSDP's reduce-scatter stays
exact inside the shard group (a host); the replicate dimension is the
optimizer's: until the freeze the host-exact gradient shards are averaged
exactly across the replicas (Adam on the shard, AdamW step for step), after
it each rank's momentum shard goes through DoubleSqueeze across the
replicas against the shard's frozen variance. So no Adam state is
replicated: the moments, the error memories and the frozen denominators are
1/shard-size of the model per rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import TorchDistributedComm
from ..errors import ConfigError, StateError
from ..optim import SUMMARY_ENTRIES, CompressedAdam
from ._collectives import ReplicaAverage
from ._seams import find_units, mesh_roles, replicas_exchange_flat, take_over_replicate

__all__ = ["ShardedCompressedAdam", "compressed_adam"]


class ShardedCompressedAdam(CompressedAdam):
    """CompressedAdam over this rank's local shards of a ``fully_shard``
    model's parameters (``compressed_adam`` builds it). ``step()`` reads the
    DTensor gradients' local shards; ``zero_grad()`` clears the model's.
    ``slots``: each shard's index among the model's ``total`` trainable
    parameters (a short parameter leaves some ranks no shard)."""

    def __init__(self, shards: list[tuple[str, torch.Tensor, torch.nn.Parameter]], slots: list[int], total: int,
                 *, comm: TorchDistributedComm, mesh: str, **options: Any):
        if options.get("max_grad_norm", 0.0):
            raise ConfigError("compressed_adam on FSDP shards cannot clip by the global norm of the local momentum "
                              "(each rank holds other shards); clip the DTensor gradients before step() with "
                              "torch.nn.utils.clip_grad_norm_ instead")
        super().__init__([(name, local) for name, local, _ in shards], comm=comm, **options)
        self.other_rank_state = "raise"  # the moments are this rank's shard, not replicated
        self._params = [(local, param) for _, local, param in shards]
        self._param_of = {id(local): param for _, local, param in shards}
        self._slot_of = {id(local): slot for (_, local, _), slot in zip(shards, slots)}
        self._total, self.mesh = total, mesh

    def _trains(self, p: torch.Tensor) -> bool:
        # a local shard never requires a gradient itself: its DTensor parameter says whether it trains
        return self._param_of[id(p)].requires_grad

    def _variance_summary(self, entries: list[tuple[dict, torch.Tensor, str]], t: int) -> torch.Tensor:
        """Every rank holds other parameters' variance: the per-parameter sums
        are placed by parameter and summed over the whole world (one small
        all-reduce per window), so every rank freezes at the same step."""
        device = self.comm.device
        vector = torch.zeros(self._total, SUMMARY_ENTRIES, dtype=torch.float64, device=device)
        if entries:  # (the shards that train now)
            local = super()._variance_summary(entries, t).to(device, torch.float64)
            slots = torch.tensor([self._slot_of[id(p)] for _, p, _ in entries], device=device)
            vector[slots] = local.view(-1, SUMMARY_ENTRIES)
        dist.all_reduce(vector)
        return vector.reshape(-1)

    @torch.no_grad()
    def step(self, closure=None):
        for local, param in self._params:
            local.grad = None if param.grad is None else param.grad.to_local()
        try:
            return super().step(closure)
        finally:
            for local, _ in self._params:
                local.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, param in self._params:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["fsdp"] = {"rank": dist.get_rank(), "world": dist.get_world_size(), "mesh": self.mesh}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("fsdp", {})
        mine = {"rank": dist.get_rank(), "world": dist.get_world_size(), "mesh": self.mesh}
        if saved != mine:
            raise StateError(f"compressed_adam state saved by rank {saved.get('rank')} of {saved.get('world')} "
                             f"({saved.get('mesh')}); this is rank {mine['rank']} of {mine['world']} ({self.mesh}): "
                             f"its moments are that rank's shards, so load each rank's own on the same mesh")
        super().load_state_dict(state_dict)


def compressed_adam(model: torch.nn.Module, **options: Any) -> ShardedCompressedAdam:
    """CompressedAdam on an HSDP model's shards (see the module docstring),
    in one line after ``fully_shard``. ``options``: CompressedAdam's
    (``lr``, ``betas``, ``weight_decay``, ``freeze_step``, ``compressor``,
    ``error_dtype`` ...)."""
    units = find_units(model, "compressed_adam")
    roles = mesh_roles(units, "compressed_adam")
    if roles.replicate is None:
        raise ConfigError("compressed_adam compresses the momentum across HSDP's replicas; this model is sharded on "
                          "a 1-D mesh (no replicas). Shard it on a (replicate, shard) mesh, or use "
                          "dsq_plugins.fsdp.compress(model) for the gradient path")
    hierarchy = replicas_exchange_flat(options.pop("hierarchy", "auto"))
    for unit in units:  # the replicas' exchange is the optimizer's: FSDP leaves each rank its host's exact shard
        take_over_replicate(unit, ReplicaAverage(unit, None), "compressed_adam")
    names = {id(param): name for name, param in model.named_parameters()}
    shards, slots, index = [], [], 0
    for unit in units:
        for param in unit.parameters():
            if not param.requires_grad:
                continue
            local = getattr(param, "_local_tensor", param)  # the shard itself, not a view with a grad_fn
            if local.numel():  # a short parameter may leave this shard empty
                shards.append((names[id(param)], local, param))
                slots.append(index)
            index += 1
    comm = TorchDistributedComm(roles.replicate)
    return ShardedCompressedAdam(shards, slots, index, comm=comm, mesh=roles.describe(), hierarchy=hierarchy,
                                 **options)
