"""The two seams' bodies: FSDP's reduce-scatter as DoubleSqueeze's worker
pass (1-D mesh), and HSDP's replicate all-reduce as the whole of Algorithm 1
among the replicas (each rank holding its host's exact mean of one shard).

Both run inside FSDP's post-backward, once per ``fully_shard`` module, on
FSDP's reduce-scatter / all-reduce stream; both belong to the step that
``_steps.BackwardSteps`` opens at the first module of a backward and closes
after the last one.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..reducer import DoubleSqueeze
from ._seams import Unit

__all__ = ["CompressedReduceScatter", "ReplicaAverage", "replica_scale", "scatter_scale"]


def scatter_scale(unit: Unit, group_size: int) -> float:
    """What FSDP expects from its reduce-scatter over ``group_size`` ranks,
    as a multiple of their mean: the mean itself (its default ``AVG``), the
    sum (fp16's or ``set_force_sum_reduction_for_comms``'s ``SUM``: FSDP
    divides afterwards), or the sum over ``set_gradient_divide_factor``'s
    factor (its ``PREMUL_SUM``)."""
    group = unit.group
    factor = group.gradient_divide_factor
    force_sum = getattr(group, "force_sum_reduction_for_comms", False)
    reduce_dtype = group._reduce_dtype or group._orig_dtype
    if force_sum or reduce_dtype not in (torch.float32, torch.bfloat16, None):
        return float(group_size)
    if factor is None:
        return 1.0
    return group_size / factor


def replica_scale(unit: Unit, replicas: int) -> float:
    """What FSDP expects across the replicas, as a multiple of their mean,
    once the replicate dimension is ours (``_seams.take_over_replicate``):
    FSDP then divides by the shard group's size alone (before, after, or in
    its reduce-scatter), so the replicas' mean completes the global mean;
    with ``set_gradient_divide_factor`` it divides by that factor alone, so
    the replicas are summed."""
    return 1.0 if unit.group.gradient_divide_factor is None else float(replicas)


class CompressedReduceScatter:
    """FSDP's gradient reduce-scatter (1-D mesh) as DoubleSqueeze's worker
    pass: each rank compensates its padded flat gradients (world, -1) with its
    worker error, compresses row k for rank k, and rank k decodes the
    ``world`` payloads of its row into their mean, its gradient shard. There
    is no server pass: the shard stays with its owner (ZeRO's reduce-scatter,
    ``DoubleSqueeze.reduce_scatter``). It implements FSDP2's ``ReduceScatter``
    interface (``allocate`` and the call), which FSDP reads by duck typing."""

    def __init__(self, unit: Unit, run: Callable[[Callable[[DoubleSqueeze], Any]], Any]):
        self.unit, self.run = unit, run  # run: BackwardSteps.run

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        if async_op:
            raise ConfigError("dsq_plugins.fsdp's reduce-scatter runs synchronously on FSDP's reduce-scatter "
                              "stream; FSDP asked for async_op=True")
        shard, size = self.run(lambda reducer: (reducer.reduce_scatter(self.unit.name, input_tensor),
                                                reducer.comm.size), (self.unit.name, input_tensor.numel()))
        output_tensor.copy_(_scaled(shard, scatter_scale(self.unit, size)))
        return None


class ReplicaAverage:
    """HSDP's replicate all-reduce as Algorithm 1 among the replicas: called
    with this rank's shard of its host's exact mean (FSDP's reduce-scatter
    inside the shard group), it writes the DoubleSqueeze average over the
    replicas in place, both passes with their error memories; every replica
    of the shard gets the same bytes back. ``run=None`` (``compressed_adam``'s
    hook) leaves the shard as it is: the optimizer averages across the
    replicas itself."""

    def __init__(self, unit: Unit, run: Callable[[Callable[[DoubleSqueeze], Any]], Any] | None):
        self.unit, self.run = unit, run  # run: BackwardSteps.run; None: leave the shard as it is

    def __call__(self, shard: torch.Tensor) -> None:
        if not getattr(self.unit.group, "all_reduce_grads", True):
            # HSDP's own accumulation across micro-batches keeps the shards aside until the last one; with the
            # replicate dimension ours, FSDP would write each micro-batch's shard unexchanged
            raise ConfigError(f"module {self.unit.name!r}: set_requires_all_reduce(False) is not supported by "
                              f"dsq_plugins.fsdp; accumulate with set_requires_gradient_sync(False) instead")
        if self.run is None:
            return
        average, size = self.run(lambda reducer: (reducer.reduce(self.unit.name, shard), reducer.comm.size),
                                 (self.unit.name, shard.numel()))
        shard.copy_(_scaled(average, replica_scale(self.unit, size)))


def _scaled(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """``tensor`` times ``scale``, in place; FSDP's default (the mean) costs no pass."""
    return tensor if scale == 1.0 else tensor.mul_(scale)
