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

from ..comm import header
from ..compressors import Compressor
from ..compressors.base import TRUSTED
from ..compressors.decoded import Decoded
from ..errors import CollectiveMismatchError, PayloadError, PeerStatusError
from ._statuses import UNCHANGED, raise_for_statuses
from ._step import Round
from ._verdict import StepVerdict, first_true, nonfinite

NONFINITE_WORDS = "decodes to non-finite values"
T = TypeVar("T")


@dataclass
class Checked:
    """One decoded payload and what its checks said."""

    decoded: Decoded | None        # None: known on the host to be unusable
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

    def _never_bad(self, device: torch.device) -> bool | torch.Tensor:
        return False

    def served_status(self, checked: Sequence[tuple[int, Checked]], strict: bool) -> int | torch.Tensor:
        """An owner's status over (sender, contribution) pairs: the first refused sender's."""
        raise NotImplementedError

    def refusal(self, checked: Sequence[tuple[int, Checked]]) -> Callable[[], str]:
        """Why the first refused contribution was refused, once that is known."""
        raise NotImplementedError

    def served(self, q: Compressor, payload: torch.Tensor | None, numel: int, seed: int | None,
               device: torch.device, name: str, k: int) -> Decoded:
        """Chunk k of ``name`` as its one owner served it, decoded; a chunk
        that does not decode fails the step (now, or when it settles)."""
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

    def served_status(self, checked, strict):
        first = next((j for j, c in checked if c.bad), None)
        return header.bad_payload(first) if first is not None and strict else header.OK

    def refusal(self, checked):
        why = next((c.why for _, c in checked if c.bad), "")
        return lambda: why

    def served(self, q, payload, numel, seed, device, name, k):
        try:
            if payload is None:
                raise PayloadError("wrong length")
            return decode_finite(q, payload, numel, seed, device)
        except PayloadError as exc:
            raise PayloadError(f"rank {k} served a chunk of {name!r} that does not decode: {exc}; {UNCHANGED}",
                               rank=k) from None


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
        # header.NONFINITE is 1 and OK 0: the device flag is the status (the header casts it)
        return nonfinite(v)

    def failure(self, rnd, v, exc):
        if v is not None and bool(nonfinite(v)):  # an operator that refuses NaN: this rare path reads it
            return header.NONFINITE
        return rnd.fail_locally(exc)

    def decode(self, q, payload, numel, seed, device):
        decoded, flags, words = decode_checked(q, payload, numel, seed, device)
        return Checked(decoded, flags.any(), words, self.verdict.read(flags))

    def _never_bad(self, device):
        return _device_false(device)

    def served_status(self, checked, strict):
        if all(c.bad is _device_false(c.bad.device) for _, c in checked):  # only trusted payloads (``own``)
            return header.OK
        # one owner per chunk here, so a contribution's position is its sender's rank
        return first_true(torch.stack([c.bad for _, c in checked]), header.BAD_PAYLOAD)

    def refusal(self, checked):
        def why() -> str:
            return next((c.why[i] for _, c in checked if c.flags is not None
                         for i, v in enumerate(c.flags.values) if v), "")
        return why

    def served(self, q, payload, numel, seed, device, name, k):
        decoded, flags, words = decode_checked(q, payload, numel, seed, device)
        reading = self.verdict.read(flags)

        def judge() -> None:  # every rank decoded the same bytes, so every rank reaches it
            why = next((words[i] for i, v in enumerate(reading.values) if v), None)
            if why is not None:
                raise PayloadError(f"rank {k} served a chunk of {name!r} that does not decode: {why}; {UNCHANGED}",
                                   rank=k)
        self.verdict.then(judge)
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


def decode_finite(q: Compressor, payload: torch.Tensor, numel: int, seed: int | None, device: torch.device
                  ) -> Decoded:
    """``payload`` decoded; a ``PayloadError`` if it does not decode or decodes to NaN or Inf."""
    decoded = q.decode(payload.to(device), numel, seed)
    if not decoded.is_finite():
        raise PayloadError(NONFINITE_WORDS)
    return decoded


def decode_checked(q: Compressor, payload: torch.Tensor | None, numel: int, seed: int | None, device: torch.device
                   ) -> tuple[Decoded, torch.Tensor, list[str]]:
    """(the decoded payload, a device bool per check, each check's words):
    the decoder's own checks, then finiteness, none of them read back."""
    try:
        if payload is None:
            raise PayloadError("wrong length")
        checks: list[tuple[torch.Tensor, str]] = []
        decoded = q.decode(payload.to(device), numel, seed, refusals=checks)
    except PayloadError as exc:  # refused on the host (its length): a check that failed for sure
        zeros = torch.zeros(numel, device=device)
        return Decoded(zeros, numel), torch.ones(1, dtype=torch.bool, device=device), [str(exc)]
    flags = torch.stack([flag for flag, _ in checks] + [nonfinite(decoded.values)])
    return decoded, flags, [words for _, words in checks] + [NONFINITE_WORDS]


@functools.lru_cache(maxsize=None)
def _device_false(device: torch.device) -> torch.Tensor:
    """A device False, made once per device: the check of a payload that cannot be bad (``Checks.own``)."""
    return torch.zeros((), dtype=torch.bool, device=device)
