"""CompressedAdam at ZeRO stages 1 and 2: the 1-bit Adam design with the
optimizer state partitioned, as ZeRO keeps it.

ZeRO gives rank k partition k of each parameter group: its fp32 master and
Adam's two moments there. The partition optimizer is a stock
``torch.optim.AdamW``. Then:

* **warm-up** (the first ``freeze_step`` applied steps): DeepSpeed's own
  ZeRO path, exactly: its gradient reduce-scatter, AdamW on each partition,
  its parameter all-gather.
* **the freeze**: each partition's variance stops moving, so its Adam
  denominator sqrt(v/(1 - beta2^T)) + eps is final: it is gathered once to
  every rank (fp32, or bf16 with a compact ``error_dtype``), floored per
  parameter as CompressedAdam floors it (``dsq_plugins.optim._kernel``: a
  coordinate whose gradients were rare in the warm-up must not divide by a
  near-eps denominator ever after), as are the momentum partitions. What
  is compressed is the momentum divided by it, u = m / denominator, as in
  CompressedAdam (its module docstring says why); in two levels the
  division comes after the exact stage inside the host
  (``reduce_scatter(divide_by=)``), so a rank needs the denominators of its
  host shard only. Gradient clipping moves from the averaged gradient to
  each rank's own, as in ``CompressedAdam``.
* **after it**, per step, at the accumulation boundary (flat; two levels
  below): each rank forms its
  local momentum m_i = beta1·m + (1 - beta1)·g_i over the whole vector; the
  worker pass (``reduce_scatter``, worker error) brings partition k's
  average to its owner; the server pass (``all_gather``, server error)
  squeezes it and brings every partition's result to every rank: the new m,
  the same everywhere. Every rank then applies the same update,
  -lr/(1 - beta1^t)·m/denominator with AdamW's weight decay, to its copy of
  the parameters, and each owner to its fp32 master: no parameter pass.

Two 1-bit passes per step after the freeze, against ZeRO's fp32
reduce-scatter and all-gather. (A compressed parameter pass, Q(master -
replica), was tried first: one scale per chunk of Adam's heavy-tailed
updates threw the parameters far off at every other step.) State changes
by whole steps: m and the error memories are written only when the step went
through on every rank; an fp16 overflow or a skipped step
(``on_nonfinite="skip"``) leaves them as they were. A coordinate whose
variance is zero (it never had a gradient) keeps its parameter: its
denominator is infinite, and its momentum is kept at zero on every rank.

Two levels (``hierarchy``, hosts of L ranks; "auto" picks it across hosts):
local rank i of every host holds host shard i, the partitions of local
index i on every host (its own partition among them), and keeps the
momentum and the denominators only there. Its local momentum adds
L·beta1·m on that shard to (1 - beta1)·g_i over the whole vector, so the
host's exact reduce-scatter (the fast link) forms beta1·m + (1 - beta1)·mean(g)
on every shard; DoubleSqueeze then runs among the hosts on each shard
(``all_gather`` with ``keep_payloads``: the server pass without the in-host
stage);
each local rank steps its shard of the parameters, and the host's ranks
gather the shards exactly. A host sends the two 1-bit passes of one copy of
the model across its link per step.

Memory per rank after the freeze: the worker error over the host shard, m
and the denominators (4 or 2 bytes per parameter) over the host shard,
and the server error over a partition (``error_dtype`` each): the whole
vector and 1/L of it in two levels (``python -m bench.memory --node-size``).
A checkpoint holds all but the denominators, which a load gathers again
from the restored variance.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from dsq_plugins import DoubleSqueeze, TorchDistributedComm
from dsq_plugins.algorithm import ServedPayloads
from dsq_plugins.config import ReducerConfig
from dsq_plugins.errors import StateError
from dsq_plugins.optim import (FreezePolicy, FreezesVariance, adam_denominator, clip_to_norm, denominator_floor,
                               denominator_sums, preconditioned_step_, without_variance_)

from .zero import ZeroCompression

log = logging.getLogger("dsq_plugins")
#: 2: the error memories and the kept momentum payloads hold m / denominator (1: m)
STATE_VERSION = 2


class ZeroCompressedAdam(FreezesVariance, ZeroCompression):
    """CompressedAdam's momentum exchange wired into an initialized ZeRO 1/2
    engine whose client optimizer is a ``torch.optim.AdamW``. ``cfg``: the
    momentum exchange's options (``CompressedAdam.momentum_config``)."""

    def __init__(self, engine: Any, cfg: ReducerConfig, comm: TorchDistributedComm, *, freeze: FreezePolicy,
                 max_grad_norm: float):
        self.freeze = freeze
        self.max_grad_norm = float(max_grad_norm)
        #: optimizer steps applied on every rank (the warm-up counts them)
        self.applied_steps = 0
        #: the whole momentum per group, the same on every rank: the last server pass's payloads (of m divided
        #: by the denominator; about 1 bit per element for sign), or m in fp32 from the freeze to the first
        #: compressed step
        self.momentum: dict[int, ServedPayloads | torch.Tensor] = {}
        self._compact = cfg.error_dtype != "fp32"
        self._staged_momentum: list[torch.Tensor] = []
        self._staged_payloads: list[ServedPayloads] = []
        self.denominators: list[torch.Tensor] = []  # after the freeze, per group, whole
        if engine.fp16_enabled() and cfg.on_nonfinite == "raise":
            # after the freeze DeepSpeed's overflow check does not run: an overflow must skip the step, on every
            # rank, and back the loss scale off, as DeepSpeed's own step does
            log.info("CompressedAdam under ZeRO with fp16: an overflow after the freeze skips the step "
                     "(on_nonfinite='skip')")
            cfg = cfg.replace(on_nonfinite="skip")
        super().__init__(engine, cfg, comm)
        #: this rank in the exchange's host layout: ``hosts`` x ``per_host`` ranks (flat: every rank a host)
        self.hosts, self.per_host, self.host, self.local = self.reducer.hosts.position(comm.rank)
        self.compress_params = False  # no parameter pass: every rank applies the same update
        self.exact = DoubleSqueeze.exact(comm)
        self._basic = self.optimizer.optimizer
        if not isinstance(self._basic, torch.optim.AdamW):
            raise TypeError(f"the partition optimizer must be torch.optim.AdamW, got {type(self._basic).__name__}")

    def freeze_clock(self) -> int:
        return self.applied_steps

    def active(self) -> bool:
        return self.frozen

    # -- the freeze -----------------------------------------------------------------
    def _freeze(self) -> None:
        """Gather each group's momentum partitions once (exactly), and the denominators."""
        opt = self.optimizer
        for i, master in enumerate(opt.single_partition_of_fp32_groups):
            numel = opt.bit16_groups_flat[i].numel()
            m = self.exact.all_gather(f"zero.group{i}.freeze", self._basic.state[master]["exp_avg"], numel,
                                      error_feedback=False)
            self.momentum[i] = self.host_shard(m).reshape(-1).cpu()
        self._gather_denominators()
        log.info("CompressedAdam under ZeRO: the variance froze after %d steps; the momentum is exchanged "
                 "compressed from now on", self.applied_steps)

    def _denominator_sums(self) -> torch.Tensor:
        """Per group, the sum over every partition of sqrt(v / (1 - beta2^t)):
        each rank's sums gathered exactly and added, so every rank decides alike."""
        opt, n = self.optimizer, self.comm.size
        mine = denominator_sums([(self._basic.state[master]["exp_avg_sq"], self._basic.param_groups[i]["betas"][1])
                                 for i, master in enumerate(opt.single_partition_of_fp32_groups)], self.applied_steps)
        everyone = self.exact.all_gather("zero.freeze.sums", mine, mine.numel() * n, error_feedback=False)
        return everyone.view(n, -1).sum(0)

    def _gather_denominators(self) -> None:
        """sqrt(v / (1 - beta2^freeze_step)) + eps over the whole vector on
        every rank (infinite where v is zero), and clipping moved off ZeRO."""
        opt, dtype = self.optimizer, torch.bfloat16 if self._compact else torch.float32
        self.denominators = []
        for i, master in enumerate(opt.single_partition_of_fp32_groups):
            group, v = self._basic.param_groups[i], self._basic.state[master]["exp_avg_sq"]
            denominator = adam_denominator(v, group["betas"][1], self.freeze_step, group["eps"])
            denominator.masked_fill_(v == 0, 0.0)  # no variance: sent as 0 (a real one is at least eps)
            full = self.exact.all_gather(f"zero.group{i}.denominator", denominator, opt.bit16_groups_flat[i].numel(),
                                         error_feedback=False)
            self._floor_(full, [p.numel() for p in opt.bit16_groups[i]])
            shard = self.host_shard(full).reshape(-1)
            self.denominators.append(shard.masked_fill_(shard == 0, float("inf")).to(dtype))
        opt.clip_grad = 0.0  # each rank clips its own gradient (partition_averages)

    @staticmethod
    def _floor_(full: torch.Tensor, sizes: list[int]) -> None:
        """Each parameter's stretch of a whole group's denominators floored as
        CompressedAdam floors a tensor's (``optim._kernel``), in place; zeros
        (no variance) stay zero. Every rank holds the whole vector, so every
        rank floors alike."""
        for stretch in full[:sum(sizes)].split(sizes):
            live = stretch > 0
            floor = denominator_floor(stretch, stretch)
            stretch.copy_(torch.where(live, stretch.clamp_min(floor), stretch))

    # -- after the freeze: the momentum exchange and the step ----------------------
    def partition_averages(self) -> list[torch.Tensor]:
        """The new momentum m (staged, whole), exchanged compressed; returns
        this rank's partitions of it."""
        opt = self.optimizer
        scale = float(getattr(opt, "loss_scale", 1.0) or 1.0)
        grads = [self._local_gradient(i).div_(scale) for i in range(len(opt.bit16_groups))]
        grads = clip_to_norm(grads, self.max_grad_norm, in_place=True)
        self._staged_momentum, self._staged_payloads, out = [], [], []
        for i, g in enumerate(grads):
            beta1 = self._basic.param_groups[i]["betas"][0]
            m = self.momentum_of(i, g.device)  # this rank's host shard of it
            # beta1·m + (1 - beta1)·g_i; in two levels only local rank i holds m on host shard i, so it adds
            # per_host·beta1·m there and the host's exact mean (stage 1) is beta1·m + (1 - beta1)·mean(g)
            local = g.mul_(1 - beta1)
            self.host_shard(local).add_(m.view(self.hosts, -1), alpha=self.per_host * beta1)
            # what is compressed is m / denominator, as CompressedAdam compresses it (its module docstring)
            average = self.reducer.reduce_scatter(f"zero.group{i}.momentum", local,
                                                  divide_by=self.denominators[i].float())
            u, served = self.reducer.all_gather(f"zero.group{i}.momentum.served", average, g.numel(),
                                                 keep_payloads=True)
            self._staged_momentum.append(self._masked(i, u))
            self._staged_payloads.append(served)
            out.append(self._staged_momentum[-1].view(self.hosts, -1)[self.host])
        return out

    def optimizer_step(self, original_step, *args, **kwargs):
        """Warm-up: DeepSpeed's own step. After the freeze: the same update on
        every rank from the exchanged momentum; DeepSpeed's step is not run."""
        opt = self.optimizer
        if not self.frozen:
            result = original_step(*args, **kwargs)  # DeepSpeed's own ZeRO step: exact AdamW
            if not opt.overflow:
                self.applied_steps += 1
                if self.freeze.observe(self.applied_steps, self._denominator_sums):
                    self._freeze()
            return result
        if self._step is None:
            raise RuntimeError("CompressedAdam under ZeRO: optimizer step without a momentum exchange at the "
                               "accumulation boundary")
        try:
            if self._step.skipped:
                self._skip_step()
            else:
                self._frozen_update()
                opt.overflow = False
                opt._update_scale(False)  # a dynamic loss scale grows back as after DeepSpeed's own steps
        except BaseException as exc:
            self._close_step(exc)
            raise
        finally:
            for k in list(opt.averaged_gradients.keys()):
                opt.averaged_gradients[k] = None
        if self._close_step().applied:
            self.after_applied_step()
        return None

    @torch.no_grad()
    def _frozen_update(self) -> None:
        """-lr/(1 - beta1^t)·m/denominator and AdamW's decay: on every rank's
        parameters, and on this rank's fp32 master partitions; the partition
        optimizer's state records m and the step, as AdamW would."""
        opt, t = self.optimizer, self.applied_steps + 1
        opt._global_grad_norm = None
        for i, group in enumerate(self._basic.param_groups):
            u, denominator = self._staged_momentum[i], self.denominators[i].float()
            hyper = dict(lr=group["lr"], beta1=group["betas"][0], weight_decay=group["weight_decay"], t=t)
            flat = opt.bit16_groups_flat[i]
            shard = self.host_shard(flat).to(torch.float32, copy=True).reshape(-1)
            preconditioned_step_(shard, u, **hyper)
            if self.per_host == 1:
                self.host_shard(flat).copy_(shard.view(self.hosts, -1))
            else:  # each local rank stepped its host shard: the host's ranks gather them, exactly
                whole = self.reducer.two_level.gather_inside_host(f"zero.group{i}.params", shard)
                by_local = whole.view(self.per_host, self.hosts, -1)
                flat.view(self.hosts, self.per_host, -1).copy_(by_local.transpose(0, 1))
            master, mine = opt.single_partition_of_fp32_groups[i], u.view(self.hosts, -1)[self.host]
            preconditioned_step_(master.data, mine, **hyper)
            state = self._basic.state[master]
            state["exp_avg"].copy_(self._momentum(mine, denominator.view(self.hosts, -1)[self.host]))
            state["step"] += 1

    def after_applied_step(self) -> None:
        for i, (served, m) in enumerate(zip(self._staged_payloads, self._staged_momentum)):
            # (no payloads: hierarchy "node" on one host, where the momentum is the host's exact mean)
            if served is None:
                self.momentum[i] = self._momentum(m, self.denominators[i].to(m.device, torch.float32)).cpu()
            else:
                self.momentum[i] = ServedPayloads(served.name, served.step, [p.cpu() for p in served.payloads])
        self._staged_momentum, self._staged_payloads = [], []
        self.applied_steps += 1

    def host_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's host shard of a whole group vector, a ``(hosts, partition)`` view: the
        partitions of its local index on every host (flat: every partition)."""
        return flat.view(self.hosts, self.per_host, -1)[:, self.local]

    def momentum_of(self, i: int, device: torch.device) -> torch.Tensor:
        """Group i's momentum m on this rank's host shard, as every rank holding that shard last
        applied it (a fresh tensor): the whole m when flat, 1/per_host of it in two levels."""
        kept, numel = self.momentum[i], self.denominators[i].numel()
        if isinstance(kept, torch.Tensor):
            return kept.to(device, copy=True)
        u = self._masked(i, kept.decode(self.reducer.server_compressor, self.reducer.seeds, numel, device))
        return self._momentum(u, self.denominators[i].to(device, torch.float32))

    @staticmethod
    def _momentum(u: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        """m = u·denominator, zero where the denominator is infinite (no variance)."""
        return torch.where(torch.isinf(denominator), 0.0, u * denominator)

    def _masked(self, i: int, m: torch.Tensor) -> torch.Tensor:
        """No variance (never a gradient in the warm-up, or padding): the momentum stays zero there, as
        CompressedAdam keeps it, so that it never inflates the next step's scales."""
        return without_variance_(m, torch.isinf(self.denominators[i]))

    def momentum_nbytes(self) -> int:
        return sum(kept.nbytes() if isinstance(kept, ServedPayloads) else kept.numel() * 4
                   for kept in self.momentum.values())

    # -- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        momentum = {i: vars(kept) if isinstance(kept, ServedPayloads) else kept for i, kept in self.momentum.items()}
        return {**super().state_dict(), "momentum": momentum, "applied_steps": self.applied_steps,
                "freeze": self.freeze.state_dict(), "version": STATE_VERSION}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version", 1) != STATE_VERSION and state["freeze"].get("frozen_at") is not None \
                and int(state["applied_steps"]) > state["freeze"]["frozen_at"]:
            raise StateError(f"this CompressedAdam-under-ZeRO checkpoint (version {state.get('version', 1)}) was "
                             f"saved after the freeze, when the error memories held the momentum; this version "
                             f"({STATE_VERSION}) keeps the preconditioned momentum in them: resume with the version "
                             f"that saved it")
        super().load_state_dict(state)
        self.applied_steps = int(state["applied_steps"])
        self.freeze.load_state_dict(state["freeze"])
        self.momentum = {int(i): ServedPayloads(**kept) if isinstance(kept, dict) else kept
                         for i, kept in state["momentum"].items()}
        if self.frozen:
            self._gather_denominators()

