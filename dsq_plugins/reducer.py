"""DoubleSqueeze on a sharded server: error-compensated compression on the
worker pass and again on the server pass (Tang et al., ICML 2019, Alg. 1).

``DoubleSqueeze`` is a façade over the pieces that do the work:

* ``config.ReducerConfig``: the options, validated once;
* ``algorithm.Algorithm1``: one bucket's exchange, over
  ``algorithm.WorkerPass`` (v = g + d_worker, Q per chunk, all-to-all) and
  ``algorithm.ServerPass`` (aggregate, + d_server, Q' again, all-gather);
* ``step.Checks``: when problems are judged (at each collective, or once per step);
* ``step.StepScope``: steps, written only when every bucket succeeded;
* ``state.ReducerState``: the error memories and counters a checkpoint holds;
* ``algorithm.Seeds`` and the fault hook (``testing.faults``).

What it adds is the public API: tensors in and out (flattening, buckets,
buffers kept across steps), and the step as a ``with`` block.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from .algorithm import WORKER_SIDE, Seeds, build_exchange, host_groups, shared_draw
from .config import ReducerConfig
from .errors import ConfigError
from .layout import (Bucket, KeptBuffers, Ownership, Pieces, chunk_bounds, flat_input, input_problem,
                     length_problem, Layouts, resolve_hosts)
from .state import ReducerState
from .step import SKIPPED, Plan, Step, StepScope

if TYPE_CHECKING:
    from .comm import Communicator

__all__ = ["DoubleSqueeze", "chunk_bounds"]


class DoubleSqueeze:
    """Averages gradients across the ranks of ``comm`` with double-pass
    error-compensated compression.

    Args:
        comm: a ``Communicator`` (``LocalGroup`` rank, ``TorchDistributedComm``,
            or an engine adapter).
        compressor, server_compressor, error_feedback, aggregator, options:
            any option by name (``compressor_params``, ``bucket_mb``,
            ``owners``, ``faults``, ``verdict`` ...), as ``ReducerConfig``
            defines each once; or ``config=`` a ready one.
    """

    def __init__(self, comm: Communicator, compressor: Any = "sign", server_compressor: Any = None,
                 error_feedback: str = "both", aggregator: Any = "mean", *, config: ReducerConfig | None = None,
                 **options: Any):
        config = ReducerConfig.build(config, dict(compressor=compressor, server_compressor=server_compressor,
                                                  error_feedback=error_feedback, aggregator=aggregator), options)
        self.config, self.comm = config, comm
        self.compressor, self.server_compressor = config.build_compressors(warn=True, stacklevel=2)
        self.error_feedback = config.error_feedback
        #: the hosts (``layout.resolve_hosts``); two-level: Algorithm 1 runs among the hosts, on ``cross_comm``
        self.hosts = resolve_hosts(comm, config.hierarchy, config.node_size)
        self.node_comm, self.cross_comm = host_groups(comm, self.hosts, (self.compressor, self.server_compressor))
        algorithm_comm = self.cross_comm or comm
        self.ownership = Ownership(config.owners, algorithm_comm.size)
        spec = config.build_faults()
        config.warn_about_faults(spec, self.ownership, stacklevel=2)
        #: steps with a plan judge their verdicts once, at their end (``dsq_plugins.step``)
        self.defers_verdicts = config.defers_verdicts(comm.device, bool(spec))
        identity = {"rank": comm.rank, "size": comm.size}
        if self.hosts.two_level:
            identity["hosts"] = self.hosts.describe()
        self.state = ReducerState(identity, error_dtype=config.error_dtype)
        self.scope = StepScope(self.state, self.defers_verdicts, lambda: config.agree_across(comm))
        self.seeds = Seeds(config.seed, shared_draw(self.compressor, self.server_compressor))
        self.faults = config.build_fault_hook(spec, algorithm_comm.rank, algorithm_comm.size)
        pieces = (config, self.state, self.seeds, self.faults, self.ownership)
        self.worker, self.server, self.algorithm, self.two_level = build_exchange(
            comm, algorithm_comm, self.node_comm, self.hosts, (self.compressor, self.server_compressor), pieces)
        self._layouts = Layouts(config.bucket_mb, config.layerwise)
        self._plans: dict[int, tuple[list[Bucket], Plan]] = {}  # by the id of their layout
        self._kept = KeptBuffers()

    @classmethod
    def exact(cls, comm: Communicator, **options: Any) -> "DoubleSqueeze":
        """A reducer that averages exactly (fp32, no error feedback; flat unless
        ``hierarchy`` says otherwise): the warm-up and control exchanges."""
        return cls(comm, "none", error_feedback="none", **{"hierarchy": "flat", **options})

    # -- the state, by role --------------------------------------------------
    worker_error = property(lambda self: self.state["worker_error"])
    server_error = property(lambda self: self.state["server_error"])
    momentum = property(lambda self: self.state["momentum"])
    tracked = property(lambda self: self.state["tracked"])
    replicas = property(lambda self: self.state["replicas"])
    aggregates = property(lambda self: self.state["aggregates"])
    steps = property(lambda self: self.state.steps, doc="exchanges applied, by bucket name")
    skipped_steps = property(lambda self: self.state.skipped_steps)
    rejected = property(lambda self: self.server.rejected, doc="payloads left out (strict_payloads=False), by sender")
    last_step = property(lambda self: self.scope.last, doc="the last closed step (its outcome)")

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last closed step was skipped (``on_nonfinite="skip"``)."""
        return self.last_step is not None and self.last_step.outcome == SKIPPED

    # -- steps ----------------------------------------------------------------
    def step(self, plan: Plan | None = None) -> contextlib.AbstractContextManager[Step]:
        """The scope of one optimizer step: every ``reduce``, ``reduce_many``
        and ``reduce_bucket`` inside it belongs to this step, and their state
        is written on leaving it only if all succeeded. Nested scopes join the
        open one. The yielded ``Step`` says the outcome once closed.

        ``plan``: the buckets the step will exchange (a ``step.Plan``), so
        that a reducer that defers verdicts judges them once, here, at the
        step's end (``reduce_many`` and ``reduce`` plan their own steps)."""
        return self.scope(plan)

    def open_step(self, plan: Plan | None = None) -> Step:
        """Start a step to hold across calls (ZeRO from its accumulation
        boundary to its optimizer step, a DDP hook across buckets); end it
        with ``close_step``. ``with reducer.step():`` is the same for a block."""
        return self.scope.open(plan)

    def close_step(self, error: BaseException | None = None) -> Step:
        """End the step ``open_step`` started: with ``error`` it failed and
        writes nothing; otherwise it is judged and, if it succeeded, written."""
        return self.scope.close(error)

    # -- the public reduce API ---------------------------------------------------
    def reduce(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The average of ``tensor`` over all ranks (compressed both ways),
        same shape and dtype. ``name`` keys the error memory: use the same
        name for the same tensor at every step, on every rank."""
        problem = input_problem(tensor, f"reduce({name!r})")
        if tensor.dim() >= 2:  # (a flat vector stays undescribed: it may be many tensors)
            self.describe(name, [(name, tensor.shape)])
        with self.step() as current:
            judged_at_close = current.plan is not None  # a caller's planned step (the DDP hook's) judges once
            self.scope.adopt_plan(current, Plan([(name, tensor.numel())]))
            flat = self._exchange(name, flat_input(tensor, problem), problem)
            if not judged_at_close:
                self.scope.settle(current)
            return (flat.zero_() if current.skipped else flat).reshape(tensor.shape).to(tensor.dtype)

    def reduce_many(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, in_place: bool = False
                    ) -> list[torch.Tensor]:
        """Average many tensors at once, fused into buckets; results in the
        order given. The order must be the same on every rank. One step.
        ``in_place``: write the averages into the given tensors (an in-place
        allreduce, as the engines do with gradients) and return them; a step
        that fails may leave some of them written."""
        named = list(named_tensors)
        problem = next(filter(None, (input_problem(t, f"reduce_many({n!r})") for n, t in named)), None)
        by_name = dict(named)
        out: list[torch.Tensor] = []
        with self.step() as current:
            buckets = self.layout([(n, tuple(t.shape)) for n, t in named])
            self.scope.adopt_plan(current, Plan([(bucket.name, bucket.numel) for bucket in buckets]))
            for bucket in buckets:
                out.extend(self._reduce_bucket(bucket, [by_name[slot.name] for slot in bucket.slots], problem,
                                               in_place))
            self.scope.settle(current)
            if current.skipped:  # a later bucket skipped the step: no part of it is applied
                out = [t.zero_() for t in out] if in_place else [torch.zeros_like(t) for t in out]
        return out

    def reduce_flat(self, entries: Sequence[tuple[str, Sequence[int]]], flat: torch.Tensor, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """``reduce_many`` of the tensors laid end to end in ``flat``, named and
        shaped by ``entries`` (in order): the same buckets, bytes, memories and
        results, each bucket read as one piece of ``flat`` where ``reduce_many``
        reads it tensor by tensor; the average as one fp32 vector (in ``out`` when given)."""
        buckets = self.layout(entries)
        total = sum(bucket.numel for bucket in buckets)
        out = torch.empty(total, dtype=torch.float32, device=flat.device) if out is None else out
        problem = input_problem(flat, "reduce_flat") or length_problem("reduce_flat", total, flat, out)
        if problem is None:
            flat = flat_input(flat, None)
        else:  # announced to every rank by the first bucket's exchange, which raises it
            flat, out = torch.zeros(total, device=flat.device), torch.empty(total, device=flat.device)
        with self.step() as current:
            self.scope.adopt_plan(current, Plan([(bucket.name, bucket.numel) for bucket in buckets]))
            for bucket, start in zip(buckets, itertools.accumulate([0] + [b.numel for b in buckets])):
                self.describe(bucket.name, bucket.tensors)
                part = out[start:start + bucket.numel]
                average = self._exchange(bucket.name, flat[start:start + bucket.numel], problem, out=part)
                if average is not part:  # owners="all"'s own vector, a skipped step's zeros
                    part.copy_(average)
            self.scope.settle(current)
        return out.zero_() if current.skipped else out

    def reduce_bucket(self, bucket: Bucket, tensors: Sequence[torch.Tensor], *, in_place: bool = False
                      ) -> list[torch.Tensor]:
        """Average one bucket of a ``layout``. Inside ``step()`` it is one
        bucket of that step (the engine adapters exchange buckets one at a
        time, as their gradients become ready); outside, a step of its own.
        ``in_place`` as in ``reduce_many``."""
        problem = next(filter(None, (input_problem(t, f"reduce_bucket({bucket.name!r})") for t in tensors)), None)
        with self.step() as current:
            owned = current.exchanged == 0 and current.plan is None  # a step of its own: planned and settled here
            if owned:
                self.scope.adopt_plan(current, Plan([(bucket.name, bucket.numel)]))
            out = self._reduce_bucket(bucket, tensors, problem, in_place)
            if owned:
                self.scope.settle(current)
                if current.skipped:
                    out = [t.zero_() for t in out]
            return out

    def reduce_scatter(self, name: str, flat: torch.Tensor, *, divide_by: torch.Tensor | None = None) -> torch.Tensor:
        """The worker pass alone (ZeRO's gradient reduce-scatter): this
        rank's chunk (``chunk_bounds``) of the aggregate of every rank's
        compressed, error-compensated ``flat`` vector, in fp32. The worker
        error is staged in the open step like ``reduce``'s. Needs owners=1:
        the chunk's one owner is who consumes it. ``divide_by``: compress ``flat``
        / it, the same on every rank, laid out as this rank's host shard."""
        self._require_one_owner("reduce_scatter")
        problem = input_problem(flat, f"reduce_scatter({name!r})")
        a, b = chunk_bounds(flat.numel(), self.comm.size)[self.comm.rank]
        half = self.algorithm if self.two_level is None else self.two_level
        with self.step() as current:
            checks = self.algorithm.checks_for(current, name, flat.numel())
            return self.scope.exchange(lambda: half.reduce_scatter(name, flat_input(flat, problem), problem, divide_by,
                                                                   checks),
                                       lambda: torch.zeros(b - a, device=flat.device))

    def all_gather(self, name: str, chunk: torch.Tensor, numel: int, *, error_feedback: bool = True,
                   keep_payloads: bool = False) -> Any:
        """The server pass alone (ZeRO's parameter all-gather): every rank
        compresses its own ``chunk`` of a ``numel``-element vector with the
        server compressor and every rank decodes all of them, in rank order,
        into the same fp32 vector. ``error_feedback``: keep this pass's
        server error (False when the caller carries the residual itself, as
        ZeRO's replica gap does). ``keep_payloads``: return ``(vector,
        algorithm.ServedPayloads)``, the payloads to rebuild it from later
        (None for a skipped step, or where none crossed a host link); in
        two levels, for state kept 1/L per rank, the vector is then this
        rank's host shard, the chunks of its local index on every host in
        host order (``HostLayout.position``), without the in-host stage."""
        self._require_one_owner("all_gather")
        rank = self.comm.rank
        a, b = chunk_bounds(numel, self.comm.size)[rank]
        problem = input_problem(chunk, f"all_gather({name!r})")
        if problem is None and chunk.numel() != b - a:
            problem = ValueError(f"all_gather({name!r}): rank {rank} holds chunk [{a}, {b}) of {numel} elements, "
                                 f"got {chunk.numel()}")
        g = flat_input(chunk, problem) if problem is None else torch.zeros(b - a, device=chunk.device)
        with self.step():
            zeros = lambda: torch.zeros(numel, device=chunk.device)  # noqa: E731
            if self.two_level is None:
                return self.scope.exchange(
                    lambda: self.algorithm.all_gather(name, g, problem, numel, error_feedback, keep_payloads),
                    (lambda: (zeros(), None)) if keep_payloads else zeros)
            if keep_payloads:
                shard = numel // self.hosts.per_host
                return self.scope.exchange(lambda: self.two_level.host_shard(name, g, problem, error_feedback),
                                           lambda: (torch.zeros(shard, device=chunk.device), None))
            return self.scope.exchange(lambda: self.two_level.all_gather(name, g, problem, error_feedback), zeros)

    def describe(self, name: str, tensors: Sequence[tuple[str, Sequence[int]]]) -> None:
        """The tensors (name, shape), in order, that the flat vector reduced
        as ``name`` is made of, for structured operators (``lowrank``: each
        its own matrix); see ``chunk_sizes``. ``reduce_many``/``_bucket``
        describe their own. A ``ConfigError`` names a tensor refused."""
        self.algorithm.sizes.describe(name, tensors)

    def layout(self, entries: Sequence[tuple[str, Sequence[int]]]) -> list[Bucket]:
        """The (cached) bucket layout for these names and shapes (``layout.Layouts``)."""
        return self._layouts(entries)

    def plan_of(self, entries: Sequence[tuple[str, Sequence[int]]]) -> Plan:
        """The plan of a ``reduce_many`` over these names and shapes, one object while they stay the same:
        passed to ``step(plan)`` it is agreed at the first step only (``reduce_many`` agrees at each call)."""
        buckets = self.layout(entries)
        held = self._plans.get(id(buckets))  # (the layouts are kept, so their ids stay theirs)
        if held is None:
            held = self._plans[id(buckets)] = (buckets, Plan([(bucket.name, bucket.numel) for bucket in buckets]))
        return held[1]

    # -- checkpoints and seeds -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Error memories and step counters: everything needed to continue
        bit for bit. Each rank saves its own (server error is per rank); a step closed unjudged is judged first."""
        self.scope.judge_pending()
        return self.state.state_dict(
            compressor=[type(self.compressor).name, self.compressor.params()],
            server_compressor=[type(self.server_compressor).name, self.server_compressor.params()],
            error_feedback=self.error_feedback)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a ``StateError`` if it is not this rank's
        (policy ``"raise"`` of ``state.OTHER_RANK_POLICIES``: load each rank's
        own, or ``dsq_plugins.reshard`` them for another world size). A step closed unjudged is forgotten."""
        self.state.load_state_dict(state)
        self.scope.pending = None

    def chunk_seed(self, name: str, step: int, side: str, sender: int, chunk: int) -> int:
        """Seed of the payload ``sender`` makes for ``chunk`` of ``name`` at
        ``step`` on ``side`` "w" (worker pass) or "s" (server pass); every rank
        derives the same value, so seeds never travel."""
        return self.seeds.chunk(name, step, side, sender, chunk)

    # -- one bucket --------------------------------------------------------------
    def _exchange(self, name: str, g: torch.Tensor | Pieces, problem: Exception | None = None,
                  out: torch.Tensor | Pieces | None = None) -> torch.Tensor | Pieces:
        """Algorithm 1 for one bucket of the open step, its verdicts judged
        once per step when the step's plan covers the bucket."""
        checks = self.algorithm.checks_for(self.scope.current, name, g.numel())
        exchange = self.algorithm if self.two_level is None else self.two_level
        return self.scope.exchange(lambda: exchange.reduce(name, g, problem, checks, out),
                                   lambda: torch.zeros(g.numel(), device=g.device))

    def _reduce_bucket(self, bucket: Bucket, tensors: Sequence[torch.Tensor], problem: Exception | None,
                       in_place: bool = False) -> list[torch.Tensor]:
        if problem is not None:  # announced to every rank by the exchange, which raises it here
            return self._exchange(bucket.name, torch.zeros(bucket.numel, device=tensors[0].device), problem)
        self.describe(bucket.name, bucket.tensors)
        device = tensors[0].device
        # with worker-side feedback the worker pass compresses g + error, a buffer of its own: g is read once
        compresses_a_copy = self.error_feedback in WORKER_SIDE
        if len(bucket.slots) == 1:  # a lone tensor flattens to a view of itself
            flat: torch.Tensor | Pieces = bucket.flatten(tensors)
        elif compresses_a_copy and not self.config.worker_momentum:
            flat = Pieces(bucket, tensors)  # g + error is summed from the pieces: never flattened
        else:  # several tensors are copied into a buffer kept across steps
            flat = bucket.flatten(tensors, self._kept.get((bucket.name, "flat"), bucket.numel, device))
        if not in_place:
            return bucket.unflatten(self._exchange(bucket.name, flat), tensors)
        target = Pieces(bucket, tensors)
        if not (compresses_a_copy and target.writable()):
            # the average never leaves this call, so it may live in a buffer kept across steps
            target = self._kept.get((bucket.name, "average"), bucket.numel, device)
        # else the served chunks are decoded straight into the tensors: nothing reads g once they arrive
        average = self._exchange(bucket.name, flat, out=target)
        if not isinstance(average, Pieces):  # a kept buffer, owners="all"'s own vector, a skipped step's zeros
            bucket.unflatten_into(average, tensors)
        return list(tensors)

    def _require_one_owner(self, what: str) -> None:
        if self.two_level is not None and not self.two_level.consecutive:
            raise ConfigError(f"{what} in two levels (hierarchy={self.config.hierarchy!r}): ZeRO's partition r must "
                              f"be rank r's, so each host's ranks must be consecutive; use hierarchy='flat' for it")
        if self.ownership.r != 1:
            raise ConfigError(f"{what} gives each chunk to one owner; this reducer has owners={self.config.owners}")
        if self.error_feedback == "ef21":
            raise ConfigError(f"{what} keeps DoubleSqueeze's error memories; error_feedback='ef21' needs the "
                              f"full exchange (reduce or reduce_many)")

