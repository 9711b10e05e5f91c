"""Overlapping the exchange with backward: one background thread that
reduces the buckets of each step, in bucket order, as the training thread
hands them over; ``OverlappedBuckets`` wires it to a model's parameters (the
Horovod drop-in optimizer and the DeepSpeed section at ZeRO stage 0 both use
it). Buckets are reduced in the same fixed order on
every rank whatever order their gradients became ready in, so the
collectives match.

It holds the reducer and the communicator but no reference to its owner
(an optimizer, an engine), so an owner that is dropped is collected (and the
thread stopped, through ``weakref.finalize``); ``close()`` stops it
explicitly, and every exchange still open is closed at interpreter exit,
before the engines shut their communication down.

Each step runs inside ``reducer.step(plan)``: the error memories of all its
buckets are written together, or (an error, a skipped step) not at all. The
plan is the same every step, so a reducer that defers its verdicts to the
step's end (``dsq_plugins.step``, the default on a GPU) agrees it with
the other ranks once, and each step's results are published when its
verdict is in.

On a GPU a frontend may run its exchange on a side stream (``SideStreams``,
the DDP hook's), beside the backward kernels that follow it.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from .comm import initialise_vector_math
from .errors import PeerFailedError
from .layout import Bucket
from .reducer import DoubleSqueeze
from .step import SKIPPED, Plan

__all__ = ["BackgroundQueue", "BucketFeed", "DEFAULT_TIMEOUT", "Exchange", "ExchangeClosed", "Handoff",
           "OverlappedBuckets", "SideStreams", "ready_hooks", "start_background", "timeout_or_env"]

#: seconds a step waits for its exchange before it calls a peer lost, unless ``DSQ_EXCHANGE_TIMEOUT`` says
DEFAULT_TIMEOUT = 300.0


def timeout_or_env(timeout: float | None = None) -> float:
    """``timeout``, or when None ``DSQ_EXCHANGE_TIMEOUT`` (else ``DEFAULT_TIMEOUT``):
    read when an exchange is built, never at import."""
    return float(os.environ.get("DSQ_EXCHANGE_TIMEOUT", DEFAULT_TIMEOUT)) if timeout is None else float(timeout)

#: every background thread's owner, and its thread (one registry for the drop-in's, DeepSpeed's and the DDP hook's)
_running: "weakref.WeakKeyDictionary[Any, threading.Thread]" = weakref.WeakKeyDictionary()


def start_background(owner: Any, target: Callable[[], None], name: str) -> threading.Thread:
    """The one way this package runs work beside training: a daemon thread
    for ``owner`` (which has a ``close()``) that runs ``target`` with its
    creator's intra-op thread count (OpenMP's is per thread: the same sums in
    the same order, bit for bit, whichever thread runs them), with the vector
    math set up first, and that is stopped at exit before Horovod or
    torch.distributed shut down."""
    threads = torch.get_num_threads()
    initialise_vector_math()  # before this thread uses it beside the training thread

    def main() -> None:
        torch.set_num_threads(threads)
        target()
    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    _running[owner] = thread
    return thread


class BackgroundQueue:
    """Jobs run one after another on the package's background thread
    (``start_background``), in the order they were submitted: the DDP hook's
    buckets in the order DDP handed them over, LocalSteps' overlapped syncs
    (the same order on every rank, so the collectives match)."""

    def __init__(self, name: str) -> None:
        self._jobs: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
        self.thread = start_background(self, self._run, name)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def run_beside(self, job: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
        """Submit ``job``; its result or exception comes back through the future
        (``future.result(timeout)`` in the training thread)."""
        future: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
        future.set_running_or_notify_cancel()

        def run() -> None:
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, raised there
                future.set_exception(exc)
        self.submit(run)
        return future

    def close(self) -> None:
        """Let the thread end once the jobs before this call have run."""
        self._jobs.put(None)

    def wait(self) -> None:
        """Until every job submitted so far has run."""
        self._jobs.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            finally:
                job = None  # holds the owner's state until the next job: let a dropped owner go now
                self._jobs.task_done()


class ExchangeClosed(RuntimeError):
    """The exchange was closed (``close()``) while a step waited on it."""


class Exchange:
    """Reduces ``buckets`` step after step on a background thread."""

    def __init__(self, reducer: DoubleSqueeze, buckets: Sequence[Bucket], timeout: float,
                 hint: str = "Every rank must step together.", in_place: bool = False):
        self.reducer = reducer
        #: the averages are written into the handed-over gradients (``reduce_bucket(in_place=True)``)
        self.in_place = in_place
        self.buckets = list(buckets)
        self.timeout = timeout
        self._cond = threading.Condition()
        self._queue: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._results: dict[tuple[int, Any], Any] = {}
        self._closed = False
        self._hint = hint  # what a timeout message tells the user to check
        self._thread = start_background(self, self._run, "dsq-exchange")

    # -- the training thread's side -----------------------------------------
    def submit(self, step: int, bucket: int, grads: list[torch.Tensor]) -> None:
        """Hand over bucket ``bucket`` of ``step``: its gradients, which nothing
        may write until the step is collected."""
        with self._cond:
            if self._closed:
                raise ExchangeClosed("the compressed exchange is closed")
            self._queue[(step, bucket)] = grads
            self._cond.notify_all()

    def collect(self, step: int) -> tuple[list[Any], bool]:
        """(each bucket's averaged tensors, or the exception it raised;
        whether the step was skipped). Waits at most ``timeout`` seconds."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while (step, "outcome") not in self._results:
                if self._closed:
                    raise ExchangeClosed("the compressed exchange was closed before the step finished")
                left = deadline - time.monotonic()
                if left <= 0:
                    where = getattr(self.reducer.comm, "current_collective", None) or "its first collective"
                    raise PeerFailedError(
                        f"the compressed exchange of step {step} did not finish within {self.timeout:.0f} s; this "
                        f"rank waits in collective {where!r}: another rank is in a different collective or "
                        f"stopped. {self._hint}")
                self._cond.wait(min(left, 1.0))
            results = [self._results.pop((step, b)) for b in range(len(self.buckets))]
            skipped = self._results.pop((step, "outcome")) == SKIPPED
        return results, skipped

    def close(self) -> None:
        """Stop the thread once it has nothing in hand (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        _running.pop(self, None)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the exchange thread ---------------------------------------------------
    def _next(self, step: int, bucket: int) -> list[torch.Tensor] | None:
        with self._cond:
            while (step, bucket) not in self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            return self._queue.pop((step, bucket))

    def _publish(self, key: tuple[int, Any], value: Any) -> None:
        with self._cond:
            self._results[key] = value
            self._cond.notify_all()

    def _run(self) -> None:
        # the same buckets in the same order every step: a reducer that defers verdicts agrees them once
        plan = Plan([(bucket.name, bucket.numel) for bucket in self.buckets])
        step = 0
        while True:
            first = self._next(step, 0)
            if first is None:
                return
            results: list[Any] = []
            try:
                with self.reducer.step(plan) as current:
                    for b, bucket in enumerate(self.buckets):
                        grads = first if b == 0 else self._next(step, b)
                        if grads is None:  # closed in the middle of a step: it stays unapplied
                            current.fail(ExchangeClosed("closed in the middle of a step"))
                            return
                        try:
                            result: Any = self.reducer.reduce_bucket(bucket, grads, in_place=self.in_place)
                        except Exception as exc:  # noqa: BLE001 - raised in the training thread by collect()
                            result = exc  # the step records it; its later buckets raise it again, moving nothing
                        results.append(result)
            except Exception as exc:  # noqa: BLE001 - a deferred verdict, judged as the step closed
                results = [exc] * len(self.buckets)
            if current.skipped and current.verdict is not None:  # deferred: every bucket was exchanged
                results = [[t.zero_() for t in r] if isinstance(r, list) else r for r in results]
            for b, result in enumerate(results):
                self._publish((step, b), result)
            self._publish((step, "outcome"), current.outcome)
            step += 1


class BucketFeed:
    """The training thread's side of an ``Exchange``: which parameters are
    ready this step. A bucket whose parameters all are goes to the exchange
    at once; ``start()`` sends the rest and moves on to the next step."""

    def __init__(self, exchange: Exchange, bucket_params: Sequence[Sequence[torch.Tensor]],
                 grads_of: Callable[[int], list[torch.Tensor]]):
        self.exchange = exchange
        self.bucket_params = [list(members) for members in bucket_params]
        self._grads_of = grads_of  # bucket index -> the gradients to hand over
        self._bucket_of = {id(p): b for b, members in enumerate(self.bucket_params) for p in members}
        self._ready: set[int] = set()
        self._ready_count = [0] * len(self.bucket_params)
        self._submitted: set[int] = set()
        self._step = 0
        #: buckets of the last started step that were sent before ``start()``, as their parameters became ready
        self.sent_early = 0

    def ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is final for this step (once per step)."""
        key = id(param)
        b = self._bucket_of[key]
        if b in self._submitted:
            raise RuntimeError("a gradient was accumulated again after its bucket was sent for this step (two "
                               "backward passes before one step?)")
        if key in self._ready:
            return
        self._ready.add(key)
        self._ready_count[b] += 1
        if self._ready_count[b] == len(self.bucket_params[b]):
            self._submit(b)

    def _submit(self, b: int) -> None:
        self._submitted.add(b)
        self.exchange.submit(self._step, b, self._grads_of(b))

    def start(self) -> int:
        """Send the buckets not sent yet and move on to the next step's
        gradients; returns the step started, for ``collect``."""
        self.sent_early = len(self._submitted)
        for b in range(len(self.bucket_params)):
            if b not in self._submitted:
                self._submit(b)
        step, self._step = self._step, self._step + 1
        self._ready.clear()
        self._submitted.clear()
        self._ready_count = [0] * len(self.bucket_params)
        return step

    def collect(self, step: int) -> tuple[list[list[torch.Tensor]], bool]:
        """(each bucket's averaged tensors, whether ``on_nonfinite="skip"``
        skipped the step); raises what the exchange raised, on every rank."""
        results, skipped = self.exchange.collect(step)
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            raise failures[0]
        return results, skipped


