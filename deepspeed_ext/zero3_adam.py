"""CompressedAdam at ZeRO stage 3 (a OneBitAdam config): the 1-bit Adam
design on stage 3's partitions, with its state kept for a host shard only.

Stage 3 gives rank k partition k of every parameter (its fp32 master and
Adam's two moments there) and reduce-scatters the gradients bucket by bucket
during backward. The partition optimizer is a stock ``torch.optim.AdamW``.

* **warm-up** (the first ``freeze_step`` applied steps): DeepSpeed's own
  stage 3, its reduce-scatters and its AdamW, exactly.
* **the freeze**: each partition's Adam denominator is final. It is floored
  per parameter as CompressedAdam floors a tensor's (``optim._kernel``; the
  mean over a parameter's live coordinates is summed over every rank's
  partition of it), and it and the momentum are gathered once, exactly, to
  the ranks that keep them: local rank i keeps host shard i, the partitions
  of local index i on every host (flat: every partition).
* **after it**, per bucket during backward: each rank forms (1 - beta1)·g_i
  and adds L·beta1·m on its host shard, so that the host's exact
  reduce-scatter forms beta1·m + (1 - beta1)·mean(g) there, as the ZeRO-1/2
  mapping does; what is compressed is that divided by the denominator,
  u = m / D (``reduce_scatter(divide_by=)``), and the server pass
  (``all_gather`` with ``keep_payloads``) brings u to every rank of the
  shard. Each owner steps its fp32 master by u (AdamW's decay and
  -lr/(1 - beta1^t)·u) in place of DeepSpeed's AdamW, and every keeper of a
  shard keeps m = u·D there. The new weights reach the other ranks by
  stage 3's parameter pass: across hosts the compressed one
  (``deepspeed_ext.zero3_params``: ``Q(master - replica)`` into hpZ's
  secondary partition), else DeepSpeed's exact gather.

What a host sends across its link per step after the freeze: u's two 1-bit
passes and the parameters' one. State per rank: on its host shard (1/L of
the model) D, the worker error, and m as the payloads each bucket's last
server pass kept (about 1 bit per element for sign: u decodes from them bit
for bit, and m = u·D); the server error over a partition.

Refused by name: fp16 (an overflow is found after backward, when the
momentum has been exchanged), gradient accumulation (the exchange needs
the whole local gradient of a step, which stage 3 does not keep), param
groups with different betas. Gradient clipping applies to the warm-up's
exact average; after the freeze each bucket is exchanged before the whole
gradient's norm exists, so it is not clipped (said once).

A backward is one reducer step; m and the master are written by the
optimizer step after a backward that went through on every rank. A NaN is
the same error from every rank's backward and writes nothing. Checkpoints
hold m, the memories and the step count; a load gathers the denominators
again from the restored variance.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from dsq_plugins import DoubleSqueeze, TorchDistributedComm
from dsq_plugins.algorithm import ServedPayloads
from dsq_plugins.config import ReducerConfig
from dsq_plugins.errors import ConfigError, StateError
from dsq_plugins.optim import (DENOMINATOR_FLOOR, FreezePolicy, FreezesVariance, adam_denominator, denominator_sums,
                               preconditioned_step_)

from . import patches
from .zero3 import REDUCE_SCATTERS, Zero3Compression
from .zero3_layout import layout_of, names_of

log = logging.getLogger("dsq_plugins")
STATE_VERSION = 1
_SCATTER, _CONTIGUOUS = REDUCE_SCATTERS


class Zero3CompressedAdam(FreezesVariance, Zero3Compression):
    """CompressedAdam's momentum exchange wired into an initialized stage-3
    engine whose client optimizer is a ``torch.optim.AdamW``. ``cfg``: the
    momentum exchange's options (``CompressedAdam.momentum_config``).
    ``max_grad_norm``: the config's ``gradient_clipping``, which DeepSpeed
    applies itself to the warm-up's exact average and nothing applies after
    the freeze (the module docstring says why); taken as the ZeRO-1/2 mapping takes it."""

    def __init__(self, engine: Any, cfg: ReducerConfig, comm: TorchDistributedComm, *, freeze: FreezePolicy,
                 max_grad_norm: float):
        refuse_settings(engine.fp16_enabled(), engine.gradient_accumulation_steps())
        self.freeze = freeze
        self.applied_steps = 0
        #: m on this rank's host shard, per bucket it was last exchanged in (the freeze's: per sub-group)
        self.kept: dict[str, KeptMomentum] = {}
        self._source: dict[str, tuple[str, int]] = {}  # parameter name -> (its kept entry, its column there)
        self.denominators: list[torch.Tensor] = []  # per sub-group, (hosts, its partition): D, inf where no variance
        self._staged: list[tuple] = []  # per bucket of this backward: (name, names, places, its KeptMomentum)
        self._own_u: list[torch.Tensor] = []  # per sub-group: this rank's partition of u, as its master is laid out
        self._compact = cfg.error_dtype != "fp32"
        super().__init__(engine, cfg, comm)
        opt = self.optimizer
        self._basic = opt.optimizer
        if not isinstance(self._basic, torch.optim.AdamW):
            raise TypeError(f"the partition optimizer must be torch.optim.AdamW, got {type(self._basic).__name__}")
        if len({tuple(group["betas"]) for group in self._basic.param_groups}) > 1:
            raise ConfigError("OneBitAdam at ZeRO stage 3: every param group must have the same betas (the "
                              "momentum is exchanged bucket by bucket, and a bucket mixes groups)")
        self.beta1 = float(self._basic.param_groups[0]["betas"][0])
        self.hosts, self.per_host, self.host, self.local = self.reducer.hosts.position(comm.rank)
        if comm.rank != self.host * self.per_host + self.local:
            raise ConfigError(f"OneBitAdam at ZeRO stage 3: the ranks must be numbered host by host (rank "
                              f"{comm.rank} is local rank {self.local} of host {self.host})")
        self.exact = DoubleSqueeze.exact(comm)
        #: each parameter's place in its sub-group's partition: ds_id -> (sub-group, offset, partition size)
        self._place: dict[int, tuple[int, int, int]] = {}
        for sub, group in enumerate(opt.fp16_groups):
            layout = layout_of(group, names_of(group, self._names), comm.size, kind="adam")
            self._place.update({p.ds_id: (sub, at, part)
                                for p, part, at in zip(group, layout.partitions, layout.offsets())})
        self._said_clipping = False
        step = patches.on(opt, "step", lambda *a, **kw: self._optimizer_step(step.previous, *a, **kw))
        inner = patches.on(opt, "_optimizer_step", lambda sub: self._sub_group_step(inner.previous, sub))

    @staticmethod
    def _reducer(cfg: ReducerConfig, comm: TorchDistributedComm) -> DoubleSqueeze:
        """The momentum's reducer: compressed on one host too, as CompressedAdam compresses."""
        return DoubleSqueeze(comm, config=cfg)

    def freeze_clock(self) -> int:
        return self.applied_steps

    # -- the reduce-scatters: DeepSpeed's own until the freeze ----------------------
    def _scatter(self, params: list, communication_data_type: torch.dtype) -> list[torch.Tensor]:
        if not self.frozen:
            return self.deepspeeds[_SCATTER](params, communication_data_type)
        return self.partition_averages(params)

    def _contiguous(self, buffer: torch.Tensor, communication_data_type: torch.dtype) -> list[torch.Tensor]:
        if not self.frozen:
            return self.deepspeeds[_CONTIGUOUS](buffer, communication_data_type)
        return super()._contiguous(buffer, communication_data_type)

    def partition_averages(self, params: Sequence[Any]) -> list[torch.Tensor]:
        """After the freeze, one bucket: the new u exchanged compressed (staged
        for the optimizer step); returns this rank's partitions of it."""
        layout = self._layouts.get(tuple(p.ds_id for p in params)) or self._new_layout(params)
        if self._step is None:
            self._step = self.reducer.open_step(self.plans.opening(self.reducer))
            self._staged = []
            for own in self._own_u:
                own.zero_()
        names, places = names_of(params, self._names), [self._place[p.ds_id] for p in params]
        try:
            local = layout.flatten([p.grad for p in params]).mul_(1 - self.beta1)
            shard = local.view(self.hosts, self.per_host, -1)[:, self.local]
            denominator = self._rows(self.denominators, places).float()
            shard.add_(self._momentum_rows(layout.name, names, places, denominator), alpha=self.per_host * self.beta1)
            self.plans.exchanging(layout.name, local.numel())
            average = self.reducer.reduce_scatter(layout.name, local, divide_by=denominator.reshape(-1))
            self.plans.exchanging(f"{layout.name}.served", local.numel())
            u, served = self.reducer.all_gather(f"{layout.name}.served", average, local.numel(), keep_payloads=True)
        except BaseException as exc:  # the same error on every rank; nothing of this backward is written
            self._close_step(exc)
            raise
        u = u.view(self.hosts, -1).masked_fill_(torch.isinf(denominator), 0.0)
        # what m is kept as: the payloads where a server pass crossed a host link (about 1 bit per element for
        # sign), else m itself, made now (u may be a buffer the reducer hands out again to the next bucket)
        kept = KeptMomentum(places, served) if served is not None else \
            KeptMomentum(places, None, torch.where(torch.isinf(denominator), 0.0, u * denominator))
        self._staged.append((layout.name, names, places, kept))
        own = u[self.host]
        for (sub, offset, size), part in zip(places, layout.partitions_of(own)):
            self._own_u[sub][offset:offset + size].copy_(part)
        return [part.to(self.optimizer.gradient_accumulation_dtype) for part in layout.partitions_of(own)]

    def _close_step(self, error: BaseException | None) -> None:
        if error is not None:
            self._staged = []
        super()._close_step(error)

    @staticmethod
    def _rows(kept: list[torch.Tensor], places: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """(hosts, bucket partition) of a per-sub-group host-shard state at ``places``, in that order."""
        return torch.cat([kept[sub][:, offset:offset + size] for sub, offset, size in places], dim=1)

    def _momentum_rows(self, name: str, names: list[str], places: list, denominator: torch.Tensor) -> torch.Tensor:
        """m on this rank's host shard for a bucket's parameters, (hosts, bucket
        partition): decoded from the payloads the bucket's last server pass kept
        (one decode, as every step has it), or pieced together from where each
        parameter was last kept (the freeze's gather, a bucket laid out otherwise)."""
        kept = self.kept.get(name)
        if kept is not None and kept.places == places:
            return kept.momentum(self.reducer, denominator)
        decoded: dict[str, torch.Tensor] = {}
        pieces = []
        for parameter, (_, _, size) in zip(names, places):
            source, at = self._source[parameter]
            if source not in decoded:
                entry = self.kept[source]
                decoded[source] = entry.momentum(self.reducer, self._rows(self.denominators, entry.places).float())
            pieces.append(decoded[source][:, at:at + size])
        return torch.cat(pieces, dim=1)

    def _keep(self, name: str, names: list[str], places: list, kept: "KeptMomentum") -> None:
        """A bucket's m kept under ``name``; entries no parameter reads any more are let go."""
        self.kept[name] = kept
        at = 0
        for parameter, (_, _, size) in zip(names, places):
            self._source[parameter] = (name, at)
            at += size
        read = {source for source, _ in self._source.values()}
        self.kept = {key: entry for key, entry in self.kept.items() if key in read}

    # -- the optimizer step ------------------------------------------------------------
    def _optimizer_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Warm-up: DeepSpeed's own step (and the freeze after the last). After
        it: DeepSpeed's step with the update below per sub-group; then m is kept."""
        opt = self.optimizer
        if not self.frozen:
            result = original(*args, **kwargs)
            if not opt.overflow:
                self.applied_steps += 1
                if self.freeze.observe(self.applied_steps, self._denominator_sums):
                    self._freeze()
            return result
        if not self._staged or self.last_backward is None or not self.last_backward.applied:
            raise RuntimeError("OneBitAdam at ZeRO stage 3: optimizer step without a momentum exchange in the "
                               "backward before it (or after one that failed)")
        result = original(*args, **kwargs)
        for name, names, places, kept in self._staged:
            self._keep(name, names, places, kept)
        self._staged = []
        self.applied_steps += 1
        return result

    @torch.no_grad()
    def _sub_group_step(self, original: Any, sub: int) -> None:
        """After the freeze, in place of AdamW on a sub-group's fp32 master:
        decay and -lr/(1 - beta1^t)·u, and Adam's state records m = u·D and the step."""
        if not self.frozen:
            return original(sub)
        opt = self.optimizer
        master, u = opt.fp32_partitioned_groups_flat[sub], self._own_u[sub]
        group = self._basic.param_groups[opt.sub_group_to_group_id[sub]]
        preconditioned_step_(master.data, u, lr=group["lr"], beta1=group["betas"][0],
                             weight_decay=group["weight_decay"], t=self.applied_steps + 1)
        denominator = self.denominators[sub][self.host].float()
        state = self._basic.state[master]
        state["exp_avg"].copy_(torch.where(torch.isinf(denominator), 0.0, u * denominator))
        state["step"] += 1
        return None

    # -- the freeze --------------------------------------------------------------------
    def _denominator_sums(self) -> torch.Tensor:
        """Per sub-group, the sum over every partition of sqrt(v / (1 - beta2^t)):
        each rank's sums gathered exactly and added, so every rank decides alike."""
        opt, n = self.optimizer, self.comm.size
        mine = denominator_sums([(self._basic.state[master]["exp_avg_sq"], self._group_of(sub)["betas"][1])
                                 for sub, master in enumerate(opt.fp32_partitioned_groups_flat)], self.applied_steps)
        everyone = self.exact.all_gather("zero3.freeze.sums", mine, mine.numel() * n, error_feedback=False)
        return everyone.view(n, -1).sum(0)

    def _freeze(self) -> None:
        """The denominators and the momentum of this rank's host shard, gathered once, exactly."""
        opt = self.optimizer
        self.kept, self._source = {}, {}
        for sub, (group, master) in enumerate(zip(opt.fp16_groups, opt.fp32_partitioned_groups_flat)):
            m = self._host_shard(f"zero3.sub{sub}.momentum", self._basic.state[master]["exp_avg"])
            places = [self._place[p.ds_id] for p in group]
            self._keep(f"zero3.sub{sub}", names_of(group, self._names), places, KeptMomentum(places, None, m))
        self._gather_denominators()
        log.info("OneBitAdam at ZeRO stage 3: the variance froze after %d steps; the momentum is exchanged "
                 "compressed from now on", self.applied_steps)

    def _gather_denominators(self) -> None:
        """sqrt(v / (1 - beta2^freeze_step)) + eps on this rank's host shard,
        floored per parameter (infinite where v is zero); clipping moved off."""
        opt = self.optimizer
        own = []
        for sub, master in enumerate(opt.fp32_partitioned_groups_flat):
            group, v = self._group_of(sub), self._basic.state[master]["exp_avg_sq"]
            denominator = adam_denominator(v, group["betas"][1], self.freeze_step, group["eps"])
            own.append(denominator.masked_fill_(v == 0, 0.0))  # no variance: 0 here, infinite once gathered
        self._floor_(own)
        dtype = torch.bfloat16 if self._compact else torch.float32
        self.denominators = []
        for sub, denominator in enumerate(own):
            shard = self._host_shard(f"zero3.sub{sub}.denominator", denominator)
            self.denominators.append(shard.masked_fill_(shard == 0, float("inf")).to(dtype))
        self._own_u = [torch.zeros_like(master, dtype=torch.float32) for master in opt.fp32_partitioned_groups_flat]
        if getattr(opt, "clip_grad", 0.0) and not self._said_clipping:
            log.warning("OneBitAdam at ZeRO stage 3: after the freeze the gradients are not clipped (each bucket's "
                        "momentum is exchanged during backward, before the whole gradient's norm exists)")
            self._said_clipping = True
        opt.clip_grad = 0.0

    def _floor_(self, own: list[torch.Tensor]) -> None:
        """Each parameter's denominators floored at ``DENOMINATOR_FLOOR`` times
        their mean over its live coordinates on every rank, in place; zeros stay."""
        n = self.comm.size
        stretches = [own[sub][offset:offset + size] for sub, offset, size in self._place.values()]
        live = [(s > 0) for s in stretches]
        mine = torch.stack([torch.stack([(s * alive).sum(), alive.sum().float()]) for s, alive in zip(stretches, live)])
        every = self.exact.all_gather("zero3.freeze.floors", mine.reshape(-1), mine.numel() * n, error_feedback=False)
        sums = every.view(n, -1, 2).sum(0)
        floors = sums[:, 0] / sums[:, 1].clamp_min(1) * DENOMINATOR_FLOOR
        for stretch, alive, floor in zip(stretches, live, floors):
            stretch.copy_(torch.where(alive, stretch.clamp_min(floor), stretch))

    def _host_shard(self, name: str, own: torch.Tensor) -> torch.Tensor:
        """(hosts, partition): every rank's ``own`` gathered exactly, the rows of this rank's local index kept."""
        n = self.comm.size
        every = self.exact.all_gather(name, own.detach().float(), own.numel() * n, error_feedback=False)
        return every.view(self.hosts, self.per_host, -1)[:, self.local].clone()

    def _group_of(self, sub: int) -> dict:
        return self._basic.param_groups[self.optimizer.sub_group_to_group_id[sub]]

    def momentum(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(m, D) on this rank's host shard, (hosts, partition) each, per kept entry."""
        out = []
        for entry in self.kept.values():
            denominator = self._rows(self.denominators, entry.places).float()
            out.append((entry.momentum(self.reducer, denominator), denominator))
        return out

    def state_nbytes(self) -> int:
        """Bytes this rank keeps for the exchange: memories, m and D on its host shard."""
        kept = sum(entry.nbytes() for entry in self.kept.values())
        return self.reducer.state.nbytes() + kept + sum(d.numel() * d.element_size() for d in self.denominators)

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "kept": {name: entry.state_dict() for name, entry in self.kept.items()},
                "sources": dict(self._source), "applied_steps": self.applied_steps, "version": STATE_VERSION,
                "freeze": self.freeze.state_dict(), "position": (self.hosts, self.per_host)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "applied_steps" not in state:
            raise StateError("this checkpoint was not written by OneBitAdam at ZeRO stage 3")
        if tuple(state.get("position", ())) != (self.hosts, self.per_host):
            raise StateError(f"this OneBitAdam checkpoint keeps its momentum for {state.get('position')} (hosts, "
                             f"ranks per host); this run has ({self.hosts}, {self.per_host}) hosts")
        super().load_state_dict(state)
        self.applied_steps = int(state["applied_steps"])
        self.freeze.load_state_dict(state["freeze"])
        device = self.optimizer.fp32_partitioned_groups_flat[0].device
        self.kept = {name: KeptMomentum.from_state(entry, device) for name, entry in state["kept"].items()}
        self._source = {name: (source, int(at)) for name, (source, at) in state["sources"].items()}
        if self.frozen:
            self._gather_denominators()


class KeptMomentum:
    """m on a rank's host shard for one bucket's parameters (``places``, in
    the bucket's order): the payloads of the bucket's last server pass, from
    which u decodes bit for bit (m = u·D), or m itself (at the freeze, or
    where no pass crossed a host link)."""

    def __init__(self, places: list, served: ServedPayloads | None, dense: torch.Tensor | None = None):
        self.places, self.served, self.dense = [tuple(p) for p in places], served, dense

    def momentum(self, reducer: DoubleSqueeze, denominator: torch.Tensor) -> torch.Tensor:
        """(hosts, bucket partition) fp32: m, zero where ``denominator`` (the same places) is infinite."""
        if self.served is None:
            return self.dense.float()
        u = self.served.decode(reducer.server_compressor, reducer.seeds, denominator.numel(), denominator.device)
        return torch.where(torch.isinf(denominator), 0.0, u.view_as(denominator) * denominator)

    def nbytes(self) -> int:
        return self.served.nbytes() if self.served is not None else self.dense.numel() * self.dense.element_size()

    def state_dict(self) -> dict[str, Any]:
        served = None if self.served is None else {**vars(self.served),
                                                   "payloads": [p.cpu() for p in self.served.payloads]}
        return {"places": self.places, "served": served, "dense": None if self.dense is None else self.dense.cpu()}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> "KeptMomentum":
        served = state["served"]
        if served is not None:
            served = ServedPayloads(**{**served, "payloads": [p.to(device) for p in served["payloads"]]})
        dense = state["dense"]
        return cls(state["places"], served, None if dense is None else dense.to(device))


def refuse_settings(fp16: bool, accumulation: Any) -> None:
    """The ``ConfigError`` naming what OneBitAdam at stage 3 cannot serve: from
    the config before DeepSpeed builds anything (``onebit.refuse_at_zero``;
    an accumulation left to DeepSpeed, "auto", is checked once resolved) and
    from the engine, which every rank builds from the same config."""
    if fp16:
        raise ConfigError("optimizer.type OneBitAdam with fp16 at ZeRO stage 3: an overflow is found after "
                          "backward, when the momentum has been exchanged; use bf16 or fp32")
    if isinstance(accumulation, int) and accumulation != 1:
        raise ConfigError(f"optimizer.type OneBitAdam at ZeRO stage 3 with gradient_accumulation_steps="
                          f"{accumulation}: the momentum exchange needs each step's whole local gradient, which "
                          f"stage 3 does not keep; use 1 (a larger micro-batch)")
