"""``LocalSteps``: workers step alone, and every ``sync_every`` steps average
where they went, compressed with DoubleSqueeze (the DiLoCo family, with
error feedback on both passes of the exchange).

Each rank runs its own optimizer (``inner_optimizer``, e.g. AdamW) on its
own gradients; no byte moves. Every ``sync_every`` steps:

    Δ_i = anchor − θ_i                       # this rank's pseudo-gradient
    Δ   = DoubleSqueeze(Δ_i)                 # averaged, compressed on both passes, error memories kept
    m   = μ·m + Δ;  u = Δ + μ·m (Nesterov)   # the outer step, the same on every rank
    θ   = anchor − η·u;  anchor = θ          # every rank starts the next round from the same weights

The default outer step is Nesterov with η = 0.7 and μ = 0.8, not DiLoCo's
η = 0.7, μ = 0.9, which was tuned for H in the hundreds: at H in the tens
a smaller momentum is the better outer step with exact averaging. The
error memories are decayed by half at each sync (``error_decay=0.5``):
between syncs the inner steps already pull back what a sync did not send
(they start from the anchor it left and descend from there), so a full
memory sends that correction a second time, and the outer momentum carries
the excess on. ``sign`` sends by default the RMS of every block of 128
elements (``block=128``, bfloat16 scales: 1.125 bits per element): the RMS
keeps the norm of what it replaces, where the mean scale makes every outer
step shorter than the exact one, and a scale per block follows the
pseudo-gradient's magnitudes layer by layer, where one scale per chunk
spans several layers. Each of these choices was measured against its
alternatives and the exact control: docs/results/local-steps.md, "Local steps on the
LM" (``python -m bench.lm local``).

A sync is a DoubleSqueeze step: if it fails anywhere (a non-finite
pseudo-gradient, a peer lost), every rank raises the same error, its
weights go back to the anchor (the last good sync) and the outer momentum
and error memories stay as they were. The first ``exact_steps`` steps
average gradients exactly, every step (a warm-up as DDP would run it); by
default two rounds' worth, 2·``sync_every``: from the very first step the
workers' weights are still moving fast and far apart, and the study's
figures (docs/results/local-steps.md) were all taken after
such a warm-up. ``exact_steps=0`` steps alone from the start.

``fragments`` = P > 1 cuts the parameters into P contiguous groups (whole
tensors) of about equal size, each synced every H steps at staggered steps (fragment f
at step (f + 1)·H/P of each round), so that a sync sends a P-th of the
model (Streaming DiLoCo). ``overlap_steps`` = k > 0 runs each sync on a
background thread beside the next k inner steps (k ≤ H/P: one sync in
flight at a time): where the link, not the arithmetic, sets the pace, a
round costs max(H steps, its syncs) instead of their sum, and with P
fragments a sync's bytes hide behind H/P steps at only H/P steps of
staleness. The outer step lands k steps late and keeps what the rank did
meanwhile: θ = anchor' + (θ − θ_sent). Both are off by default: staggered,
late fragments end above the blocking sync after as many steps, and win
only at equal wall-clock on a slow link (docs/results/local-steps-more.md).
The sync has its own process group (``comm=None``), so the training thread
may run collectives of its own meanwhile (a ``comm`` passed in must carry
nothing else while a sync is in flight); ``finish()`` applies a sync in
flight at once (before evaluating, saving or stopping: ``state_dict`` calls
it). A sync that
fails raises at the step that applies it, on every rank, with the weights
back at the anchor.

On several hosts (``hierarchy="node"``, or ``"auto"`` where the launcher
put the ranks on several hosts) each host is one DiLoCo worker
(``inside_host="exact"``, the default there): every inner step averages
the gradients exactly among the host's ranks, over its fast link, and only
the syncs cross a host link, through the two-level exchange (exact inside a
host, DoubleSqueeze between hosts). ``inside_host="alone"`` lets every rank
step alone, as on one host.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ..comm import Communicator, sparse_mean
from ..errors import ConfigError, NonFiniteGradientError, PeerFailedError, StateError
from ..overlap import BackgroundQueue, timeout_or_env
from ..reducer import DoubleSqueeze
from ..step import statuses_meant

__all__ = ["LocalSteps"]

STATE_VERSION = 1
#: ``compressor="sign"``'s parameters when none are given: the RMS of each block of 128 elements
DEFAULT_SIGN = {"scale": "rms", "block": 128}
#: the error memories' ``error_decay`` when none is given (see the module's docstring)
DEFAULT_ERROR_DECAY = 0.5
#: the exact warm-up when ``exact_steps`` is not given, in rounds of ``sync_every`` steps
WARMUP_ROUNDS = 2
#: how the ranks of a host take their inner steps (``inside_host``; None: "exact")
INSIDE_HOST = (None, "exact", "alone")


class LocalSteps:
    """Use in place of ``inner_optimizer``: ``opt.step()`` after each
    backward. Args: ``model`` (its parameters are the shared weights),
    ``inner_optimizer`` (over them), ``comm`` (None: torch.distributed's
    default group), ``sync_every`` (H: inner steps per sync), ``outer_lr``
    and ``outer_momentum`` (the outer Nesterov SGD; DiLoCo's are 0.7 and 0.9),
    ``error_decay`` (the error memories decayed at each sync; None: 0.5),
    ``exact_steps`` (a warm-up with exact averaging every step; None:
    ``WARMUP_ROUNDS``·``sync_every``),
    ``fragments`` (P: the parameters synced in P staggered groups),
    ``overlap_steps`` (0: a sync blocks; k in 1..H/P: it runs beside the next
    k inner steps, see the module's docstring; ``timeout`` seconds to wait
    for it, None: ``DSQ_EXCHANGE_TIMEOUT`` or 300), and the pseudo-gradient
    exchange's reducer options by name (``compressor``, ``error_dtype``,
    ``hierarchy`` ...; ``"sign"`` without ``compressor_params`` is sign
    with the RMS scale of each block of 128, ``DEFAULT_SIGN``); ``inside_host`` (``"exact"`` or ``"alone"``: on
    several hosts, whether a host's ranks average their gradients every
    step, one DiLoCo worker per host, or step alone; None: ``"exact"``)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Communicator | None = None,
                 *, sync_every: int = 20, compressor: Any = "sign", outer_lr: float = 0.7,
                 outer_momentum: float = 0.8, nesterov: bool = True, exact_steps: int | None = None, fragments: int = 1,
                 overlap_steps: int = 0, timeout: float | None = None, inside_host: str | None = None,
                 **options: Any):
        if exact_steps is None and isinstance(sync_every, int):
            exact_steps = WARMUP_ROUNDS * sync_every
        _check(sync_every, outer_lr, outer_momentum, exact_steps, fragments, overlap_steps)
        if inside_host not in INSIDE_HOST:
            raise ConfigError(f"inside_host must be one of {INSIDE_HOST}, got {inside_host!r}")
        if comm is None:
            comm = _default_comm(own_group=overlap_steps > 0)
        self.model, self.inner, self.comm = model, inner_optimizer, comm
        self.overlap_steps, self.timeout = overlap_steps, timeout_or_env(timeout)
        self._queue: BackgroundQueue | None = None  # the thread the overlapped syncs run on
        self._in_flight: _InFlight | None = None
        self.sync_every, self.exact_steps = int(sync_every), int(exact_steps)
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        #: the parameters' indices in ``named`` of each fragment, and the step of a round each one syncs at
        self.fragments = _fragments([p.numel() for _, p in self.named], fragments)
        self._phases = [(f + 1) * self.sync_every // fragments % self.sync_every for f in range(fragments)]
        options.setdefault("error_dtype", "int8")
        if options.get("error_decay") is None:  # EF21's state is no error memory: it keeps all of it
            options["error_decay"] = 1.0 if options.get("error_feedback") == "ef21" else DEFAULT_ERROR_DECAY
        if compressor == "sign" and options.get("compressor_params") is None:
            options["compressor_params"] = dict(DEFAULT_SIGN)  # see the module's docstring
        #: the pseudo-gradient's exchange (error memories on both passes), and the warm-up's exact one
        self.reducer = DoubleSqueeze(comm, compressor, **options)
        self.exact = DoubleSqueeze.exact(comm)
        #: the inner steps' exact mean inside this rank's host (None where each rank steps alone)
        self.host_exact = _host_exchange(comm, self.reducer, inside_host)
        _require_same_weights(self.exact, self.named)
        self.anchor = {n: p.detach().float().clone() for n, p in self.named}
        self.momentum: dict[str, torch.Tensor] = {}
        self.steps = 0   # step() calls applied
        self.syncs = 0   # syncs applied (a fragment's counts as one)

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
        """One inner step (after the warm-up, on this rank's own gradients, or
        its host's mean with ``host_exact``); every ``sync_every``-th also
        syncs. Returns the closure's loss."""
        if self.steps < self.exact_steps:
            self._average_gradients(self.exact)
        elif self.host_exact is not None:
            try:
                self._average_gradients(self.host_exact)
            except NonFiniteGradientError:  # the host's weights go non-finite: its next sync fails on every rank,
                for _, p in self.named:     # as when a rank stepping alone went non-finite
                    p.grad = torch.full_like(p, float("nan"))
        loss = self.inner.step(closure)
        self.steps += 1
        if self.steps <= self.exact_steps:
            self.anchor = {n: p.detach().float().clone() for n, p in self.named}  # still the same everywhere
            return loss
        if self._in_flight is not None and self.steps - self._in_flight.launched_at >= self.overlap_steps:
            self.finish()
        phase = (self.steps - self.exact_steps) % self.sync_every
        for fragment, at in zip(self.fragments, self._phases):
            if at == phase:
                self._sync(fragment)
        return loss

    def _average_gradients(self, exchange: DoubleSqueeze) -> None:
        """Every gradient replaced by its exact mean over ``exchange``'s ranks (of the parameters that
        train: a frozen one keeps no gradient, which the inner optimizer skips)."""
        named = [self.named[i] for i in self._training(range(len(self.named)))]
        sparse = [(n, p) for n, p in named if p.grad is not None and p.grad.is_sparse]
        dense = [(n, p) for n, p in named if p.grad is None or not p.grad.is_sparse]
        grads = [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in dense]
        for (_, p), g in zip(dense, exchange.reduce_many(grads)):
            p.grad = g.to(p.dtype)
        for n, p in sparse:  # (nn.Embedding(sparse=True)'s) exactly, its rows as they are
            with statuses_meant(n, rank=exchange.comm.rank, on_nonfinite="raise"):
                p.grad = sparse_mean(exchange.comm, p.grad, name=n)

    def _training(self, indices: Iterable[int]) -> tuple[int, ...]:
        """Those of the parameters ``indices`` that train now. One whose ``requires_grad`` was turned
        off after this was built (a frozen layer) is left out of the exchange and the outer step, so
        that it stays as it is: its zero pseudo-gradient would still be compressed, and sign sends a
        zero as +scale."""
        return tuple(i for i in indices if self.named[i][1].requires_grad)

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients of every parameter and take the outer
        step; on failure, back to the last good sync on every rank, then
        raise. With ``overlap_steps`` the exchange starts here and the outer
        step is applied ``overlap_steps`` steps later (or by ``finish()``)."""
        self.finish()
        self._sync(tuple(range(len(self.named))))

    def _sync(self, indices: tuple[int, ...]) -> None:
        """The sync of the parameters ``indices`` (a fragment, or all) that train."""
        indices = self._training(indices)
        named = [self.named[i] for i in indices]
        deltas = torch._foreach_sub([self.anchor[n] for n, _ in named],
                                    [p.detach().float() for _, p in named]) if named else []
        pseudo = [(n, delta) for (n, _), delta in zip(named, deltas)]
        if self.overlap_steps:
            if self._queue is None:
                self._queue = BackgroundQueue("dsq-local-steps")
                weakref.finalize(self, self._queue.close)  # a dropped optimizer stops its thread
            sent = {n: p.detach().float().clone() for n, p in named}
            self._in_flight = _InFlight(self._queue.run_beside(lambda: self._exchange(pseudo)), sent, self.steps,
                                        indices)
            return
        self._apply(self._exchange_or_reset(lambda: self._exchange(pseudo)), None, indices)

    @torch.no_grad()
    def finish(self) -> None:
        """Apply the sync in flight now (``overlap_steps``), if there is one:
        before evaluating, checkpointing or stopping. Raises its error, if it
        failed, with the weights back at the anchor."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return

        def outcome():
            try:
                return flight.future.result(timeout=self.timeout)
            except concurrent.futures.TimeoutError:
                raise PeerFailedError(f"LocalSteps: the sync started at step {flight.launched_at} did not finish "
                                      f"within {self.timeout:g} s (a rank lost, or not stepping?); the weights are "
                                      f"back at the last good sync") from None
        self._apply(self._exchange_or_reset(outcome), flight.sent, flight.indices)

    def _exchange(self, pseudo: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor] | None:
        """The pseudo-gradients averaged, or None if the step was skipped (``on_nonfinite="skip"``)."""
        with self.reducer.step(self.reducer.plan_of([(n, t.shape) for n, t in pseudo])) as exchange:
            averaged = self.reducer.reduce_many(pseudo)
        return None if exchange.skipped else averaged

    def _exchange_or_reset(self, exchange) -> list[torch.Tensor] | None:
        try:
            return exchange()
        except BaseException:
            self._load_weights(self.anchor)
            raise

    def _apply(self, averaged: list[torch.Tensor] | None, sent: dict[str, torch.Tensor] | None,
               indices: tuple[int, ...]) -> None:
        """The outer step of the parameters ``indices`` from their averaged
        pseudo-gradients (None: skipped, nobody moves); their weights become
        the new anchor, plus what this rank did since it sent ``sent`` (an
        overlapped sync)."""
        named = [self.named[i] for i in indices]
        names = [name for name, _ in named]
        if averaged is not None and names:  # multi-tensor ops over the fragment: a few launches, not a few per tensor
            updates = averaged
            if self.outer_momentum:
                for name, delta in zip(names, averaged):
                    if name not in self.momentum:
                        self.momentum[name] = torch.zeros_like(delta)
                momenta = [self.momentum[name] for name in names]
                torch._foreach_mul_(momenta, self.outer_momentum)
                torch._foreach_add_(momenta, averaged)
                updates = torch._foreach_add(averaged, momenta, alpha=self.outer_momentum) if self.nesterov \
                    else momenta
            anchors = torch._foreach_sub([self.anchor[name] for name in names], updates, alpha=self.outer_lr)
            self.anchor.update(zip(names, anchors))
        if averaged is not None:
            self.syncs += 1
        here = [self.anchor[name] for name in names]
        if sent is not None and names:  # plus what this rank did since it sent
            here = torch._foreach_add(here, torch._foreach_sub([p.detach().float() for _, p in named],
                                                               [sent[name] for name in names]))
        if names:
            torch._foreach_copy_([p for _, p in named], [h.to(p.dtype) for h, (_, p) in zip(here, named)])

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, p in self.named:
            p.copy_(weights[name].to(p.dtype))

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the anchor and outer momentum (the same
        on every rank), and this rank's error memories (``"reducer"``); a sync
        in flight is applied first (``finish()``)."""
        self.finish()
        return {"version": STATE_VERSION, "steps": self.steps, "syncs": self.syncs, "inner": self.inner.state_dict(),
                "anchor": {n: t.clone() for n, t in self.anchor.items()},
                "momentum": {n: t.clone() for n, t in self.momentum.items()},
                "reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise StateError(f"LocalSteps state version {state.get('version')} is not {STATE_VERSION}")
        if set(state["anchor"]) != set(self.anchor):
            raise StateError("LocalSteps state was saved for other parameters")
        self.finish()  # its collectives are under way on every rank: let them end before the state is replaced
        self.reducer.load_state_dict(state["reducer"])
        self.inner.load_state_dict(state["inner"])
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        self.anchor = {n: t.clone() for n, t in state["anchor"].items()}
        self.momentum = {n: t.clone() for n, t in state["momentum"].items()}


@dataclass
class _InFlight:
    """An overlapped sync: its outcome, the weights it sent, the step it started at, its parameters."""

    future: "concurrent.futures.Future[list[torch.Tensor] | None]"
    sent: dict[str, torch.Tensor]
    launched_at: int
    indices: tuple[int, ...]


def _host_exchange(comm: Communicator, reducer: DoubleSqueeze, inside_host: str | None) -> DoubleSqueeze | None:
    """The exact mean among this rank's host's ranks, on a group of its own
    (an overlapped sync may be using the reducer's); None on one host or
    with ``inside_host="alone"``."""
    if not reducer.hosts.two_level:
        if inside_host == "exact":
            raise ConfigError('LocalSteps: inside_host="exact" needs several hosts (hierarchy="node" with '
                              'node_size, or a launch on several hosts)')
        return None
    if inside_host == "alone":
        return None
    return DoubleSqueeze.exact(comm.split(reducer.hosts.node_groups()))


def _fragments(sizes: list[int], count: int) -> list[tuple[int, ...]]:
    """``count`` contiguous groups of the parameter indices, of about equal numel, none empty."""
    if count > len(sizes):
        raise ConfigError(f"LocalSteps: fragments={count} is more than the model's {len(sizes)} parameters")
    cumulative, cuts = list(itertools.accumulate(sizes)), [0]
    for g in range(1, count):
        past = next(i + 1 for i, c in enumerate(cumulative) if c >= cumulative[-1] * g / count)
        cuts.append(min(max(past, cuts[-1] + 1), len(sizes) - (count - g)))
    cuts.append(len(sizes))
    return [tuple(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def _default_comm(own_group: bool) -> Communicator:
    """torch.distributed's default group, or a group of the same ranks of its
    own (an overlapped sync runs beside the training thread's collectives)."""
    import torch.distributed as dist

    from ..comm import TorchDistributedComm
    default = TorchDistributedComm()  # says so if torch.distributed is not initialised
    return TorchDistributedComm(dist.new_group(backend=dist.get_backend())) if own_group else default


def _check(sync_every: Any, outer_lr: Any, outer_momentum: Any, exact_steps: Any, fragments: Any,
           overlap_steps: Any) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"sync_every must be a positive integer (inner steps per sync), got {sync_every!r}")
    if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= sync_every:
        raise ConfigError(f"fragments must be an integer from 1 to sync_every ({sync_every}), got {fragments!r}")
    most = sync_every // fragments
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or not 0 <= overlap_steps <= most:
        raise ConfigError(f"overlap_steps must be an integer from 0 to sync_every // fragments ({most}: one sync in "
                          f"flight at a time), got {overlap_steps!r}")
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
