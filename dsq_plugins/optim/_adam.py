"""``CompressedAdam``: Adam(W) whose *momentum*, not its gradient, is
compressed, after a warm-up with exact averaging (the 1-bit Adam design,
Tang et al. 2021, with any DoubleSqueeze compressor).

Why not compress gradients in front of Adam: Adam divides each coordinate by
its own running RMS, so it sees compressed magnitudes, and the residual error
feedback re-injects is rescaled by that division; the LM study in
``bench.lm`` measures how much that costs. Adam's variance, though, settles
early in training. So:

* warm-up (steps 1 .. ``freeze_step``): gradients are averaged exactly (fp32,
  a reduce-scatter and an all-gather: the bytes of a ring allreduce) and this
  is AdamW, step for step;
* then the variance is frozen (with its bias correction at the freeze), and
  each worker forms its momentum from its *local* gradient,
  m_i = beta1·m + (1 - beta1)·g_i. What is averaged with DoubleSqueeze (error
  feedback on both passes) is the preconditioned momentum u_i = m_i / D, D
  the frozen denominator (floored, ``optim._kernel``); every rank steps by
  the average u and keeps m = u·D. D is the same on every rank, so the exact
  average is unchanged; what changes is where the compression error lands.
  In u a coordinate's scale is the size of its own Adam step, so sign's one
  magnitude per chunk is a step every coordinate can take; in m it would be
  divided by each coordinate's own D, and one near eps made it a huge step.
  The update is linear in u, so compressing u with error feedback is what
  compressing SGD-with-momentum's gradients does.

Weight decay is decoupled (AdamW). State (moments, step) is the same on every
rank; the error memories are each rank's own and ride in ``state_dict()``.
A step changes nothing unless it succeeded on every rank: a non-finite
gradient anywhere is a ``NonFiniteGradientError`` on every rank (or, with
``on_nonfinite="skip"``, a step skipped everywhere) with the moments, error
memories and step as they were.
"""
from __future__ import annotations

import operator
import warnings
from typing import Any, Iterable

import torch

from ..comm import Communicator
from ..config import ReducerConfig
from ..errors import AdamCompressionWarning, ConfigError, StateError
from ..reducer import DoubleSqueeze
from ..state import is_own_state
from ._freeze import (FREEZE_STEP, FREEZE_THRESHOLD, FREEZE_WINDOW, MAX_FREEZE_STEP, FreezePolicy, FreezesVariance,
                      check_freeze_options, denominator_sums)
from ._flat import FlatMoments
from ._frozen import FrozenDenominators
from ._kernel import (adam_denominator, adam_step_, clip_coefficient, clip_to_norm, denominator_floor,
                      preconditioned_momentum_, preconditioned_step_, without_variance_)

#: 2: the error memories hold the preconditioned momentum m / D (1: the momentum m)
STATE_VERSION = 2


