"""The communicator protocol the reducer talks to, independent of the engine.

Two collectives over 1-D uint8 payloads whose sizes may differ per rank:
``alltoall`` (payload k goes to rank k) and ``allgather`` (one payload to all).

Every collective first all-gathers a small int64 header from each rank:
``[tag, status, length...]``. Because every rank then sees every header, all
ranks reach the same verdict before any payload moves, so a problem on one
rank becomes the same clear error on every rank instead of a hang:

* tags differ  -> ``CollectiveMismatchError`` (ranks reduce different tensors)
* a status != 0 -> ``PeerStatusError`` (``header`` says what each status
  means; the reducer turns it into the error it stands for)
* a declared length differs from the expected one -> ``PayloadError`` naming
  the sender, or with ``strict=False`` that payload is not moved at all and
  the receiver gets ``None`` in its place (robust aggregation excludes it).

Transports move the headers one of two ways. The default gathers them
first (a small int64 all-gather), then moves only the payloads the verdict
accepts. A *fused* transport (``fused = True``: Horovod, the in-process
group) puts each sender's whole header in front of every message and moves
both in one collective: every rank still receives every header, so the
verdict is the same, in half the collectives.

In a deferred step (``verdict=``, see ``dsq_plugins.step``) the step's
agreed plan fixes every length: the payloads move at those lengths at once,
the headers stay on the device, and the verdict above is reached when the
step settles, in the same order and with the same errors. Since nothing
waits for the headers there, every transport moves them with the payloads:
the default one puts each sender's header (its int64 words, as bytes)
behind every message, so a deferred collective is one collective, and the
headers are judged from the bytes that arrived.

Bytes are counted from what moves: the headers (8 bytes per int64) and the
payloads to and from other ranks. The default allgather moves every payload
padded to the longest one, and the padding is counted too; fused transports
move each payload at its own length. What a rank sends to itself is not
counted.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Protocol, Sequence

import torch

from ..errors import ConfigError, PayloadError
from . import header as hdr


class DeferredVerdict(Protocol):
    """What a deferred collective needs of its step's verdict
    (``dsq_plugins.step``): device values to read back, and judges to run
    once they are back."""

    def read(self, tensor: torch.Tensor, bad: Callable[[], torch.Tensor] | None = None) -> object: ...

    def read_words(self, table: torch.Tensor, bad: Callable[[], torch.Tensor] | None = None) -> object: ...

    def then(self, judge: Callable[[], None]) -> None: ...


class Communicator:
    """Base class: the protocol above on top of transport primitives.

    Subclasses set ``rank``, ``size`` and ``device`` and implement either
    ``_gather_headers``, ``_alltoallv`` and ``_allgather_equal``, or (with
    ``fused = True``) ``_fused_alltoall`` and ``_fused_allgather``."""

    rank: int
    size: int
    device: torch.device
    #: header and payload travel together in one collective (see the module docstring)
    fused: bool = False
    #: the communicator this one was ``split`` from (its counters count this one's bytes too)
    parent: "Communicator | None" = None

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        #: payloads refused for a wrong length, by sender rank (strict=False only)
        self.rejected: dict[int, int] = {}
        #: deferred steps' header constants, on the device, by (tag, lengths)
        self._device_headers: dict[tuple, torch.Tensor] = {}
        #: a function giving the senders' statuses of the last deferred collective (a device int64 each), which
        #: a two-level exchange carries from one stage into the next
        self.last_statuses: Callable[[], torch.Tensor] | None = None

    def reset_counters(self) -> None:
        self.bytes_sent = self.bytes_received = 0

    @staticmethod
    @contextlib.contextmanager
    def uncounted() -> Iterator[None]:
        """Collectives this thread runs inside the block are left out of every
        communicator's ``bytes_sent`` / ``bytes_received``: control traffic
        (the settings' agreement, fault injection's side exchange). Only this
        thread's: a collective another thread runs meanwhile (an overlapped
        sync's, say) is counted as ever, where saving the counters and putting
        them back afterwards dropped it."""
        before = getattr(_UNCOUNTED, "on", False)
        _UNCOUNTED.on = True
        try:
            yield
        finally:
            _UNCOUNTED.on = before

    def split(self, groups: Sequence[Sequence[int]]) -> "Communicator":
        """This rank's communicator among the ranks of the group of
        ``groups`` that holds it (a partition of this communicator's ranks,
        the same on every rank, which must all call it together); ranks are
        numbered in the order the group lists them. What it moves is counted
        here too. Transports that can form groups implement ``_split``."""
        members = sorted(r for group in groups for r in group)
        if members != list(range(self.size)):
            raise ValueError(f"split needs a partition of the {self.size} ranks, got {groups}")
        sub = self._split([list(group) for group in groups])
        sub.parent = self
        return sub

    @property
    def can_split(self) -> bool:
        """Whether this transport forms groups (``split``); hierarchy="auto" stays flat where it cannot."""
        return type(self)._split is not Communicator._split

    def _split(self, groups: list[list[int]]) -> "Communicator":
        raise ConfigError(f"{type(self).__name__} cannot form groups of ranks, which hierarchy='node' needs: use "
                          f"hierarchy='flat', or a transport that can (torch.distributed, LocalGroup)")

    # -- collectives ------------------------------------------------------
    def alltoall(self, payloads: Sequence[torch.Tensor], *, tag: int = 0, status: int | torch.Tensor = 0,
                 expected: Sequence[int] | None = None, strict: bool = True,
                 verdict: DeferredVerdict | None = None) -> list[torch.Tensor | None]:
        """Send ``payloads[k]`` to rank k; return what each rank j sent here.

        ``expected[k]``, when given, is the length every rank must send to
        rank k (the same list on every rank). With a ``verdict`` (a deferred
        step: ``expected`` needed, ``strict`` only) the table is judged when
        the verdict settles, and ``status`` may be a device tensor."""
        n, me = self.size, self.rank
        if len(payloads) != n:
            raise ValueError(f"alltoall needs {n} payloads (one per rank), got {len(payloads)}")
        for p in payloads:
            _check_payload(p)
        if verdict is not None:
            return self._alltoall_deferred(list(payloads), tag, status, _needed(expected, strict), verdict)
        header = [tag, status, *(int(p.numel()) for p in payloads)]
        if n == 1:
            table, received = [header], list(payloads)
        elif self.fused:  # the payloads move with their headers: counted whatever the verdict
            table, received = self._fused_alltoall(header, list(payloads))
            self._count(8 * len(header), sum(int(payloads[k].numel()) for k in range(n) if k != me),
                        sum(int(received[j].numel()) for j in range(n) if j != me))
        else:
            table = self._gather_header_table(header)
        lengths = self._judge(table, tag)
        refused = self._refuse_unexpected(lengths, None if expected is None else [list(expected)] * n,
                                          strict, "alltoall")
        if not self.fused and n > 1:  # move only what the verdict accepted
            send_lens, recv_lens = lengths[me], [lengths[j][me] for j in range(n)]
            if any(any(row) for row in lengths):
                received = self._alltoallv([p[:L] for p, L in zip(payloads, send_lens)], recv_lens)
            else:
                received = [payloads[0][:0]] * n
            self._count(0, sum(L for k, L in enumerate(send_lens) if k != me),
                        sum(L for j, L in enumerate(recv_lens) if j != me))
        return [None if (j, me) in refused else received[j] for j in range(n)]

    def allgather(self, payload: torch.Tensor, *, tag: int = 0, status: int | torch.Tensor = 0,
                  expected: Sequence[int] | None = None, strict: bool = True,
                  verdict: DeferredVerdict | None = None) -> list[torch.Tensor | None]:
        """Every rank's payload, in rank order. ``expected[j]``, when given,
        is the length rank j must send; ``verdict`` as in ``alltoall``."""
        _check_payload(payload)
        if verdict is not None:
            return self._allgather_deferred(payload, tag, status, _needed(expected, strict), verdict)
        n, me = self.size, self.rank
        header = [tag, status, int(payload.numel())]
        if n == 1:
            table, gathered = [header], [payload]
        elif self.fused:
            table, gathered = self._fused_allgather(header, payload)
            self._count(8 * len(header), int(payload.numel()) * (n - 1),
                        sum(int(gathered[j].numel()) for j in range(n) if j != me))
        else:
            table = self._gather_header_table(header)
        lengths = self._judge(table, tag)
        refused = self._refuse_unexpected(lengths, None if expected is None else [[e] for e in expected],
                                          strict, "allgather")
        if not self.fused and n > 1:  # every payload padded to the longest accepted one
            lens = [row[0] for row in lengths]
            width = max(lens)
            if width:
                buf = payload.new_zeros(width)
                buf[: lens[me]] = payload[: lens[me]]
                gathered = [g[: lens[j]] for j, g in enumerate(self._allgather_equal(buf))]
            else:
                gathered = [payload[:0]] * n
            self._count(0, width * (n - 1), width * (n - 1))
        return [None if (j, 0) in refused else gathered[j] for j in range(n)]

    # -- deferred verdicts (``verdict``) ------------------------------------
    def _alltoall_deferred(self, payloads: list[torch.Tensor], tag: int, status: int | torch.Tensor,
                           expected: list[int], verdict: DeferredVerdict) -> list[torch.Tensor]:
        """The plan fixes every length, so the payloads move at once, each
        cut or padded to its expected length; the header (with the lengths
        really built) is judged when the verdict settles."""
        n, me = self.size, self.rank
        header = [tag, status, *(int(p.numel()) for p in payloads)]
        if n == 1:
            table, received = self._device_header(header).reshape(1, -1), [_fitted(payloads[0], expected[0])]
        elif self.fused:
            table, received = self._fused_alltoall(header, [_fitted(p, e) for p, e in zip(payloads, expected)])
        else:  # the header rides behind each message: one collective
            words = self._header_bytes(header)
            messages = torch.cat([piece for p, e in zip(payloads, expected)
                                  for piece in (*_fitted_pieces(p.to(self.device), e), *words)])
            header_bytes = 8 * len(header)
            arrived = self._alltoallv(list(messages.split([e + header_bytes for e in expected])),
                                      [expected[me] + header_bytes] * n)
            received = [m[: expected[me]] for m in arrived]
            table = _carried_headers([m[expected[me]:] for m in arrived])
        self._count(8 * len(header), sum(expected[k] for k in range(n) if k != me), expected[me] * (n - 1))
        self._judge_when_settled(verdict, table, tag, [list(expected)] * n, "alltoall")
        return received

    def _allgather_deferred(self, payload: torch.Tensor, tag: int, status: int | torch.Tensor,
                            expected: list[int], verdict: DeferredVerdict) -> list[torch.Tensor]:
        """``allgather`` of a deferred step: as ``_alltoall_deferred``."""
        n, me = self.size, self.rank
        header = [tag, status, int(payload.numel())]
        if n == 1:
            table, gathered = self._device_header(header).reshape(1, -1), [_fitted(payload, expected[0])]
            sent = received = 0
        elif self.fused:
            table, gathered = self._fused_allgather(header, _fitted(payload, expected[me]))
            sent, received = expected[me] * (n - 1), sum(expected[j] for j in range(n) if j != me)
        else:  # every payload padded to the longest, its header behind it: one collective
            width = max(expected)
            mine = _fitted_pieces(payload[: expected[me]].to(self.device), width)
            arrived = self._allgather_equal(torch.cat([*mine, *self._header_bytes(header)]))
            gathered = [g[: expected[j]] for j, g in enumerate(arrived)]
            table = _carried_headers([g[width:] for g in arrived])
            sent = received = width * (n - 1)
        self._count(8 * len(header), sent, received)
        self._judge_when_settled(verdict, table, tag, [[e] for e in expected], "allgather")
        return gathered

    def _judge_when_settled(self, verdict: DeferredVerdict, table: torch.Tensor | list[list], tag: int,
                            expected: list[list[int]], what: str) -> None:
        """Judge ``table`` as the collective protocol does (``_judge``, then
        ``_refuse_unexpected``) once ``verdict`` has read it back: a device
        table whole, a fused transport's host headers for their statuses only."""
        if isinstance(table, torch.Tensor):  # int64 words, or their bytes as they arrived behind the payloads
            carried = table.dtype == torch.uint8
            bad = lambda: table != self._expected_table(tag, expected, carried)  # noqa: E731
            reading = verdict.read_words(table, bad) if carried else verdict.read(table, bad)
            width = table.shape[-1] // 8 if carried else table.shape[-1]
            table_rows = lambda: reading.rows(width)  # noqa: E731
            self.last_statuses = lambda: (table.contiguous().view(torch.int64) if carried else table)[:, hdr.STATUS]
        else:
            column = torch.stack([_int64(row[hdr.STATUS], self.device) for row in table])
            mismatch = len({row[hdr.TAG] for row in table}) > 1 or any(
                list(row[hdr.LENGTHS:]) != list(e) for row, e in zip(table, expected))
            statuses = verdict.read(column, lambda: torch.ones(1, dtype=torch.bool, device=column.device)
                                    if mismatch else column != hdr.OK)
            table_rows = lambda: [[*row[:hdr.STATUS], s, *row[hdr.STATUS + 1:]]  # noqa: E731
                                  for row, s in zip(table, statuses.values)]
            self.last_statuses = lambda: column
        verdict.then(lambda: self._refuse_unexpected(self._judge(table_rows(), tag), expected, True, what))

    def _expected_table(self, tag: int, expected: list[list[int]], as_bytes: bool) -> torch.Tensor:
        """The header table a judge passes, on the device (cached): every row
        ``[tag, OK, expected lengths]``, as int64 words or their bytes. A table
        that differs from it anywhere is one its judge will condemn."""
        key = ("passes", tag, tuple(map(tuple, expected)))
        table = self._device_headers.get(key)
        if table is None:
            rows = [[tag, hdr.OK, *lengths] for lengths in expected]
            table = self._device_headers[key] = torch.tensor(rows, dtype=torch.int64).to(self.device)
        return table.view(torch.uint8) if as_bytes else table

    def _device_header(self, header: list) -> torch.Tensor:
        """``[tag, status, lengths...]`` on this rank's device. The constant
        part is copied to the device once per collective (a host-to-device
        copy waits for the device); the status is written on the device."""
        status = header[hdr.STATUS]
        key = (header[hdr.TAG], tuple(header[hdr.LENGTHS:]))
        base = self._device_headers.get(key)
        if base is None:
            if len(self._device_headers) > 1024:  # a few per bucket; only odd lengths from a faulty peer add more
                self._device_headers.clear()
            base = self._device_headers[key] = torch.tensor([*key[:1], hdr.OK, *key[1]], dtype=torch.int64
                                                            ).to(self.device)
        if isinstance(status, int) and status == hdr.OK:
            return base
        status = _int64(status, self.device).reshape(1) if isinstance(status, int) else _moved(status, self.device)
        return torch.cat([base[:hdr.STATUS], status.reshape(1), base[hdr.STATUS + 1:]])  # one op; a bool is cast

    def _header_bytes(self, header: list) -> list[torch.Tensor]:
        """``_device_header`` as uint8 pieces, for a caller that concatenates
        them with its payloads anyway: a device int64 status goes in as it
        is, where joining it to the header first was an op of its own."""
        status = header[hdr.STATUS]
        if not isinstance(status, torch.Tensor):
            return [self._device_header(header).view(torch.uint8)]
        base = self._device_header([*header[:hdr.STATUS], hdr.OK, *header[hdr.STATUS + 1:]])
        status = _int64(status, self.device).reshape(1)
        return [base[:hdr.STATUS].view(torch.uint8), status.view(torch.uint8), base[hdr.STATUS + 1:].view(torch.uint8)]

    # -- the shared protocol ---------------------------------------------
    def _gather_header_table(self, header: list[int]) -> list[list[int]]:
        """Two-collective transports: every rank's header, gathered first."""
        table = self._gather_headers(torch.tensor(header, dtype=torch.int64)).tolist()
        self._count(8 * len(header), 0, 0)
        return table

    def _count(self, header_bytes: int, payload_sent: int, payload_received: int) -> None:
        """Headers go to, and come from, every other rank."""
        if getattr(_UNCOUNTED, "on", False):
            return
        overhead = header_bytes * (self.size - 1)
        comm: Communicator | None = self
        while comm is not None:  # a group's bytes are its parent's too
            comm.bytes_sent += overhead + payload_sent
            comm.bytes_received += overhead + payload_received
            comm = comm.parent

    def _judge(self, table: list[list[int]], tag: int) -> list[list[int]]:
        """The verdict every rank reaches from the same header table
        (``header.judge``); returns the declared lengths, one row per sender."""
        return hdr.judge(table, tag, self.rank)

    def _refuse_unexpected(self, lengths: list[list[int]], expected: list[list[int]] | None, strict: bool,
                           what: str) -> set[tuple[int, int]]:
        """Declared lengths that differ from ``expected``: an error naming the
        sender (strict), or the set of (sender, slot) refused, with their
        lengths zeroed so that nothing moves for them."""
        if expected is None:
            return set()
        bad = [(j, k) for j in range(len(lengths)) for k in range(len(lengths[j]))
               if lengths[j][k] != expected[j][k]]
        if bad and strict:
            j, k = bad[0]
            to = f" to rank {k}" if what == "alltoall" else ""
            raise PayloadError(f"rank {j} sent a {lengths[j][k]}-byte payload{to} in {what}; "
                               f"expected {expected[j][k]} bytes", rank=j)
        for j, k in bad:
            lengths[j][k] = 0
            if what == "allgather" or k == self.rank:
                self.rejected[j] = self.rejected.get(j, 0) + 1
        return set(bad)

    # -- transport primitives --------------------------------------------
    def _fused_alltoall(self, header: list[int], payloads: list[torch.Tensor]):
        """Fused transports: send ``header`` and ``payloads[k]`` to rank k in
        one collective; return (every sender's header, what each sent here)."""
        raise NotImplementedError

    def _fused_allgather(self, header: list[int], payload: torch.Tensor):
        """Fused transports: (every rank's header, every rank's payload)."""
        raise NotImplementedError

    def _gather_headers(self, header: torch.Tensor) -> torch.Tensor:
        """All ranks' int64 headers (same length everywhere), shape (size, H)."""
        raise NotImplementedError

    def _alltoallv(self, send: list[torch.Tensor], recv_lens: list[int]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _allgather_equal(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """All ranks' uint8 buffers, all of the same length."""
        raise NotImplementedError


def joined(payloads: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 message of ``payloads`` in order. Payloads that already lie
    one after another in one buffer (the rows of a batched encode) are that
    buffer's span, a view: nothing is copied. Otherwise they are
    concatenated (a lone payload is returned as it is)."""
    payloads = list(payloads)
    if len(payloads) == 1:
        return payloads[0]
    if payloads and _consecutive(payloads):
        first = payloads[0]
        total = sum(int(p.numel()) for p in payloads)
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))
    return torch.cat(payloads)


def rows(payloads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """``payloads`` as the rows of one (count, *shape) view, where they are
    contiguous, of one shape and dtype, and lie at even steps in one buffer
    (what a collective delivers for a run of equal-sized chunks: one after
    another, or each at the start of a row padded to the longest payload;
    what a kernel that wrote several results together hands out, unbound),
    so that they are used together without a copy; None otherwise (a
    refused one, other shapes, copies)."""
    payloads = list(payloads)
    first = payloads[0] if payloads else None
    if first is None or any(p is None or not p.is_contiguous() or p.shape != first.shape or p.dtype != first.dtype
                            or p.device != first.device for p in payloads):
        return None
    length = int(first.numel())
    if length == 0:
        return None
    storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
    step = payloads[1].storage_offset() - start if len(payloads) > 1 else length
    if step < length or any(p.untyped_storage().data_ptr() != storage or p.storage_offset() != start + j * step
                            for j, p in enumerate(payloads)):
        return None
    return first.new_empty(0).set_(first.untyped_storage(), start, (len(payloads), *first.shape),
                                   (step, *first.stride()))


def _consecutive(payloads: list[torch.Tensor]) -> bool:
    """Whether the 1-D contiguous ``payloads`` follow one another in one storage, on one device."""
    first = payloads[0]
    storage, end = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in payloads:
        if p.device != first.device or not p.is_contiguous() or p.untyped_storage().data_ptr() != storage \
                or p.storage_offset() != end:
            return False
        end += int(p.numel())
    return True


def _carried_headers(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The headers that arrived behind the payloads, each sender's int64
    words as bytes: a (senders, 8·H) view of the buffer they arrived in."""
    table = rows(pieces)
    return torch.stack(pieces) if table is None else table


def _needed(expected: Sequence[int] | None, strict: bool) -> list[int]:
    """A deferred step moves the lengths its plan fixes: they must be given, and wrong ones are errors."""
    if expected is None or not strict:
        raise ValueError("a deferred verdict needs the expected lengths and strict payloads")
    return [int(e) for e in expected]


#: whether this thread's collectives go uncounted (``Communicator.uncounted``)
_UNCOUNTED = threading.local()


def _int64(value: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-d int64 tensor of ``value`` on ``device``, a number made there without a host-to-device copy."""
    if isinstance(value, torch.Tensor):
        return _moved(value, device).reshape(()).to(torch.int64)
    return torch.full((), int(value), dtype=torch.int64, device=device)


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on the transport's ``device``: a status word computed beside CUDA payloads travels with gloo's
    host buffers (an op only there; on nccl, or on a CPU, it is where it is)."""
    return tensor if tensor.device == device else tensor.to(device)


def _fitted(payload: torch.Tensor, length: int) -> torch.Tensor:
    """``payload`` cut or zero-padded to ``length`` bytes."""
    pieces = _fitted_pieces(payload, length)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _fitted_pieces(payload: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
    """``payload`` cut to ``length`` bytes, or it and the zeros that pad it
    there: pieces for a caller that concatenates them with others anyway."""
    if payload.numel() >= length:
        return (payload[:length],)
    return payload, payload.new_zeros(length - payload.numel())


def _check_payload(p) -> None:
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 1:
        got = f"{p.dtype} {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
        raise TypeError(f"payloads must be 1-D torch.uint8 tensors, got {got}")
