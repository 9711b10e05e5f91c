"""``LocalGroup(n).run(fn)``: n ranks as threads of this process, with real
blocking collectives, so the per-rank code that runs over torch.distributed
runs here unchanged (tests, simulations of many workers, fault injection).

Payloads are copied on delivery, as a network would, so no rank can alias
another's buffers. If a rank raises, or returns while others wait in a
collective, the waiting ranks get ``PeerFailedError`` at once: never a hang.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from ..errors import ConfigError, PeerFailedError
from ._math_library import initialise_vector_math
from ._protocol import Communicator


class _Board:
    """Shared mailbox plus a barrier that knows when a peer is gone."""

    def __init__(self, size: int, timeout: float, parent: "_Board | None" = None,
                 members: list[int] | None = None):
        self.size = size
        self.timeout = timeout
        #: a group's board: the board of every rank (its condition, failures and finished ranks), and the
        #: group's ranks there
        self.parent, self.members = parent, members
        self.groups: dict[tuple, _Board] = {}  # boards of groups split from this one, by (split, ranks)
        self.slots: list[list[Any]] = [[None] * size, [None] * size]  # double-buffered
        self.rounds = [0] * size
        self.cond = threading.Condition() if parent is None else parent.cond
        self.arrived = 0
        self.generation = 0
        self.failed: dict[int, BaseException] = {}
        self.finished: set[int] = set()

    def wait(self, rank: int) -> None:
        with self.cond:
            self._raise_if_peer_gone(rank)
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.size:
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return
            deadline = time.monotonic() + self.timeout
            while generation == self.generation:
                self._raise_if_peer_gone(rank)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.failed.setdefault(rank, PeerFailedError("timeout"))
                    self.cond.notify_all()
                    raise PeerFailedError(
                        f"rank {rank}: peers did not reach the collective within {self.timeout:.0f} s")
                self.cond.wait(min(left, 1.0))

    def _raise_if_peer_gone(self, rank: int, among: list[int] | None = None) -> None:
        """Raise if a rank this one waits for (``among``, default all) failed or returned."""
        if self.parent is not None:  # a group: its ranks' failures are recorded on the whole board
            self.parent._raise_if_peer_gone(self.members[rank], [self.members[r] for r in among or range(self.size)])
            return
        failed = {r: e for r, e in self.failed.items() if among is None or r in among}
        if failed:
            culprits = sorted(failed)
            first = next(iter(failed.values()))
            raise PeerFailedError(f"rank {rank} stops: rank(s) {culprits} failed ({first!r})")
        finished = sorted(r for r in self.finished if among is None or r in among)
        if finished:
            raise PeerFailedError(f"rank {rank} waits in a collective that rank(s) {finished} "
                                  f"will never join: they already returned")

    def group(self, key: tuple, members: list[int]) -> "_Board":
        """The board of a group of this board's ranks, made by whichever rank asks first."""
        with self.cond:
            if key not in self.groups:
                self.groups[key] = _Board(len(members), self.timeout, self, list(members))
            return self.groups[key]

    def exchange(self, rank: int, item: Any) -> list[Any]:
        """Post ``item``, wait for all, return every rank's item. Rounds
        alternate between two slot arrays: a rank can post round r+2 only
        after everyone has arrived at round r+1, i.e. finished reading r."""
        slots = self.slots[self.rounds[rank] % 2]
        self.rounds[rank] += 1
        slots[rank] = item
        self.wait(rank)
        return list(slots)


class LocalComm(Communicator):
    """One rank's view of a ``LocalGroup``: a fused transport (header and
    payload posted together, one barrier per exchange)."""

    fused = True

    def __init__(self, board: _Board, rank: int, device: torch.device | str = "cpu"):
        super().__init__()
        self._board = board
        self.rank = rank
        self.size = board.size
        self.device = torch.device(device)

    # Payloads are copied by the sender before they are posted, as a network would: a copy taken by the
    # receiver after the barrier races with a sender that has already returned and reuses its buffers.
    def _split(self, groups):
        self._splits = getattr(self, "_splits", 0) + 1
        members = next(g for g in groups if self.rank in g)
        board = self._board.group((self._splits, tuple(members)), members)
        return LocalComm(board, members.index(self.rank), self.device)

    def _fused_alltoall(self, header, payloads):
        everything = self._board.exchange(self.rank, (header, [p.clone() for p in payloads]))
        return [h for h, _ in everything], _received([p[self.rank] for _, p in everything])

    def _fused_allgather(self, header, payload):
        everything = self._board.exchange(self.rank, (header, payload.clone()))
        return [h for h, _ in everything], _received([p for _, p in everything])  # one posted copy, many readers


def _received(payloads: list[torch.Tensor]) -> list[torch.Tensor]:
    """What each sender posted, copied into one receive buffer, one after
    another, as a network transport delivers them (so that payloads of one
    length arrive as one buffer's rows, ``comm.rows``)."""
    if len({(p.dtype, p.device, p.dim()) for p in payloads}) != 1 or payloads[0].dim() != 1:
        return [p.clone() for p in payloads]
    return list(torch.cat(payloads).split([int(p.numel()) for p in payloads]))


class LocalGroup:
    """n in-process ranks. ``run(fn)`` calls ``fn(comm)`` on each, in its own
    thread, and returns the results in rank order.

    If any rank raises, ``run`` raises that rank's exception (the lowest
    rank's, when several raised; exceptions that only say a peer failed come
    last). ``return_exceptions=True`` returns the exceptions in the result list
    instead, to check that every rank saw an error."""

    def __init__(self, size: int, *, timeout: float = 120.0, device: torch.device | str = "cpu"):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"LocalGroup size must be a positive integer, got {size!r}")
        self.size = size
        self.timeout = timeout
        self.device = device

    def run(self, fn: Callable[[LocalComm], Any], *args: Any,
            return_exceptions: bool = False) -> list[Any]:
        """``fn(comm, *args)`` on every rank, in threads; results in rank order."""
        board = _Board(self.size, self.timeout)
        comms = [LocalComm(board, r, self.device) for r in range(self.size)]
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def target(rank: int) -> None:
            try:
                results[rank] = fn(comms[rank], *args)
                with board.cond:
                    board.finished.add(rank)
                    board.cond.notify_all()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors[rank] = exc
                with board.cond:
                    board.failed.setdefault(rank, exc)
                    board.cond.notify_all()

        initialise_vector_math()  # before the rank threads make their first calls together
        threads = [threading.Thread(target=target, args=(r,), name=f"dsq-rank{r}", daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if return_exceptions:
            return [errors[r] if errors[r] is not None else results[r] for r in range(self.size)]
        raised = [e for e in errors if e is not None]
        if raised:
            primary = [e for e in raised if not isinstance(e, PeerFailedError)]
            raise (primary or raised)[0]
        return results


