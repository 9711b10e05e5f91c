"""How one exchange's problems are announced and judged: the only thing in
which the two verdict modes of Algorithm 1 differ (``algorithm``).

* ``Immediate`` (``verdict="collective"``): every collective's header table
  is judged on the host before its payloads count, and every decoder's
  checks are read back before it returns. A problem raises at once, the
  same on every rank.
* ``Deferred`` (``verdict="step"``, see ``dsq_plugins.step``): statuses,
  decoder checks and finiteness stay device values, judged once when the
  step settles, in the order ``Immediate`` raises them. Nothing stops early:
  a rank that could not build its payloads sends zeros of the agreed lengths
  and says so in its status.

Either way, a payload is decoded into a ``Checked``: the decoded value (None
when it is known on the host to be unusable), whether it is bad (a bool, or
a device bool when deferred) and why.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from ..comm import header, rows
from ..compressors import Compressor
from ..compressors.base import TRUSTED
from ..compressors.decoded import Decoded
from ..compressors.finite import NONFINITE_WORDS
from ..errors import CollectiveMismatchError, PayloadError, PeerStatusError
from ._statuses import UNCHANGED, raise_for_statuses
from ._step import Round
from ._verdict import Reading, StepVerdict, first_true, nonfinite, nonfinite_rows, nonfinite_status

T = TypeVar("T")


@dataclass
class Checked:
    """One decoded payload and what its checks said."""

    decoded: Decoded | None        # None: known on the host to be unusable, or taken into an aggregate already
    bad: bool | torch.Tensor       # a device bool when the checks are deferred
    why: str | list[str]           # why it is bad; deferred: each check's words, read with ``flags``
    flags: object = None           # deferred: the ``Reading`` of each check


class Checks:
    """The verdict protocol of one exchange (see the module docstring)."""

    verdict: StepVerdict | None = None
    deferred = False

    def collective(self, call: Callable[[StepVerdict | None], T], explain: Callable[[BaseException], None]) -> T:
        """Run ``call(verdict)``; what its headers say is passed to ``explain``."""
        raise NotImplementedError

    def placeholder(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """What a rank that cannot take part sends in place of a payload."""
        raise NotImplementedError

    def finite_status(self, v: torch.Tensor) -> int | torch.Tensor:
        """The worker status of a compensated vector the host did not check."""
        raise NotImplementedError

    def failure(self, rnd: Round, v: torch.Tensor | None, exc: Exception) -> int | torch.Tensor:
        """The worker status when building payloads from the compensated
        vector ``v`` (None: not formed) raised ``exc`` (``rnd.fail_locally``)."""
        return rnd.fail_locally(exc)

    def decode(self, q: Compressor, payload: torch.Tensor | None, numel: int, seed: int | None,
               device: torch.device) -> Checked:
        raise NotImplementedError

    def own(self, q: Compressor, payload: torch.Tensor, numel: int, seed: int | None, device: torch.device
            ) -> Checked:
        """This rank's own honest payload, decoded unchecked: its bytes are
        well formed by construction, and ``q.decodes_finite`` says they
        decode to finite values when what was compressed was finite (which
        the worker status already vouches for)."""
        return Checked(q.decode(payload.to(device), numel, seed, refusals=TRUSTED), self._never_bad(device), "")

    def decode_rows(self, q: Compressor, rows: torch.Tensor, numel: int, seeds: Sequence[int | None],
                    device: torch.device) -> list[Checked]:
        """``decode`` of each row of ``rows`` (senders' payloads of one chunk,
        as one buffer's rows), in one call of ``q.decode_rows``: the same
        ``Checked`` per row, in ops that do not grow with the rows."""
        raise NotImplementedError

    def judged_rows(self, flags: torch.Tensor, words: list[str], values: torch.Tensor | None = None,
                    numel: int = 0, bad: torch.Tensor | None = None) -> list[Checked]:
        """Each row's ``Checked`` from its (checks, rows) ``flags`` and each check's words, as
        ``decode_rows`` makes them; without ``values``, of rows an aggregate took in already
        (``algorithm``'s folded mean): their ``decoded`` is None. ``bad``: each row's flag (any
        check's) where a kernel formed it with the flags."""
        raise NotImplementedError

    def trusted(self, device: torch.device) -> Checked:
        """``own``'s ``Checked`` of a payload an aggregate took in already: nothing to check."""
        return Checked(None, self._never_bad(device), "")

    def _never_bad(self, device: torch.device) -> bool | torch.Tensor:
        return False

    def served_status(self, checked: Sequence[tuple[int, Checked]], strict: bool,
                      formed: torch.Tensor | None = None) -> int | torch.Tensor:
        """An owner's status over (sender, contribution) pairs: the first refused sender's.
        ``formed``: that status as a kernel already formed it on the device from the same checks
        (``algorithm``'s folded mean), which a deferred verdict takes as it is."""
        raise NotImplementedError

    def refusal(self, checked: Sequence[tuple[int, Checked]]) -> Callable[[], str]:
        """Why the first refused contribution was refused, once that is known."""
        raise NotImplementedError

    def owner_finite(self, status: int | torch.Tensor, us: Sequence[torch.Tensor]) -> int | torch.Tensor:
        """An owner's ``status`` with what it aggregated checked: ``header.OVERFLOW`` where nothing was refused
        but a u (aggregate plus server error, whose residual becomes the server error) holds NaN or Inf, as
        the mean of payloads whose scales are near the largest float does; the step then fails as a worker's
        non-finite vector fails it, and no memory takes the Inf."""
        raise NotImplementedError

    def served(self, q: Compressor, payload: torch.Tensor | None, numel: int, seed: int | None,
               device: torch.device, name: str, k: int, into: torch.Tensor | None = None) -> Decoded:
        """Chunk k of ``name`` as its one owner served it, decoded (into ``into``
        where the decoder can: ``Compressor.decode``); a chunk
        that does not decode fails the step (now, or when it settles)."""
        raise NotImplementedError

    def served_rows(self, q: Compressor, rows: torch.Tensor, numel: int, seeds: Sequence[int | None],
                    device: torch.device, name: str, first: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """``served`` for the chunks ``first, first + 1, ...`` of equal size,
        one row each, decoded in one call: (rows, numel), into ``into`` where
        the decoder can (``Compressor.decode_rows``)."""
        raise NotImplementedError


class Immediate(Checks):
    def collective(self, call, explain):
        try:
            return call(None)
        except (PeerStatusError, CollectiveMismatchError) as exc:
            explain(exc)
            raise  # explain always raises; this is for readers

    def placeholder(self, nbytes, device):
        return torch.empty(0, dtype=torch.uint8, device=device)

    def finite_status(self, v):
        return header.OK  # compensate() checked it already

    def decode(self, q, payload, numel, seed, device):
        if payload is None:
            return Checked(None, True, "wrong length")
        try:
            return Checked(decode_finite(q, payload, numel, seed, device), False, "")
        except PayloadError as exc:
            return Checked(None, True, str(exc))

    def decode_rows(self, q, rows, numel, seeds, device):
        values, flags, words = rows_checked(q, rows, numel, seeds, device)
        return self.judged_rows(flags, words, values, numel)

    def judged_rows(self, flags, words, values=None, numel=0, bad=None):
        table = flags.tolist()
        whys = [_why(table, words, j) for j in range(flags.shape[1])]
        return [Checked(None if values is None else Decoded(values[j], numel), False, "") if why is None
                else Checked(None, True, why) for j, why in enumerate(whys)]

    def served_rows(self, q, rows, numel, seeds, device, name, first, into=None):
        values, flags, words = rows_checked(q, rows, numel, seeds, device, into)
        _judge_served(flags.tolist(), words, name, first)
        return values

    def served_status(self, checked, strict, formed=None):
        first = next((j for j, c in checked if c.bad), None)
        return header.bad_payload(first) if first is not None and strict else header.OK

    def refusal(self, checked):
        why = next((c.why for _, c in checked if c.bad), "")
        return lambda: why

    def owner_finite(self, status, us):
        if status != header.OK or not any(bool(nonfinite(u)) for u in us):
            return status
        return header.OVERFLOW

    def served(self, q, payload, numel, seed, device, name, k, into=None):
        try:
            if payload is None:
                raise PayloadError("wrong length")
            return decode_finite(q, payload, numel, seed, device, into)
        except PayloadError as exc:
            raise _undecodable(name, k, str(exc)) from None


class Deferred(Checks):
    deferred = True

    def __init__(self, verdict: StepVerdict):
        self.verdict = verdict

    def collective(self, call, explain):
        with self.verdict.explained_by(explain):
            return call(self.verdict)

    def placeholder(self, nbytes, device):
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def finite_status(self, v):
        # header.NONFINITE is 1 and OK 0: the device flag, as int64, is the status, and goes into the header as it is
        return nonfinite_status(v)

    def failure(self, rnd, v, exc):
        if v is not None and bool(nonfinite(v)):  # an operator that refuses NaN: this rare path reads it
            return header.NONFINITE
        return rnd.fail_locally(exc)

    def decode(self, q, payload, numel, seed, device):
        decoded, flags, words = decode_checked(q, payload, numel, seed, device)
        return Checked(decoded, flags.any(), words, self.verdict.read(flags))

    def decode_rows(self, q, rows, numel, seeds, device):
        values, flags, words = rows_checked(q, rows, numel, seeds, device)
        return self.judged_rows(flags, words, values, numel)

    def judged_rows(self, flags, words, values=None, numel=0, bad=None):
        count, reading = flags.shape[1], self.verdict.read(flags)
        if bad is None:
            bad = flags[0] if flags.shape[0] == 1 else flags.any(0)
        return [Checked(None if values is None else Decoded(values[j], numel), bad[j], words,
                        _Column(reading, j, count)) for j in range(count)]

    def served_rows(self, q, rows, numel, seeds, device, name, first, into=None):
        values, flags, words = rows_checked(q, rows, numel, seeds, device, into)
        reading = self.verdict.read(flags)
        self.verdict.then(lambda: _judge_served(reading.rows(rows.shape[0]), words, name, first))
        return values

    def _never_bad(self, device):
        return _device_false(device)

    def served_status(self, checked, strict, formed=None):
        if formed is not None:
            return formed
        if all(c.bad is _device_false(c.bad.device) for _, c in checked):  # only trusted payloads (``own``)
            return header.OK
        # one owner per chunk here, so a contribution's position is its sender's rank
        return first_true(stacked_flags([c.bad for _, c in checked]), header.BAD_PAYLOAD)

    def owner_finite(self, status, us):
        if not us:
            return status
        found = (nonfinite(us[0]) if len(us) == 1 else torch.stack([nonfinite(u) for u in us]).any()) \
            .to(torch.int64) * header.OVERFLOW
        if isinstance(status, int) and status == header.OK:
            return found
        return torch.where(torch.as_tensor(status, device=found.device) == header.OK, found, status)

    def refusal(self, checked):
        def why() -> str:
            return next((c.why[i] for _, c in checked if c.flags is not None
                         for i, v in enumerate(c.flags.values) if v), "")
        return why

    def served(self, q, payload, numel, seed, device, name, k, into=None):
        decoded, flags, words = decode_checked(q, payload, numel, seed, device, into)
        reading = self.verdict.read(flags)  # every rank decoded the same bytes, so every rank judges them alike
        self.verdict.then(lambda: _judge_served([[v] for v in reading.values], words, name, k))
        return decoded


IMMEDIATE = Immediate()


def explainer(rnd: Round, *, rank: int, on_nonfinite: str, refusal: Callable[[], str] = lambda: ""
              ) -> Callable[[BaseException], None]:
    """What a collective of ``rnd`` raises, as the error every rank means by
    it: statuses become the error they stand for (``statuses``), a header
    mismatch names the bucket."""
    def explain(exc: BaseException) -> None:
        if isinstance(exc, PeerStatusError):
            raise_for_statuses(rnd.name, exc.statuses, rank=rank, on_nonfinite=on_nonfinite,
                               local_error=rnd.local_error, refusal=refusal())
        if isinstance(exc, CollectiveMismatchError):
            raise CollectiveMismatchError(f"reducing {rnd.name!r} ({rnd.numel} elements): {exc}") from None
        raise exc
    return explain


def decode_finite(q: Compressor, payload: torch.Tensor, numel: int, seed: int | None, device: torch.device,
                  into: torch.Tensor | None = None) -> Decoded:
    """``payload`` decoded (``into``: ``Compressor.decode``'s); a ``PayloadError`` if it does not decode
    or decodes to NaN or Inf."""
    decoded = q.decode(payload.to(device), numel, seed, into=into)
    if not q.checks_finite and not decoded.is_finite():
        raise PayloadError(NONFINITE_WORDS)
    return decoded


def decode_checked(q: Compressor, payload: torch.Tensor | None, numel: int, seed: int | None, device: torch.device,
                   into: torch.Tensor | None = None) -> tuple[Decoded, torch.Tensor, list[str]]:
    """(the decoded payload, a device bool per check, each check's words):
    the decoder's own checks, then finiteness, none of them read back.
    ``into``: ``Compressor.decode``'s."""
    try:
        if payload is None:
            raise PayloadError("wrong length")
        checks: list[tuple[torch.Tensor, str]] = []
        decoded = q.decode(payload.to(device), numel, seed, refusals=checks, into=into)
    except PayloadError as exc:  # refused on the host (its length): a check that failed for sure
        zeros = torch.zeros(numel, device=device)
        return Decoded(zeros, numel), torch.ones(1, dtype=torch.bool, device=device), [str(exc)]
    if q.checks_finite and checks:  # what passes its checks is finite
        return decoded, stacked_flags([flag for flag, _ in checks]), [words for _, words in checks]
    flags = torch.stack([flag for flag, _ in checks] + [nonfinite(decoded.values)])
    return decoded, flags, [words for _, words in checks] + [NONFINITE_WORDS]


def rows_checked(q: Compressor, rows: torch.Tensor, numel: int, seeds: Sequence[int | None], device: torch.device,
                 into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``decode_checked`` of each row: (values (rows, numel), flags (checks, rows), each check's words)."""
    checks: list[tuple[torch.Tensor, str]] = []
    values = q.decode_rows(rows.to(device), numel, seeds, refusals=checks, into=into)
    flags = [flag for flag, _ in checks] + ([] if q.checks_finite else [nonfinite_rows(values)])
    words = [words for _, words in checks] + ([] if q.checks_finite else [NONFINITE_WORDS])
    if not flags:
        return values, torch.zeros(1, rows.shape[0], dtype=torch.bool, device=device), [""]
    return values, (flags[0].unsqueeze(0) if len(flags) == 1 else stacked_flags(flags)), words  # (one: a view)


def stacked_flags(flags: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(flags)``; where they are already the rows of one tensor
    (a decoder's kernel wrote its checks together; a row decode's flag per
    row), that tensor as it is (``comm.rows``): a stack would be a launch."""
    together = rows(flags)
    return torch.stack(flags) if together is None else together


def _why(table: list[list[int]], words: list[str], j: int) -> str | None:
    """The words of the first check that flags column ``j`` of a (checks, rows) table, or None."""
    return next((words[i] for i, row in enumerate(table) if row[j]), None)


def _undecodable(name: str, k: int, why: str) -> PayloadError:
    """The error of a chunk of ``name`` that its one owner, rank ``k``, served and that does not decode."""
    return PayloadError(f"rank {k} served a chunk of {name!r} that does not decode: {why}; {UNCHANGED}", rank=k)


def _judge_served(table: list[list[int]], words: list[str], name: str, first: int) -> None:
    """The first served row that does not decode (rows in chunk order; one owner per chunk, so chunk k's owner
    is rank k), as ``Checks.served`` raises it."""
    for j in range(len(table[0]) if table else 0):
        why = _why(table, words, j)
        if why is not None:
            raise _undecodable(name, first + j, why)


class _Column:
    """Row ``j``'s checks in the ``Reading`` of a (checks, rows) flag table: ``values`` as a one-row ``Reading``'s."""

    def __init__(self, reading: Reading, j: int, rows: int):
        self.reading, self.j, self.rows = reading, j, rows

    @property
    def values(self) -> list[int] | None:
        values = self.reading.values
        return None if values is None else values[self.j::self.rows]


@functools.lru_cache(maxsize=None)
def _device_false(device: torch.device) -> torch.Tensor:
    """A device False, made once per device: the check of a payload that cannot be bad (``Checks.own``)."""
    return torch.zeros((), dtype=torch.bool, device=device)
