"""Algorithm 1 between hosts: exact inside a host, DoubleSqueeze across.

With N hosts of L ranks, one bucket's exchange is three stages:

    1. inside each host, an exact reduce-scatter: local rank i gets its
       host's mean of shard i (1/L of the bucket), over the fast link;
    2. among the ranks with local index i on every host, Algorithm 1 on
       shard i (``Algorithm1`` on the cross group: worker pass with the
       worker error, server pass with the server error);
    3. inside each host, an exact all-gather of the shards.

A host then sends about 2·M_c across its link per step (M_c: the compressed
bucket), where the flat exchange sends 2·L·M_c; the worker error is 1/L of
the bucket per rank. Every worker of stage 2 is a host's mean, so a robust
aggregator votes among hosts: a faulty rank makes its host's mean faulty,
and ``f`` counts hosts.

Failures stay the same on every rank. Stage 1's headers tell every rank of
a host what its host's ranks reported; a host with a non-finite gradient
sends a non-finite shard into every cross group, and a host with a rank
that failed announces it there, so every cross group reaches the same
verdict (a ``NonFiniteGradientError`` or skipped step naming the hosts).
What only one cross group saw (a payload its owner refused) is announced
to the host's other ranks by stage 3's headers.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..comm import Communicator, header
from ..compressors.finite import all_finite
from ..errors import ConfigError, DSQError, NonFiniteGradientError, PeerFailedError, PeerStatusError
from ..layout import HostLayout, Pieces, chunk_bounds
from ..state import StagedUpdate
from ..step import IMMEDIATE, Checks, Deferred, Skipped, StepVerdict, nonfinite, raise_for_statuses
from ._algorithm1 import Algorithm1

__all__ = ["TwoLevel", "host_groups"]


def host_groups(comm: Communicator, hosts: HostLayout, compressors: tuple
                ) -> tuple[Communicator | None, Communicator | None]:
    """Two-level: this rank's host group and its cross group (every rank
    splits, in the same order); flat: None, None."""
    if not hosts.two_level:
        return None, None
    structured = next((q for q in compressors if q.structured), None)
    if structured is not None:
        raise ConfigError(f"hierarchy='node' cannot be used with {structured!r}: a structured operator needs whole "
                          f"tensors, and a host's shard cuts them; use hierarchy='flat'")
    return comm.split(hosts.node_groups()), comm.split(hosts.cross_groups())


class TwoLevel:
    """One bucket's three stages. ``node``: this rank's host group;
    ``algorithm``: Algorithm 1 on this rank's cross group (None on one
    host: nothing crosses a link, the host's exact mean is the average)."""

    def __init__(self, node: Communicator, algorithm: Algorithm1 | None, hosts: HostLayout, rank: int,
                 on_nonfinite: str):
        self.node, self.algorithm, self.hosts, self.on_nonfinite = node, algorithm, hosts, on_nonfinite
        self.host, self.local = hosts.host_of(rank), hosts.local_index(rank)
        #: the ranks of host h are h·L .. h·L + L - 1 (ZeRO's halves need it, as partition r is rank r's)
        self.consecutive = all(members == tuple(range(h * len(members), (h + 1) * len(members)))
                               for h, members in enumerate(hosts.hosts))

    def reduce(self, name: str, g: torch.Tensor | Pieces, problem: Exception | None, checks: Checks,
               out: torch.Tensor | Pieces | None = None) -> tuple[StagedUpdate, torch.Tensor]:
        """The average of every rank's ``g``, and what stage 2 staged."""
        if checks.deferred:
            return self._reduce_deferred(name, g, problem, checks, out)
        flat = g.flat() if isinstance(g, Pieces) else g
        bounds = chunk_bounds(flat.numel(), self.node.size)
        shard, problem = self._reduce_scatter(name, flat, bounds, problem)       # 1. exact, inside the host
        update, average = StagedUpdate(name), shard
        if self.algorithm is not None:                                           # 2. Algorithm 1, across hosts
            try:
                update, average = self.algorithm.reduce(name, shard, problem, checks)
            except (Skipped, NonFiniteGradientError) as exc:  # every cross group saw the same hosts
                raise self._by_host(name, exc) from None
            except DSQError as exc:
                problem = exc
        result = self._all_gather(name, average, bounds, problem)               # 3. exact, inside the host
        if isinstance(out, torch.Tensor):
            return update, out.copy_(result)
        return update, result

    # -- the three stages judged when the step settles (``verdict="step"``) --------------------
    def _reduce_deferred(self, name: str, g: torch.Tensor | Pieces, problem: Exception | None, checks: Checks,
                         out: torch.Tensor | Pieces | None) -> tuple[StagedUpdate, torch.Tensor]:
        """``reduce`` with every header and check read once, when the step
        settles. A group reads only its own tables, so what one finds must
        reach the others before the end: a host with a non-finite gradient
        sends a non-finite shard into every cross group (so each names the
        host), a rank that failed says so in its own cross group, and stage
        3's header tells a host's ranks whether anything this rank saw will
        fail the step (a device status). So every rank fails a step that any
        rank fails, with the collective protocol's errors. (The plan, agreed
        by every rank first, fixes what a host's ranks send each other.)"""
        flat = g.flat() if isinstance(g, Pieces) else g
        bounds = chunk_bounds(flat.numel(), self.node.size)
        update, average, alarm = self._across_deferred(                                 # 1. and 2.
            name, flat, bounds, problem, checks, None,
            lambda shard, by_host: self.algorithm.reduce(name, shard, problem, by_host))
        result = self._all_gather_deferred(name, average, bounds, alarm, problem, checks.verdict)  # 3.
        if isinstance(out, torch.Tensor):
            return update, out.copy_(result)
        return update, result

    def _across_deferred(self, name: str, flat: torch.Tensor, bounds: list[tuple[int, int]],
                         problem: Exception | None, checks: Checks, divide_by: torch.Tensor | None,
                         across: Callable[[torch.Tensor, Checks], tuple[StagedUpdate, torch.Tensor]]
                         ) -> tuple[StagedUpdate, torch.Tensor, torch.Tensor]:
        """Stages 1 and 2 of a deferred step: the host's exact mean of this
        rank's shard (divided by ``divide_by``), then ``across(shard, checks)``
        among the hosts, with a host's non-finite gradient made a non-finite
        shard. Returns what stage 2 staged, its result, and the device alarm
        that stage 3 passes on to the host."""
        verdict = checks.verdict
        mark = verdict.mark()
        shard = self._reduce_scatter_deferred(name, flat, bounds, problem, verdict)
        statuses = self.node.last_statuses()
        alarm = verdict.alarm_since(mark, shard.device)
        if divide_by is not None:
            shard = shard / divide_by.reshape(-1).to(shard.dtype)
        if self.algorithm is None:  # one host: its exact mean is the average
            return StagedUpdate(name), shard, alarm
        shard = torch.where((statuses == header.NONFINITE).any().to(shard.device), float("nan"), shard)
        mark = verdict.mark()
        update, result = across(shard, _ByHost(checks, self, name))
        return update, result, alarm | verdict.alarm_since(mark, shard.device)

    def _reduce_scatter_deferred(self, name: str, flat: torch.Tensor, bounds: list[tuple[int, int]],
                                 problem: Exception | None, verdict: StepVerdict) -> torch.Tensor:
        """Stage 1 of a deferred step: this host's mean of shard ``local``.
        Its table is judged at the end: a rank of the host that failed, or a
        mismatch, raises there; a non-finite gradient is left to stage 2,
        which names the host on every rank."""
        expected = _fp32_bytes(bounds)
        status: int | torch.Tensor = header.LOCAL_FAILURE
        payloads = [torch.zeros(e, dtype=torch.uint8, device=flat.device) for e in expected]
        if problem is None:
            flat = flat.float()
            status = nonfinite(flat)  # (header.NONFINITE is 1: the device flag is the status)
            payloads = [flat[lo:hi].contiguous().view(torch.uint8) for lo, hi in bounds]
        with verdict.explained_by(self._host_verdict(name, problem)):
            received = self.node.alltoall(payloads, tag=header.make_tag(f"{name}/host", flat.numel()), status=status,
                                          expected=expected, verdict=verdict)
        return self._host_mean(received, flat.device)

    def _host_verdict(self, name: str, problem: Exception | None):
        """What stage 1's table means, judged at the end (``_reduce_scatter``'s rules)."""
        def explain(exc: BaseException) -> None:
            if not isinstance(exc, PeerStatusError):
                raise exc
            if problem is not None:
                raise problem
            failed = self._failed_ranks(name, exc.statuses)
            if failed is not None:
                raise failed
            # non-finite only: stage 2 names the host, the same on every rank
        return explain

    def _announce_deferred(self, name: str, alarm: torch.Tensor, problem: Exception | None,
                           verdict: StepVerdict) -> None:
        """``announce`` of a deferred step: a header round inside the host,
        judged when the step settles, saying whether anything this rank saw
        will fail the step."""
        with verdict.explained_by(self._gathered_verdict(name, problem)):
            self.node.allgather(torch.empty(0, dtype=torch.uint8, device=self.node.device),
                                tag=header.make_tag(f"{name}/verdict", 0), status=_alarm_status(alarm, problem),
                                expected=[0] * self.node.size, verdict=verdict)

    def _gathered_verdict(self, name: str, problem: Exception | None):
        """What a stage-3 (or announcing) table means, judged at the end."""
        def explain(exc: BaseException) -> None:
            if isinstance(exc, PeerStatusError):
                self._raise_for_host_statuses(name, exc, problem)
            raise exc
        return explain

    def _all_gather_deferred(self, name: str, average: torch.Tensor, bounds: list[tuple[int, int]],
                             alarm: torch.Tensor, problem: Exception | None, verdict: StepVerdict) -> torch.Tensor:
        """Stage 3 of a deferred step; its status says whether anything this
        rank saw will fail the step (``alarm``), for the host's other ranks."""
        status = _alarm_status(alarm, problem)
        payload = average.float().contiguous().view(torch.uint8)
        with verdict.explained_by(self._gathered_verdict(name, problem)):
            gathered = self.node.allgather(payload, tag=header.make_tag(f"{name}/gather", bounds[-1][1]),
                                           status=status, expected=_fp32_bytes(bounds), verdict=verdict)
        return torch.cat([p.view(torch.float32) for p in gathered]).to(average.device)

    # -- ZeRO's two halves: partition r of P = N·L equal ones is global rank r's -----------
    def reduce_scatter(self, name: str, flat: torch.Tensor, problem: Exception | None,
                       divide_by: torch.Tensor | None = None, checks: Checks = IMMEDIATE
                       ) -> tuple[StagedUpdate, torch.Tensor]:
        """This rank's partition of the average (stages 1 and 2: the worker
        pass and the owner's aggregation). Host shard i is made of the
        partitions of local index i on every host, so stage 2's chunk h of it
        is the partition of the rank (h, i): ZeRO's own. ``divide_by``: the
        host shard is divided by it between the stages. Deferred ``checks``:
        judged when the step settles, as ``reduce`` is."""
        interleaved, bounds = self._interleaved(name, flat)
        if checks.deferred:
            update, part, alarm = self._across_deferred(
                name, interleaved, bounds, problem, checks, divide_by,
                lambda shard, by_host: self.algorithm.reduce_scatter(name, shard, problem, checks=by_host))
            self._announce_deferred(name, alarm, problem, checks.verdict)
            return update, part
        shard, problem = self._reduce_scatter(name, interleaved, bounds, problem)
        if divide_by is not None:
            shard = shard / divide_by.reshape(-1).to(shard.dtype)
        update, part = StagedUpdate(name), shard  # one host: its exact mean of partition i is the average
        if self.algorithm is not None:
            try:
                update, part = self.algorithm.reduce_scatter(name, shard, problem)
            except (Skipped, NonFiniteGradientError) as exc:
                raise self._by_host(name, exc) from None
            except DSQError as exc:
                problem = exc
        self.announce(name, problem)  # what one host group refused, to the host's other ranks
        return update, part

    def all_gather(self, name: str, part: torch.Tensor, problem: Exception | None, error_feedback: bool
                   ) -> tuple[StagedUpdate, torch.Tensor]:
        """Every partition, squeezed by its owner (stage 2: the server pass
        among the hosts) and gathered inside each host (stage 3)."""
        update, (shard, _), problem = self.serve(name, part, problem, error_feedback)
        numel = shard.numel() * self.node.size
        interleaved = self._all_gather(name, shard, chunk_bounds(numel, self.node.size), problem)
        hosts = self.hosts.describe()["hosts"]
        return update, interleaved.view(self.node.size, hosts, -1).transpose(0, 1).reshape(-1)

    def host_shard(self, name: str, part: torch.Tensor, problem: Exception | None, error_feedback: bool
                   ) -> tuple[StagedUpdate, tuple]:
        """``serve``, with what any rank of the host raised raised here (no stage 3 follows to announce it)."""
        update, served, problem = self.serve(name, part, problem, error_feedback)
        self.announce(name, problem)
        return update, served

    def serve(self, name: str, part: torch.Tensor, problem: Exception | None, error_feedback: bool
              ) -> tuple[StagedUpdate, tuple, Exception | None]:
        """Stage 2's server pass alone: what it staged; this rank's host
        shard (the partitions of its local index on every host, in host
        order) with the payloads it was decoded from (one host: the
        partition itself, and None); and what stage 3 must announce."""
        hosts = self.hosts.describe()["hosts"]
        update, served = StagedUpdate(name), (part.new_zeros(part.numel() * hosts), None)
        part = self._spread_nonfinite(name, part, problem)
        if self.algorithm is None:
            served = (part, None)
        else:
            try:
                update, served = self.algorithm.all_gather(name, part, problem, part.numel() * hosts,
                                                           error_feedback, keep_payloads=True)
            except (Skipped, NonFiniteGradientError) as exc:
                raise self._by_host(name, exc) from None
            except DSQError as exc:
                problem = exc
        return update, served, problem

    def _spread_nonfinite(self, name: str, part: torch.Tensor, problem: Exception | None) -> torch.Tensor:
        """One header round inside the host before an all-gather's cross
        stage: where a rank of the host holds NaN or Inf, every rank's part
        becomes non-finite, so that every cross group refuses this host
        alike and raises at once (a reduce's stage 1 spreads it by
        averaging). Without it the one cross group that saw it raised while
        the others waited for it inside their hosts."""
        if self.node.size == 1:
            return part
        status = header.LOCAL_FAILURE if problem is not None else header.OK if all_finite(part) else header.NONFINITE
        try:
            self.node.allgather(part.new_empty(0, dtype=torch.uint8), tag=header.make_tag(f"{name}/finite", 0),
                                status=status)
        except PeerStatusError as exc:  # a failure of a peer goes on as before: stage 3 announces it
            if any(header.describe(code)[0] == "nonfinite" for code in exc.statuses.values()):
                return torch.full_like(part, float("nan"))
        return part

    def gather_inside_host(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        """Stage 3 alone: every local rank's fp32 ``shard`` (of equal sizes),
        exactly, in local order."""
        return self._all_gather(name, shard, chunk_bounds(shard.numel() * self.node.size, self.node.size), None)

    def _interleaved(self, name: str, flat: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """``flat`` reordered so that host shard i (the partitions of local index i) is contiguous."""
        hosts, local = self.hosts.describe()["hosts"], self.node.size
        if flat.numel() % (hosts * local):
            raise ConfigError(f"{name!r}: {flat.numel()} elements are not {hosts * local} equal partitions")
        interleaved = flat.reshape(hosts, local, -1).transpose(0, 1).reshape(-1)
        return interleaved, chunk_bounds(flat.numel(), local)

    def announce(self, name: str, problem: Exception | None) -> None:
        """One header round inside the host: raise here what any of its ranks raised."""
        status = header.OK if problem is None else header.LOCAL_FAILURE
        try:
            self.node.allgather(torch.empty(0, dtype=torch.uint8, device=self.node.device),
                                tag=header.make_tag(f"{name}/verdict", 0), status=status)
        except PeerStatusError as exc:
            raise_for_statuses(name, self._global(exc.statuses), rank=-1, on_nonfinite=self.on_nonfinite,
                               local_error=problem)
        if problem is not None:
            raise problem

    # -- the stages inside the host -------------------------------------------------
    def _reduce_scatter(self, name: str, flat: torch.Tensor, bounds: list[tuple[int, int]],
                        problem: Exception | None) -> tuple[torch.Tensor, Exception | None]:
        """This host's mean of shard ``local``, and what the cross stage must
        announce: a rank of this host that failed. A non-finite gradient on
        this host makes the shard non-finite, so every cross group sees it."""
        a, b = bounds[self.local]
        empty = torch.empty(0, dtype=torch.uint8, device=flat.device)
        status, payloads = header.LOCAL_FAILURE, [empty] * self.node.size
        if problem is None:
            flat = flat.float()
            status = header.OK if all_finite(flat) else header.NONFINITE
            payloads = [flat[lo:hi].contiguous().view(torch.uint8) for lo, hi in bounds]
        try:
            received = self.node.alltoall(payloads, tag=header.make_tag(f"{name}/host", flat.numel()),
                                          status=status, expected=_fp32_bytes(bounds))
        except PeerStatusError as exc:
            failed = problem or self._failed_ranks(name, exc.statuses)
            if failed is not None:
                return flat.new_zeros(b - a), failed
            if self.algorithm is None:
                raise_for_statuses(name, self._global(exc.statuses), rank=-1, on_nonfinite=self.on_nonfinite)
            return torch.full((b - a,), float("nan"), device=flat.device), None
        except DSQError as exc:  # a mismatch every rank of this host saw: announced across too
            return flat.new_zeros(b - a), exc
        return self._host_mean(received, flat.device), None

    def _host_mean(self, received: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The host's mean of this rank's shard from its ranks' fp32 bytes, on
        the gradient's ``device`` (gloo hands CUDA tensors back on the CPU:
        stage 2 compresses there), added in rank order so every rank of the
        host adds alike."""
        shard = received[0].view(torch.float32).to(device, copy=True)
        for part in received[1:]:
            shard.add_(part.view(torch.float32).to(device))
        return shard.div_(self.node.size)

    def _all_gather(self, name: str, average: torch.Tensor, bounds: list[tuple[int, int]],
                    problem: Exception | None) -> torch.Tensor:
        status, payload = header.OK, average.float().contiguous().view(torch.uint8)
        if problem is not None:
            status, payload = header.LOCAL_FAILURE, payload[:0]
        try:
            gathered = self.node.allgather(payload, tag=header.make_tag(f"{name}/gather", bounds[-1][1]),
                                           status=status, expected=_fp32_bytes(bounds))
        except PeerStatusError as exc:
            self._raise_for_host_statuses(name, exc, problem)
            raise  # (it always raises)
        return torch.cat([p.view(torch.float32) for p in gathered]).to(average.device)

    # -- naming ranks and hosts ------------------------------------------------------
    def _failed_ranks(self, name: str, statuses: dict[int, int]) -> PeerFailedError | None:
        """The error naming this host's ranks whose status in a host round says they failed, or None."""
        failed = [self.hosts.hosts[self.host][j] for j, code in statuses.items()
                  if header.describe(code)[0] == "local_failure"]
        return PeerFailedError(f"rank(s) {failed} could not build their payloads for {name!r} (see their logs)",
                               failed) if failed else None

    def _raise_for_host_statuses(self, name: str, exc: PeerStatusError, problem: Exception | None) -> None:
        """Raise what a host round's statuses mean, naming the ranks of the whole group."""
        raise_for_statuses(name, self._global(exc.statuses), rank=-1, on_nonfinite=self.on_nonfinite,
                           local_error=problem)

    def _global(self, statuses: dict[int, int]) -> dict[int, int]:
        """Statuses keyed by the ranks of the whole group instead of this host's."""
        members = self.hosts.hosts[self.host]
        return {members[j]: code for j, code in statuses.items()}

    def _by_host(self, name: str, exc: Skipped | NonFiniteGradientError) -> Exception:
        """The cross group's verdict, naming hosts (its ranks) and their ranks."""
        hosts = sorted(exc.ranks)
        ranks = sorted(r for h in hosts for r in self.hosts.hosts[h])
        if isinstance(exc, Skipped):
            return Skipped(ranks)
        return NonFiniteGradientError(f"gradient {name!r} holds NaN or Inf on host(s) {hosts} (ranks {ranks}); the "
                                      f"step was not applied and error-feedback state is unchanged on every rank",
                                      ranks)


def _fp32_bytes(bounds: list[tuple[int, int]]) -> list[int]:
    """The bytes of each shard of ``bounds`` in fp32: what a host round expects from each rank."""
    return [4 * (hi - lo) for lo, hi in bounds]


def _alarm_status(alarm: torch.Tensor, problem: Exception | None) -> int | torch.Tensor:
    """A deferred host round's status: this rank's own failure, else whether
    anything it saw will fail the step (a device value, read by no host)."""
    if problem is not None:
        return header.LOCAL_FAILURE
    return torch.where(alarm, header.LOCAL_FAILURE, header.OK)


class _ByHost(Deferred):
    """The cross group's deferred checks, whose non-finite verdicts (or
    skips) name hosts and their ranks, as the collective protocol's do."""

    def __init__(self, checks: Deferred, two_level: TwoLevel, name: str):
        super().__init__(checks.verdict)
        self._two_level, self._name = two_level, name

    def collective(self, call, explain):
        def by_host(exc: BaseException) -> None:
            try:
                explain(exc)
            except (Skipped, NonFiniteGradientError) as found:
                raise self._two_level._by_host(self._name, found) from None
        return super().collective(call, by_host)
