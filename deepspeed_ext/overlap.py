"""The DeepSpeed section's exchange overlapped with backward (ZeRO stage 0).

Without it the engine reduces every gradient after backward has finished
(``buffered_allreduce_fallback``), so the wire sits idle during backward and
the GPU or CPU sits idle during the exchange. Here a post-accumulate hook on
each parameter marks it ready at the accumulation boundary; a bucket whose
parameters are all ready goes to the background exchange
(``dsq_plugins.exchange``) while backward goes on with earlier layers, and
the engine's allreduce at the end of backward only waits for what is left.

* Buckets follow reverse parameter order, as gradients become ready, and the
  exchange reduces them in bucket order on every rank whatever order they
  became ready in, so collectives always match.
* The whole step is one ``reducer.step()``: error memories change together
  only when every bucket succeeded; an error (NaN on some rank, a bad payload)
  is raised on every rank from ``engine.backward`` as without overlap.
* Only the boundary micro-step's gradients are sent (the engine's own
  condition: ``enable_backward_allreduce``, outside ``no_sync()``); in modes
  where the boundary is not known during backward (DeepSpeed's unmanaged
  gradient accumulation) every bucket is sent at the end of backward:
  correct, just not overlapped.
* Gradients are read, not copied: nothing writes a parameter's gradient
  between its last accumulation and the averaged result replacing it.

With ``"overlap": false`` the same buckets are reduced after backward, so
the two give the same result bit for bit and share checkpoints.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from dsq_plugins import DoubleSqueeze
from dsq_plugins.exchange import DEFAULT_TIMEOUT, Exchange


def supported(engine) -> bool:
    """Whether this engine's gradients are the parameters' own ``.grad``
    (fp32 and fp16 engines). The bf16 optimizer reduces fp32 accumulators it
    fills after backward, so its exchange cannot start earlier."""
    return not hasattr(engine.optimizer, "get_grads_for_reduction")


class OverlappedAllreduce:
    """Hooks a stage-0 engine's parameters and feeds their buckets to a
    background exchange during backward; ``finish()`` returns the averages."""

    def __init__(self, engine, reducer: DoubleSqueeze, timeout: float = DEFAULT_TIMEOUT):
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad and p.numel() > 0]
        self.named = list(reversed(named))  # the last layers' gradients are ready first
        self.buckets = reducer.layout([(n, tuple(p.shape)) for n, p in self.named])
        by_name = dict(self.named)
        self.bucket_params = [[by_name[slot.name] for slot in bucket.slots] for bucket in self.buckets]
        self._bucket_of = {id(p): b for b, members in enumerate(self.bucket_params) for p in members}
        self._ready: set[int] = set()
        self._ready_count = [0] * len(self.buckets)
        self._submitted: set[int] = set()
        self._step = 0
        #: buckets of the last finished step that were sent during backward, by the hooks
        self.sent_during_backward = 0
        self._engine = weakref.ref(engine)
        self.exchange = Exchange(reducer, self.buckets, timeout,
                                 hint="Every rank must run engine.backward() at the same accumulation boundaries.")
        weakref.finalize(engine, self.exchange.close)  # a dropped engine stops the thread
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(_ready_hook(me)) for _, p in self.named]

    def _sending(self) -> bool:
        engine = self._engine()
        return (engine is not None and engine.enable_backward_allreduce and not engine.inside_no_sync_ctxt
                and engine.is_gradient_accumulation_boundary())

    def on_ready(self, param: torch.Tensor) -> None:
        if not self._sending():
            return
        key = id(param)
        b = self._bucket_of[key]
        if b in self._submitted:
            raise RuntimeError("a gradient was accumulated again after its bucket was sent at this accumulation "
                               "boundary (two backward passes in one boundary micro-step?); call engine.step() "
                               "between them")
        if key in self._ready:
            return
        self._ready.add(key)
        self._ready_count[b] += 1
        if self._ready_count[b] == len(self.bucket_params[b]):
            self._submit(b)

    def _submit(self, b: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.bucket_params[b]]
        self._submitted.add(b)
        self.exchange.submit(self._step, b, grads)

    def finish(self) -> tuple[list[list[Any]], bool]:
        """Send the buckets no hook sent (parameters without a gradient this
        step contribute zeros), wait for the step's exchange and return (each
        bucket's averaged tensors, whether ``on_nonfinite="skip"`` skipped the
        step). Raises what the exchange raised, on every rank."""
        self.sent_during_backward = len(self._submitted)
        for b in range(len(self.buckets)):
            if b not in self._submitted:
                self._submit(b)
        step, self._step = self._step, self._step + 1
        self._ready.clear()
        self._submitted.clear()
        self._ready_count = [0] * len(self.buckets)
        results, skipped = self.exchange.collect(step)
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            raise failures[0]
        return results, skipped

    def close(self) -> None:
        """Remove the hooks and stop the thread (idempotent)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.exchange.close()


def _ready_hook(ref: "weakref.ref[OverlappedAllreduce]"):
    def hook(param: torch.Tensor) -> None:
        overlapped = ref()
        if overlapped is not None:
            overlapped.on_ready(param)
    return hook
