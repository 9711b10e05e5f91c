"""The arithmetic of Algorithm 1 on one vector, shared by the sharded
reducer (``DoubleSqueeze``) and the replicated one (``ReplicatedDoubleSqueeze``):

    worker:  v = g + d_worker;  c = Q(v);   d_worker' = v - c
    server:  u = mean + d_server;  r = Q'(u);  d_server' = u - r

With ``error_decay`` = γ < 1 each memory is added as γ·d (SparseLoCo's
decayed error feedback): an error the next compression cannot send is
forgotten geometrically instead of carried until it is.

Nothing here stores state: callers stage what these return and write it
only when their whole step succeeded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..compressors import Compressor, kernels
from ..comm import rows
from ..compressors.base import TRUSTED, runs_of_equal_size
from ..compressors.decoded import Decoded
from ..compressors.finite import all_finite
from ..layout import Pieces
from ..state import ErrorMemory, compact
from ..state.compact import Stored
from . import aggregation
from ._compensated_codes import compensated_with_codes
from ._payloads_and_residual import payloads_with_residual

__all__ = ["adds_mean_of_one", "adds_stored_whole", "compensate", "Compensated", "compress_chunks", "decoded_chunks",
           "encoded_residual", "formed_residual", "mean_plus_stored", "recycled", "residual_by_signs",
           "server_residual", "SERVER_SIDE", "server_squeeze", "squeeze_formed", "squeeze_mean_of_rows", "Squeezed",
           "worker_residual_",
           "WORKER_SIDE"]

Bounds = Sequence[tuple[int, int]]


@dataclass
class Compensated:
    """A worker's vector, ready to compress."""

    v: torch.Tensor                  # g (+ momentum) + worker error: what is compressed
    momentum: torch.Tensor | None    # the new momentum to stage, if there is one
    finite: bool
    owned: bool                      # v is a fresh tensor of ours (the residual may be formed in it)
    #: v's status word (a device int64, 1: not finite), where v's own pass tested it (``check=False``)
    status: torch.Tensor | None = None
    #: blocksign's (codes, kept magnitudes) of v's chunks, where v's own pass took them (``compensate``'s ``encoder``)
    coded: tuple[torch.Tensor, torch.Tensor] | None = None


WORKER_SIDE = ("both", "worker", "ef21")  # error-feedback modes whose worker pass keeps a memory
SERVER_SIDE = ("both", "ef21")            # error-feedback modes whose server pass keeps a memory


