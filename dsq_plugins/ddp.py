"""DoubleSqueeze for DDP users: ``compressed_adam(ddp_model, ...)`` (Adam's
momentum compressed, the LM's method) and a communication hook for any
optimizer, as torch's PowerSGD hook is:

    opt = dsq_ddp.compressed_adam(ddp_model, lr=3e-4, freeze_step=400)   # one line: DDP stops averaging


    import dsq_plugins.ddp as dsq_ddp
    state = dsq_ddp.HookState(process_group=None, compressor="sign", exact_steps=0)
    ddp_model.register_comm_hook(state, dsq_ddp.hook)

(Lightning: ``Trainer(strategy="ddp", callbacks=[dsq_ddp.lightning_callback(state)])``,
since Lightning 2.6's ``DDPStrategy(ddp_comm_hook=...)`` registers hooks on
CUDA devices only; Accelerate:
``accelerator.prepare(model).register_comm_hook(state, dsq_ddp.hook)``.)

DDP hands the hook its gradient buckets one at a time, in the same order on
every rank, each a flat buffer. The hook:

1. opens one reducer step at the first bucket of an iteration (the error
   memories of the whole iteration change together, or not at all);
2. averages the bucket with DoubleSqueeze: error-compensated compression on
   the worker pass (all-to-all) and again on the server pass (all-gather),
   any compressor of this library; during the first ``exact_steps``
   iterations, the exact average instead;
3. closes the step at the last bucket: written only if every bucket
   succeeded. A failure (a NaN on some rank, a malformed payload) is the
   same error on every rank, raised from ``backward()``, and writes nothing.

With ``overlap=True`` (the default) these run on one background thread, in
the order DDP hands the buckets over, while backward makes the next buckets'
gradients; the last bucket's call waits for them all, so ``backward()``
returns with every average in place, or raises what failed (the buckets
after a failure keep their own gradients and exchange nothing).
``overlap=False`` averages each bucket inside the hook's call. On a GPU the
averaging runs on a side stream (``side_stream=True``, ``overlap.SideStreams``),
beside the backward kernels that follow it, as DDP's own allreduce runs on
nccl's stream; the future it returns makes DDP's stream wait for it on the
device.

DDP lays its buckets out when it is built and again after the first
iteration, and a bucket of the same size may then hold other parameters or
the same ones in another order. So the memories are keyed by the bucket's
parameters (named in the order a DDP instance first hands them over, the
same in every run of the script), and when the layout changes each
parameter's worker error and momentum move with it into the new buckets;
the server errors, which belong to chunks of the old buckets, are gathered
once, exactly, and cut into the new buckets' chunks. A run resumed from a
checkpoint continues with all its compensation; its first iteration is not
bit for bit the uninterrupted run's, since a new DDP instance compresses it
over its first layout (other buckets, so other scales).
A sparse gradient (``nn.Embedding(sparse=True)``) comes in a bucket of its
own and is averaged exactly, its rows as they are (``comm.sparse_mean``),
inside the same step: it is small already, and a compressor would first
make it as large as the table.
After an error DDP itself cannot go on (its reducer is left mid-iteration):
restart from the last checkpoint.

**The verdict on the device** (``HookState(optimizer=opt)``, ``opt`` a fused
torch optimizer, e.g. ``torch.optim.AdamW(params, fused=True)``). Reading the
step's verdict at its last bucket makes the host wait there for the GPU to
finish backward; the GPU then idles while the host launches the optimizer.
Handed the optimizer, the hook instead gives it the verdict as a device flag
(its ``found_inf``, as ``GradScaler`` does), so a condemned step is skipped on
the device (parameters, moments and step counts as they were), writes the
memories undoably, and reads the verdict back at the next iteration's first
bucket, long after the device is done with it: a failure is then raised from
that ``backward()``, one iteration late, with the memories put back. Call
``state.settle()`` after the last iteration (``state_dict()`` does) to hear
about that one. With an optimizer, ``on_nonfinite="skip"`` skips a step with
a non-finite gradient on every rank and goes on (``skipped_steps``);
without one it is refused: a hook alone cannot skip the optimizer's step.
With ``GradScaler``, which hands the optimizer a ``found_inf`` of its own, the
step takes the larger of the two flags (``_HandedVerdict``), and iterations
whose gradients accumulate into one step (backward several times, without
``no_sync``) hand it the larger of theirs: it is skipped if any was condemned.
"""
# no ``from __future__ import annotations``: DDP checks ``hook``'s annotations as objects
import contextlib
import weakref
import zlib
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .comm import TorchDistributedComm, sparse_mean

