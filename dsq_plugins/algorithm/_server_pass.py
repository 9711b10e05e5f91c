"""The server pass of Algorithm 1, sharded: rank k owns chunk k.

    u = aggregate_i(c_i) + d_server;  r = Q'(u);  all-gather r;
    d_server' = u - r   (staged, written when the whole step succeeded)

The owner decodes the ``size`` contributions to its chunk, aggregates them
(the plain mean, or a robust rule), adds its server error and squeezes the
result again; the all-gather brings every owner's result to every rank,
which decodes them into the average. With ``owners=r`` each chunk has r
owners and a receiver combines their copies (``layout.combine``); with
``owners="all"`` there is no server pass (``aggregate_everything``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

from ..comm import Communicator, header, joined, rows
from ..compressors import Compressor
from ..compressors.base import TRUSTED, runs_of_equal_size
from ..compressors.kernels import launch_bound
from ..compressors.decoded import Decoded
from ..errors import PayloadError
from ..layout import Ownership, Pieces, combine, split, write_decoded
from ..state import ReducerState
from ..state.compact import Int8Blocks
from ..step import IMMEDIATE, UNCHANGED, Checked, Checks, Round, decode_finite, explainer
from ..testing.faults import FaultInjector, NoFaults
from . import aggregation
from . import arithmetic as passes
from ._mean_of_payloads import folds_mean, mean_of_payloads
from ._seeds import AGGREGATOR, Seeds
from .arithmetic import SERVER_SIDE

if TYPE_CHECKING:  # the options are read here, never built
    from ..config import ReducerConfig

log = logging.getLogger("dsq_plugins")


@dataclass
class Served:
    """This rank's server pass of one chunk it serves."""

    chunk: int
    own: Decoded | None = None                 # this rank's own contribution, as decoded here
    squeezed: passes.Squeezed | None = None
    payload: torch.Tensor | None = None        # what is served (a fault may have replaced the honest one)
    result: Decoded | None = None              # what was served, as every rank decoded it (one owner)


@dataclass
class Serving:
    """This rank's server pass over the chunks it serves in one round."""

    chunks: dict[int, Served] = field(default_factory=dict)
    status: int | torch.Tensor = header.OK
    refusal: Callable[[], str] = lambda: ""    # why this owner refused a contribution

    def own(self) -> dict[int, Decoded | None]:
        return {k: s.own for k, s in self.chunks.items()}