class CompressedAdam(FreezesVariance, torch.optim.Optimizer):
    """Adam(W) with DoubleSqueeze-compressed momentum after ``freeze_step``
    exact steps; see the module docstring.

    Args:
        params: ``model.named_parameters()`` pairs (names key the error
            memory), plain tensors, or param groups (dicts whose ``params``
            hold either). One whose ``requires_grad`` is off (a frozen
            layer) is left as it is, as ``torch.optim.AdamW`` leaves it;
            which parameters train is read at every step.
        comm: the ``Communicator`` of the data-parallel group (``LocalGroup``
            rank, ``TorchDistributedComm``, ``horovod_ext.HorovodComm``).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (per group).
        freeze_step: exact steps before the variance is frozen (>= 1), or
            ``"auto"``: when the variance has settled (``dsq_plugins.optim.FreezePolicy``:
            checked every ``freeze_window`` steps against
            ``freeze_threshold``, at ``max_freeze_step`` at the latest).
        compressor, options: the momentum exchange's operator, and any other
            reducer option by name (``ReducerConfig``'s ``compressor_params``,
            ``server_compressor``, ``bucket_mb``, ``layerwise``, ``seed``,
            ``on_nonfinite`` ...); ``"sign"`` without parameters means sign
            with the RMS scale, and ``layerwise`` gives each tensor its own scale.
        max_grad_norm: clip gradients to this global L2 norm (0: no clipping),
            as ``torch.nn.utils.clip_grad_norm_``: during warm-up the exact
            average, after the freeze each rank's own gradient (there is no
            averaged gradient any more; DeepSpeed's 1-bit Adam did the same).
        error_feedback: the momentum exchange's (DoubleSqueeze's): ``"both"``
            compresses each worker's momentum with error feedback on both
            passes (1-bit Adam); ``"ef21"`` compresses the change of each
            worker's momentum against a state its owners replicate, which a
            slowly moving momentum suits.
    """

    def __init__(self, params: Iterable[Any], *, comm: Communicator, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 freeze_step: int | str = FREEZE_STEP, compressor: Any = "sign", max_grad_norm: float = 0.0,
                 max_freeze_step: int = MAX_FREEZE_STEP, freeze_window: int = FREEZE_WINDOW,
                 freeze_threshold: float = FREEZE_THRESHOLD,
                 **options: Any):
        momentum = self.momentum_config(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        freeze_step=freeze_step, compressor=compressor,
                                        max_freeze_step=max_freeze_step, freeze_window=freeze_window,
                                        freeze_threshold=freeze_threshold, **options)
        groups, self._names = _named_groups(params)
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        if not isinstance(max_grad_norm, (int, float)) or isinstance(max_grad_norm, bool) or max_grad_norm < 0:
            raise ConfigError(f"max_grad_norm must be a non-negative number, got {max_grad_norm!r}")
        self.comm = comm
        #: what loading another rank's state does with the error memories (``state.OTHER_RANK_POLICIES``)
        self.other_rank_state = "keep"
        self.freeze = FreezePolicy(freeze_step, max_step=max_freeze_step, window=freeze_window,
                                   threshold=freeze_threshold)
        self.max_grad_norm = float(max_grad_norm)
        #: exact averaging of the gradients during warm-up
        self.exact = DoubleSqueeze.exact(comm, hierarchy="auto", bucket_mb=momentum.bucket_mb, seed=momentum.seed,
                                         on_nonfinite=momentum.on_nonfinite)
        #: DoubleSqueeze averaging of the momentum after the freeze
        self.compressed = DoubleSqueeze(comm, config=momentum)
        self.global_step = 0
        self.skipped_steps = 0
        #: the frozen denominators, made at the first step after the freeze (``_frozen_state``)
        self._frozen: FrozenDenominators | None = None
        self._frozen_for: tuple[int, ...] = ()  # the ids of the parameters they were made for
        #: the moments as two flat vectors, where the parameters allow (``_moments_of``)
        self._moments: FlatMoments | None = None
        #: the parameters that trained at the last step and what a step derives from them (``_training_now``)
        self._training: _Training | None = None

    @staticmethod
    def momentum_config(*, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                        weight_decay: float = 0.0, freeze_step: int | str = FREEZE_STEP, compressor: Any = "sign",
                        compressor_params: dict[str, Any] | None = None,
                        max_freeze_step: int = MAX_FREEZE_STEP, freeze_window: int = FREEZE_WINDOW,
                        freeze_threshold: float = FREEZE_THRESHOLD, **options: Any) -> ReducerConfig:
        """Check CompressedAdam's options (``ConfigError`` naming the bad one)
        without a communicator, and return the momentum exchange's config."""
        _check_hyper(lr, betas, eps, weight_decay)
        check_freeze_options(freeze_step, max_freeze_step, freeze_window, freeze_threshold)
        # the RMS scale is what 1-bit Adam used; the mean scale trains worse here (bench.lm)
        if compressor == "sign" and compressor_params is None:
            compressor_params = {"scale": "rms"}
        elif compressor == "randomsign" and "scale" not in (compressor_params or {}):
            compressor_params = {**(compressor_params or {}), "scale": "rms"}
        options.setdefault("error_feedback", "both")
        return ReducerConfig.build(None, dict(compressor=compressor, compressor_params=compressor_params), options)

    # -- the step -------------------------------------------------------------
    def freeze_clock(self) -> int:
        return self.global_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        training = self._training_now()
        entries, groups = training.entries, training.groups
        moments = self._moments_of(training)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in training.params]
        t = self.global_step + 1
        if not self.frozen:
            with self.exact.step(self.exact.plan_of(training.shapes)) as exchange:
                averaged = self.exact.reduce_many(zip(training.names, grads))
            if exchange.skipped:
                self.skipped_steps += 1
                return loss
            averaged = self._clipped(averaged)
            for group, at in groups:
                self._warmup_update(group, [p for _, p, _ in entries[at]],
                                    [g.to(p.dtype) for (_, p, _), g in zip(entries[at], averaged[at])], t)
            self.freeze.observe(t, lambda: self._variance_summary(entries, t))
        else:
            frozen_step = self._frozen_step if moments is None else self._flat_frozen_step
            if not frozen_step(training, grads, t):
                self.skipped_steps += 1
                return loss
        self.global_step = t
        return loss

    def _training_now(self) -> "_Training":
        """The parameters that train now, in the groups' order, and what a step derives from them: made
        again only when they change. One whose ``requires_grad`` is off (a frozen layer) is left as it is,
        as torch's optimizers leave a parameter without a gradient: given zero gradients it would still
        decay and follow its momentum. A parameter that trains but got no gradient on this rank is
        exchanged as zeros: the other ranks may have one."""
        params = [p for group in self.param_groups for p in group["params"]]
        flags = [self._trains(p) for p in params]
        known = self._training
        if known is None or not known.made_of(self.param_groups, params, flags):
            known = self._training = _Training(self.param_groups, params, flags, self._names)
        return known

    def _trains(self, p: torch.Tensor) -> bool:
        """Whether the model's parameter that ``p`` stands for trains now (its ``requires_grad``)."""
        return p.requires_grad

    def _moments_of(self, training: "_Training") -> FlatMoments | None:
        """The moments, made at the first step: two flat vectors when the
        parameters can share them (``FlatMoments``), else a tensor each (None)."""
        params = training.params
        sparse = next((i for i, p in enumerate(params) if p.grad is not None and p.grad.is_sparse), None)
        if sparse is not None:
            raise ConfigError(f"CompressedAdam does not support sparse gradients ({training.names[sparse]!r}); "
                              f"use dense ones")
        if training.flat:
            if self._moments is None or not self._moments.holds(params, self.state):
                before, self._moments = self._moments, FlatMoments(params, self.state)
                if before is not None:  # a layer frozen: its moments leave the old vectors, which can then go
                    before.release(self.state)
            return self._moments
        for p in params:
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return None

    def _frozen_step(self, training: "_Training", grads: list[torch.Tensor], t: int) -> bool:
        """The step after the freeze, tensor by tensor; False if skipped."""
        entries, groups = training.entries, training.groups
        frozen = self._frozen_state(training)
        clipped = self._clipped(grads)
        local = []
        for group, at in groups:  # u = m / D, m = beta1·m + (1 - beta1)·g, per group
            beta1 = group["betas"][0]
            m = torch._foreach_mul([self.state[p]["exp_avg"] for _, p, _ in entries[at]], beta1)
            torch._foreach_add_(m, clipped[at], alpha=1 - beta1)
            local += self._preconditioned(m, frozen, at)
        named = [(name, u) for (_, _, name), u in zip(entries, local)]
        with self.compressed.step(self.compressed.plan_of(training.shapes)) as exchange:
            averaged = self.compressed.reduce_many(named)
        if exchange.skipped:
            return False
        for group, at in groups:
            u = [u.to(p.dtype) for (_, p, _), u in zip(entries[at], averaged[at])]
            self._frozen_update(group, entries[at], u, frozen, at, t)
        return True

    def _flat_frozen_step(self, training: "_Training", grads: list[torch.Tensor], t: int) -> bool:
        """``_frozen_step`` over the flat moments: the same arithmetic, one
        op per group where that is one per parameter, and the exchange reads
        u as one vector. Parameters stay the model's own tensors: their
        update is the one multi-tensor op per group left. False if skipped."""
        moments, frozen, groups = self._moments, self._frozen_state(training), training.groups
        denominator, zero_variance = frozen.flat()
        g = moments.gathered(grads)
        coef = clip_coefficient(grads, self.max_grad_norm)
        if coef is not None:
            g.mul_(coef)
        u = moments.scratch("local", moments.exp_avg.dtype)
        for group, at in groups:
            part = moments.span(at)
            preconditioned_momentum_(u[part], moments.exp_avg[part], g[part], denominator[part], group["betas"][0])
        if zero_variance is not None:
            zero_variance.apply_(u)
        with self.compressed.step(self.compressed.plan_of(training.shapes)) as exchange:
            averaged = self.compressed.reduce_flat(training.shapes, u, out=moments.scratch("average", torch.float32))
        if exchange.skipped:
            return False
        u = averaged.to(moments.exp_avg.dtype)
        if zero_variance is not None:
            zero_variance.apply_(u)
        torch.mul(u, denominator, out=moments.exp_avg)
        steps = moments.views(u)
        for (group, at), params in zip(groups, training.group_params):
            preconditioned_step_(params, steps[at], lr=group["lr"], beta1=group["betas"][0],
                                 weight_decay=group["weight_decay"], t=t)
        return True

    def _frozen_state(self, training: "_Training") -> "FrozenDenominators":
        """The frozen denominators, floored, and where the variance is zero:
        made at the first step after the freeze (or a load), then kept (the variance no longer moves)."""
        entries, params = training.entries, training.ids
        if self._frozen is None or self._frozen_for != params:
            if self._frozen is not None:
                self._warn_if_untrained(entries)
            self._frozen = FrozenDenominators([self._frozen_denominator(group, p) for group, p, _ in entries],
                                              [self.state[p]["exp_avg_sq"] for _, p, _ in entries])
            self._frozen_for = params
        return self._frozen

    def _warn_if_untrained(self, entries: list[tuple[dict, torch.Tensor, str]]) -> None:
        """Warn about the parameters that began to train after the freeze with no variance at all: their
        frozen variance is zero, so their momentum is kept at zero and they only decay."""
        before = set(self._frozen_for)
        still = [name for _, p, name in entries
                 if id(p) not in before and not bool(self.state[p]["exp_avg_sq"].any())]
        if still:
            names = ", ".join(still[:3]) + (f" and {len(still) - 3} more" if len(still) > 3 else "")
            warnings.warn(f"CompressedAdam: {names} began to train after the variance froze (step "
                          f"{self.freeze_step}) with no variance to step by: their momentum stays zero and only "
                          f"weight decay moves them. Unfreeze layers before the freeze step (or raise freeze_step).",
                          AdamCompressionWarning, stacklevel=4)

    def _preconditioned(self, m: list[torch.Tensor], frozen: "FrozenDenominators", at: slice
                        ) -> list[torch.Tensor]:
        """u = m / D in place, zero where the frozen variance is (``preconditioned_`` over a group)."""
        torch._foreach_div_(m, frozen.denominators[at])
        frozen.mask_(m, at)
        return m

    def _frozen_update(self, group: dict, entries: list[tuple[dict, torch.Tensor, str]], u: list[torch.Tensor],
                       frozen: "FrozenDenominators", at: slice, t: int) -> None:
        """``frozen_update_`` over a group: mask u, keep m = u·D, step by u."""
        frozen.mask_(u, at)
        params = [p for _, p, _ in entries]
        torch._foreach_copy_([self.state[p]["exp_avg"] for p in params], torch._foreach_mul(u, frozen.denominators[at]))
        preconditioned_step_(params, u, lr=group["lr"], beta1=group["betas"][0], weight_decay=group["weight_decay"],
                             t=t)

    def _variance_summary(self, entries: list[tuple[dict, torch.Tensor, str]], t: int) -> torch.Tensor:
        """What ``freeze_step="auto"`` watches: per parameter, the sum of its
        bias-corrected denominators (the same on every rank: the variance is)."""
        if not entries:  # every parameter frozen
            return torch.zeros(0, dtype=torch.float64)
        return denominator_sums([(self.state[p]["exp_avg_sq"], group["betas"][1]) for group, p, _ in entries], t)

    def _clipped(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return clip_to_norm(grads, self.max_grad_norm)

    def _warmup_update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], t: int) -> None:
        """AdamW's step on the exact average over a group, in torch.optim.AdamW's
        order of operations (``optim._kernel``'s, as multi-tensor ops)."""
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        adam_step_(params, exp_avgs, adam_denominator(exp_avg_sqs, beta2, t, eps), lr=lr, beta1=beta1,
                   weight_decay=group["weight_decay"], t=t)

    def _frozen_denominator(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        """``p``'s denominator frozen at ``freeze_step``, floored (``optim._kernel``)."""
        v, beta2 = self.state[p]["exp_avg_sq"], group["betas"][1]
        denominator = adam_denominator(v, beta2, self.freeze_step, group["eps"])
        return denominator.clamp_min_(denominator_floor(denominator, v))

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (moments, replicated on every rank) plus
        ``"compressed"``: this rank's error memories and the global step."""
        for group in self.param_groups:  # torch's per-parameter step, written here rather than at every step
            for p in group["params"]:
                if self.state[p]:
                    self.state[p]["step"] = float(self.global_step)
        sd = super().state_dict()
        sd["compressed"] = {
            "version": STATE_VERSION, "rank": self.comm.rank, "size": self.comm.size,
            "names": [self._names[p] for group in self.param_groups for p in group["params"]],
            "global_step": self.global_step, "freeze_step": self.freeze_step, "skipped_steps": self.skipped_steps,
            "freeze": self.freeze.state_dict(),
            "exact": self.exact.state_dict(), "momentum": self.compressed.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``. Another world size or other parameters
        are a ``StateError``; another rank's entry (a checkpoint written by
        rank 0 only, as DeepSpeed does) restores the replicated moments and
        step and keeps this rank's own error memories, as ``other_rank_state``
        says (``dsq_plugins.state``: "keep", with a warning, unless an engine
        that restores them from its own per-rank files said "reshard")."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("compressed", None)
        if extra is None:
            raise StateError("this state_dict has no 'compressed' entry: it was not saved by CompressedAdam")
        names = [self._names[p] for group in self.param_groups for p in group["params"]]
        if extra.get("names") != names:
            raise StateError(f"CompressedAdam state_dict was saved for other parameters "
                             f"({_describe(extra.get('names'))}); this optimizer has {_describe(names)}")
        if extra.get("size") != self.comm.size:
            raise StateError(f"CompressedAdam state_dict was saved with {extra.get('size')} workers; this run has "
                             f"{self.comm.size} (the error memories are per rank and per chunk)")
        frozen_at = extra.get("freeze_step")
        if extra.get("version", 1) != STATE_VERSION and frozen_at is not None and extra["global_step"] > frozen_at:
            raise StateError(f"CompressedAdam state_dict version {extra.get('version', 1)} was saved after the "
                             f"freeze, when the error memories held the momentum; this version ({STATE_VERSION}) "
                             f"keeps the preconditioned momentum in them: resume with the version that saved it")
        super().load_state_dict(state_dict)
        self._frozen = self._moments = self._training = None
        self._frozen_for = ()
        self.global_step = int(extra["global_step"])
        self.freeze.load_state_dict(extra.get("freeze", {}))
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        if not is_own_state(extra, rank=self.comm.rank, size=self.comm.size, policy=self.other_rank_state,
                            owner="CompressedAdam"):
            return
        self.exact.load_state_dict(extra["exact"])
        self.compressed.load_state_dict(extra["momentum"])

    def compressed_state_dict(self) -> dict[str, Any]:
        """Only this rank's part (error memories): what a checkpoint written
        by one rank cannot hold."""
        return {"rank": self.comm.rank, "size": self.comm.size, "exact": self.exact.state_dict(),
                "momentum": self.compressed.state_dict()}

    def load_compressed_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rank") != self.comm.rank or state.get("size") != self.comm.size:
            raise StateError(f"error memories saved by rank {state.get('rank')} of {state.get('size')}; this is "
                             f"rank {self.comm.rank} of {self.comm.size}")
        self.exact.load_state_dict(state["exact"])
        self.compressed.load_state_dict(state["momentum"])


class _Training:
    """The parameters that train (``flags``: which of the groups' ``params``),
    as (group, parameter, name) entries in the groups' order, and what a step
    derives from them: names, shapes (the key the reducers' layouts and plans
    are found by), each group's slice of them. A step checks only that the
    same parameters train (``made_of``), where deriving all this again walked
    the parameter list several times in Python at every step."""

    def __init__(self, groups: list[dict], params: list[torch.Tensor], flags: list[bool],
                 names: dict[torch.Tensor, str]):
        self._groups, self._all, self._flags = list(groups), params, flags
        every = [(group, p) for group in groups for p in group["params"]]  # in the order of ``flags``
        self.entries = [(group, p, names[p]) for (group, p), trains in zip(every, flags) if trains]
        self.params = [p for _, p, _ in self.entries]
        self.names = [name for _, _, name in self.entries]
        self.shapes = tuple((name, tuple(p.shape)) for _, p, name in self.entries)
        self.ids = tuple(id(p) for p in self.params)
        #: each param group that holds entries, with the slice of them it holds
        self.groups = _group_slices(self.entries)
        self.group_params = [self.params[at] for _, at in self.groups]
        #: whether the moments can be two flat vectors (``FlatMoments.serves``)
        self.flat = FlatMoments.serves(self.params)

    def made_of(self, groups: list[dict], params: list[torch.Tensor], flags: list[bool]) -> bool:
        """Whether these are the param groups (the same dicts: torch's ``load_state_dict`` makes new ones,
        with the saved hyperparameters) and parameters, with these training, that this was made for."""
        return (flags == self._flags and len(groups) == len(self._groups) and len(params) == len(self._all)
                and all(map(operator.is_, groups, self._groups)) and all(map(operator.is_, params, self._all)))


def _group_slices(entries: list[tuple[dict, torch.Tensor, str]]) -> list[tuple[dict, slice]]:
    """Each param group that holds entries, with the slice of
    ``entries`` it holds (entries list the groups in order)."""
    slices: list[tuple[dict, slice]] = []
    for i, (group, _, _) in enumerate(entries):
        if slices and slices[-1][0] is group:
            slices[-1] = (group, slice(slices[-1][1].start, i + 1))
        else:
            slices.append((group, slice(i, i + 1)))
    return slices


# optimizers that divide each coordinate by its own running RMS (matched in the lower-cased class or type name)
ADAM_FAMILY = ("adam", "lamb", "adagrad", "adadelta", "rmsprop", "lion", "adafactor")
_EXACT_CASTS = ("none", "fp16", "bf16")
_warned: set[tuple[str, str]] = set()  # (optimizer, where) pairs already warned about


def preconditioned_(m: torch.Tensor, denominator: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``m / denominator`` (in place), zero where the frozen variance ``v`` is:
    what ``CompressedAdam`` exchanges after the freeze."""
    return without_variance_(m.div_(denominator), v == 0)


def frozen_update_(p: torch.Tensor, u: torch.Tensor, denominator: torch.Tensor, state: dict[str, Any],
                   group: dict[str, Any], t: int) -> None:
    """Adam's step after the freeze on one parameter whose moments are in
    ``state``: the averaged preconditioned momentum ``u`` (masked where the
    frozen variance is zero, in place) against ``denominator`` (the frozen
    one, floored); ``state["exp_avg"]`` keeps m = u·denominator."""
    without_variance_(u, state["exp_avg_sq"] == 0)
    torch.mul(u, denominator, out=state["exp_avg"])
    preconditioned_step_(p, u, lr=group["lr"], beta1=group["betas"][0], weight_decay=group["weight_decay"], t=t)


def warn_if_adam(optimizer: Any, config: ReducerConfig, where: str) -> bool:
    """Warn (once per optimizer type and place) when ``config`` compresses
    gradients with error feedback in front of an Adam-family ``optimizer``
    (an instance, a class or a type name such as DeepSpeed's ``"AdamW"``).
    Returns whether it warned."""
    name = optimizer if isinstance(optimizer, str) else (optimizer if isinstance(optimizer, type)
                                                          else type(optimizer)).__name__
    worker, _ = config.build_compressors()
    if ((name, where) in _warned or isinstance(optimizer, CompressedAdam) or config.error_feedback == "none"
            or type(worker).name in _EXACT_CASTS or not any(k in name.lower() for k in ADAM_FAMILY)):
        return False
    _warned.add((name, where))
    warnings.warn(
        f"{where}: {type(worker).name} gradient compression with error feedback in front of {name}. Adam divides "
        f"each coordinate by its own running RMS, so it sees compressed magnitudes and rescales the residual that "
        f"error feedback re-injects: on the LM workload AdamW on compressed gradients ends far above exact AdamW "
        f"(docs/results/lm-adam.md). Compress the momentum instead: dsq_plugins.CompressedAdam "
        f"(DeepSpeed: optimizer type \"OneBitAdam\"), which ends close to exact AdamW there.", AdamCompressionWarning,
        stacklevel=3)
    return True


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr < 0:
        raise ConfigError(f"lr must be a non-negative number, got {lr!r}")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise ConfigError(f"eps must be a positive number, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ConfigError(f"weight_decay must be a non-negative number, got {weight_decay!r}")


def _named_groups(params: Iterable[Any]) -> tuple[list[dict[str, Any]], dict[torch.Tensor, str]]:
    """Param groups of plain tensors, and every parameter's name."""
    params = list(params)
    if not params:
        raise ConfigError("CompressedAdam got an empty parameter list")
    groups = [dict(g) for g in params] if isinstance(params[0], dict) else [{"params": params}]
    names: dict[torch.Tensor, str] = {}
    seen: set[str] = set()
    for gi, group in enumerate(groups):
        if "params" not in group:
            raise ConfigError(f"param group {gi} has no 'params'")
        items = group["params"]
        items = [items] if isinstance(items, torch.Tensor) else list(items)
        tensors = []
        for j, item in enumerate(items):
            name, p = item if isinstance(item, tuple) else (f"group{gi}.param{j}", item)
            if not isinstance(p, torch.Tensor):
                raise ConfigError(f"param group {gi} item {j} is not a tensor or a (name, tensor) pair")
            if name in seen:
                raise ConfigError(f"parameter name {name!r} appears twice")
            seen.add(name)
            names[p] = name
            tensors.append(p)
        group["params"] = tensors
    return groups, names


def _describe(names: Any) -> str:
    if not isinstance(names, list):
        return "no names"
    return f"{len(names)} parameters: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
