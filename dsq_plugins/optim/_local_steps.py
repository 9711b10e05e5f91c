"""``LocalSteps``: workers step alone, and every ``sync_every`` steps average
where they went, compressed with DoubleSqueeze (the DiLoCo family, with
error feedback on both passes of the exchange).

Each rank runs its own optimizer (``inner_optimizer``, e.g. AdamW) on its
own gradients; no byte moves. Every ``sync_every`` steps:

    Δ_i = anchor − θ_i                       # this rank's pseudo-gradient
    Δ   = DoubleSqueeze(Δ_i)                 # averaged, compressed on both passes, error memories kept
    m   = μ·m + Δ;  u = Δ + μ·m (Nesterov)   # the outer step, the same on every rank
    θ   = anchor − η·u;  anchor = θ          # every rank starts the next round from the same weights

The default outer step is Nesterov with η = 1 and μ = 0.5, not DiLoCo's
η = 0.7, μ = 0.9 (tuned for H in the hundreds): on the small LM at H = 20
(``python -m bench.lm local``, docs/results.md) it ended lowest of the outer
steps tried with exact averaging, and within 0.3% of the best with sign
(twice the average, which makes exact averaging diverge), where DiLoCo's
amplifies sign's delayed error feedback into a 9% loss. ``sign`` sends
the RMS of its chunk by default here (the same norm as what it replaces):
its mean scale makes every outer step shorter than the exact one, and
ended 1-2% higher.

A sync is a DoubleSqueeze step: if it fails anywhere (a non-finite
pseudo-gradient, a peer lost), every rank raises the same error, its
weights go back to the anchor (the last good sync) and the outer momentum
and error memories stay as they were. The first ``exact_steps`` steps
average gradients exactly, every step (a warm-up as DDP would run it).
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm import Communicator
from ..errors import ConfigError, StateError
from ..reducer import DoubleSqueeze

__all__ = ["LocalSteps"]

STATE_VERSION = 1


class LocalSteps:
    """Use in place of ``inner_optimizer``: ``opt.step()`` after each
    backward. Args: ``model`` (its parameters are the shared weights),
    ``inner_optimizer`` (over them), ``comm`` (None: torch.distributed's
    default group), ``sync_every`` (H: inner steps per sync), ``outer_lr``
    and ``outer_momentum`` (the outer Nesterov SGD; DiLoCo's are 0.7 and 0.9),
    ``exact_steps`` (a warm-up with exact averaging every step), and the
    pseudo-gradient exchange's reducer options by name (``compressor``,
    ``error_dtype``, ``hierarchy`` ...; ``"sign"`` without
    ``compressor_params`` is sign with the RMS scale)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Communicator | None = None,
                 *, sync_every: int = 20, compressor: Any = "sign", outer_lr: float = 1.0,
                 outer_momentum: float = 0.5, nesterov: bool = True, exact_steps: int = 0, **options: Any):
        _check(sync_every, outer_lr, outer_momentum, exact_steps)
        if comm is None:
            from ..comm import TorchDistributedComm
            comm = TorchDistributedComm()
        self.model, self.inner, self.comm = model, inner_optimizer, comm
        self.sync_every, self.exact_steps = int(sync_every), int(exact_steps)
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        options.setdefault("error_dtype", "int8")
        if compressor == "sign" and options.get("compressor_params") is None:
            options["compressor_params"] = {"scale": "rms"}  # see the module's docstring
        #: the pseudo-gradient's exchange (error memories on both passes), and the warm-up's exact one
        self.reducer = DoubleSqueeze(comm, compressor, **options)
        self.exact = DoubleSqueeze(comm, "none", error_feedback="none", hierarchy="flat")
        _require_same_weights(self.exact, self.named)
        self.anchor = {n: p.detach().float().clone() for n, p in self.named}
        self.momentum: dict[str, torch.Tensor] = {}
        self.steps = 0   # step() calls applied
        self.syncs = 0   # syncs applied

    @property
    def warmed_up(self) -> bool:
        """Whether the exact warm-up (``exact_steps``) is over: from now on only syncs move bytes."""
        return self.steps >= self.exact_steps

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One inner step (after the warm-up, on this rank's own gradients);
        every ``sync_every``-th also syncs. Returns the closure's loss."""
        if self.steps < self.exact_steps:
            grads = [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.named]
            for (_, p), g in zip(self.named, self.exact.reduce_many(grads)):
                p.grad = g.to(p.dtype)
        loss = self.inner.step(closure)
        self.steps += 1
        if self.steps <= self.exact_steps:
            self.anchor = {n: p.detach().float().clone() for n, p in self.named}  # still the same everywhere
        elif (self.steps - self.exact_steps) % self.sync_every == 0:
            self.sync()
        return loss

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients and take the outer step; on failure,
        back to the last good sync on every rank, then raise."""
        pseudo = [(n, self.anchor[n] - p.detach().float()) for n, p in self.named]
        try:
            with self.reducer.step() as exchange:
                averaged = self.reducer.reduce_many(pseudo)
        except BaseException:
            self._load_weights(self.anchor)
            raise
        if exchange.skipped:  # on_nonfinite="skip": nobody moves
            self._load_weights(self.anchor)
            return
        for (name, _), delta in zip(pseudo, averaged):
            update = delta
            if self.outer_momentum:
                m = self.momentum.setdefault(name, torch.zeros_like(delta))
                m.mul_(self.outer_momentum).add_(delta)
                update = delta.add(m, alpha=self.outer_momentum) if self.nesterov else m
            self.anchor[name] = self.anchor[name].sub(update, alpha=self.outer_lr)
        self._load_weights(self.anchor)
        self.syncs += 1

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, p in self.named:
            p.copy_(weights[name].to(p.dtype))

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the anchor and outer momentum (the same
        on every rank), and this rank's error memories (``"reducer"``)."""
        return {"version": STATE_VERSION, "steps": self.steps, "syncs": self.syncs, "inner": self.inner.state_dict(),
                "anchor": {n: t.clone() for n, t in self.anchor.items()},
                "momentum": {n: t.clone() for n, t in self.momentum.items()},
                "reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise StateError(f"LocalSteps state version {state.get('version')} is not {STATE_VERSION}")
        if set(state["anchor"]) != set(self.anchor):
            raise StateError("LocalSteps state was saved for other parameters")
        self.reducer.load_state_dict(state["reducer"])
        self.inner.load_state_dict(state["inner"])
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        self.anchor = {n: t.clone() for n, t in state["anchor"].items()}
        self.momentum = {n: t.clone() for n, t in state["momentum"].items()}


def _check(sync_every: Any, outer_lr: Any, outer_momentum: Any, exact_steps: Any) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"sync_every must be a positive integer (inner steps per sync), got {sync_every!r}")
    if isinstance(exact_steps, bool) or not isinstance(exact_steps, int) or exact_steps < 0:
        raise ConfigError(f"exact_steps must be a non-negative integer, got {exact_steps!r}")
    if not isinstance(outer_lr, (int, float)) or not outer_lr > 0:
        raise ConfigError(f"outer_lr must be a positive number, got {outer_lr!r}")
    if not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
        raise ConfigError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")


def _require_same_weights(exact: DoubleSqueeze, named: list[tuple[str, torch.Tensor]]) -> None:
    """One small collective: every rank's weights' checksum, the same on every rank or a ConfigError everywhere."""
    sums = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().abs().sum()])
                        for _, p in named]).reshape(-1) if named else torch.zeros(2, dtype=torch.float64)
    comm = exact.comm
    gathered = comm.allgather(sums.view(torch.uint8).reshape(-1).to(comm.device), tag=0x4C6F6353)  # "LocS"
    mine = sums.view(torch.uint8).reshape(-1).cpu()
    differ = [r for r, g in enumerate(gathered) if not torch.equal(g.cpu(), mine)]
    if differ:
        raise ConfigError(f"LocalSteps: the model's parameters differ between ranks (rank {comm.rank} differs from "
                          f"rank(s) {differ}); start every rank from the same weights (same seed, or broadcast)")
