"""The worker pass of Algorithm 1 (Tang et al., ICML 2019):

    v = g + d_worker;  c_k = Q(v_k) for each chunk k;  chunk k to its owners;
    d_worker' = v - c   (staged, written when the whole step succeeded)

Each chunk is compressed on its own so that its payload can go to the
chunk's owner alone (an all-to-all; with ``owners="all"`` an all-gather).
Headers go first: a rank that cannot take part (its gradient is not finite,
or building its payloads raised) says so in its status, and every rank stops
at the same collective with the same error (``step.raise_for_statuses``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from ..comm import Communicator, header, joined
from ..compressors import Compressor
from ..compressors.decoded import Decoded
from ..layout import Ownership, Pieces
from ..state import ReducerState
from ..state.compact import Stored
from ..step import Checks, Round, explainer
from ..testing.faults import FaultInjector, NoFaults
from . import arithmetic as passes
from ._seeds import Seeds
from ._payloads_and_residual import payloads_with_residual
from .arithmetic import WORKER_SIDE

if TYPE_CHECKING:  # the options are read here, never built
    from ..config import ReducerConfig


@dataclass
class Sent:
    """What this rank built as a worker in one round."""

    compensated: passes.Compensated | None = None
    tracked: torch.Tensor | None = None            # ef21: this worker's state h before the step
    payloads: list = field(default_factory=list)   # what the honest code built, one per chunk
    status: int | torch.Tensor = header.OK
    #: v - Q(v) as the int8 memory stores it, where the encode formed it in its own pass (``payloads_with_residual``)
    residual: Stored | None = None


class WorkerPass:
    """This rank's part as a worker: compensate, compress, send, and stage
    its memories from what it sent."""

    def __init__(self, comm: Communicator, compressor: Compressor, config: ReducerConfig, state: ReducerState,
                 seeds: Seeds, faults: FaultInjector | NoFaults, ownership: Ownership):
        self.comm, self.q, self.state, self.seeds = comm, compressor, state, seeds
        self.faults, self.ownership = faults, ownership
        self.error_feedback = config.error_feedback
        self.beta = float(config.worker_momentum)
        self.decay = float(config.error_decay)
        self.strict = config.payloads_strict()
        self.on_nonfinite = config.on_nonfinite

    def compensate(self, name: str, g: torch.Tensor | Pieces, device: torch.device, check: bool = True,
                   bounds: Sequence[tuple[int, int]] = ()) -> tuple[passes.Compensated, torch.Tensor | None]:
        """(v = g, or its momentum, plus the worker error, built in the error's
        recycled buffer; with ef21 this worker's state h, and v = x - h).
        ``check=False`` leaves the finiteness test to the caller, or to v's own
        pass where it can make it (``Compensated.status``). ``bounds``: v's chunks, where
        the merged encode will take them (``payloads_with_residual``): blocksign's codes
        of them then come from v's pass (``Compensated.coded``)."""
        numel, memories = g.numel(), self.state
        momentum = memories["momentum"].get(name, numel, device) if self.beta else None
        tracked = None
        if self.error_feedback == "ef21":  # compress x - h, where x is the gradient or its momentum
            tracked = memories["tracked"].get(name, numel, device)
            worker_error = -tracked
        elif self.error_feedback in WORKER_SIDE:
            worker_error = memories["worker_error"].to_add(name, numel, device)
        else:
            worker_error = None
        out = memories["worker_error"].scratch(name, numel, device) if self.error_feedback in WORKER_SIDE else None
        encoder = self.q if bounds else None
        return passes.compensate(g, worker_error=worker_error, momentum=momentum, beta=self.beta, out=out,
                                 check=check, decay=self.decay,  # ef21 configs keep decay 1
                                 encoder=encoder, bounds=bounds), tracked

    def build(self, rnd: Round, g: torch.Tensor | Pieces, problem: Exception | None, checks: Checks) -> Sent:
        """Compensate and compress every chunk (nothing stored yet).
        ``problem``: why this rank cannot take part; announced, then raised."""
        q, rank = self.q, self.comm.rank
        def placeholders() -> list[torch.Tensor]:  # made only when needed: a zero fill per chunk is a launch each
            return [checks.placeholder(q.payload_nbytes(m), rnd.device) for m in rnd.sizes]
        sent = Sent()
        c = None
        try:
            if problem is not None:
                raise problem
            merged = self._residual_with_payloads(q)
            c, sent.tracked = self.compensate(rnd.name, g, rnd.device, check=not checks.deferred,
                                              bounds=rnd.bounds if merged else ())
            sent.compensated = c
            if c.finite:
                fused = payloads_with_residual(q, c.v, rnd.bounds, c.coded, scratch=c.owned) if merged else None
                if fused is not None:
                    sent.payloads, sent.residual = fused
                else:
                    sent.payloads = passes.compress_chunks(q, c.v, rnd.bounds,
                                                           lambda k: self.seeds.worker(rnd.name, rnd.step, rank, k),
                                                           rnd.sizes)
                sent.status = checks.finite_status(c.v) if c.status is None else c.status
            else:
                sent.payloads = placeholders()
                if self.strict:
                    sent.status = header.NONFINITE
                # else (robust mode) a non-finite rank sends nothing and is left out like a malformed peer
        except Exception as exc:  # noqa: BLE001 - announced to every rank, then raised here
            sent.payloads = placeholders()
            sent.status = checks.failure(rnd, None if c is None else c.v, exc)
            if rnd.local_error is not None:
                sent.compensated = None
        return sent

    def _residual_with_payloads(self, q: Compressor) -> bool:
        """Whether v - Q(v) may be formed with the payloads, before they travel: bound for an int8
        memory, no fault hook to replace them (the residual is then of what the owners decoded), and
        no encoder set on the operator itself (a wrapper, a test's faulty one: it is what encodes)."""
        return (self.error_feedback in ("both", "worker") and self.state["worker_error"].dtype == "int8"
                and isinstance(self.faults, NoFaults) and "compress_chunks" not in vars(q))

    def send(self, rnd: Round, sent: Sent, checks: Checks) -> list[torch.Tensor | None]:
        """Chunk k's payload to its owners (through the fault hook); returns
        what each rank sent here, by sender (None: refused)."""
        comm, q, own, n = self.comm, self.q, self.ownership, len(rnd.bounds)
        sizes = rnd.sizes
        wire = self.faults.worker_payloads(
            list(sent.payloads), sizes=sizes, compressor=q, step=rnd.step,
            seed_of=lambda j, k: self.seeds.worker(rnd.name, rnd.step, j, k),
            side_exchange=lambda everything: self._side_exchange(everything, rnd.tag))
        nbytes = [q.payload_nbytes(m) for m in sizes]
        explain = explainer(rnd, rank=comm.rank, on_nonfinite=self.on_nonfinite)
        if own.everyone:
            message, expected = torch.cat(wire), [sum(nbytes)] * n
            return checks.collective(lambda verdict: comm.allgather(
                message, tag=rnd.tag, status=sent.status, expected=expected, strict=self.strict, verdict=verdict),
                explain)
        messages = [joined([wire[k] for k in own.served_by(j)]) for j in range(n)]
        expected = [sum(nbytes[k] for k in own.served_by(j)) for j in range(n)]
        return checks.collective(lambda verdict: comm.alltoall(
            messages, tag=rnd.tag, status=sent.status, expected=expected, strict=self.strict, verdict=verdict),
            explain)

    def stage(self, rnd: Round, sent: Sent, own: dict[int, Decoded | None]) -> None:
        """Stage this worker's momentum and error (or EF21 state) from what it
        sent; ``own``: its chunks as its owners already decoded them, by index.
        (Robust mode: a rank left out for a non-finite gradient keeps its
        worker memories as they were.)"""
        c = sent.compensated
        if c is None or not c.finite:
            return
        rnd.update.momentum = c.momentum
        seed_of = lambda k: self.seeds.worker(rnd.name, rnd.step, self.comm.rank, k)  # noqa: E731
        if self.error_feedback == "ef21":  # h' = h + Q(x - h), formed as the owners form their replica of it
            rnd.update.tracked = sent.tracked + passes.decoded_chunks(self.q, sent.payloads, rnd.bounds, seed_of,
                                                                      decoded=own, sizes=rnd.sizes)
        elif sent.residual is not None:  # formed with the payloads, in their pass: nothing to decode
            rnd.update.worker_error = passes.recycled(sent.residual, c.v, self.state["worker_error"], c.owned)
        elif self.error_feedback in WORKER_SIDE:
            rnd.update.worker_error = passes.worker_residual_(c, self.q, sent.payloads, rnd.bounds, seed_of,
                                                              decoded=own, sizes=rnd.sizes,
                                                              memory=self.state["worker_error"],
                                                              decoded_as_sent=isinstance(self.faults, NoFaults))

    def _side_exchange(self, everything: torch.Tensor, tag: int) -> list[torch.Tensor]:
        """Fault injection's colluding attackers (ALIE, IPM) see every honest
        payload: an all-gather whose bytes are not counted."""
        with self.comm.uncounted():
            return self.comm.allgather(everything, tag=tag)

