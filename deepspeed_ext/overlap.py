"""The DeepSpeed section's exchange overlapped with backward (ZeRO stage 0).

Without it the engine reduces every gradient after backward has finished
(``buffered_allreduce_fallback``), so the wire sits idle during backward and
the GPU or CPU sits idle during the exchange. Here a post-accumulate hook on
each parameter marks it ready at the accumulation boundary; a bucket whose
parameters are all ready goes to the background exchange
(``dsq_plugins.overlap.Exchange``) while backward goes on with earlier layers, and
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
* Gradients are read, not copied, and the averages are written back into
  them by the exchange (an in-place allreduce): nothing else writes a
  parameter's gradient between its last accumulation and the engine's step.

With ``"overlap": false`` the same buckets are reduced after backward, so
the two give the same result bit for bit and share checkpoints.
"""
from __future__ import annotations

import weakref

import torch

from dsq_plugins import DoubleSqueeze
from dsq_plugins.overlap import OverlappedBuckets


def supported(engine) -> bool:
    """Whether this engine's gradients are the parameters' own ``.grad``
    (fp32 and fp16 engines). The bf16 optimizer reduces fp32 accumulators it
    fills after backward, so its exchange cannot start earlier."""
    return not hasattr(engine.optimizer, "get_grads_for_reduction")


class OverlappedAllreduce(OverlappedBuckets):
    """Hooks a stage-0 engine's parameters and feeds their buckets to a
    background exchange during backward; ``finish()`` returns the averages."""

    def __init__(self, engine, reducer: DoubleSqueeze, timeout: float | None = None):
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad and p.numel() > 0]
        named.reverse()  # the last layers' gradients are ready first
        self._engine = weakref.ref(engine)
        super().__init__(engine, reducer, named, self.on_ready, timeout=timeout, in_place=True,
                         hint="Every rank must run engine.backward() at the same accumulation boundaries.")

    @property
    def sent_during_backward(self) -> int:
        """Buckets of the last finished step that the hooks sent during backward."""
        return self.feed.sent_early

    def on_ready(self, param: torch.Tensor) -> None:
        engine = self._engine()
        if (engine is not None and engine.enable_backward_allreduce and not engine.inside_no_sync_ctxt
                and engine.is_gradient_accumulation_boundary()):
            self.feed.ready(param)

    def finish(self) -> tuple[list[torch.Tensor], bool]:
        """Send the buckets no hook sent (a parameter without a gradient this
        step gets zeros, as DeepSpeed gives it), wait for the step's exchange
        and return (the averages of ``params``, whether ``on_nonfinite="skip"``
        skipped the step). Raises what the exchange raised, on every rank."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        results, skipped = self.feed.collect(self.feed.start())
        return [a for bucket in results for a in bucket], skipped