class ServerPass:
    """This rank's part as an owner: decode, aggregate, squeeze, serve, and
    (as every rank) decode what every owner served."""

    def __init__(self, comm: Communicator, compressors: tuple[Compressor, Compressor], config: ReducerConfig,
                 state: ReducerState, seeds: Seeds, faults: FaultInjector | NoFaults, ownership: Ownership):
        self.comm, self.state, self.seeds, self.faults, self.ownership = comm, state, seeds, faults, ownership
        self.q, self.qs = compressors
        self.aggregator = config.build_aggregator()
        #: the plain mean, whose contributions are summed one at a time into a buffer of ours, never stacked
        self.plain_mean = self.aggregator is aggregation.mean
        self.error_feedback = config.error_feedback
        self.decay = float(config.error_decay)
        self.strict = config.payloads_strict()
        self.on_nonfinite = config.on_nonfinite
        #: payloads left out of aggregation (strict_payloads=False), by sender rank
        self.rejected: dict[int, int] = {}

    # -- the owner's side ------------------------------------------------------
    def serve(self, rnd: Round, received: list, checks: Checks) -> Serving:
        """Decode the contributions to each chunk this rank serves, aggregate,
        add the server error, squeeze again. A failure here is announced in
        the status of what it serves."""
        serving = Serving({k: Served(k) for k in self.ownership.served_by(self.comm.rank)})
        everything: list[tuple[int, Checked]] = []
        try:
            if rnd.local_error is not None:
                raise rnd.local_error
            pieces = self.pieces_by_chunk(received, serving.chunks, rnd.sizes)
            formed: torch.Tensor | None = None  # the status a folded chunk's kernel formed from its checks and u
            for k, s in serving.chunks.items():
                folded = self.folded(rnd, k, pieces[k], checks)
                if folded is not None:  # u from the payloads in one pass: no contribution decoded on its own
                    s.squeezed, checked, formed = folded
                    usable: list[Decoded] = []
                else:
                    usable, s.own, checked = self.contributions(rnd, k, pieces[k], checks)
                    s.squeezed = self.squeeze(rnd, k, usable)
                everything += checked
                s.payload = self.faults.server_payload(
                    s.squeezed.payload, numel=rnd.served_sizes[k], compressor=self.qs, step=rnd.step,
                    seed=self.seeds.server(rnd.name, rnd.step, k),
                    contributions=lambda usable=usable: stacked(usable) if usable else None)
            whole = formed if len(serving.chunks) == 1 else None
            serving.status = checks.served_status(everything, self.strict, whole)
            # is each u finite, where no kernel's status said (a group of one sums no payloads: nothing to overflow)
            if self.comm.size > 1 and (whole is None or not checks.deferred):
                serving.status = checks.owner_finite(serving.status, [s.squeezed.u for s in serving.chunks.values()])
            serving.refusal = checks.refusal(everything)
        except Exception as exc:  # noqa: BLE001 - announced to every rank, then raised here
            serving.status = rnd.fail_locally(exc)
            for k, s in serving.chunks.items():
                s.payload = checks.placeholder(self.qs.payload_nbytes(rnd.served_sizes[k]), rnd.device)
        return serving

    def contributions(self, rnd: Round, k: int, pieces: Sequence[torch.Tensor | None], checks: Checks
                      ) -> tuple[list[Decoded], Decoded | None, list[tuple[int, Checked]]]:
        """Chunk k's contributions as decoded here: (the usable ones, in
        sender order; this rank's own; every (sender, check)). With ef21 each
        usable one is the sender's replicated state plus its contribution,
        staged in the round's update."""
        a, b = rnd.bounds[k]
        me, trust_own = self.comm.rank, self.trusts_own(self.q)
        seed_of = lambda j: self.seeds.worker(rnd.name, rnd.step, j, k)  # noqa: E731
        together = rows(pieces) if len(pieces) > 1 and self.q.decodes_rows(rnd.device) else None
        if together is not None:  # every sender's payload in one call
            checked = list(enumerate(checks.decode_rows(self.q, together, rnd.sizes[k],
                                                        [seed_of(j) for j in range(len(pieces))], rnd.device)))
        else:
            checked = [(j, (checks.own if j == me and trust_own and piece is not None else checks.decode)(
                            self.q, piece, rnd.sizes[k], seed_of(j), rnd.device))
                       for j, piece in enumerate(pieces)]
        usable = []
        for j, c in checked:
            if c.bad is True:
                if not self.strict:
                    self.reject(j, f"rank {self.comm.rank}: left out rank {j}'s payload for {rnd.name!r} at step "
                                   f"{rnd.step}: {c.why}")
                continue
            d = c.decoded
            if self.error_feedback == "ef21":
                key = f"{rnd.name}@chunk{k}@from{j}"
                d = Decoded(self.state["replicas"].get(key, b - a, rnd.device) + d.dense(), b - a)
                rnd.update.replicas[key] = d.values
            usable.append(d)
        return usable, checked[self.comm.rank][1].decoded, checked

    def folded(self, rnd: Round, k: int, pieces: Sequence[torch.Tensor | None], checks: Checks
               ) -> tuple[passes.Squeezed, list[tuple[int, Checked]], torch.Tensor | None] | None:
        """``squeeze`` of chunk k with its contributions' decode folded into the mean and the
        int8 server error (``mean_of_payloads``), with ``folded_mean``'s checks and status; None
        where that does not apply or the server error is not an int8 memory added whole."""
        if self.error_feedback != "both":
            return None
        a, b = rnd.bounds[k]
        key, errors = self.server_key(rnd.name, k), self.state["server_error"]
        server_error = errors.to_add(key, b - a, rnd.device)
        if not passes.adds_stored_whole(server_error, self.decay):
            return None
        folded = self.folded_mean(rnd, k, pieces, checks, server_error, lambda: errors.scratch(key, b - a, rnd.device),
                                  encoder=self.qs)
        if folded is None:
            return None
        u, checked, status, coded = folded
        squeezed = passes.squeeze_formed(self.qs, u, self.seeds.server(rnd.name, rnd.step, k),
                                         size=rnd.served_sizes[k], memory=errors, coded=coded)
        return squeezed, checked, status

    def folded_mean(self, rnd: Round, k: int, pieces: Sequence[torch.Tensor | None], checks: Checks,
                    memory: Int8Blocks | None = None, out: Callable[[], torch.Tensor] | None = None,
                    encoder: Compressor | None = None
                    ) -> tuple[torch.Tensor, list[tuple[int, Checked]], torch.Tensor | None, tuple | None] | None:
        """Chunk k's mean of its contributions, plus the int8 ``memory`` where given (u, built in
        ``out()`` where it can), from their payloads in one kernel (``mean_of_payloads``); every
        (sender, check) as ``contributions`` gives them; the status the kernel formed from them
        (None: nothing was checked); ``encoder``'s codes of u where the kernel took them
        (``Folded.coded``). None where it does not apply: the plain mean of every payload,
        checked as one and all (strict payloads, nothing a fault hook replaced, no ef21 replicas),
        an operator whose row decode folds, on a GPU's paths."""
        if not (self.plain_mean and self.strict and self.error_feedback != "ef21" and self.trusts_served()):
            return None
        together = rows(pieces)
        a, b = rnd.bounds[k]
        if together is None or rnd.sizes[k] != b - a or not folds_mean(self.q, together, b - a, memory):
            return None
        folded = mean_of_payloads(self.q, together.to(rnd.device), b - a, memory, None if out is None else out(),
                                  encoder)
        if len(pieces) == 1 and self.trusts_own(self.q):  # this rank's own payload alone, unchecked (``Checks.own``)
            return folded.u, [(self.comm.rank, checks.trusted(rnd.device))], None, folded.coded
        return folded.u, list(enumerate(checks.judged_rows(folded.flags, folded.words, bad=folded.bad))), \
            folded.status, folded.coded

    def aggregate(self, rnd: Round, k: int, contributions: list[Decoded], into: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """The aggregate of chunk k; the plain mean is built in ``into``
        (a recycled buffer) when given."""
        numel = rnd.bounds[k][1] - rnd.bounds[k][0]
        if not contributions:
            return torch.zeros(numel, dtype=torch.float32, device=rnd.device)
        if self.plain_mean:
            total = torch.empty(numel, dtype=torch.float32, device=rnd.device) if into is None else into
            return aggregation.mean_of(contributions, total)
        kwargs: dict[str, Any] = {}
        if getattr(self.aggregator, "takes_seed", False):
            kwargs["seed"] = self.seeds.chunk(rnd.name, rnd.step, AGGREGATOR, k, k)
        key = f"{rnd.name}@chunk{k}"
        aggregates = self.state["aggregates"]
        if getattr(self.aggregator, "takes_previous", False):
            kwargs["previous"] = aggregates.get(key, numel, rnd.device) if key in aggregates else None
        result = self.aggregator(stacked(contributions), **kwargs)
        if "previous" in kwargs:
            rnd.update.aggregates[key] = result
        return result

    def squeeze(self, rnd: Round, k: int, contributions: list[Decoded]) -> passes.Squeezed:
        """Aggregate chunk k's contributions (the plain mean built in the
        server error's recycled buffer), add the server error, squeeze again."""
        key, numel = self.server_key(rnd.name, k), rnd.bounds[k][1] - rnd.bounds[k][0]
        keeps_error, errors = self.error_feedback in SERVER_SIDE, self.state["server_error"]
        into = errors.scratch(key, numel, rnd.device) if keeps_error and self.plain_mean else None
        server_error = errors.to_add(key, numel, rnd.device) if keeps_error else None
        seed = self.seeds.server(rnd.name, rnd.step, k)
        memory = errors if keeps_error else None  # where u - Q'(u) is staged
        if self.plain_mean and passes.adds_mean_of_one(contributions, server_error, self.decay):
            return passes.server_squeeze(self.qs, contributions[0].values, server_error, seed, out=into,
                                         size=rnd.served_sizes[k], decay=self.decay, memory=memory)
        senders = aggregation.dense_rows(contributions) if self.plain_mean and launch_bound(rnd.device) \
            and passes.adds_stored_whole(server_error, self.decay) else None
        if senders is not None:  # the mean and the memory in one pass
            return passes.squeeze_mean_of_rows(self.qs, senders, server_error, seed, size=rnd.served_sizes[k],
                                               out=into, memory=memory)
        aggregate = self.aggregate(rnd, k, contributions, into=into)
        return passes.server_squeeze(self.qs, aggregate, server_error, seed, owned=self.plain_mean,
                                     size=rnd.served_sizes[k], decay=self.decay, memory=memory)

    # -- every rank's side -------------------------------------------------------
    def finish(self, rnd: Round, serving: Serving, checks: Checks, out: torch.Tensor | Pieces | None = None
               ) -> torch.Tensor | Pieces:
        """All-gather the squeezed chunks and decode them (each chunk's
        copies combined, one per owner) into the average: in ``out`` when
        given, a flat buffer or a bucket's tensors themselves."""
        own, rank = self.ownership, self.comm.rank
        nbytes = lambda k: self.qs.payload_nbytes(rnd.served_sizes[k])  # noqa: E731
        message = joined([serving.chunks[k].payload for k in own.served_by(rank)])
        expected = [sum(nbytes(k) for k in own.served_by(j)) for j in range(len(rnd.bounds))]
        strict = self.strict or own.r == 1  # one owner is trusted: a bad copy is an error
        explain = explainer(rnd, rank=rank, on_nonfinite=self.on_nonfinite, refusal=serving.refusal)
        gathered = checks.collective(lambda verdict: self.comm.allgather(
            message, tag=rnd.tag, status=serving.status, expected=expected, strict=strict, verdict=verdict), explain)
        rnd.gathered = gathered
        if rnd.local_error is not None:  # deferred: the verdict fails this step on every rank; nothing to decode
            return torch.empty(rnd.numel, dtype=torch.float32, device=rnd.device) if out is None else out
        copies = [split(message, own.served_by(j), nbytes) for j, message in enumerate(gathered)]
        if own.r == 1:
            return self._decode_served(rnd, serving, [copies[k][k] for k in range(len(rnd.bounds))], checks, out)
        if out is None:
            out = torch.empty(rnd.numel, dtype=torch.float32, device=rnd.device)
        for k, (a, b) in enumerate(rnd.bounds):
            write_decoded(out, self._combined(rnd, k, copies, self.seeds.server(rnd.name, rnd.step, k)), a)
        return out

    def _decode_served(self, rnd: Round, serving: Serving, served: list, checks: Checks,
                       out: torch.Tensor | Pieces | None) -> torch.Tensor | Pieces:
        """Each chunk as its one owner served it, decoded into ``out``: a run
        of equal-sized chunks whose payloads are one buffer's rows in one
        call (``chunk_bounds`` makes at most two runs), others one by one.
        Without ``out``, where one call decodes every chunk, its rows are the
        average itself: no buffer, and no copy of the bucket into one."""
        seed_of = lambda k: self.seeds.server(rnd.name, rnd.step, k)  # noqa: E731
        runs = runs_of_equal_size(rnd.bounds)
        if out is None and self.qs.sparse:  # written into a vector either way: by a dense decoder (a GPU's) directly
            out = torch.empty(rnd.numel, dtype=torch.float32, device=rnd.device)
        for first, count, size in runs:
            start = rnd.bounds[first][0]
            together = rows(served[first: first + count]) if count > 1 and self.qs.decodes_rows(rnd.device) \
                and not self.qs.structured else None
            if together is None:
                for k in range(first, first + count):
                    a, b = rnd.bounds[k]
                    target = out[a:b] if isinstance(out, torch.Tensor) else None  # a dense decode may go there
                    decoded = checks.served(self.qs, served[k], rnd.served_sizes[k], seed_of(k), rnd.device,
                                            rnd.name, k, into=target)
                    if k in serving.chunks:
                        serving.chunks[k].result = decoded
                    if out is None and len(rnd.bounds) == 1 and _a_vector_of_its_own(decoded, served[k]):
                        return decoded.values  # one chunk: its decode is the average itself, with no copy
                    out = torch.empty(rnd.numel, dtype=torch.float32, device=rnd.device) if out is None else out
                    if target is None or decoded.is_sparse or not _written_into(decoded.values, target):
                        write_decoded(out, decoded, a)
                continue
            target = out[start: start + count * size].view(count, size) if isinstance(out, torch.Tensor) else None
            values = checks.served_rows(self.qs, together, size, [seed_of(k) for k in range(first, first + count)],
                                        rnd.device, rnd.name, first, into=target)
            for k in range(first, first + count):
                if k in serving.chunks:
                    serving.chunks[k].result = Decoded(values[k - first], size)
            if out is None and len(runs) == 1 and values.dtype == torch.float32 and values.is_contiguous():
                return values.view(-1)
            out = torch.empty(rnd.numel, dtype=torch.float32, device=rnd.device) if out is None else out
            if target is None or not _written_into(values, target):
                write_decoded(out, Decoded(values.reshape(-1), count * size), start)
        return out

    def _combined(self, rnd: Round, k: int, copies: list[dict], seed: int) -> Decoded:
        """Chunk k from its owners' copies (``layout.combine``); an unusable
        copy is an error, or left out and counted without strict payloads."""
        a, b = rnd.bounds[k]
        chunk, left_out = combine([(j, copies[j][k]) for j in self.ownership.owners_of(k)],
                                  lambda p: decode_finite(self.qs, p, rnd.served_sizes[k], seed, rnd.device).dense(),
                                  f"chunk {k} of {rnd.name!r}")
        for j, why in left_out:
            if self.strict:
                raise PayloadError(f"rank {j} served a copy of chunk {k} of {rnd.name!r} that cannot be used ({why}); "
                                   f"{UNCHANGED}", rank=j)
            self.reject(j, f"rank {self.comm.rank}: left out rank {j}'s copy of chunk {k} of {rnd.name!r} at step "
                           f"{rnd.step}: {why}")
        return Decoded(chunk, b - a)

    def aggregate_everything(self, rnd: Round, received: list) -> tuple[dict[int, Decoded | None], torch.Tensor]:
        """owners="all": every rank holds every worker's payloads and
        aggregates every chunk itself; no server pass. Returns (this rank's
        own contributions as decoded here, by chunk; the average)."""
        own, pieces = {}, []
        for k, from_senders in self.pieces_by_chunk(received, range(len(rnd.bounds)), rnd.sizes).items():
            usable, own[k], checked = self.contributions(rnd, k, from_senders, IMMEDIATE)
            bad = [(j, c) for j, c in checked if c.bad]
            if bad and self.strict:  # every rank decoded the same bytes: the same error everywhere
                j, c = bad[0]
                raise PayloadError(f"could not decode the payload rank {j} sent for {rnd.name!r}: {c.why}; "
                                   f"{UNCHANGED}", rank=j)
            pieces.append(self.aggregate(rnd, k, usable))
        return own, torch.cat(pieces)

    def trusts_own(self, q: Compressor) -> bool:
        """Whether this rank's own worker payloads of ``q`` go unchecked
        (``Checks.own``): the operator decodes finite vectors to finite
        values, and no fault hook can have replaced what this rank built.
        (What it serves is not vouched for: nothing checked that u is finite.)"""
        return q.decodes_finite and self.trusts_served()

    def trusts_served(self) -> bool:
        """Whether what this rank serves reaches every rank as it was squeezed: no fault hook can
        replace it (a residual may then come from Q'(u)'s own pass, not from what was decoded)."""
        return isinstance(self.faults, NoFaults)

    # -- state -----------------------------------------------------------------------
    def stage(self, rnd: Round, serving: Serving) -> None:
        """Stage d_server' = u - Q'(u) for each chunk served, from this rank's own Q'(u)."""
        if self.error_feedback not in SERVER_SIDE:
            return
        memory = self.state["server_error"]
        for k, s in serving.chunks.items():
            sq = s.squeezed
            residual = passes.formed_residual(sq, memory)  # no decode for the ones the squeeze formed
            if residual is None:
                residual = passes.residual_by_signs(sq.u, self.qs, sq.payload, memory, owned=sq.owned)
            rnd.update.server_errors[self.server_key(rnd.name, k)] = residual if residual is not None \
                else passes.server_residual(sq, self._own_result(rnd, s), memory)

    def _own_result(self, rnd: Round, s: Served) -> Decoded:
        """What this rank itself served for its chunk, decoded (the server
        residual is u - Q'(u) of its own Q'(u), whatever the others served)."""
        if self.ownership.r == 1 and s.payload is s.squeezed.payload and s.result is not None:
            return s.result  # every rank decoded exactly what this rank served
        return self.qs.decode(s.squeezed.payload, rnd.served_sizes[s.chunk],
                              self.seeds.server(rnd.name, rnd.step, s.chunk), refusals=TRUSTED)

    def server_key(self, name: str, chunk: int) -> str:
        """The server error's memory name: the bucket's, or per chunk when a rank serves several."""
        return name if self.ownership.r == 1 else f"{name}@chunk{chunk}"

    def pieces_by_chunk(self, received: list, chunks: Iterable[int], sizes: Sequence[int]) -> dict[int, list]:
        """Each sender's message (worker payloads of ``chunks``, in order) cut
        into its chunks: {chunk: [the piece from sender j, by j]}. ``sizes``:
        every chunk's, as the worker operator is told it (``Round.sizes``)."""
        chunks = list(chunks)
        nbytes = lambda k: self.q.payload_nbytes(sizes[k])  # noqa: E731
        by_sender = [split(message, chunks, nbytes) for message in received]
        return {k: [m[k] for m in by_sender] for k in chunks}

    def reject(self, sender: int, message: str) -> None:
        """Count a payload left out; say so in the log the first time per sender."""
        self.rejected[sender] = self.rejected.get(sender, 0) + 1
        level = logging.WARNING if self.rejected[sender] == 1 else logging.DEBUG
        log.log(level, "%s%s", message, " (further ones from this rank are logged at DEBUG)" if level ==
                logging.WARNING else "")


def _a_vector_of_its_own(decoded: Decoded, payload: torch.Tensor) -> bool:
    """Whether ``decoded`` is a dense fp32 vector in memory of its own, which may be
    handed out as an average: not a view of the received bytes (``none`` decodes to one)."""
    values = decoded.values
    return (not decoded.is_sparse and values.dtype == torch.float32 and values.is_contiguous()
            and values.untyped_storage().data_ptr() != payload.untyped_storage().data_ptr())


def _written_into(values: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a decoder wrote ``values`` into ``target`` itself (``Compressor.decode``'s ``into``)."""
    return values.data_ptr() == target.data_ptr() and values.numel() == target.numel()


def stacked(contributions: list[Decoded]) -> torch.Tensor:
    """The contributions as rows, for rules that look at all of them at once."""
    return torch.stack([c.dense() for c in contributions])
