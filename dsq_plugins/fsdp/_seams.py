"""Where this package meets FSDP2: finding the ``fully_shard`` units of a
model, checking that this torch has the seams we use, and turning HSDP's
native replicate all-reduce over to us.

FSDP2's public seams (``set_custom_reduce_scatter``, ``set_all_reduce_hook``,
``set_gradient_divide_factor``) cover the 1-D mesh. On HSDP's 2-D mesh the
replicate all-reduce is always torch's own, and the hook only runs after it;
so each unit's parameter group is given the shard-only view of its mesh
(``FSDPMeshInfo``, the mesh unchanged), and the replicate dimension becomes
the all-reduce hook's business. Nothing else reads that view's replicate
half: the parameters keep their 2-D placements and the all-gather its shard
group. The private names this needs are checked here once, so a torch that
moved them is a ``ConfigError`` naming what is missing, not an
``AttributeError`` in the middle of a backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import flat_hierarchy
from ..errors import ConfigError

__all__ = ["TESTED_TORCH", "Unit", "MeshRoles", "find_units", "mark", "mesh_roles", "replicas_exchange_flat",
           "take_over_replicate"]

TESTED_TORCH = "2.13"  # the FSDP2 these seams were written against (and tested with; 2.11 too, on a GPU)
_MARK = "_dsq_fsdp"    # set on a module once a DoubleSqueeze frontend wired it


@dataclass
class Unit:
    """One ``fully_shard`` module: its name in the model and its one parameter group."""

    name: str
    module: torch.nn.Module
    group: Any  # torch's FSDPParamGroup

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this unit shards (its own and those of submodules no
        other ``fully_shard`` took), as FSDP holds them: DTensors."""
        return [fsdp_param.sharded_param for fsdp_param in self.group.fsdp_params]


@dataclass
class MeshRoles:
    """The process groups a unit's gradients cross: the shard group (FSDP's
    reduce-scatter) and, under HSDP, the replicate group (None on a 1-D mesh)."""

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    shard_size: int
    replicate_size: int

    def describe(self) -> str:
        if self.replicate is None:
            return f"FSDP on a 1-D mesh of {self.shard_size}"
        return f"HSDP {self.replicate_size} replicas x {self.shard_size} shards"


