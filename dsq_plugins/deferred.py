"""One bucket of DoubleSqueeze in a deferred step (``verdict="step"``).

The same Algorithm 1 as ``DoubleSqueeze._reduce_flat`` (owners=1, strict
payloads), with every verdict a device value judged when the step settles
(``dsq_plugins.verdict``): the worker's finiteness becomes its header status,
each contribution's decoder checks become the owner's status in the server
pass, and the served chunks' checks are judged last, in the order the
collective protocol raises them. Nothing here reads a device value on the
host, and nothing stops early: a rank with a local failure sends zeros of the
plan's lengths and says so in its status, so every rank runs every collective
of the step and learns the outcome from the same readings.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import header, passes
from .bucketing import Pieces
from .compressors import Compressor
from .compressors.decoded import Decoded
from .config import SERVER_SIDE, WORKER_SIDE
from .errors import CollectiveMismatchError, PayloadError, PeerStatusError
from .step import StagedUpdate
from .verdict import Reading, StepVerdict, collecting_checks, first_true, nonfinite

if TYPE_CHECKING:
    from .reducer import DoubleSqueeze

NONFINITE_WORDS = "decodes to non-finite values"


def reduce_flat(r: "DoubleSqueeze", name: str, g: torch.Tensor | Pieces, problem: Exception | None,
                verdict: StepVerdict, out: torch.Tensor | Pieces | None = None
                ) -> tuple[StagedUpdate, torch.Tensor | Pieces]:
    """Algorithm 1 for one bucket, its verdicts left in ``verdict``; returns
    what to stage and the average (in ``out`` when given), both meaningful
    only if the verdict settles without raising."""
    from .reducer import _write, chunk_bounds

    comm, q, qs = r.comm, r.compressor, r.server_compressor
    rank, device, numel = comm.rank, g.device, g.numel()
    bounds = chunk_bounds(numel, comm.size)
    tag, step = header.make_tag(name, numel), r.steps.get(name, 0)
    a, b = bounds[rank]
    update = StagedUpdate(name)
    seed_of = lambda k: r.chunk_seed(name, step, "w", rank, k)  # noqa: E731
    local_error: list[BaseException] = []  # this rank's own failure, raised here when the verdict names it

    def explain(exc: BaseException, refusal=lambda: "") -> None:
        if isinstance(exc, PeerStatusError):
            r._raise_for_statuses(name, exc.statuses, local_error[0] if local_error else None, refusal())
        if isinstance(exc, CollectiveMismatchError):
            raise CollectiveMismatchError(f"reducing {name!r} ({numel} elements): {exc}") from None
        raise exc

    with collecting_checks():  # this rank's own payloads, decoded for its residuals: nothing to judge
        # worker pass
        nbytes = [q.payload_nbytes(hi - lo) for lo, hi in bounds]
        c = None
        try:
            if problem is not None:
                raise problem
            c = r._compensate(name, g, device, check=False)[0]
            payloads = passes.compress_chunks(q, c.v, bounds, seed_of)
            status: int | torch.Tensor = torch.where(nonfinite(c.v), header.NONFINITE, header.OK)
        except Exception as exc:  # noqa: BLE001 - announced in the header, raised when the verdict settles
            payloads = [_zeros(n, device) for n in nbytes]
            if c is not None and bool(nonfinite(c.v)):  # an operator that refuses NaN: this rare path reads it
                status = header.NONFINITE
            else:
                local_error.append(exc)
                c, status = None, header.LOCAL_FAILURE
        with verdict.explained_by(explain):
            received = comm.alltoall(payloads, tag=tag, status=status, expected=nbytes, strict=True, verdict=verdict)

        # serving chunk ``rank``
        refusals: list[tuple[Reading, list[str]]] = []
        own: Decoded | None = None
        squeezed = None
        try:
            if local_error:
                raise local_error[0]
            contributions, bad = [], []
            for j, piece in enumerate(received):
                d, flags, words = decode_checked(q, piece, b - a, r.chunk_seed(name, step, "w", j, rank), device)
                contributions.append(d)
                bad.append(flags.any())
                refusals.append((verdict.read(flags), words))
                if j == rank:
                    own = d
            served_status: int | torch.Tensor = first_true(torch.stack(bad), header.BAD_PAYLOAD)
            squeezed = r._squeeze(name, rank, contributions, b - a, step, device, update)
            payload = squeezed.payload
        except Exception as exc:  # noqa: BLE001 - as above
            if not local_error:
                local_error.append(exc)
            served_status, payload = header.LOCAL_FAILURE, _zeros(qs.payload_nbytes(b - a), device)

        def refusal() -> str:  # why this owner refused a contribution, once the readings are back
            return next((words[i] for reading, words in refusals for i, v in enumerate(reading.values) if v), "")

        # server pass
        snbytes = [qs.payload_nbytes(hi - lo) for lo, hi in bounds]
        with verdict.explained_by(lambda exc: explain(exc, refusal)):
            gathered = comm.allgather(payload, tag=tag, status=served_status, expected=snbytes, strict=True,
                                      verdict=verdict)
        if out is None:
            out = torch.zeros(numel, dtype=torch.float32, device=device)
        if local_error:  # the verdict fails this step on every rank: nothing to decode or stage
            return update, out
        for k, (lo, hi) in enumerate(bounds):
            d, flags, words = decode_checked(qs, gathered[k], hi - lo, r.chunk_seed(name, step, "s", k, k), device)
            _write(out, d, lo)
            verdict.then(_served_judge(name, k, verdict.read(flags), words))
            if k == rank:  # what this rank served, as every rank decodes it: Q'(u) for the server residual
                served_here = d

        # memories, staged: written only if the verdict settles without raising
        update.momentum = c.momentum
        if r.error_feedback in WORKER_SIDE:
            update.worker_error = passes.worker_residual_(c, q, payloads, bounds, seed_of, decoded={rank: own})
        if r.error_feedback in SERVER_SIDE:
            update.server_errors[name] = passes.server_residual(squeezed, served_here)
    return update, out


def decode_checked(q: Compressor, payload: torch.Tensor, numel: int, seed: int | None, device: torch.device
                   ) -> tuple[Decoded, torch.Tensor, list[str]]:
    """(the decoded payload, a device bool per check, each check's words):
    the decoder's own checks, then finiteness, none of them read back."""
    try:
        with collecting_checks() as checks:
            decoded = q.decode(payload.to(device), numel, seed)
    except PayloadError as exc:  # refused on the host (its length): a check that failed for sure
        return Decoded(torch.zeros(numel, device=device), numel), torch.ones(1, dtype=torch.bool, device=device), \
            [str(exc)]
    flags = torch.stack([flag for flag, _ in checks] + [nonfinite(decoded.values)])
    return decoded, flags, [words for _, words in checks] + [NONFINITE_WORDS]


def _served_judge(name: str, k: int, reading: Reading, words: list[str]):
    """The judge of chunk k as served: every rank decoded the same bytes, so every rank reaches it."""
    def judge() -> None:
        why = next((words[i] for i, v in enumerate(reading.values) if v), None)
        if why is not None:
            raise PayloadError(f"rank {k} served a chunk of {name!r} that does not decode: {why}; the step was not "
                               f"applied and error-feedback state is unchanged", rank=k)
    return judge


def _zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)
