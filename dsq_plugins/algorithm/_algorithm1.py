"""Algorithm 1 of DoubleSqueeze (Tang et al., ICML 2019) for one bucket, on
a sharded server; the one copy of it, whichever way its verdicts are judged
(``step.Checks``: at each collective, or once per step).

    worker i:  v_i = g_i + d_i;  c_i = Q(v_i);  d_i' = v_i - c_i
    owner k:   u = mean_i(c_i) + d;  r = Q'(u);  d' = u - r
    everyone:  the average is r, all chunks together

The two half passes ZeRO uses (``reduce_scatter``: the worker pass and the
aggregation of this rank's chunk; ``all_gather``: the server pass alone) are
here too. Every function returns what its round staged; nothing is written
until the step scope (``step.StepScope``) applies the whole step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Communicator, header
from ..compressors import Compressor
from ..compressors.base import TRUSTED
from ..compressors.decoded import Decoded
from ..compressors.finite import all_finite
from ..compressors.shapes import without_warm
from ..errors import CollectiveMismatchError
from ..layout import Ownership, Pieces, chunk_bounds
from ..state import ReducerState, StagedUpdate
from ..step import IMMEDIATE, Checks, Deferred, Plan, Round, Step, explainer
from . import arithmetic as passes
from ._chunk_sizes import ChunkSizes
from ._seeds import Seeds
from ._server_pass import Served, ServerPass, Serving
from ._worker_pass import WorkerPass
from .arithmetic import SERVER_SIDE


@dataclass
class ServedPayloads:
    """What a server pass moved: each owner's payload of bucket ``name`` at
    ``step``. ``decode`` gives back the vector every rank decoded, bit for
    bit, from about as many bytes as travelled (1 bit per element for sign)."""

    name: str
    step: int
    payloads: list
    sizes: list | None = None  # each chunk's size as the operator was told it (``Round.served_sizes``)

    def decode(self, compressor: Compressor, seeds: Seeds, numel: int, device: torch.device) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32, device=device)
        for k, (a, b) in enumerate(chunk_bounds(numel, len(self.payloads))):
            size = self.sizes[k] if self.sizes else b - a
            compressor.decode(self.payloads[k].to(device), size, seeds.server(self.name, self.step, k),
                              refusals=TRUSTED).write_to_(out[a:b])  # decoded once already, when they arrived
        return out

    def nbytes(self) -> int:
        return sum(int(p.numel()) for p in self.payloads)


class Algorithm1:
    """The rounds of one reducer, over its worker and server passes."""

    def __init__(self, comm: Communicator, worker: WorkerPass, server: ServerPass, state: ReducerState,
                 ownership: Ownership, seeds: Seeds, plans_agreed_on: Communicator | None = None):
        self.comm, self.worker, self.server, self.state = comm, worker, server, state
        #: where a deferred step's plan is agreed: every rank of the reducer (among the hosts, two levels have
        #: each rank exchange with its host too, so a plan agreed by one cross group alone would not do)
        self.plans_agreed_on = plans_agreed_on or comm
        self.ownership, self.seeds = ownership, seeds
        #: what structured operators are told about each chunk (``chunk_sizes``)
        self.sizes = ChunkSizes((worker.q, server.qs), state)

    def round(self, name: str, numel: int, device: torch.device) -> Round:
        rnd = Round(name, numel, chunk_bounds(numel, self.comm.size), header.make_tag(name, numel),
                    self.state.steps.get(name, 0), device, StagedUpdate(name))
        self.sizes.fill(rnd)
        return rnd

    def reduce(self, name: str, g: torch.Tensor | Pieces, problem: Exception | None, checks: Checks,
               out: torch.Tensor | Pieces | None = None) -> tuple[StagedUpdate, torch.Tensor | Pieces]:
        """The average of every rank's ``g``; returns what to stage and the
        average (built in ``out`` when given, and then ``out`` itself).
        ``problem``: why this rank cannot take part (announced, then raised)."""
        rnd = self.round(name, g.numel(), g.device)
        # 1. worker: v = g + d_worker; Q(v) chunk by chunk; chunk k to its owners
        sent = self.worker.build(rnd, g, problem, checks)
        received = self.worker.send(rnd, sent, checks)
        if self.ownership.everyone:  # every rank aggregates every chunk itself: no server pass
            own, out = self.server.aggregate_everything(rnd, received)
            serving = Serving()
        else:
            # 2. owner: decode the contributions, aggregate, u = mean + d_server, squeeze Q'(u)
            serving = self.server.serve(rnd, received, checks)
            # 3. all-gather every owner's Q'(u); every rank decodes them into the average
            out = self.server.finish(rnd, serving, checks, out)
            own = serving.own()
            if self.ownership.r == 1 and rnd.local_error is None:
                self.sizes.keep_served(rnd)
        # 4. stage d_worker' = v - Q(v) and d_server' = u - Q'(u), written if the whole step succeeds
        if rnd.local_error is None:
            self.worker.stage(rnd, sent, own)
            self.server.stage(rnd, serving)
        return rnd.update, out

    def reduce_scatter(self, name: str, g: torch.Tensor, problem: Exception | None,
                       divide_by: torch.Tensor | None = None, checks: Checks = IMMEDIATE
                       ) -> tuple[StagedUpdate, torch.Tensor]:
        """The worker pass and the aggregation of this rank's chunk (one
        owner per chunk), of ``g / divide_by`` where given. What this owner
        found in the payloads it decoded is announced in a header-only round,
        since no server pass carries it: read at once, or, deferred, with
        the rest of the step when it settles."""
        if divide_by is not None:
            g = g / divide_by.reshape(-1).to(g.dtype)
        rank = self.comm.rank
        rnd = self.round(name, g.numel(), g.device)
        sent = self.worker.build(rnd, g, problem, checks)
        received = self.worker.send(rnd, sent, checks)
        pieces = self.server.pieces_by_chunk(received, [rank], rnd.sizes)[rank]
        folded = self.server.folded_mean(rnd, rank, pieces, checks) if rnd.local_error is None else None
        if folded is not None:  # the mean from the payloads in one pass: no contribution decoded on its own
            mean, checked, formed, _ = folded
            own = None
        else:
            usable, own, checked = self.server.contributions(rnd, rank, pieces, checks)
            formed = None
        if self.server.strict and self.comm.size > 1:
            explain = explainer(rnd, rank=rank, on_nonfinite=self.server.on_nonfinite,
                                refusal=checks.refusal(checked))
            status = checks.served_status(checked, True, formed)
            nothing = torch.empty(0, dtype=torch.uint8, device=g.device)
            checks.collective(lambda verdict: self.comm.allgather(
                nothing, tag=rnd.tag, status=status, expected=[0] * self.comm.size, verdict=verdict), explain)
        out = mean if folded is not None else self.server.aggregate(rnd, rank, usable)
        if rnd.local_error is None:  # deferred: the verdict fails this step on every rank
            self.worker.stage(rnd, sent, {rank: own})
        return rnd.update, out

    def all_gather(self, name: str, chunk: torch.Tensor, problem: Exception | None, numel: int,
                   error_feedback: bool, keep_payloads: bool = False) -> tuple[StagedUpdate, Any]:
        """The server pass alone: squeeze this rank's chunk (with its server
        error when kept) and decode every rank's into one vector; with
        ``keep_payloads``, also the payloads that vector was decoded from."""
        rank, device = self.comm.rank, chunk.device
        rnd = self.round(name, numel, device)
        a, b = rnd.bounds[rank]
        keep = error_feedback and self.server.error_feedback in SERVER_SIDE
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        served, status = Served(rank), header.OK
        try:
            if problem is not None:
                raise problem
            server_error = self.state["server_error"].to_add(name, b - a, device) if keep else None
            seed = self.seeds.server(name, rnd.step, rank)
            # the residual from Q'(u)'s own pass where what every rank decodes is what was squeezed
            memory = self.state["server_error"] if keep and self.server.trusts_served() else None
            served.squeezed = passes.server_squeeze(self.server.qs, chunk, server_error, seed,
                                                    size=rnd.served_sizes[rank], decay=self.server.decay,
                                                    memory=memory)
            served.payload = served.squeezed.payload
            if not all_finite(served.squeezed.u):
                status, served.payload = header.NONFINITE, empty
            else:
                served.payload = self.server.faults.server_payload(served.payload, numel=rnd.served_sizes[rank],
                                                                   compressor=self.server.qs, step=rnd.step, seed=seed)
        except Exception as exc:  # noqa: BLE001 - announced to every rank, then raised here
            served = Served(rank, squeezed=passes.Squeezed(empty, chunk), payload=empty)
            status = rnd.fail_locally(exc)
        out = self.server.finish(rnd, Serving({rank: served}, status), IMMEDIATE)
        if keep:
            rnd.update.server_errors[name] = passes.server_residual(served.squeezed, Decoded(out[a:b], b - a),
                                                                    self.state["server_error"])
        if keep_payloads:
            sizes = [without_warm(size) for size in rnd.served_sizes]
            return rnd.update, (out, ServedPayloads(name, rnd.step, list(rnd.gathered), sizes))
        return rnd.update, out

    def checks_for(self, current: Step, name: str, numel: int) -> Checks:
        """The verdict protocol of bucket ``name`` in step ``current``: judged
        once, at the step's end, where the step's plan (agreed with the other
        ranks first) covers it; at each collective otherwise."""
        if current.verdict is not None and current.plan.covers(name, numel):
            self.agree(current.plan, (self.worker.q, self.server.qs))
            return Deferred(current.verdict)
        return IMMEDIATE

    def agree(self, plan: Plan, compressors: tuple[Compressor, Compressor]) -> None:
        """Every rank's plan the same, before the first payload of a deferred
        step moves: then every collective of the step has the same lengths on
        every rank (one header round, read on the host; once per plan)."""
        if plan.agreed:
            return
        comm = self.plans_agreed_on
        try:
            comm.allgather(torch.empty(0, dtype=torch.uint8, device=comm.device), tag=plan.tag(*compressors))
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(f"the ranks planned steps over different tensors (names, sizes or "
                                          f"compressors): {exc}") from None
        plan.agreed = True
