"""The communicator protocol the reducer talks to, independent of the engine.

Two collectives over 1-D uint8 payloads whose sizes may differ per rank:
``alltoall`` (payload k goes to rank k) and ``allgather`` (one payload to all).

Every collective first all-gathers a small int64 header from each rank:
``[tag, status, length...]``. Because every rank then sees every header, all
ranks reach the same verdict before any payload moves, so a problem on one
rank becomes the same clear error on every rank instead of a hang:

* tags differ  -> ``CollectiveMismatchError`` (ranks reduce different tensors)
* a status != 0 -> ``PeerStatusError`` (the caller gives statuses a meaning,
  e.g. "my gradient is not finite")
* a declared length differs from the expected one -> ``PayloadError`` naming
  the sender, or with ``strict=False`` that payload is not moved at all and
  the receiver gets ``None`` in its place (robust aggregation excludes it).

Transports move the headers one of two ways. The default gathers them
first (a small int64 all-gather), then moves only the payloads the verdict
accepts. A *fused* transport (``fused = True``: Horovod, the in-process
group) puts each sender's whole header in front of every message and moves
both in one collective: every rank still receives every header, so the
verdict is the same, in half the collectives.

Bytes are counted from what moves: the headers (8 bytes per int64) and the
payloads to and from other ranks. The default allgather moves every payload
padded to the longest one, and the padding is counted too; fused transports
move each payload at its own length. What a rank sends to itself is not
counted.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch

from .errors import CollectiveMismatchError, DSQError, PayloadError

_TAG, _STATUS, _LEN = 0, 1, 2


class PeerStatusError(DSQError):
    """Some rank entered a collective with a non-zero status."""

    def __init__(self, statuses: dict[int, int]):
        super().__init__(f"ranks reported non-zero status: {statuses}")
        self.statuses = statuses


def make_tag(name: str, numel: int) -> int:
    """A 62-bit tag for a collective over tensor ``name`` of ``numel`` elements."""
    return (zlib.crc32(name.encode()) << 30) | (numel & ((1 << 30) - 1))


class Communicator:
    """Base class: the protocol above on top of three transport primitives.

    Subclasses set ``rank``, ``size`` and ``device`` and implement
    ``_gather_headers``, ``_alltoallv`` and ``_allgather_equal``."""

    rank: int
    size: int
    device: torch.device
    #: header and payload travel together in one collective (see the module docstring)
    fused: bool = False

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        #: payloads refused for a wrong length, by sender rank (strict=False only)
        self.rejected: dict[int, int] = {}

    def reset_counters(self) -> None:
        self.bytes_sent = self.bytes_received = 0

    # -- collectives ------------------------------------------------------
    def alltoall(self, payloads: Sequence[torch.Tensor], *, tag: int = 0, status: int = 0,
                 expected: Sequence[int] | None = None, strict: bool = True) -> list[torch.Tensor | None]:
        """Send ``payloads[k]`` to rank k; return what each rank j sent here.

        ``expected[k]``, when given, is the length every rank must send to
        rank k (the same list on every rank)."""
        n = self.size
        if len(payloads) != n:
            raise ValueError(f"alltoall needs {n} payloads (one per rank), got {len(payloads)}")
        for p in payloads:
            _check_payload(p)
        if n == 1:
            self._check_single(tag, status, [int(payloads[0].numel())], expected, strict)
            return [None if self._refused_single else payloads[0]]
        if self.fused:
            header = [tag, status, *(int(p.numel()) for p in payloads)]
            table, received = self._fused_alltoall(header, list(payloads))
            lengths = self._judge(table, tag)
            self._count_fused(len(header), sum(int(p.numel()) for k, p in enumerate(payloads) if k != self.rank),
                              sum(lengths[j][self.rank] for j in range(n) if j != self.rank))
            if expected is not None:
                self._apply_expected(lengths, [list(expected)] * n, strict, "alltoall")
            return [None if self._refused[j][self.rank] else received[j] for j in range(n)]
        lengths = self._headers(tag, status, [int(p.numel()) for p in payloads])
        if expected is not None:
            self._apply_expected(lengths, [list(expected)] * n, strict, "alltoall")
        send_lens = lengths[self.rank]
        recv_lens = [lengths[j][self.rank] for j in range(n)]
        if any(any(row) for row in lengths):
            send = [p[:L] if L else p[:0] for p, L in zip(payloads, send_lens)]
            received = self._alltoallv(send, recv_lens)
        else:
            received = [payloads[0][:0]] * n
        self.bytes_sent += sum(L for k, L in enumerate(send_lens) if k != self.rank)
        self.bytes_received += sum(L for j, L in enumerate(recv_lens) if j != self.rank)
        return [None if self._refused[j][self.rank] else received[j] for j in range(n)]

    def allgather(self, payload: torch.Tensor, *, tag: int = 0, status: int = 0,
                  expected: Sequence[int] | None = None, strict: bool = True) -> list[torch.Tensor | None]:
        """Every rank's payload, in rank order. ``expected[j]``, when given,
        is the length rank j must send."""
        _check_payload(payload)
        n = self.size
        if n == 1:
            self._check_single(tag, status, [int(payload.numel())],
                               None if expected is None else [expected[0]], strict)
            return [None if self._refused_single else payload]
        if self.fused:
            header = [tag, status, int(payload.numel())]
            table, gathered = self._fused_allgather(header, payload)
            lengths = self._judge(table, tag)
            self._count_fused(len(header), int(payload.numel()) * (n - 1),
                              sum(lengths[j][0] for j in range(n) if j != self.rank))
            if expected is not None:
                self._apply_expected(lengths, [[e] for e in expected], strict, "allgather")
            return [None if self._refused[j][0] else gathered[j] for j in range(n)]
        lengths = self._headers(tag, status, [int(payload.numel())])
        if expected is not None:
            self._apply_expected(lengths, [[e] for e in expected], strict, "allgather")
        lens = [row[0] for row in lengths]
        width = max(lens)
        if width:
            buf = payload.new_zeros(width)
            buf[: lens[self.rank]] = payload[: lens[self.rank]]
            gathered = self._allgather_equal(buf)
        else:
            gathered = [payload[:0]] * n
        self.bytes_sent += width * (n - 1)
        self.bytes_received += width * (n - 1)
        return [None if self._refused[j][0] else gathered[j][: lens[j]] for j in range(n)]

    # -- the shared protocol ---------------------------------------------
    def _headers(self, tag: int, status: int, lengths: list[int]) -> list[list[int]]:
        header = torch.tensor([tag, status, *lengths], dtype=torch.int64)
        table = self._gather_headers(header).tolist()
        n = self.size
        self.bytes_sent += 8 * len(header) * (n - 1)
        self.bytes_received += 8 * len(header) * (n - 1)
        return self._judge(table, tag)

    def _count_fused(self, header_len: int, payload_sent: int, payload_received: int) -> None:
        overhead = 8 * header_len * (self.size - 1)
        self.bytes_sent += overhead + payload_sent
        self.bytes_received += overhead + payload_received

    def _judge(self, table: list[list[int]], tag: int) -> list[list[int]]:
        """The verdict every rank reaches from the same header table; returns
        the declared lengths, one row per sender."""
        n = self.size
        tags = [row[_TAG] for row in table]
        if len(set(tags)) != 1:
            others = [j for j in range(n) if tags[j] != tag]
            raise CollectiveMismatchError(
                f"rank {self.rank} entered a collective for a different tensor (name or size) than ranks {others}")
        statuses = {j: row[_STATUS] for j, row in enumerate(table) if row[_STATUS] != 0}
        if statuses:
            raise PeerStatusError(statuses)
        self._refused = [[False] * (len(row) - _LEN) for row in table]
        return [row[_LEN:] for row in table]

    def _apply_expected(self, lengths: list[list[int]], expected: list[list[int]], strict: bool, what: str) -> None:
        bad = [(j, k, lengths[j][k]) for j in range(len(lengths)) for k in range(len(lengths[j]))
               if lengths[j][k] != expected[j][k]]
        if not bad:
            return
        if strict:
            j, k, got = bad[0]
            want = expected[j][k]
            to = f" to rank {k}" if what == "alltoall" else ""
            raise PayloadError(f"rank {j} sent a {got}-byte payload{to} in {what}; expected {want} bytes", rank=j)
        for j, k, _ in bad:
            lengths[j][k] = 0
            self._refused[j][k] = True
            if (what == "alltoall" and k == self.rank) or what == "allgather":
                self.rejected[j] = self.rejected.get(j, 0) + 1

    def _check_single(self, tag, status, lengths, expected, strict) -> None:
        self._refused_single = False
        if status:
            raise PeerStatusError({0: status})
        if expected is not None and lengths[0] != expected[0]:
            if strict:
                raise PayloadError(f"rank 0 produced a {lengths[0]}-byte payload; expected {expected[0]} bytes", rank=0)
            self._refused_single = True
            self.rejected[0] = self.rejected.get(0, 0) + 1

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


def _check_payload(p) -> None:
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 1:
        got = f"{p.dtype} {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
        raise TypeError(f"payloads must be 1-D torch.uint8 tensors, got {got}")
