"""ZeRO stage 3 with its gradient pass compressed: the first step of the
stage-3 mapping.

Stage 3 partitions every parameter over the data-parallel ranks (rank k
keeps partition k of each, with its fp32 master and optimizer state) and,
during backward, reduce-scatters the gradients bucket by bucket. Here each
bucket's reduce-scatter is DoubleSqueeze's worker pass
(``DoubleSqueeze.reduce_scatter``): every rank compresses its full
gradients of the bucket plus its worker error, partition k of every
parameter to rank k, and rank k averages what it decodes. The bucket's flat
vector is laid out by rank (``Zero3Layout``): rank 0's partitions of its
parameters, then rank 1's, ..., so that chunk k is exactly rank k's.

On one host, with ``hierarchy`` left at "auto", nothing crosses a host
link: the gradients are then reduce-scattered exactly, said once in the
log; ``hierarchy="flat"`` compresses them anyway. Across hosts "auto" is
two-level: exact inside a host, compressed between hosts.

The parameter pass: across hosts, with the server side's error feedback
(``error_feedback`` "both", the default), hpZ's secondary partition is the
replica, kept between steps and moved forward by the owners' compressed
``Q(master - replica)`` (``deepspeed_ext.zero3_params``); the section sets
``zero_hpz_partition_size`` to the ranks per host where the config leaves
it out. Otherwise (one host, "flat", the worker side only, or hpZ groups
that are not the hosts) it stays DeepSpeed's own all-gather, exact, said
once. Refused by name: parameter or
optimizer offload, MoE, pipeline parallelism, sequence parallelism,
``on_nonfinite="skip"``, a partition group other than the data-parallel one.

A backward is one step of the reducer, opened at its first bucket and
closed when DeepSpeed's epilogue has reduced the last: the worker errors
of all its buckets are written together, only if every bucket went through
on every rank. A failure (a NaN gradient, say) is the same error on every
rank, from ``engine.backward``, and writes nothing. Checkpoints
carry each rank's worker errors (``deepspeed_ext.engine``); they are laid
out by rank, so one saved at another world size is refused by name.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from dsq_plugins import DoubleSqueeze, TorchDistributedComm
from dsq_plugins.algorithm import SERVER_SIDE
from dsq_plugins.config import ReducerConfig
from dsq_plugins.errors import ConfigError
from dsq_plugins.layout import launched_on_one_host, launcher_sizes
from dsq_plugins.step import LearnedPlans

from . import patches
from .zero3_layout import Zero3Layout, layout_of, names_of
from .zero3_params import SecondaryReplicas
from .zero import SECTION, refuse_offload, refuse_options

log = logging.getLogger("dsq_plugins")
#: the stage-3 optimizer's two reduce-scatters (name-mangled private methods), both replaced
REDUCE_SCATTERS = ("_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
                    "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads")


def refuse(cfg: ReducerConfig, zero: dict[str, Any]) -> None:
    """What the stage-3 mapping cannot serve, from the config (before DeepSpeed builds anything)."""
    refuse_offload(zero)
    refuse_options(cfg)
    if cfg.on_nonfinite == "skip":
        raise ConfigError(f"{SECTION}: on_nonfinite='skip' is not served at ZeRO stage 3 (its gradients are "
                          f"reduced bucket by bucket during backward, before the step could be skipped); use "
                          f"on_nonfinite='raise'")


def with_replica_partition(cfg: ReducerConfig, zero: dict[str, Any]) -> dict[str, Any]:
    """The stage-3 section DeepSpeed gets: hpZ's secondary partition over
    each host (``zero_hpz_partition_size`` = the ranks per host), the replica
    the compressed parameter pass keeps, where the job spans hosts, the
    server side keeps its error feedback and the config leaves hpZ out."""
    if cfg.error_feedback not in SERVER_SIDE or cfg.hierarchy == "flat" or zero.get("zero_hpz_partition_size", 1) != 1:
        return zero
    sizes = launcher_sizes()
    per_host = cfg.node_size or (sizes[0] if sizes is not None and sizes[0] < sizes[1] else None)
    if per_host is None or per_host <= 1:
        return zero
    log.info("%s: ZeRO stage 3 across hosts: zero_hpz_partition_size set to the %d ranks per host (hpZ's secondary "
             "partition is the replica the compressed parameter pass keeps)", SECTION, per_host)
    return {**zero, "zero_hpz_partition_size": per_host}


class Zero3Compression:
    """The compressed gradient pass wired into an initialized stage-3 engine
    (``deepspeed_ext.attach`` builds it)."""

    def __init__(self, engine: Any, cfg: ReducerConfig, comm: TorchDistributedComm):
        self.optimizer = opt = engine.optimizer
        if getattr(opt, "offload_optimizer", False) or getattr(opt, "offload_param", False):
            raise ConfigError(f"{SECTION}: ZeRO offload is not supported with compression")
        if getattr(opt, "sequence_parallel_size", 1) != 1:
            raise ConfigError(f"{SECTION}: sequence parallelism is not supported at ZeRO stage 3")
        if getattr(opt, "postscale_gradients", True) and getattr(opt, "gradient_predivide_factor", 1.0) != 1.0:
            raise ConfigError(f"{SECTION}: gradient_predivide_factor is not supported at ZeRO stage 3 (the "
                              f"compressed exchange averages, and is told nothing else)")
        self.comm = comm
        self.reducer = self._reducer(cfg, comm)
        self._layouts: dict[tuple, Zero3Layout] = {}
        self._names = {id(p): name for name, p in engine.module.named_parameters()}
        self._padding: dict[str, torch.Tensor | None] = {}
        self.parameter_pass = self._parameter_pass(cfg)
        self._step: Any = None  # the reducer's step, open from a backward's first bucket to its epilogue
        self.last_backward: Any = None  # the last backward's step, closed (the parameter pass is a step of its own)
        self.plans = LearnedPlans()  # the buckets every backward reduces: each backward then reads the host once
        #: DeepSpeed's own reduce-scatters, by name, as they were before these replaced them
        self.deepspeeds: dict[str, Any] = {}
        for name in REDUCE_SCATTERS:
            contiguous = name.endswith("contiguous_grads")
            self.deepspeeds[name] = patches.on(opt, name, self._contiguous if contiguous else self._scatter).previous
        epilogue = patches.on(opt, "independent_gradient_partition_epilogue",
                              lambda *args, **kwargs: self._epilogue(epilogue.previous, *args, **kwargs))

    @staticmethod
    def _reducer(cfg: ReducerConfig, comm: TorchDistributedComm) -> DoubleSqueeze:
        """The gradients' reducer: exact on one host with "auto" (said once), else the section's."""
        if cfg.hierarchy == "auto" and cfg.node_size is None and comm.size > 1 and launched_on_one_host(comm.size):
            log.warning("%s: ZeRO stage 3 on one host: nothing crosses a host link, so the gradients are "
                        "reduce-scattered exactly; set hierarchy 'flat' to compress them anyway", SECTION)
            return DoubleSqueeze.exact(comm, bucket_mb=cfg.bucket_mb, seed=cfg.seed)
        return DoubleSqueeze(comm, config=cfg)

    def _parameter_pass(self, cfg: ReducerConfig) -> Any:
        """The compressed parameter pass where it can run (hpZ's groups are the
        hosts the two-level exchange found), else None, said once."""
        hosts, hpz = self.reducer.hosts, int(getattr(self.optimizer, "zero_hpz_partition_size", 1))
        why = None
        if cfg.error_feedback not in SERVER_SIDE:
            why = f"error_feedback={cfg.error_feedback!r} keeps no server side"
        elif self.reducer.two_level is None:
            why = "nothing crosses a host link" if len(hosts.hosts) == 1 else "the exchange is flat"
        elif hpz != hosts.per_host or any(list(members) != list(range(h * hpz, (h + 1) * hpz))
                                          for h, members in enumerate(hosts.hosts)):
            why = (f"zero_hpz_partition_size is {hpz}, not the {hosts.per_host} ranks of each host (numbered host by "
                   f"host)")
        if why is not None:
            log.info("%s: ZeRO stage 3; the gradients' reduce-scatter goes through the section; the parameters are "
                     "gathered by DeepSpeed, exactly (%s)", SECTION, why)
            return None
        log.info("%s: ZeRO stage 3 on %d hosts; the gradients' reduce-scatter and the parameter pass between hosts "
                 "are compressed, hpZ's secondary partition the replica", SECTION, len(hosts.hosts))
        return SecondaryReplicas(self.optimizer, self.reducer, self._names)

    def _epilogue(self, original, *args, **kwargs):
        """DeepSpeed's end of backward (it reduces the last buckets), then the step closes: written, or not."""
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            self._close_step(exc)
            raise
        self._close_step(None)
        return result

    def _close_step(self, error: BaseException | None) -> None:
        step, self._step = self._step, None
        if step is not None:
            self.last_backward = self.reducer.close_step(error)
            self.plans.closed(self.reducer)

    def _contiguous(self, buffer: torch.Tensor, communication_data_type: torch.dtype) -> list[torch.Tensor]:
        """Stands in for the reduce-scatter of a contiguous bucket: the same, from its parameters' gradients."""
        return self.partition_averages(self.optimizer.ipg_buckets[communication_data_type].params)

    def _scatter(self, params: list, communication_data_type: torch.dtype) -> list[torch.Tensor]:
        return self.partition_averages(params)

    def partition_averages(self, params: Sequence[Any]) -> list[torch.Tensor]:
        """This rank's partition of each parameter's compressed average
        gradient, in ``params`` order, as ZeRO's ``partition_grads`` takes them."""
        opt = self.optimizer
        layout = self._layouts.get(tuple(p.ds_id for p in params)) or self._new_layout(params)
        if self._step is None:
            self._step = self.reducer.open_step(self.plans.opening(self.reducer))
        try:
            flat = layout.flatten([p.grad for p in params])
            self.plans.exchanging(layout.name, flat.numel())
            chunk = self.reducer.reduce_scatter(layout.name, flat)
        except BaseException as exc:  # the same error on every rank; nothing of this backward is written
            self._close_step(exc)
            raise
        if self._padding[layout.name] is not None:
            chunk.masked_fill_(self._padding[layout.name], 0.0)
        averaging = opt._gradient_averaging_world_size(params, self.comm.size)
        if averaging != self.comm.size:
            chunk.mul_(self.comm.size / float(averaging))
        return [part.to(opt.gradient_accumulation_dtype) for part in layout.partitions_of(chunk)]

    def _new_layout(self, params: Sequence[Any]) -> Zero3Layout:
        """A bucket seen for the first time: its layout and padding, kept;
        refused if its parameters are partitioned over another group."""
        import deepspeed.comm as dist
        partitioned_over = dist.get_world_size(group=self.optimizer._get_param_partition_group(params[0]))
        if partitioned_over != self.comm.size:
            raise ConfigError(f"{SECTION}: these parameters are partitioned over {partitioned_over} ranks, not the "
                              f"{self.comm.size} data-parallel ranks the exchange runs over (MiCS-style "
                              f"groups are not served)")
        layout = self._layouts[tuple(p.ds_id for p in params)] = layout_of(params, names_of(params, self._names),
                                                                            self.comm.size)
        self._padding[layout.name] = layout.padding(self.comm.rank, params[0].grad.device)
        return layout

    def state_dict(self) -> dict[str, Any]:
        """The reducer's memories, marked as laid out for this many ranks."""
        return {"reducer": self.reducer.state_dict(), "size": self.comm.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The memories ``state_dict`` saved (at this world size: ``engine`` refuses another one)."""
        self.reducer.load_state_dict(state["reducer"])