def compensate(g: torch.Tensor | Pieces, *, worker_error: torch.Tensor | Stored | None,
               momentum: torch.Tensor | None = None, beta: float = 0.0, out: torch.Tensor | None = None,
               check: bool = True, decay: float = 1.0, encoder: Compressor | None = None,
               bounds: Bounds = ()) -> Compensated:
    """v = (momentum of) g plus the worker error (times ``decay``). ``worker_error`` None: no
    error feedback on the worker side; a memory as stored (``compact.Int8Blocks``): its decode is part of
    the addition's pass where that is all there is to do. ``out``: where to build v (a
    recycled buffer of g's size; its contents are overwritten). ``g`` may
    be a bucket's ``Pieces``: added to the error piece by piece when that is
    all there is to do on a CPU (on a GPU, an int8 error is added in v's buffer
    after one batched copy), flattened otherwise. ``check=False`` leaves the
    finiteness test to the caller (``finite`` is then True): v's status word comes in
    ``status`` where the addition's pass tests it (an int8 memory's), and the caller tests
    v itself where ``status`` is None. (A test made here also comes from that pass where
    it can: one read of v fewer.) ``encoder``: what will encode v's chunks ``bounds``; blocksign's
    codes of them come in ``coded`` where the addition's pass can take them (``compensated_with_codes``)."""
    if isinstance(g, Pieces) and (worker_error is None or beta):
        g = g.flat()
    if isinstance(g, Pieces) and adds_stored_whole(worker_error, decay) and kernels.launch_bound(g.device):
        # one batched copy of the pieces into v's buffer, then the memory added there in its decode's pass
        # (with the test, and blocksign's codes): two calls however many pieces, where the decode, the copy,
        # the addition and the test were four
        g = g.bucket.flatten(g.tensors, out)
        out = g
    if adds_stored_whole(worker_error, decay) and not beta and isinstance(g, torch.Tensor):
        # the test in the addition's pass: read here when checked, else left on the device for the caller
        coded = compensated_with_codes(g.reshape(-1), worker_error, out, encoder, bounds)
        v, word, codes = (*compact.added_with_status(g.reshape(-1), worker_error, out), None) if coded is None \
            else coded
        return Compensated(v, None, not bool(word) if check else True, owned=True, status=None if check else word,
                           coded=codes)
    if worker_error is not None:
        worker_error = compact.load(worker_error)
    new_momentum = None
    if beta:
        new_momentum = beta * momentum + (1 - beta) * g
        g = new_momentum
    if worker_error is None:
        v = g
    elif isinstance(g, Pieces):
        v = g.add(worker_error, torch.empty(g.numel(), dtype=torch.float32, device=g.device) if out is None else out,
                  alpha=decay)
    elif out is None:
        v = torch.add(g, worker_error, alpha=decay)
    else:
        v = torch.add(g, worker_error, alpha=decay, out=out)
    return Compensated(v, new_momentum, all_finite(v) if check else True, owned=worker_error is not None)


