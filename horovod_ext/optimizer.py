"""``horovod_ext.DistributedOptimizer``: the signature and the contract of
``hvd.DistributedOptimizer``; with a DoubleSqueeze compression it moves
packed payloads instead of dense allreduces.

* Gradients are fused into buckets (reverse parameter order: the last layers'
  gradients are ready first). A post-accumulate hook marks a parameter ready;
  a bucket whose parameters are all ready is copied and handed to the
  background exchange (``dsq_plugins.overlap.Exchange``), so its exchange overlaps the
  rest of the backward pass.
* The exchange reduces buckets in bucket order, whatever order they became
  ready in on each rank, so ranks can never wait on each other's different
  orders; collective names are derived from that fixed sequence.
* A step is one ``reducer.step()``: its error memories change together only
  when every bucket succeeded. An error (NaN on some rank, a bad peer
  payload) is raised on every rank from ``step()``/``synchronize()`` and
  leaves them as they were; ``on_nonfinite="skip"`` skips the optimizer step
  on every rank.
* ``staleness=1`` is the paper's asynchronous variant: ``step()`` applies the
  average of the previous step's gradients while this step's exchange runs on
  behind the next forward and backward pass. ``flush()`` applies the last one.

Horovod's own contract, kept:

* Resume: ``hvd.broadcast_optimizer_state`` initialises a fresh optimizer's
  state by calling the *wrapped* optimizer's ``step()`` on Horovod's own
  optimizers (recognised by their module), never the exchange; this class
  reports Horovod's module so that the same happens here and no rank waits
  in an exchange that another never joins. Error state rides in
  ``state_dict()["doublesqueeze"]``, per rank (each rank owns a chunk of the
  server error): broadcasting the optimizer state never touches it, and
  loading another rank's entry leaves this rank's as it was (with a warning).
* Process sets: a rank outside ``process_set`` gets a pass-through optimizer
  (its own gradients, no exchange); ranks inside exchange among themselves.
* Sparse gradients (``nn.Embedding(sparse=True)``) are exchanged dense and
  handed back sparse, as ``sparse_as_dense=True`` does; without that flag a
  one-time warning says so.
* ``_parameter_names``, ``synchronize()``, ``skip_synchronize()`` and the
  warning for ``step()`` after ``synchronize()`` outside it are Horovod's.
* A step waits for its exchange at most ``exchange_timeout`` seconds (None:
  ``DSQ_EXCHANGE_TIMEOUT``, read here, else 300), then
  raises ``PeerFailedError`` naming the Horovod collective it is stuck in
  (a rank in another collective, e.g. a broadcast, never joins it).

Transport: by default the payloads move on Horovod's ``alltoall`` and
``allgather`` (its process sets, its MPI/gloo/NCCL controllers).
``transport="torch"`` moves them on a torch.distributed group of their own
(``horovod_ext.torch_transport``): the same bytes and averages, without
Horovod's negotiation round per collective.

With a stock Horovod compressor (``Compression.none``, ``.fp16`` ...) this is
``hvd.DistributedOptimizer`` itself.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from dsq_plugins import DoubleSqueeze
from dsq_plugins.comm import TorchDistributedComm
from dsq_plugins.errors import ConfigError
from dsq_plugins.optim import warn_if_adam
from dsq_plugins.overlap import OverlappedBuckets, timeout_or_env
from dsq_plugins.state import is_own_state

from .comm import HorovodComm
from .compression import Compression, DoubleSqueezeCompression
from .elastic import elastic_job, join_world
from .torch_transport import TRANSPORTS, payload_group

#: ``hvd.broadcast_optimizer_state`` treats optimizers of this module as Horovod's own
_HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=None, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False, process_set=None,
                         *, staleness: int = 0, exchange_timeout: float | None = None,
                         transport: str = "horovod"):
    """Drop-in for ``hvd.DistributedOptimizer``; see the module docstring.

    ``transport="torch"`` moves the compressed payloads on a torch.distributed
    group of their own instead of Horovod's collectives (``torch_transport``):
    no per-collective negotiation, at the price of a gloo/NCCL group beside
    Horovod's transport; every rank must make the optimizer."""
    import horovod.torch as hvd
    if process_set is None:
        process_set = hvd.global_process_set
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if not isinstance(compression, DoubleSqueezeCompression):
        if transport != "horovod":
            raise ConfigError('transport="torch" needs a DoubleSqueeze compression (Compression.doublesqueeze(...))')
        if staleness:
            raise ConfigError("staleness needs a DoubleSqueeze compression (Compression.doublesqueeze(...))")
        return hvd.DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                                        hvd.Average if op is None else op, gradient_predivide_factor,
                                        num_groups, groups, sparse_as_dense, process_set)
    if op not in (None, hvd.Average):
        raise ConfigError("the DoubleSqueeze optimizer averages gradients; op must be hvd.Average")
    if gradient_predivide_factor != 1.0:
        raise ConfigError("gradient_predivide_factor does not apply to compressed exchange; leave it at 1.0")
    if staleness not in (0, 1):
        raise ConfigError(f"staleness must be 0 or 1, got {staleness!r}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    exchange_timeout = timeout_or_env(exchange_timeout)
    if not exchange_timeout > 0:
        raise ConfigError(f"exchange_timeout must be a positive number of seconds, got {exchange_timeout!r}")
    warn_if_adam(optimizer, compression.config, "horovod_ext.DistributedOptimizer")
    # groups / num_groups shape Horovod's allreduce fusion; buckets (bucket_mb) play that part here.
    body = dict(_CompressedOptimizer.__dict__)
    body["__module__"] = _HOROVOD_OPTIMIZER_MODULE  # see "Resume" in the module docstring
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), body)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, staleness,
               sparse_as_dense, process_set, exchange_timeout, transport)


