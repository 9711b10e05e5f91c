"""``horovod_ext.DistributedOptimizer``: the signature of
``hvd.DistributedOptimizer``; with a DoubleSqueeze compression it moves packed
payloads instead of dense allreduces.

* Gradients are fused into buckets (reverse parameter order: the last layers'
  gradients are ready first). A post-accumulate hook marks a parameter ready;
  a bucket whose parameters are all ready is copied and handed to a background
  thread, so its exchange overlaps the rest of the backward pass.
* The thread exchanges buckets in bucket order, whatever order they became
  ready in on each rank, so ranks can never wait on each other's different
  orders; collective names are derived from that fixed sequence.
* State changes of one step are staged and committed together only when every
  bucket succeeded: an error (NaN on some rank, a bad peer payload) is raised
  on every rank from ``step()``/``synchronize()`` and leaves the error memories
  as they were.
* ``staleness=1`` is the paper's asynchronous variant: ``step()`` applies the
  average of the previous step's gradients while this step's exchange runs on
  behind the next forward and backward pass. ``flush()`` applies the last one.
* Error state rides in ``state_dict()["doublesqueeze"]`` (per rank: each rank
  owns a chunk of the server error). ``hvd.broadcast_optimizer_state`` ignores
  that key, so broadcasting the optimizer state never overwrites it.

With a stock Horovod compressor (``Compression.none``, ``.fp16`` ...) this is
``hvd.DistributedOptimizer`` itself.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch

from dsq_plugins import DoubleSqueeze
from dsq_plugins.errors import ConfigError

from .comm import HorovodComm
from .compression import Compression, DoubleSqueezeCompression


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=None, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False, process_set=None,
                         *, staleness: int = 0):
    """Drop-in for ``hvd.DistributedOptimizer``; see the module docstring."""
    import horovod.torch as hvd
    if process_set is None:
        process_set = hvd.global_process_set
    if not isinstance(compression, DoubleSqueezeCompression):
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
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    # groups / num_groups shape Horovod's allreduce fusion; buckets (bucket_mb) play that part here.
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_CompressedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, staleness,
               sparse_as_dense, process_set)


class _CompressedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, staleness,
                 sparse_as_dense, process_set):
        super(self.__class__, self).__init__(params)
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(all_params)]
        else:
            named = list(named_parameters)
            if len({n for n, _ in named}) != len(named):
                raise ConfigError("named_parameters holds duplicate names")
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(all_params) if id(p) not in known]
            if missing:
                raise ConfigError(f"named_parameters does not name every optimizer parameter (indices {missing})")
        ids = {id(p) for p in all_params}
        self._named = [(n, p) for n, p in reversed(named) if id(p) in ids and p.requires_grad]
        self.comm = HorovodComm(process_set)
        self.reducer = DoubleSqueeze(self.comm, **compression.reducer_kwargs)
        if compression.faults is not None or os.environ.get("DSQ_FAULTS"):
            from robust.faults import maybe_inject
            self.reducer.comm = maybe_inject(self.comm, self.reducer.compressor, compression.faults)
        self.backward_passes_per_step = backward_passes_per_step
        self.staleness = staleness
        self.sparse_as_dense = sparse_as_dense
        self._buckets = self.reducer.layout([(n, tuple(p.shape)) for n, p in self._named])
        by_name = dict(self._named)
        self._bucket_params = [[by_name[slot.name] for slot in bucket.slots] for bucket in self._buckets]
        self._bucket_of = {id(p): b for b, members in enumerate(self._bucket_params) for p in members}
        self._passes = {id(p): 0 for _, p in self._named}
        self._ready_count = [0] * len(self._buckets)
        self._cond = threading.Condition()
        self._queue: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._results: dict[tuple[int, int], Any] = {}
        self._submitted: set[int] = set()
        self._step_id = 0
        self._inflight: int | None = None  # step whose exchange runs (staleness 1)
        self.step_skipped = False  # the last collected step was skipped (on_nonfinite="skip")
        self._synchronized = False  # synchronize() ran since the last step()
        self._worker = threading.Thread(target=self._exchange_loop, name="dsq-horovod", daemon=True)
        self._worker.start()
        for _, p in self._named:
            p.register_post_accumulate_grad_hook(self._make_hook(p))

    # -- hooks and the exchange thread -----------------------------------
    def _make_hook(self, p):
        def hook(param):
            key = id(param)
            self._passes[key] += 1
            if self._passes[key] > self.backward_passes_per_step:
                raise RuntimeError("gradients were computed more than backward_passes_per_step times before "
                                   "step(); increase backward_passes_per_step to accumulate locally")
            if self._passes[key] == self.backward_passes_per_step:
                b = self._bucket_of[key]
                self._ready_count[b] += 1
                if self._ready_count[b] == len(self._bucket_params[b]):
                    self._submit(b)
        return hook

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g is None:
            return torch.zeros_like(p)
        if g.is_sparse:
            if not self.sparse_as_dense:
                raise ConfigError("sparse gradients need sparse_as_dense=True with DoubleSqueeze compression")
            g = g.to_dense()
        return g

    def _submit(self, b: int) -> None:
        if b in self._submitted:
            return
        grads = [self._grad_of(p).detach().clone() for p in self._bucket_params[b]]
        with self._cond:
            self._submitted.add(b)
            self._queue[(self._step_id, b)] = grads
            self._cond.notify_all()

    def _exchange_loop(self) -> None:
        step = 0
        while True:
            self.reducer.begin()
            errors = []
            for b, bucket in enumerate(self._buckets):
                with self._cond:
                    while (step, b) not in self._queue:
                        self._cond.wait()
                    grads = self._queue.pop((step, b))
                try:
                    result: Any = self.reducer.reduce_bucket(bucket, grads)
                except Exception as exc:  # noqa: BLE001 - re-raised in the training thread
                    errors.append(exc)
                    result = exc
                with self._cond:
                    self._results[(step, b)] = result
                    self._cond.notify_all()
            skipped = self.reducer.last_step_skipped
            self.reducer.last_step_skipped = False
            if errors or skipped:
                self.reducer.abort()  # all buckets of a step change state together, or none does
            else:
                self.reducer.commit()
            with self._cond:
                self._results[(step, "skipped")] = skipped
                self._cond.notify_all()
            step += 1

    def _collect(self, step: int) -> list[list[torch.Tensor]]:
        """Wait for a step's exchange; raise what it raised; remember whether
        ``on_nonfinite="skip"`` skipped it."""
        with self._cond:
            while (step, "skipped") not in self._results:
                self._cond.wait()
            results = [self._results.pop((step, b)) for b in range(len(self._buckets))]
            self.step_skipped = self._results.pop((step, "skipped"))
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            raise failures[0]
        return results

    def _start_exchange(self) -> int:
        """Submit the buckets no hook submitted (unused parameters) and move
        on to the next step's gradients; returns the step submitted."""
        for b in range(len(self._buckets)):
            self._submit(b)
        step = self._step_id
        self._step_id += 1
        self._submitted.clear()
        self._ready_count = [0] * len(self._buckets)
        for key in self._passes:
            self._passes[key] = 0
        return step

    def _apply(self, results: list[list[torch.Tensor]]) -> None:
        for params, averaged in zip(self._bucket_params, results):
            for p, g in zip(params, averaged):
                if p.grad is None:
                    p.grad = g.to(p.dtype)
                elif p.grad.is_sparse:
                    p.grad = g.to(p.dtype).to_sparse()
                else:
                    p.grad.copy_(g)

    # -- optimizer API ----------------------------------------------------
    def synchronize(self) -> None:
        """Finish this step's exchange and write the averaged gradients into
        ``p.grad`` (staleness 0). Raises, on every rank, what the exchange raised."""
        if self.staleness:
            raise RuntimeError("synchronize() does not apply with staleness=1; step() applies the previous average")
        self._apply(self._collect(self._start_exchange()))
        self._synchronized = True

    def step(self, closure=None):
        if self.staleness:
            step = self._start_exchange()
            previous, self._inflight = self._inflight, step
            if previous is None:
                return None  # nothing averaged yet: the first step only starts an exchange
            self._apply(self._collect(previous))
            if self.step_skipped:
                return None
            return super(self.__class__, self).step(closure)
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        if self.step_skipped:
            return None
        return super(self.__class__, self).step(closure)

    def flush(self) -> None:
        """staleness=1: apply the update still in flight (end of training)."""
        if self.staleness and self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._apply(self._collect(previous))
            super(self.__class__, self).step()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); clip; step()``, as in Horovod: ``step()``
        inside it does not synchronize again."""
        self._synchronized = True
        yield

    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd["doublesqueeze"] = self.reducer.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        dsq_state = state_dict.pop("doublesqueeze", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if dsq_state is not None:
            self.reducer.load_state_dict(dsq_state)