def mesh_info_classes() -> tuple[type, type]:
    """FSDP2's ``FSDPMeshInfo`` and ``DDPMeshInfo`` (private: HSDP's replicate
    dimension has no public seam, see the module docstring)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo  # noqa: PLC2701
    return FSDPMeshInfo, DDPMeshInfo


def _fsdp_module_class() -> type:
    try:
        from torch.distributed.fsdp import FSDPModule
        mesh_info_classes()
    except ImportError as exc:
        raise ConfigError(f"dsq_plugins.fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, tested with torch "
                          f"{TESTED_TORCH}); this torch {torch.__version__} has none ({exc})") from exc
    for seam in ("set_custom_reduce_scatter", "set_all_reduce_hook", "_get_fsdp_state",
                 "set_requires_gradient_sync"):
        if not hasattr(FSDPModule, seam):
            raise ConfigError(f"dsq_plugins.fsdp needs FSDPModule.{seam}, which torch {torch.__version__} lacks; "
                              f"use torch {TESTED_TORCH} (the version it is tested with)")
    return FSDPModule


def find_units(model: torch.nn.Module, frontend: str) -> list[Unit]:
    """Every ``fully_shard`` module of ``model`` that holds parameters, in
    module order (the same on every rank). A ``ConfigError`` when there is
    none (called before ``fully_shard``), when a frontend already wired the
    model, or when a module has several parameter groups."""
    fsdp_module = _fsdp_module_class()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{frontend} takes the model (an nn.Module after fully_shard), got {type(model).__name__}")
    units = []
    for name, module in model.named_modules():
        if not isinstance(module, fsdp_module):
            continue
        if getattr(module, _MARK, None):
            raise ConfigError(f"{frontend}: module {name or '<root>'!r} is already wired by "
                              f"dsq_plugins.fsdp.{getattr(module, _MARK)}; call it once per model")
        groups = param_groups(module._get_fsdp_state())
        if len(groups) > 1:
            raise ConfigError(f"{frontend}: module {name or '<root>'!r} has {len(groups)} FSDP parameter groups "
                              f"(a per-parameter mesh, shard_placement_fn); FSDP2 takes custom collectives only "
                              f"for one group per module")
        for group in groups:
            for attribute in ("mesh_info", "_all_reduce_hook", "gradient_divide_factor", "fsdp_params"):
                if not hasattr(group, attribute):
                    raise ConfigError(f"{frontend}: FSDP's parameter group has no {attribute!r} in torch "
                                      f"{torch.__version__}; use torch {TESTED_TORCH}")
            units.append(Unit(name or "<root>", module, group))
    if not units:
        raise ConfigError(f"{frontend}: the model has no fully_shard module with parameters; call fully_shard "
                          f"(on its blocks and on the model) first")
    return units


def param_groups(state: Any) -> list:
    """A module's FSDP parameter groups: a list from torch 2.13 (per-parameter
    meshes), at most one before it (``_fsdp_param_group``, torch 2.11)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def mesh_roles(units: list[Unit], frontend: str) -> MeshRoles:
    """The shard and replicate groups, which every unit must share."""
    FSDPMeshInfo, DDPMeshInfo = mesh_info_classes()
    seen = set()
    for unit in units:
        info = unit.group.mesh_info
        if not isinstance(info, FSDPMeshInfo):
            raise ConfigError(f"{frontend}: module {unit.name!r} is replicated without sharding (a DDP-style mesh); "
                              f"use dsq_plugins.ddp for that")
        replicate = info.replicate_process_group if isinstance(info, DDPMeshInfo) else None
        seen.add((info.shard_process_group, replicate))
    if len(seen) > 1:
        raise ConfigError(f"{frontend}: the model's fully_shard modules use {len(seen)} different meshes; "
                          f"shard every module on the same mesh")
    shard, replicate = seen.pop()
    return MeshRoles(shard, replicate, dist.get_world_size(shard),
                     1 if replicate is None else dist.get_world_size(replicate))


def take_over_replicate(unit: Unit, hook: Any, frontend: str) -> None:
    """Make ``hook(shard_gradient)`` the unit's replicate exchange: the group
    gets the shard-only view of its mesh (no native all-reduce) and the hook."""
    FSDPMeshInfo, _ = mesh_info_classes()
    info = unit.group.mesh_info
    if getattr(info, "dp_mesh_dims", None) is not None:  # torch 2.13's SPMD meshes
        raise ConfigError(f"{frontend}: module {unit.name!r} is sharded on an SPMD mesh (dp_mesh_dims); shard it on "
                          f"a (replicate, shard) mesh of its own")
    view = FSDPMeshInfo(mesh=info.mesh, shard_mesh_dim=info.shard_mesh_dim)
    if hasattr(info, "reduce_scatter_process_group"):  # torch 2.13: a reduce-scatter group of its own, maybe
        view.reduce_scatter_process_group = info.reduce_scatter_process_group
    if unit.group.post_forward_mesh_info is info:  # reshard_after_forward=True: "after forward" is the same mesh
        unit.group.post_forward_mesh_info = view
    unit.group.mesh_info = view
    unit.group._all_reduce_hook = hook
    mark(unit, frontend)


def mark(unit: Unit, frontend: str) -> None:
    """Remember that ``frontend`` wired the unit (a second call is refused by name)."""
    setattr(unit.module, _MARK, frontend)


def replicas_exchange_flat(hierarchy: Any) -> str:
    """The hierarchy of HSDP's replicate exchange: flat, since the shard
    dimension already is the exact level inside a host."""
    return flat_hierarchy(hierarchy, "HSDP's shard dimension is already the exact level inside a host: leave "
                                     "hierarchy at 'auto' (the replicas exchange flat)")