class _CompressedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, staleness,
                 sparse_as_dense, process_set, exchange_timeout, transport):
        super(self.__class__, self).__init__(params)
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is None:
            named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(self.param_groups)
                     for j, p in enumerate(group["params"])]
        else:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) for item in named):
                raise ConfigError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                                 "model.named_parameters()")
            names = [n for n, _ in named]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ConfigError(f"parameter names in named_parameters must be unique; duplicates: {dups}")
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(all_params) if id(p) not in known]
            if missing:
                raise ConfigError(f"named_parameters does not name every optimizer parameter (indices {missing})")
        ids = {id(p) for p in all_params}
        #: Horovod's mapping, kept for tools that read it
        self._parameter_names = {p: n for n, p in sorted(named, key=lambda item: item[0]) if id(p) in ids}
        self._named = [(n, p) for n, p in reversed(named) if id(p) in ids and p.requires_grad]
        self.compression = compression
        self.transport = transport
        self.backward_passes_per_step = backward_passes_per_step
        self.staleness = staleness
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.step_skipped = False  # the last collected step was skipped (on_nonfinite="skip")
        self._synchronized = False  # synchronize() ran since the last step()
        self._should_synchronize = True  # False inside skip_synchronize()
        self._warned_sparse = False
        self.comm = self.reducer = self._exchange = None
        group = None
        if transport == "torch":  # collective over every Horovod rank, so before the pass-through return
            group = payload_group(process_set, cuda=any(p.is_cuda for _, p in self._named))
        if not process_set.included():
            return  # a pass-through on this rank, as Horovod's own optimizer is
        self.comm = HorovodComm(process_set) if transport == "horovod" else TorchDistributedComm(group)
        self.reducer = DoubleSqueeze(self.comm, config=compression.config)
        self._passes = {id(p): 0 for _, p in self._named}
        self._inflight: int | None = None  # step whose exchange runs (staleness 1)
        self._overlap = OverlappedBuckets(
            self, self.reducer, self._named, self._on_ready, self._bucket_grads, timeout=exchange_timeout,
            in_place=not self.staleness, hint="Every rank must call step()/synchronize() together (no "
                                              "hvd.broadcast_* or other collective in between on one rank only).")
        self._buckets, self._bucket_params = self._overlap.buckets, self._overlap.bucket_params
        self._exchange, self._feed = self._overlap.exchange, self._overlap.feed
        #: Horovod Elastic: the worlds this optimizer has joined, and whether its exchange belongs to an old one
        self.worlds, self._stale_world = 0, elastic_job()

    # -- Horovod Elastic (horovod_ext.elastic) -----------------------------
    def on_reset(self) -> None:
        """For ``state.register_reset_callbacks([opt.on_reset])``: the world
        changed; the next step joins the new one (``elastic.join_world``)."""
        self._stale_world = True
        self._inflight = None  # staleness 1: the old world's exchange is not collected

    def install(self, comm, reducer: DoubleSqueeze) -> None:
        """Exchange through ``comm`` and ``reducer`` from now on (same parameters and hooks)."""
        self.comm, self.reducer = comm, reducer
        self._overlap.renew(reducer)
        self._buckets, self._bucket_params = self._overlap.buckets, self._overlap.bucket_params
        self._exchange, self._feed = self._overlap.exchange, self._overlap.feed

    def _join_world_if_stale(self) -> None:
        if self._stale_world:
            self._stale_world = False
            join_world(self)

    # -- gradients in, averages out ----------------------------------------
    def _on_ready(self, param: torch.Tensor) -> None:
        self._join_world_if_stale()
        key = id(param)
        self._passes[key] += 1
        if self._passes[key] > self.backward_passes_per_step:
            raise RuntimeError("gradients were computed more than backward_passes_per_step times before "
                               "step(); increase backward_passes_per_step to accumulate locally")
        if self._passes[key] == self.backward_passes_per_step:
            self._feed.ready(param)

    def _grad_of(self, name: str, p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g is None:  # not computed here (unused parameter): this rank contributes zeros, as Horovod does
            return torch.zeros_like(p)
        if g.is_sparse:
            if not self.sparse_as_dense and not self._warned_sparse:
                self._warned_sparse = True
                warnings.warn(f"sparse gradient of {name!r}: compressed exchange is dense, so sparse gradients "
                              f"are exchanged as with sparse_as_dense=True (dense, handed back sparse); pass "
                              f"sparse_as_dense=True to say so and silence this warning", stacklevel=2)
            g = g.to_dense()
        return g

    def _bucket_grads(self, b: int) -> list[torch.Tensor]:
        """Bucket b's gradients for the exchange. With staleness 0 they are
        the parameters' own (the exchange averages them in place, as
        Horovod's allreduce does: nothing writes them between the last
        backward and step()); with staleness 1 copies, since the next
        backward writes the gradients while this exchange still runs."""
        grads = [self._grad_of(slot.name, p).detach()
                 for slot, p in zip(self._buckets[b].slots, self._bucket_params[b])]
        return [g.clone() for g in grads] if self.staleness else grads

    def _start_exchange(self) -> int:
        """Submit the buckets no hook submitted (unused parameters) and move
        on to the next step's gradients; returns the step submitted."""
        self._join_world_if_stale()
        for key in self._passes:
            self._passes[key] = 0
        return self._feed.start()

    def _collect(self, step: int) -> list[list[torch.Tensor]]:
        """Wait for a step's exchange; raise what it raised; remember whether
        ``on_nonfinite="skip"`` skipped it."""
        results, self.step_skipped = self._feed.collect(step)
        return results

    def _apply(self, results: list[list[torch.Tensor]]) -> None:
        for params, averaged in zip(self._bucket_params, results):
            for p, g in zip(params, averaged):
                if p.grad is None:
                    p.grad = g.to(p.dtype)
                elif p.grad.is_sparse:
                    p.grad = g.to(p.dtype).to_sparse()
                elif p.grad.data_ptr() != g.data_ptr():  # else averaged in place already
                    p.grad.copy_(g)

    # -- optimizer API ----------------------------------------------------
    def synchronize(self) -> None:
        """Finish this step's exchange and write the averaged gradients into
        ``p.grad`` (staleness 0). Raises, on every rank, what the exchange raised."""
        if self._exchange is None:  # outside the process set
            self._synchronized = True
            return
        if self.staleness:
            raise RuntimeError("synchronize() does not apply with staleness=1; step() applies the previous average")
        self._apply(self._collect(self._start_exchange()))
        self._synchronized = True

    def step(self, closure=None):
        base = super(self.__class__, self)
        if self._exchange is None:  # outside the process set: local gradients, as Horovod's pass-through
            self._synchronized = False
            return base.step(closure)
        if self.staleness:
            step = self._start_exchange()
            previous, self._inflight = self._inflight, step
            if previous is None:
                return None  # nothing averaged yet: the first step only starts an exchange
            self._apply(self._collect(previous))
            return None if self.step_skipped else base.step(closure)
        if self._synchronized:
            if self._should_synchronize:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(): the gradients are already averaged and are not exchanged "
                              "again; call step() inside optimizer.skip_synchronize() to silence this warning",
                              stacklevel=2)
        else:
            self.synchronize()
        self._synchronized = False
        return None if self.step_skipped else base.step(closure)

    def flush(self) -> None:
        """staleness=1: apply the update still in flight (end of training)."""
        if self.staleness and self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._apply(self._collect(previous))
            if not self.step_skipped:
                super(self.__class__, self).step()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); clip; step()``, as in Horovod: ``step()``
        inside it does not synchronize again (nor warn)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def close(self) -> None:
        """Stop the exchange thread and remove the gradient hooks; the
        optimizer cannot step afterwards. Idempotent; also done when the
        optimizer is garbage-collected and at interpreter exit."""
        if self._exchange is not None:
            self._overlap.close()

    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        if self.reducer is not None:
            sd["doublesqueeze"] = self.reducer.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        dsq_state = state_dict.pop("doublesqueeze", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if dsq_state is None or self.reducer is None:
            return
        # Horovod's resume broadcasts rank 0's optimizer state: every other rank keeps its own error memories
        if is_own_state(dsq_state, rank=self.comm.rank, size=self.comm.size, policy="keep",
                        owner="the optimizer's DoubleSqueeze"):
            self.reducer.load_state_dict(dsq_state)