class OverlappedBuckets:
    """Parameters in buckets, each bucket handed to a background ``Exchange``
    as soon as backward has made all its gradients: the wiring the Horovod
    drop-in and the DeepSpeed section at ZeRO stage 0 share.

    ``named``: (name, parameter) in the order their gradients become ready
    (reverse layer order), which fixes the buckets. ``on_ready(param)``: the
    owner's bound method called by each parameter's post-accumulate hook (it
    decides whether this gradient is final, then calls ``feed.ready``);
    ``grads_of(b)``: bucket b's gradients to hand over. ``owner``: the
    optimizer or engine; once it is collected the thread stops."""

    def __init__(self, owner: object, reducer: DoubleSqueeze, named: Sequence[tuple[str, torch.Tensor]],
                 on_ready: Callable[[torch.Tensor], None], grads_of: Callable[[int], list[torch.Tensor]] | None = None,
                 *, timeout: float | None = None, hint: str = "Every rank must step together.",
                 in_place: bool = False):
        self._named = list(named)
        self._settings = dict(timeout=timeout_or_env(timeout), hint=hint, in_place=in_place)
        if grads_of is None:
            grads_of = lambda b: [p.grad for p in self.bucket_params[b]]  # noqa: E731
        self._grads_of, self._owner = grads_of, weakref.ref(owner)
        self._wire(reducer)
        self._hooks = ready_hooks(self.params, on_ready)  # weak: the hooks never keep the owner alive

    def _wire(self, reducer: DoubleSqueeze) -> None:
        self.buckets = reducer.layout([(n, tuple(p.shape)) for n, p in self._named])
        by_name = dict(self._named)
        #: each bucket's parameters, and all of them in bucket order (as results come back)
        self.bucket_params = [[by_name[slot.name] for slot in bucket.slots] for bucket in self.buckets]
        self.params = [p for members in self.bucket_params for p in members]
        self.exchange = Exchange(reducer, self.buckets, **self._settings)
        self.feed = BucketFeed(self.exchange, self.bucket_params, self._grads_of)
        weakref.finalize(self._owner(), self.exchange.close)  # a dropped owner stops the thread

    def renew(self, reducer: DoubleSqueeze) -> None:
        """The same parameters and hooks on another reducer (a new world
        after a Horovod Elastic reset): the old exchange thread stops and a
        new one starts; nothing may be in flight."""
        self.exchange.close()
        self._wire(reducer)

    def close(self) -> None:
        """Remove the hooks and stop the thread (idempotent)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.exchange.close()


# -- a frontend's exchange on a side stream of the GPU --------------------------
# On one stream a bucket's exchange (memory-bound kernels, its collectives) runs between the backward kernels
# that follow it, and the GPU does one after the other. On a stream of its own, as DDP's allreduce runs on
# nccl's, it can run beside them. Two orderings make that safe without any host wait: the side stream starts
# on a bucket once the stream that produced it has reached the point where the bucket was handed over (an
# event recorded there), and the result goes back in a CUDA-aware future, which makes whoever waits on it wait
# for the side stream's work, on the device; the result's memory is marked as used by the producer's stream,
# so the allocator does not hand it out again before that stream is done with it.

class Handoff:
    """One bucket's way onto the side stream and back: ``with handoff.on_side():``
    runs work there after the producer's point of handover, and ``publish``
    completes a future with its result."""

    def __init__(self, side: torch.cuda.Stream, producer: torch.cuda.Stream):
        self.side, self.producer = side, producer
        self.ready = torch.cuda.Event()
        self.ready.record(producer)

    def future(self, device: torch.device) -> torch.futures.Future:
        """A future whose waiters' streams wait for the side stream's work (CUDA-aware)."""
        return torch.futures.Future(devices=[device])

    @contextlib.contextmanager
    def on_side(self) -> Iterator[None]:
        """The side stream, current for this thread, after the handover point."""
        self.side.wait_event(self.ready)
        with torch.cuda.stream(self.side):
            yield

    def publish(self, future: torch.futures.Future, result: torch.Tensor) -> None:
        """Complete ``future`` with ``result`` (call inside ``on_side``, after the work that makes it)."""
        for part in (result._indices(), result._values()) if result.is_sparse else (result,):  # (no storage of its own)
            part.record_stream(self.producer)
        future.set_result(result)


class SideStreams:
    """One side stream per CUDA device, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def handoff(self, tensor: torch.Tensor) -> Handoff | None:
        """Where ``tensor``'s producer hands it over (called on the producer's
        thread, its stream current): the way onto the side stream, or None
        off CUDA (a CPU's work has no streams to overlap)."""
        if not tensor.is_cuda:
            return None
        side = self._streams.get(tensor.device)
        if side is None:
            side = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        return Handoff(side, torch.cuda.current_stream(tensor.device))


def ready_hooks(params: Sequence[torch.Tensor], on_ready: Callable[[torch.Tensor], None]) -> list:
    """Post-accumulate-grad hooks calling the bound method ``on_ready(param)``
    through a weak reference, so the hooks never keep its owner alive."""
    method = weakref.WeakMethod(on_ready)

    def hook(param: torch.Tensor) -> None:
        bound = method()
        if bound is not None:
            bound(param)
    return [p.register_post_accumulate_grad_hook(hook) for p in params]


@atexit.register
def _close_all() -> None:
    """At exit, stop every background thread before Horovod or torch.distributed shuts down (an idle
    thread left to the interpreter's teardown can abort the process)."""
    for owner, thread in list(_running.items()):
        owner.close()
        thread.join(timeout=5.0)