__all__ = ["HookState", "compressed_adam", "hook", "lightning_callback", "local_gradients"]
from .config import ReducerConfig
from .errors import ConfigError, NonFiniteGradientError
from .layout import chunk_bounds
from .optim import CompressedAdam
from .overlap import BackgroundQueue, SideStreams
from .reducer import DoubleSqueeze
from .step import Plan, statuses_meant


class HookState:
    """The hook's state, grouped by role as torch's ``PowerSGDState`` is.

    Args:
        process_group: the DDP process group (None: the default group).
        compressor, compressor_params, options: the operator, its
            parameters, and any other reducer option by name
            (``server_compressor``, ``error_dtype``, ``seed`` ...; see
            ``ReducerConfig``).
        exact_steps: iterations averaged exactly before compression starts.
        optimizer: the fused torch optimizer that steps on these gradients
            (``fused=True``), to hand each iteration's verdict on the device
            instead of reading it on the host in backward (module docstring).
        side_stream: on a GPU, average on a stream of the hook's own, beside
            backward (False: on backward's stream, as before).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, compressor: Any = "sign",
                 compressor_params: Optional[Dict[str, Any]] = None, exact_steps: int = 0,
                 optimizer: Optional[torch.optim.Optimizer] = None, side_stream: bool = True, **options: Any):
        # -- hyperparameters
        if isinstance(exact_steps, bool) or not isinstance(exact_steps, int) or exact_steps < 0:
            raise ConfigError(f"exact_steps must be a non-negative integer, got {exact_steps!r}")
        self.config = ReducerConfig.build(None, dict(compressor=compressor, compressor_params=compressor_params),
                                          options)
        if self.config.owners != 1 or self.config.error_feedback == "ef21":
            raise ConfigError("the DDP hook keeps DoubleSqueeze's per-bucket memories: owners must be 1 and "
                              "error_feedback one of both, worker, none")
        optimizer = _unwrapped(optimizer)
        if optimizer is not None and not _skips_on_the_device(optimizer):
            fused = getattr(optimizer, "defaults", {}).get("fused")
            raise ConfigError(f"optimizer must be a fused torch optimizer, which skips a step on the device when "
                              f"handed a found_inf (e.g. torch.optim.AdamW(params, fused=True)); got "
                              f"{type(optimizer).__name__} with fused={fused}")
        if self.config.on_nonfinite == "skip" and optimizer is None:
            raise ConfigError("on_nonfinite='skip' cannot skip the optimizer's step from a DDP communication hook "
                              "unless the hook is handed a fused optimizer (HookState(optimizer=...)); use "
                              "on_nonfinite='raise'")
        self.exact_steps = exact_steps
        self.process_group = process_group
        self.optimizer = optimizer
        self._handed = _HandedVerdict(optimizer) if optimizer is not None else None
        if not isinstance(side_stream, bool):
            raise ConfigError(f"side_stream must be True or False, got {side_stream!r}")
        self.side_streams = SideStreams() if side_stream else None
        # -- internal state (made at the first bucket: the process group must exist by then)
        self.reducer: Optional[DoubleSqueeze] = None
        self.exact: Optional[DoubleSqueeze] = None
        self.iteration = 0
        self._keys: Dict[int, str] = {}                       # id(parameter) -> its name here
        self._layout: Dict[int, Tuple[Tuple[str, int], ...]] = {}  # bucket index -> its (parameter, numel)s
        # while DDP lays its buckets out anew (one iteration): the layout as it was, its whole server errors
        self._old_layout: Optional[Dict[int, Tuple[Tuple[str, int], ...]]] = None
        self._old_server_errors: Optional[Dict[str, torch.Tensor]] = None
        self._queue: Optional[BackgroundQueue] = None  # the thread that averages buckets during backward
        self._failure: Optional[BaseException] = None  # what a bucket of this iteration raised on it
        self._plan: Optional[Plan] = None  # the buckets of every iteration, once DDP's layout no longer changes
        # -- statistics
        self.bytes_sent = 0

    @property
    def comm(self) -> Optional[TorchDistributedComm]:
        return None if self.reducer is None else self.reducer.comm

    def _reducers(self) -> Tuple[DoubleSqueeze, DoubleSqueeze]:
        if self.reducer is None:
            comm = TorchDistributedComm(self.process_group)
            self.reducer = DoubleSqueeze(comm, config=self.config)
            self.exact = DoubleSqueeze.exact(comm)
        return self.reducer, self.exact

    def settle(self) -> None:
        """Read the verdict of the last iteration, where it was left on the
        device (``optimizer``): what condemned it is raised here, the same on
        every rank, with the memories as they were before it (the optimizer
        skipped it on the device). The next iteration's first bucket and
        ``state_dict`` call it; call it after the last iteration."""
        for reducer in (self.reducer, self.exact):
            if reducer is None:
                continue
            try:
                judged = reducer.scope.judge_pending()
            except BaseException:
                self.iteration -= 1
                raise
            if judged is not None and not judged.applied:  # skipped (on_nonfinite="skip")
                self.iteration -= 1

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error memories and counters (each rank saves its own)."""
        self.settle()
        return {"iteration": self.iteration, "layout": {k: list(v) for k, v in self._layout.items()},
                "reducer": None if self.reducer is None else self.reducer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self._layout = {int(k): tuple((str(n), int(m)) for n, m in v) for k, v in state["layout"].items()}
        if state["reducer"] is not None:
            self._reducers()[0].load_state_dict(state["reducer"])
        if self._handed is not None:
            self._handed.forget()

    def _average(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The bucket's average (steps 1-3 of the module docstring). A failure
        closes the step unapplied and is raised."""
        reducer, exact = self._reducers()
        opening = reducer.scope.current is None and exact.scope.current is None
        if opening:  # the last iteration's verdict, if it was left on the device, is read now (it may undo it)
            self.settle()
        active = reducer if self.iteration >= self.exact_steps else exact
        buffer = bucket.buffer()
        # 1. one step per iteration, opened at its first bucket (with its buckets' plan once DDP's layout is stable,
        #    so that a reducer that defers verdicts judges them once, at the last bucket)
        if opening:
            active.open_step(self._plan)
        try:
            # 2. this bucket, compressed both ways (or exact during the first exact_steps iterations); a sparse
            #    gradient's rows exactly, as they are
            if buffer.is_sparse:
                average = self._sparse_average(buffer, active)
            else:
                average = active.reduce(self._begin_bucket(bucket, reducer), buffer)
        except BaseException as exc:
            active.close_step(exc)
            if self._handed is not None:  # whatever the caller does next, the optimizer does not take this step
                self._handed.hand(torch.ones((), device=buffer.device))
            raise
        # 3. the last bucket closes the step: the memories change only now, and only if every bucket went through
        #    (or, with an optimizer that skips on the device, change now and are put back if the verdict condemns)
        if bucket.is_last():
            self._end_iteration(reducer)
            if self._handed is not None:
                self._handed.hand(active.scope.close_unjudged(active.comm.device))
            else:
                active.close_step()
            if active.scope.pending is not None or active.last_step.applied:
                self.iteration += 1
            self.bytes_sent = reducer.comm.bytes_sent
        return average

    def _sparse_average(self, buffer: torch.Tensor, active: DoubleSqueeze) -> torch.Tensor:
        """A sparse bucket's exact mean (``comm.sparse_mean``), one bucket of the open step: it stages no
        memory, fails the step or skips it as a dense bucket would, and keeps its gradient where skipped."""
        name = f"ddp.sparse.{tuple(buffer.shape)}"

        def run() -> torch.Tensor:
            with statuses_meant(name, rank=active.comm.rank, on_nonfinite=self.config.on_nonfinite):
                return sparse_mean(active.comm, buffer, name=name)

        return active.scope.exchange_unstaged(run, lambda: buffer)

    def _background(self) -> "BackgroundQueue":
        if self._queue is None:
            self._queue = BackgroundQueue("dsq-ddp-hook")
            weakref.finalize(self, self._queue.close)  # a dropped state stops its thread
        return self._queue

    def _stop_background(self) -> None:
        """After a failed step: the thread, idle now, is ended and joined, so
        that nothing of this step is left running when the caller stops (or
        exits); a next step starts a new one."""
        queue, self._queue = self._queue, None
        if queue is not None:
            queue.close()
            queue.thread.join(timeout=30.0)

    def _begin_bucket(self, bucket: dist.GradBucket, reducer: DoubleSqueeze) -> str:
        """The bucket's memory name; a bucket laid out anew takes its
        parameters' worker errors and momenta from wherever they were."""
        params = bucket.parameters()
        for p in params:
            self._keys.setdefault(id(p), f"p{len(self._keys)}")
        layout = tuple((self._keys[id(p)], p.numel()) for p in params)
        if self._layout.get(bucket.index()) != layout:
            if self._old_layout is None:  # the first bucket of this iteration laid out anew
                self._old_layout = dict(self._layout)
                if reducer.two_level is None:
                    self._old_server_errors = self._gather_server_errors(reducer)
            if reducer.two_level is None:
                self._relayout(layout, reducer)
            # (two-level: the memories are host shards of the old buckets, cut elsewhere; the new bucket's
            # start from zero, as the first iteration's did: DDP lays its buckets out anew once, after it)
            self._layout[bucket.index()] = layout
        reducer.describe(_name(layout), [(f"parameter {self._keys[id(p)][1:]}", p.shape) for p in params])
        return _name(layout)

    def _end_iteration(self, reducer: DoubleSqueeze) -> None:
        """After an iteration that laid the buckets out anew: the old buckets'
        memories go. After one that did not, the layout is DDP's for good,
        and it becomes the plan of the steps to come (agreed once)."""
        if self._old_layout is None:
            if self._plan is None:
                self._plan = Plan([(_name(layout), sum(n for _, n in layout))
                                   for _, layout in sorted(self._layout.items())])
            return
        self._plan = None
        current = {_name(members) for members in self._layout.values()}
        for members in self._old_layout.values():
            if _name(members) not in current:
                for role in ("worker_error", "server_error", "momentum"):
                    reducer.state[role].drop(_name(members))
        self._old_layout = self._old_server_errors = None

    def _relayout(self, layout: Tuple[Tuple[str, int], ...], reducer: DoubleSqueeze) -> None:
        """Each parameter's memories, moved from the buckets they were in to ``layout``'s bucket."""
        where = {}  # parameter -> (its bucket's name, offset), in the layout as it was
        for members in self._old_layout.values():
            offset = 0
            for key, numel in members:
                where[key] = (_name(members), offset)
                offset += numel
        whole = {"worker_error": None, "momentum": None, "server_error": self._old_server_errors}
        for role, source in whole.items():
            memory = reducer.state[role]
            pieces = []
            for key, numel in layout:
                name, offset = where.get(key, (None, 0))
                if source is not None:
                    stored = source.get(name)
                else:
                    stored = memory.get(name, memory.numel_of(name), torch.device("cpu")) if name in memory else None
                pieces.append(torch.zeros(numel) if stored is None else stored[offset: offset + numel].cpu())
            if not any(piece.any() for piece in pieces):
                continue
            vector = torch.cat(pieces)
            if role == "server_error":  # this rank's chunk of the new bucket
                a, b = chunk_bounds(vector.numel(), reducer.comm.size)[reducer.comm.rank]
                vector = vector[a:b].clone()
            memory.set(_name(layout), vector)

    def _gather_server_errors(self, reducer: DoubleSqueeze) -> Dict[str, torch.Tensor]:
        """Every old bucket's whole server error, from each owner's chunk (an exact gather per bucket)."""
        out, comm, memory = {}, reducer.comm, reducer.state["server_error"]
        for members in self._old_layout.values():
            name, numel = _name(members), sum(n for _, n in members)
            a, b = chunk_bounds(numel, comm.size)[comm.rank]
            mine = memory.get(name, b - a, comm.device)
            out[name] = self.exact.all_gather(f"{name}.relayout", mine, numel, error_feedback=False).cpu()
        return out


class _HandedVerdict:
    """The iterations' verdicts handed to a fused optimizer as its ``found_inf``
    (a device flag, 1 to skip), kept through what else may set that flag
    before the step: ``GradScaler.step`` sets its own (for overflows) just
    before it calls the optimizer's, so a step hook of the optimizer's joins
    the two then, the larger; and an iteration whose gradients accumulate into
    a step that has not come yet joins the flag of the iterations before it.
    Device ops only: nothing waits for the device."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.flag: Optional[torch.Tensor] = None  # what this step must take into account, until it is taken
        self._stepped = True
        self._optimizer = weakref.ref(optimizer)
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)

    def hand(self, flag: torch.Tensor) -> None:
        """An iteration's verdict flag, for the optimizer's next step."""
        if not self._stepped and self.flag is not None:  # its gradient accumulates into the same step
            flag = torch.maximum(self.flag, flag)
        self.flag, self._stepped = flag, False
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer.found_inf = flag

    def forget(self) -> None:
        """Nothing pending: a checkpoint was loaded."""
        self.flag, self._stepped = None, True

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        theirs = getattr(optimizer, "found_inf", None)
        if self._stepped or self.flag is None or theirs is self.flag:
            return
        if theirs is None:
            optimizer.found_inf = self.flag
        else:  # GradScaler's, for this step
            optimizer.found_inf = torch.maximum(theirs, self.flag.to(theirs.device, theirs.dtype))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped = True


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper whose step calls it (Accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``: its ``.optimizer``): the flag goes to the
    one that steps (Lightning's wrapper copies the inner one's attributes, so it looks fused itself)."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        return _unwrapped(inner)
    return optimizer


def _skips_on_the_device(optimizer: Any) -> bool:
    """Whether ``optimizer`` takes a ``found_inf`` flag and skips its step on
    the device when it is set: torch's fused optimizers (``GradScaler``'s
    protocol, ``_step_supports_amp_scaling``)."""
    return isinstance(optimizer, torch.optim.Optimizer) and bool(getattr(optimizer, "_step_supports_amp_scaling",
                                                                         False))


def _name(layout: Tuple[Tuple[str, int], ...]) -> str:
    text = ",".join(f"{key}:{numel}" for key, numel in layout)
    return f"ddp.{zlib.crc32(text.encode()):08x}.{sum(numel for _, numel in layout)}"


def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the DoubleSqueeze average of ``bucket``
    (see the module docstring for its three steps). With ``overlap`` (the
    default) the bucket is averaged on a background thread while backward
    makes the next ones; the last bucket's call waits for them all and
    raises, from ``backward()``, what any of them raised. On a GPU the work
    runs on the hook's side stream (``side_stream``)."""
    buffer = bucket.buffer()
    handoff = state.side_streams.handoff(buffer) if state.side_streams is not None else None
    future = handoff.future(buffer.device) if handoff is not None else torch.futures.Future()

    def publish(result: torch.Tensor) -> None:
        if handoff is None:
            future.set_result(result)
            return
        with handoff.on_side():  # the future records the side stream's point: DDP's stream waits for it there
            handoff.publish(future, result)

    if not state.config.overlap:
        with handoff.on_side() if handoff is not None else contextlib.nullcontext():
            try:
                average = state._average(bucket)
            except NonFiniteGradientError as exc:
                raise _with_remedy(state, exc) from None
        publish(average)
        return future

    def job() -> None:
        result = buffer  # a failed bucket, or any after it in the iteration, keeps its gradients
        if state._failure is None:
            try:
                # the thread's current CUDA device is its own: make it the bucket's, as in the hook's caller
                with torch.cuda.device(result.device) if result.is_cuda else contextlib.nullcontext(), \
                        handoff.on_side() if handoff is not None else contextlib.nullcontext():
                    result = state._average(bucket)
            except BaseException as exc:  # noqa: BLE001 - raised from the last bucket's call, in backward()
                state._failure = exc
        publish(result)

    state._background().submit(job)
    if bucket.is_last():
        state._background().wait()
        failure, state._failure = state._failure, None
        if failure is not None:
            state._stop_background()
            if isinstance(failure, NonFiniteGradientError):
                raise _with_remedy(state, failure) from None
            raise failure
    return future


def _with_remedy(state: HookState, exc: NonFiniteGradientError) -> NonFiniteGradientError:
    """``exc`` with what to do where a hook without an optimizer to skip meets Inf: under mixed precision
    ``GradScaler``'s overflows are expected, and only a hook handed the optimizer can skip them (the
    same words on every rank: every rank has the same options)."""
    if state.optimizer is not None:
        return exc
    return NonFiniteGradientError(f"{exc}. Training with torch.amp.GradScaler, whose overflows put Inf in the "
                                  f"gradients? Hand the hook the fused optimizer and skip them: HookState(..., "
                                  f"optimizer=torch.optim.AdamW(params, fused=True), on_nonfinite='skip')", exc.ranks)


def compressed_adam(ddp_model: torch.nn.parallel.DistributedDataParallel, **options: Any) -> CompressedAdam:
    """``CompressedAdam`` over a DDP model's parameters and process group, in
    one line. DDP's own allreduce is replaced by a hook that leaves each
    rank's gradients as they are (``local_gradients``): the optimizer
    exchanges them itself, exactly during its warm-up and as a compressed
    momentum after. ``options``: CompressedAdam's (``lr``, ``freeze_step``,
    ``compressor`` ...)."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError(f"compressed_adam needs a DistributedDataParallel model, got {type(ddp_model).__name__}; "
                          f"for a plain module use dsq_plugins.CompressedAdam(model.named_parameters(), comm=...)")
    ddp_model.register_comm_hook(None, local_gradients)
    comm = TorchDistributedComm(ddp_model.process_group)
    named = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
    return CompressedAdam(named, comm=comm, **options)


def local_gradients(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP hook that exchanges nothing: each rank keeps its own gradients."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def lightning_callback(state: HookState, comm_hook: Any = hook) -> Any:
    """A Lightning callback that registers ``comm_hook`` with ``state`` on the
    DDP model Lightning built, once the strategy has wrapped it. Lightning
    2.6's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` skips
    the registration unless the device is CUDA; this works on every device
    (use one or the other: DDP takes one hook). Needs ``lightning`` (or
    ``pytorch_lightning``) installed."""
    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback

    class RegisterCommHook(Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            model = trainer.strategy.model
            if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
                raise ConfigError(f"lightning_callback needs a DDP strategy; the trainer's model is "
                                  f"{type(model).__name__}")
            model.register_comm_hook(state, comm_hook)

    return RegisterCommHook()
