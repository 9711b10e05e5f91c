"""The compressor contract: a tensor goes in, a ``Packet`` whose ``payload`` is
exactly the bytes that travel comes out, and ``decompress`` turns a packet (or
a payload received from a peer plus what the receiver already knows: shape,
dtype, and the shared seed) back into a tensor of the original shape and dtype.

Compressors compute in fp32 whatever the input dtype, never keep state between
calls that the receiver would need, and validate every payload they decode, so
a malformed payload from a peer is a ``PayloadError``, not a crash deep in torch.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Sequence, Union

import torch

from ..errors import ConfigError, PayloadError
from . import kernels
from .decoded import Decoded

__all__ = ["as_bytes", "check_float_tensor", "columns_as", "Compressor", "derive_seed",
    "FLOAT_DTYPES", "from_bytes", "host_values", "not_finite_nonnegative", "one_row", "Packet", "positive_int",
    "ratio_in_unit_interval", "refuse_if_any", "refuse_rows_if_any", "Refusals", "RowDecoder", "runs_of_equal_size",
    "SparseCompressor", "TRUSTED"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Packet:
    """What one ``compress`` call produced.

    ``payload`` (1-D ``torch.uint8``) is the only part that travels; ``shape``,
    ``dtype`` and ``seed`` are known to the receiver from the shared layout and
    step counter, so they cost no bytes."""

    payload: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    seed: int | None = None

    @property
    def numel(self) -> int:
        """Elements the packet stands for."""
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        """Bytes that travel."""
        return int(self.payload.numel())


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any printable parts, identical in every process
    (Python's ``hash`` is salted per process, so it cannot be used)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as a 1-D uint8 view."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype``; copies first if the slice is not
    aligned for ``dtype`` (received payloads are slices of a larger buffer)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if b.storage_offset() % itemsize or not b.is_contiguous():
        b = b.clone()
    return b.view(dtype)


class Compressor:
    """Base class. Subclasses set ``name`` and ``unbiased`` and implement
    ``_encode`` / ``_decode`` / ``payload_nbytes`` on flat fp32 tensors."""

    name: ClassVar[str] = "?"
    #: E[decompress(compress(x))] == x for every x
    unbiased: ClassVar[bool] = False
    #: uses randomness; the receiver needs the packet's seed
    randomized: ClassVar[bool] = False
    #: its decoded positions increase (so a range of them is found by bisection)
    positions_increase: ClassVar[bool] = False
    #: decodes to zeros outside a few positions, and implements ``_decode_sparse`` in place of ``_decode``
    sparse: ClassVar[bool] = False
    #: lays a chunk out by the tensors it holds (``shapes``): its payload size depends on them, so every
    #: size it is given may be a ``shapes.Shaped``, and it implements ``_encode_shaped`` and ``size_for_shape``
    structured: ClassVar[bool] = False
    #: wants one seed for a chunk at a step, the same for every sender and both passes (``algorithm.Seeds``)
    shared_draw: ClassVar[bool] = False
    #: a payload built from a finite vector decodes to finite values (a rank's own payload needs no check)
    decodes_finite: ClassVar[bool] = False
    #: a payload its decoder's checks pass decodes to finite values, so no finiteness test need follow
    checks_finite: ClassVar[bool] = False

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self._calls = 0

    # -- public API -------------------------------------------------------
    def prepare(self, flat: torch.Tensor) -> Any:
        """A value computed once over a whole vector and shared by the
        compression of each of its chunks (``shared=`` of ``compress``), e.g.
        one sign scale per bucket; ``None`` for compressors without one."""
        return None

    def compress(self, tensor: torch.Tensor, seed: int | None = None, shared: Any = None,
                 size: int | None = None) -> Packet:
        """Compress ``tensor``. ``seed`` drives any randomness; when omitted a
        fresh one is derived from the compressor's seed and a call counter.
        ``shared`` is what ``prepare`` returned for the vector this is a chunk of.
        ``size``: the tensor's element count as the receiver will be told it
        (a ``shapes.Shaped`` for a structured operator; by default what
        ``size_for_shape`` makes of the tensor's own shape)."""
        check_float_tensor(tensor, "compress")
        if self.randomized and seed is None:
            seed = self._fresh_seed()
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if size is not None and int(size) != flat.numel():
            raise ValueError(f"{self.name}: told {int(size)} elements, given a tensor of {flat.numel()}")
        if flat.numel() == 0:
            payload = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        elif self.structured:
            payload = self._encode_shaped(flat, seed, self.size_for_shape(tensor.shape) if size is None else size)
        else:
            payload = self._encode(flat, seed, shared)
        return Packet(payload, tensor.shape, tensor.dtype, seed)

    def size_for_shape(self, shape: Sequence[int]) -> int:
        """The size a tensor of ``shape`` is told as when nothing else says
        (``compress`` and ``decompress`` of a packet): its element count, or
        for a structured operator the layout it gives such a tensor."""
        return math.prod(int(s) for s in shape)

    def check_tensor(self, name: str, shape: Sequence[int]) -> None:
        """A ``ConfigError`` naming the tensor if this operator cannot
        compress one of ``shape`` (``lowrank``: a rank its matrix does not
        allow); the reducers ask before the first exchange."""

    def compress_chunks(self, tensor: torch.Tensor, bounds: Sequence[tuple[int, int]], seeds: Sequence[int | None],
                        shared: Any = None, sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
        """The payloads of the chunks ``tensor.reshape(-1)[a:b]`` for each
        ``(a, b)`` of ``bounds`` (consecutive, from 0 to the end), chunk k with
        ``seeds[k]``: each what ``compress`` sends for it. Where the compressor
        has a row encoder that pays on this device, each run of equal-sized
        chunks (``chunk_bounds`` makes at most two) is one batched call, not
        one call per chunk: on a GPU every call is a few kernel launches and
        their Python, whatever the chunk's size. ``sizes``: each chunk's size
        as ``compress`` takes it (structured operators' layouts)."""
        check_float_tensor(tensor, "compress_chunks")
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if len(seeds) != len(bounds):
            raise ValueError(f"{self.name}: {len(bounds)} chunks but {len(seeds)} seeds")
        if not _consecutive(bounds, flat.numel()):
            raise ValueError(f"{self.name}: chunk bounds {list(bounds)} do not cut a vector of {flat.numel()} elements "
                             "into consecutive pieces")
        if self.randomized:  # a missing seed is drawn as compress draws it, before any row encoder sees it
            seeds = [self._fresh_seed() if seed is None else seed for seed in seeds]
        if sizes is not None or not self.encodes_rows(flat.device):
            sizes = [b - a for a, b in bounds] if sizes is None else sizes
            return [self.compress(flat[a:b], seed=seed, shared=shared, size=size).payload
                    for (a, b), seed, size in zip(bounds, seeds, sizes)]
        payloads: list[torch.Tensor] = []
        for first, count, size in runs_of_equal_size(bounds):
            if size == 0:
                payloads += [torch.empty(0, dtype=torch.uint8, device=flat.device)] * count
                continue
            start = bounds[first][0]
            rows = flat[start: start + count * size].view(count, size)
            payloads += list(self._encode_rows(rows, seeds[first: first + count], shared).unbind(0))
        return payloads

    def _fresh_seed(self) -> int:
        """A seed for a call that was given none: from the compressor's seed and a call counter."""
        self._calls += 1
        return derive_seed(self.name, self.seed, self._calls - 1)

    def encodes_rows(self, device: torch.device) -> bool:
        """Whether ``compress_chunks`` batches chunks into rows on ``device``."""
        return False

    def decompress(self, packet: Packet) -> torch.Tensor:
        """The tensor a packet stands for, in the packet's shape and dtype."""
        flat = self.decompress_flat(packet.payload, self.size_for_shape(packet.shape), packet.seed)
        return flat.reshape(packet.shape).to(packet.dtype)

    def decompress_flat(self, payload: torch.Tensor, numel: int, seed: int | None = None, *,
                        refusals: Refusals = None) -> torch.Tensor:
        """Decode a received payload into a flat fp32 tensor of ``numel``
        elements, checking its dtype and length first."""
        return self._decoded(payload, numel, seed, refusals, None, dense=True).dense()

    def decode(self, payload: torch.Tensor, numel: int, seed: int | None = None, *,
               refusals: Refusals = None, into: torch.Tensor | None = None) -> Decoded:
        """``decompress_flat``'s vector as a ``Decoded``: sparse (positions and
        values) for the operators that keep few elements, so that adding it
        to a sum or a residual costs O(kept), not O(numel). The decoder's
        checks of the bytes (``refuse_if_any``) go to ``refusals``: None
        raises a ``PayloadError`` here, a list collects them for the caller.
        ``into``: a flat fp32 buffer of ``numel`` elements (the caller's output)
        that a dense decoder may write the values into, sparing a copy; the
        returned ``Decoded`` says where they are (``values`` is ``into``'s memory or not)."""
        return self._decoded(payload, numel, seed, refusals, into, dense=into is not None)

    def _decoded(self, payload: torch.Tensor, numel: int, seed: int | None, refusals: Refusals,
                 into: torch.Tensor | None, dense: bool) -> Decoded:
        """``decode``, its payload checked first; ``dense``: the caller wants the dense vector, which a
        sparse operator's dense decoder (``_dense_rows``) then writes in one call, into ``into`` where given."""
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            got = (f"{payload.dtype} of shape {tuple(payload.shape)}" if isinstance(payload, torch.Tensor)
                   else type(payload).__name__)
            raise PayloadError(f"{self.name}: payload must be a 1-D torch.uint8 tensor, got {got}")
        expected = self.payload_nbytes(numel)
        if payload.numel() != expected:
            raise PayloadError(
                f"{self.name}: payload for {numel} elements must be {expected} bytes, got {payload.numel()}")
        if numel == 0:
            return Decoded(torch.empty(0, dtype=torch.float32, device=payload.device), 0)
        if self.randomized and seed is None:
            raise PayloadError(f"{self.name}: decoding needs the sender's seed")
        if self.sparse:
            values = self._dense_decoded(payload, numel, refusals, into) if dense else None
            if values is not None:  # written where the caller wants the values, in one call
                return Decoded(values, numel)
            positions, values = self._decode_sparse(payload, numel, seed, refusals)
            return Decoded(values, numel, positions, increasing=self.positions_increase)
        if into is not None:
            return Decoded(self._decode_into(payload, numel, seed, refusals, into), numel)
        return Decoded(self._decode(payload, numel, seed, refusals), numel)

    def _dense_decoded(self, payload: torch.Tensor, numel: int, refusals: Refusals,
                       into: torch.Tensor | None) -> torch.Tensor | None:
        """One payload by ``_dense_rows``, its checks as ``refuse_if_any`` takes them; None where there is none."""
        checks: Refusals = [] if refusals is None else refusals
        values = self._checked_dense_rows(payload.view(1, -1), numel, checks, one_row(into))
        if values is not None and refusals is None:
            refuse_if_any(*checks)
        return None if values is None else values.view(-1)

    def _checked_dense_rows(self, payloads: torch.Tensor, numel: int, refusals: Refusals,
                            into: torch.Tensor | None) -> torch.Tensor | None:
        """``_dense_rows``' values, its checks to ``refusals`` as ``refuse_rows_if_any`` takes them."""
        made = self._dense_rows(payloads, numel, into, refusals is not TRUSTED)
        if made is None:
            return None
        values, flags, words = made
        if flags is not None:
            refuse_rows_if_any(*zip(flags.unbind(), words), refusals=refusals)
        return values

    def _dense_rows(self, payloads: torch.Tensor, numel: int, into: torch.Tensor | None, flags: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None, Sequence[str]] | None:
        """A sparse operator's rows of payloads decoded dense in one kernel where it has one on this device
        (a GPU's): (the (rows, numel) fp32 values, into ``into`` where it fits; with ``flags`` the checks'
        (checks, rows) flags, else None; what each check refuses); None where it decodes otherwise."""
        return None

    def _decode_into(self, payload: torch.Tensor, numel: int, seed: int | None, refusals: Refusals,
                     into: torch.Tensor) -> torch.Tensor:
        """``_decode``, written into ``into`` where the operator can (``decode``'s ``into``)."""
        return self._decode(payload, numel, seed, refusals)

    def decode_rows(self, payloads: torch.Tensor, numel: int, seeds: Sequence[int | None], *,
                    refusals: Refusals = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, numel) fp32: row r is ``payloads[r]`` (each a payload for
        ``numel`` elements, with ``seeds[r]``) decoded, as ``decompress_flat``
        decodes it. Where the compressor has a row decoder, all rows are one
        call whose ops do not grow with the rows: an owner decodes what every
        sender sent it, and every rank what every owner served, this way.
        Checks go to ``refusals`` one device bool per row: a list gets
        (flags of shape (rows,), words) per check; None reads them back and
        raises a ``PayloadError`` naming the first bad row. ``into``: a
        (rows, numel) fp32 buffer the values may be written into (``decode``'s)."""
        if not isinstance(payloads, torch.Tensor) or payloads.dtype != torch.uint8 or payloads.dim() != 2:
            got = (f"{payloads.dtype} of shape {tuple(payloads.shape)}" if isinstance(payloads, torch.Tensor)
                   else type(payloads).__name__)
            raise PayloadError(f"{self.name}: rows of payloads must be a 2-D torch.uint8 tensor, got {got}")
        count, expected = payloads.shape[0], self.payload_nbytes(numel)
        if payloads.shape[1] != expected:
            raise PayloadError(f"{self.name}: payload for {numel} elements must be {expected} bytes, "
                               f"got rows of {payloads.shape[1]}")
        if len(seeds) != count:
            raise ValueError(f"{self.name}: {count} rows but {len(seeds)} seeds")
        if numel == 0:
            return torch.empty(count, 0, dtype=torch.float32, device=payloads.device)
        if self.randomized and any(seed is None for seed in seeds):
            raise PayloadError(f"{self.name}: decoding needs the sender's seed")
        checks: Refusals = refusals if refusals is TRUSTED else []
        if self.decodes_rows(payloads.device):
            values = self._checked_dense_rows(payloads, numel, checks, into)  # a sparse operator's, in one kernel
            if values is None:
                values = self._decode_rows_into(payloads, numel, seeds, checks, into) if into is not None \
                    else self._decode_rows(payloads, numel, seeds, checks)
        else:
            values = self._decode_each_row(payloads, numel, seeds, checks)
        if checks is TRUSTED:
            return values
        if refusals is not None:
            refusals.extend(checks)
            return values
        if checks:
            flags = torch.stack([flag for flag, _ in checks]).tolist()
            for (_, words), row_flags in zip(checks, flags):
                if any(row_flags):
                    raise PayloadError(f"{words} (row {row_flags.index(True)})")
        return values

    def decodes_rows(self, device: torch.device) -> bool:
        """Whether ``decode_rows`` decodes all rows in one call on ``device``."""
        return False

    def kept_rows_decoder(self, payloads: torch.Tensor, numel: int) -> "RowDecoder | None":
        """Where ``decode_rows`` of these rows is one kernel that yields each row's kept positions
        and values (a sparse operator's, on a device that decodes rows at once), that kernel's
        parts, so that a caller's kernel can go on from them (an owner's mean); else None."""
        return None

    def sign_scale(self, payload: torch.Tensor) -> torch.Tensor | None:
        """The one scale s (0-d) of this rank's own payload of a vector v whose
        decode is +s where v >= 0 and -s elsewhere (sign's), so that v - Q(v)
        can be formed from v alone; None for an operator whose decode is not."""
        return None

    def subtract_own_(self, vector: torch.Tensor, payload: torch.Tensor, numel: int, seed: int | None
                      ) -> torch.Tensor:
        """``vector -= decode(payload)`` in place, where ``payload`` is this rank's
        own encode of ``vector``: the worker residual v - Q(v) of one chunk
        (``subtract_own_rows_``'s, for a chunk that is not a batched encode's row)."""
        return self.decode(payload, numel, seed, refusals=TRUSTED).subtract_from_(vector)

    def subtract_own_rows_(self, rows: torch.Tensor, payloads: torch.Tensor, seeds: Sequence[int | None]
                           ) -> torch.Tensor:
        """``rows -= decode_rows(payloads)`` in place, where ``payloads`` are
        this rank's own encodes of ``rows``: the worker residual v - Q(v) of
        a run of equal chunks. An operator that knows its own decode may form
        it in fewer ops, with the same bits."""
        return rows.sub_(self.decode_rows(payloads, rows.shape[1], seeds, refusals=TRUSTED))

    def _decode_rows(self, payloads: torch.Tensor, numel: int, seeds: Sequence[int | None], refusals: Refusals
                     ) -> torch.Tensor:
        """The row decoder of the compressors where ``decodes_rows``: checks
        as ``refuse_rows_if_any`` takes them."""
        raise NotImplementedError

    def _decode_rows_into(self, payloads: torch.Tensor, numel: int, seeds: Sequence[int | None], refusals: Refusals,
                          into: torch.Tensor) -> torch.Tensor:
        """``_decode_rows``, written into ``into`` where the operator can (``decode_rows``' ``into``):
        a kept-rows decoder's ``into`` kernel (``kept_rows_decoder``) where ``into`` is whole rows."""
        whole = kernels.fills_rows(into, payloads.shape[0], numel, into.numel(), torch.float32)
        decoder = self.kept_rows_decoder(payloads, numel) if whole else None
        if decoder is None:
            return self._decode_rows(payloads, numel, seeds, refusals)
        flags = decoder.into(into, payloads, *decoder.args, numel=into.numel())
        refuse_rows_if_any(*zip(flags.unbind(), decoder.words), refusals=refusals)
        return into

    def _decode_each_row(self, payloads: torch.Tensor, numel: int, seeds: Sequence[int | None], refusals: Refusals
                         ) -> torch.Tensor:
        """``decode_rows`` one row at a time, each row's checks stacked into one flag per row."""
        per_row: list[list] = []
        values = []
        for row, seed in zip(payloads, seeds):
            checks: Refusals = refusals if refusals is TRUSTED else []
            values.append(self.decode(row, numel, seed, refusals=checks).dense())
            if checks is not TRUSTED:
                per_row.append(checks)
        if per_row:
            refusals.extend((torch.stack([row[i][0] for row in per_row]), per_row[0][i][1])
                            for i in range(len(per_row[0])))
        return torch.stack(values)

    def payload_nbytes(self, numel: int) -> int:
        """Exact wire size, in bytes, of a payload for ``numel`` elements."""
        raise NotImplementedError

    def is_contraction(self) -> bool:
        """Whether E||x - C(x)||² < ||x||² for every x, at any size: what error
        feedback needs, or the residual it carries can grow without bound.
        The exact casts, sign and top-k are; unbiased operators override this."""
        return True

    def params(self) -> dict[str, Any]:
        """The parameters that rebuild this compressor with ``get_compressor``."""
        return {"seed": self.seed}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    # -- subclass hooks ---------------------------------------------------
    def _encode(self, flat: torch.Tensor, seed: int | None, shared: Any = None) -> torch.Tensor:
        raise NotImplementedError

    def _encode_shaped(self, flat: torch.Tensor, seed: int | None, size: int) -> torch.Tensor:
        """A structured operator's ``_encode``, told the chunk's ``size``."""
        raise NotImplementedError

    def _decode(self, payload: torch.Tensor, numel: int, seed: int | None, refusals: Refusals) -> torch.Tensor:
        raise NotImplementedError

    def _encode_rows(self, rows: torch.Tensor, seeds: Sequence[int | None], shared: Any = None) -> torch.Tensor:
        """(rows, payload_nbytes(row length)) uint8: row r's payload as
        ``_encode`` makes it, for the compressors where ``encodes_rows``."""
        raise NotImplementedError

    def _decode_sparse(self, payload: torch.Tensor, numel: int, seed: int | None, refusals: Refusals
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct int64 positions, fp32 values) of a validated payload."""
        raise NotImplementedError


def _consecutive(bounds: Sequence[tuple[int, int]], numel: int) -> bool:
    end = 0
    for a, b in bounds:
        if a != end or b < a:
            return False
        end = b
    return end == numel


def runs_of_equal_size(bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(index of the first chunk, how many, their size) of each run of consecutive equal-sized chunks."""
    runs: list[tuple[int, int, int]] = []
    for k, (a, b) in enumerate(bounds):
        if runs and runs[-1][2] == b - a:
            first, count, size = runs[-1]
            runs[-1] = (first, count + 1, size)
        else:
            runs.append((k, 1, b - a))
    return runs


class _Trusted:
    """The refusals of a payload this rank made itself: its checks cannot fail, so they are not read."""

    def __repr__(self) -> str:
        return "TRUSTED"


#: pass as ``refusals`` to decode a payload of one's own (nothing read back, nothing raised)
TRUSTED = _Trusted()

#: where a decoder's checks go: None (read them back and raise), a list (the caller judges them), or TRUSTED
Refusals = Union[list, _Trusted, None]


def one_row(into: torch.Tensor | None) -> torch.Tensor | None:
    """A flat buffer as the one row a row decoder writes (None where it is not one contiguous vector)."""
    return into.view(1, -1) if into is not None and into.dim() == 1 and into.is_contiguous() else None


def refuse_if_any(*checks: tuple[torch.Tensor, str], refusals: Refusals = None) -> None:
    """A ``PayloadError`` with the words of the first check whose flag tensor
    holds a True. The flags are read back together: on a GPU each read is a
    host sync that stalls the launch queue, so a decoder pays one, not one
    per check. Every check must be safe to compute whatever the others find.

    With a ``refusals`` list (a deferred step) the checks are appended to it
    as (device bool, words) and nothing is raised here, so a decoder must be
    safe for any bytes: it never indexes outside its vector, whatever its
    checks say. ``TRUSTED``: the payload is the caller's own; nothing is read."""
    if refusals is TRUSTED:
        return
    if refusals is not None:
        refusals.extend((_any_set(flag), words) for flag, words in checks)
        return
    flags = torch.stack([flag.reshape(-1).any() for flag, _ in checks]).tolist()
    for bad, (_, words) in zip(flags, checks):
        if bad:
            raise PayloadError(words)


def _any_set(flag: torch.Tensor) -> torch.Tensor:
    """Whether any of ``flag`` is set, as a 0-d device bool; a one-element
    bool flag is that already (a view, where ``any`` would be a launch)."""
    return flag.reshape(()) if flag.numel() == 1 and flag.dtype == torch.bool else flag.reshape(-1).any()


def refuse_rows_if_any(*checks: tuple[torch.Tensor, str], refusals: Refusals) -> None:
    """``refuse_if_any`` for a row decoder: each flag tensor has one row per
    payload (any shape after it), and each check becomes one device bool
    per row in the ``refusals`` list (``decode_rows`` reads or keeps them).
    ``TRUSTED``: nothing is computed into it, nothing kept."""
    if refusals is TRUSTED:
        return
    for flag, words in checks:
        refusals.append((flag if flag.dim() == 1 else flag.reshape(flag.shape[0], -1).any(1), words))


def not_finite_nonnegative(x: torch.Tensor) -> torch.Tensor:
    """Device flags: which elements of ``x`` are negative, infinite or NaN
    (a scale no honest encoder sends). Clamping moves exactly those, so the
    test is three elementwise ops where ``isfinite`` and a comparison take
    seven; every received payload's scales pass through it."""
    return (x - x.clamp(0, torch.finfo(x.dtype).max)) != 0


def columns_as(payloads: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[start, stop)`` of each row of ``payloads`` as ``dtype``:
    (rows, (stop - start) / itemsize), copied once into an aligned buffer
    (a row's bytes need not be aligned for ``dtype``). Fresh rows whatever
    the count: a plain ``clone()`` of a single row keeps the payload's row
    stride, which a compiled kernel cannot show divisible by the itemsize
    where it is not (its compile fails, and it runs eager for good)."""
    return payloads[:, start:stop].clone(memory_format=torch.contiguous_format).view(dtype)


def host_values(values: Sequence[int | float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few host numbers (per-chunk seed words, offsets) as a tensor on
    ``device``. On CUDA through pinned memory, copied without blocking: a
    copy from ordinary host memory waits for the GPU's queue to drain, a host
    sync per call that a batched encode exists to avoid."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_float_tensor(tensor: Any, where: str) -> None:
    """TypeError unless ``tensor`` is a dense fp32, fp16 or bf16 tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where}: dtype {tensor.dtype} is not supported; use one of float32, float16, bfloat16")
    if tensor.is_sparse:
        raise TypeError(f"{where}: sparse tensors are not supported; densify them first")


class RowDecoder(NamedTuple):
    """A row decoder's kernel, for a caller's kernel that goes on from it
    (``Compressor.kept_rows_decoder``): the operator module's ``kept_rows(payloads, *args)``
    (and its ``kept_rows_fusable``) gives (positions (rows, kept), values (rows, kept), flags
    (checks, rows)); ``words`` says what each check refuses; ``into(out, payloads, *args,
    numel=)`` writes the dense rows into ``out`` in one kernel and returns the flags."""

    args: tuple
    words: tuple[str, ...]
    into: Callable[..., torch.Tensor]


class SparseCompressor(Compressor):
    """Shared base of the compressors that keep k of n elements (top-k,
    random-k): k is ``k`` if given, else max(1, round(ratio * n)), never above n."""

    def __init__(self, ratio: float = 0.01, k: int | None = None, seed: int = 0):
        super().__init__(seed)
        if k is not None:
            positive_int(k, f"{self.name}: k")
        self.ratio = ratio_in_unit_interval(ratio, f"{self.name}: ratio")
        self.k = k

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "k": self.k, **super().params()}

    def count(self, numel: int) -> int:
        """How many elements are kept out of ``numel``."""
        if numel == 0:
            return 0
        k = self.k if self.k is not None else max(1, round(self.ratio * numel))
        return min(k, numel)


def positive_int(value: Any, what: str) -> int:
    """``value`` if it is a positive int (not a bool), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def ratio_in_unit_interval(value: Any, what: str) -> float:
    """``value`` as a float if it lies in (0, 1], else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{what} must be a number in (0, 1], got {value!r}")
    return float(value)