def compress_chunks(q: Compressor, v: torch.Tensor, bounds: Bounds, seed_of: Callable[[int], int | None],
                    sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
    """One payload per chunk of ``v``, chunk k encoded with ``seed_of(k)``, by
    the compressor's batched call; a scale shared by the whole vector
    (``q.prepare``) is computed once. ``sizes``: the chunks' sizes as a
    structured operator is told them (``Round.sizes``)."""
    return q.compress_chunks(v, bounds, [seed_of(k) for k in range(len(bounds))], shared=q.prepare(v),
                             sizes=sizes if q.structured else None)


def worker_residual_(c: Compensated, q: Compressor, payloads: Sequence[torch.Tensor], bounds: Bounds,
                     seed_of: Callable[[int], int | None], decoded: dict[int, Decoded | None] | None = None,
                     sizes: Sequence[int] | None = None, memory: ErrorMemory | None = None,
                     decoded_as_sent: bool = False) -> torch.Tensor | Stored:
    """d_worker' = v - Q(v), formed in ``c.v`` when it is ours. ``decoded``
    holds chunks already decoded elsewhere (an owner's own chunk), by index;
    ``decoded_as_sent``: they are decodes of ``payloads`` themselves (no fault
    hook replaced them on the wire), so v's own payload may stand for them.
    A sparse operator's chunk is subtracted at its kept positions only.
    Given the int8 ``memory`` it will be written to, a vector of one dense chunk
    is subtracted and encoded in one pass (``encoded_residual``), from v alone
    where Q(v) follows v's signs (``Compressor.sign_scale``)."""
    if len(bounds) == 1 and _encodes_residuals(memory):
        chunk = (decoded or {}).get(0)  # as its owner decoded it, if it did
        if decoded_as_sent or chunk is None:
            by_signs = residual_by_signs(c.v, q, payloads[0], memory, owned=c.owned)
            if by_signs is not None:
                return by_signs
        if chunk is None:
            chunk = q.decode(payloads[0], sizes[0] if sizes else c.v.numel(), seed_of(0), refusals=TRUSTED)
        if not chunk.is_sparse:
            return encoded_residual(c.v, chunk, memory, owned=c.owned)
        decoded = {0: chunk}  # decoded once
    residual = c.v if c.owned else c.v.clone()
    for first, count, size in runs_of_equal_size(bounds):
        together = rows(payloads[first: first + count]) \
            if count > 1 and q.decodes_rows(residual.device) and not q.structured else None
        if together is not None:  # the run's payloads are one batched encode's rows: one decode, one subtraction
            start = bounds[first][0]
            q.subtract_own_rows_(residual[start: start + count * size].view(count, size), together,
                                 [seed_of(k) for k in range(first, first + count)])
            continue
        for k in range(first, first + count):
            a, b = bounds[k]
            chunk = (decoded or {}).get(k)
            if chunk is not None:
                chunk.subtract_from_(residual[a:b])
            else:  # this rank's own payload, which the operator may subtract without decoding it first
                q.subtract_own_(residual[a:b], payloads[k], sizes[k] if sizes else b - a, seed_of(k))
    return residual


def decoded_chunks(q: Compressor, payloads: Sequence[torch.Tensor], bounds: Bounds,
                   seed_of: Callable[[int], int | None], decoded: dict[int, Decoded | None] | None = None,
                   sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Q(v): this rank's own payloads of every chunk decoded into one vector
    (chunks in ``decoded`` reused)."""
    decoded = decoded or {}
    return torch.cat([decoded[k].dense() if decoded.get(k) is not None
                      else q.decompress_flat(p, sizes[k] if sizes else b - a, seed_of(k), refusals=TRUSTED)
                      for k, (p, (a, b)) in enumerate(zip(payloads, bounds))])


@dataclass
class Squeezed:
    """The server pass over one chunk."""

    payload: torch.Tensor
    u: torch.Tensor      # aggregate + server error: what was compressed
    owned: bool = False  # u is a fresh tensor of ours (the residual may be formed in it)
    #: u - Q'(u) as the int8 memory stores it, where the encode formed it in its own pass (``payloads_with_residual``)
    residual: Stored | None = None


def server_squeeze(qs: Compressor, aggregate: torch.Tensor, server_error: torch.Tensor | Stored | None,
                   seed: int | None, *, owned: bool = False, size: int | None = None, decay: float = 1.0,
                   out: torch.Tensor | None = None, memory: ErrorMemory | None = None) -> Squeezed:
    """u = aggregate + server error times ``decay`` (None: no server error feedback; a memory as
    stored: decoded in the addition's pass, ``compensate``'s); Q'(u).
    ``owned``: ``aggregate`` is a fresh tensor of the caller's, so u is
    formed in it; ``out``: a buffer of the caller's to form u in instead, for a
    memory added as stored. ``size``: the chunk's size as ``qs`` is told it. ``memory``: the
    server error's, where the residual is bound: an int8 one gets it from Q'(u)'s own pass
    where the operator can (``payloads_with_residual``)."""
    if adds_stored_whole(server_error, decay):
        u = compact.added(aggregate, server_error, aggregate if owned else out)
        return _squeezed(qs, u, seed, size, memory, owned=True)  # a buffer of ours either way
    if server_error is not None:
        server_error = compact.load(server_error)
    if server_error is None:
        u = aggregate
    elif owned:
        u = aggregate.add_(server_error, alpha=decay)
    else:
        u = torch.add(aggregate, server_error, alpha=decay)
    return _squeezed(qs, u, seed, size, memory, owned=owned or server_error is not None)


def squeeze_mean_of_rows(qs: Compressor, senders: torch.Tensor, server_error: Stored, seed: int | None, *,
                         size: int | None = None, out: torch.Tensor | None = None, memory: ErrorMemory | None = None
                         ) -> Squeezed:
    """``server_squeeze`` of the plain mean of the dense contributions ``senders`` (their
    (count, numel) rows) with an int8 memory added whole (``adds_stored_whole``): the mean
    and the addition in one kernel where compiled, the same bits as ``aggregation.mean_of``
    then ``compact.added``. ``out``: a buffer of the caller's to form u in, where it can."""
    return _squeezed(qs, mean_plus_stored(senders, server_error, out), seed, size, memory, owned=True)


def squeeze_formed(qs: Compressor, u: torch.Tensor, seed: int | None, *, size: int | None = None,
                   memory: ErrorMemory | None = None, coded: tuple | None = None) -> Squeezed:
    """Q'(u) of a u the caller formed in a buffer of its own (aggregate and server error
    together, ``mean_of_payloads``), with its residual where ``memory`` is int8 (``_squeezed``);
    ``coded``: blocksign's codes of u, formed with it (``Folded.coded``)."""
    return _squeezed(qs, u, seed, size, memory, owned=True, coded=coded)


def mean_plus_stored(senders: torch.Tensor, memory: compact.Int8Blocks, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The mean of the rows ``senders`` plus the int8 ``memory``'s values: written into
    ``out`` where the vector is whole blocks, else a fresh tensor (use what this returns)."""
    count, numel = senders.shape
    divisor = kernels.device_constant(float(count), senders.device)
    codes = memory.code_rows()
    if numel % compact.BLOCK:
        return _padded_mean_added_kernel(senders, divisor, codes, memory.scales,
                                         numel=senders.numel()).view(-1)[:numel]
    out = torch.empty(numel, dtype=torch.float32, device=senders.device) if out is None else out
    _mean_added_kernel(out.view(codes.shape), senders.view(count, *codes.shape), divisor, codes, memory.scales,
                       numel=senders.numel())
    return out


def _mean_added(out: torch.Tensor, senders: torch.Tensor, count: torch.Tensor, codes: torch.Tensor,
                scales: torch.Tensor) -> torch.Tensor:
    """The mean of ``senders``' (count, blocks, block) rows plus the int8 rows, into the rows ``out``."""
    return torch.add(aggregation.mean_rows(senders, count), compact.int8_values(codes, scales), out=out)


def _mean_added_fusable(out: torch.Tensor, senders: torch.Tensor, count: torch.Tensor, codes: torch.Tensor,
                        scales: torch.Tensor) -> torch.Tensor:
    return out.copy_(aggregation.mean_rows_fusable(senders, count) + codes.to(torch.float32) * scales[:, None])


def _padded_mean_added(senders: torch.Tensor, count: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
                       ) -> torch.Tensor:
    """The mean of ``senders``' rows, padded with zeros to the int8 rows, plus their values: new rows."""
    return compact.padded_added(aggregation.mean_rows(senders, count), codes, scales)


def _padded_mean_added_fusable(senders: torch.Tensor, count: torch.Tensor, codes: torch.Tensor,
                               scales: torch.Tensor) -> torch.Tensor:
    return compact.padded_added(aggregation.mean_rows_fusable(senders, count), codes, scales)


# the server's u from its senders' rows in one kernel where compiled (a GPU), where the mean and the memory's
# addition were two; a CPU adds each sender in place, which a kernel that keeps every row apart would not beat
_mean_added_kernel = kernels.FusedKernel(_mean_added, _mean_added_fusable, compile_on_cpu=False)
_padded_mean_added_kernel = kernels.FusedKernel(_padded_mean_added, _padded_mean_added_fusable,
                                                compile_on_cpu=False)


def _squeezed(qs: Compressor, u: torch.Tensor, seed: int | None, size: int | None, memory: ErrorMemory | None, *,
              owned: bool, coded: tuple | None = None) -> Squeezed:
    """Q'(u), with u - Q'(u) encoded in the same pass where ``memory`` is int8 and ``qs`` can."""
    fused = payloads_with_residual(qs, u, [(0, u.numel())], coded) if _encodes_residuals(memory) else None
    if fused is not None:
        return Squeezed(fused[0][0], u, owned=owned, residual=fused[1])
    return Squeezed(qs.compress(u, seed=seed, size=size).payload, u, owned=owned)


def adds_mean_of_one(contributions: Sequence[Decoded], server_error: torch.Tensor | Stored | None,
                     decay: float) -> bool:
    """Whether u = mean + server error may skip the mean: one dense contribution d,
    whose mean ``aggregation.mean_of`` forms as d + 0, added to a memory as stored
    (``server_squeeze``'s one pass). The same bits: d + 0 differs from d only at
    -0.0, which turns into +0.0, and a stored memory's decoded values are never -0.0
    (int8 codes times a non-negative scale), so (d + 0) + e is d + e at every element."""
    return len(contributions) == 1 and not contributions[0].is_sparse and adds_stored_whole(server_error, decay)


def adds_stored_whole(memory: torch.Tensor | Stored | None, decay: float) -> bool:
    """Whether ``memory`` is added in its decode's pass: an int8 memory added whole
    (a decayed one is multiplied and added, which eager rounds once, as the fused pass would not)."""
    return isinstance(memory, compact.Int8Blocks) and decay == 1.0


def server_residual(sq: Squeezed, served: Decoded, memory: ErrorMemory | None = None) -> torch.Tensor | Stored:
    """d_server' = u - Q'(u), given the decoded Q'(u); formed in ``sq.u`` when it
    is ours (nothing reads u after its residual). Given the int8 ``memory`` it will
    be written to, a dense Q'(u) is subtracted and encoded in one pass, and one the
    squeeze already formed (``formed_residual``) is taken as it is. (Where Q'(u)
    follows u's signs, ``residual_by_signs`` needs no decode at all.)"""
    formed = formed_residual(sq, memory)
    if formed is not None:
        return formed
    if _encodes_residuals(memory) and not served.is_sparse:
        return encoded_residual(sq.u, served, memory, owned=sq.owned)
    return served.subtract_from_(sq.u if sq.owned else sq.u.clone())


def formed_residual(sq: Squeezed, memory: ErrorMemory) -> Stored | None:
    """u - Q'(u) as the squeeze formed it in Q'(u)'s own pass (``Squeezed.residual``), u handed back
    to ``memory`` to build in when ours; None where the squeeze did not form it."""
    return None if sq.residual is None else recycled(sq.residual, sq.u, memory, sq.owned)


def _encodes_residuals(memory: ErrorMemory | None) -> bool:
    """Whether a residual bound for ``memory`` is staged encoded: an int8 memory's is."""
    return memory is not None and memory.dtype == "int8"


def encoded_residual(v: torch.Tensor, decoded: Decoded, memory: ErrorMemory, *, owned: bool) -> Stored:
    """v - decoded as an int8 memory stores it, in one pass where compiled (the
    residual is never written out in fp32; the same bits as the subtraction and
    the encode); ``v``, when ``owned`` (a buffer of ours), goes back to the memory to build in."""
    return recycled(compact.Int8Blocks.encode_difference(v.reshape(-1), decoded.values.reshape(-1)), v, memory,
                     owned)


def residual_by_signs(v: torch.Tensor, q: Compressor, payload: torch.Tensor, memory: ErrorMemory | None, *,
                      owned: bool) -> Stored | None:
    """v - Q(v) as the int8 ``memory`` stores it, from v alone where ``payload``,
    this rank's own encode of v, decodes to ±s by v's own signs (sign's:
    ``Compressor.sign_scale``): nothing decoded, nor read back. None where the
    memory or the operator is not such (the caller decodes then)."""
    scale = q.sign_scale(payload) if _encodes_residuals(memory) else None
    if scale is None:
        return None
    return recycled(compact.Int8Blocks.encode_sign_residual(v.reshape(-1), scale), v, memory, owned)


def recycled(encoded: Stored, v: torch.Tensor, memory: ErrorMemory, owned: bool) -> Stored:
    """``encoded``, once ``v`` (what it encoded a residual of), when ``owned``, went back to the memory to build in."""
    if owned:
        memory.recycle(v)
    return encoded
