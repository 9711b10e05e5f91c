"""Sign's payloads made and read on a GPU in one Triton launch each, at the
cost of the memory they move.

On a GPU sign's encode of a bucket's rows and its decode of received rows
were compiled kernels of inductor's (``signs_rows``, ``checked_signs``) that
took several times a copy's time: its code reads a byte's eight values as
eight strided loads, and decodes each byte through a gathered table. Here a
program reads its values as one tile of whole 32-byte rows, packs each
row's flags with shifts and a sum, and writes the bytes (encode); or reads
the bytes, expands each into its eight flags by shifts and writes ±s as a
tile (decode). The scale's bytes are written and read in the same launch,
by the first program of each row.

The bytes and values are exactly those of torch's path (``sign.py``'s
``signs_rows`` and ``checked_signs``): a bit is set where a value is >= 0
(-0.0 included, NaN not), a row whose length is not whole bytes pads its
last byte with 0 bits (the flags path of ``SignCompressor._encode_rows``),
the scale is the correctly rounded quotient of the row's magnitude and its
divisor clamped to the largest float (NaN kept), a decoded value is ±1
times the scale, and a row's flag says that its scale is negative or not
finite. Where Triton is missing, the first
call's check on a GPU fails, or ``DSQ_OWN_KERNELS=torch`` (a benchmark's
control) says so, the functions return None and the caller takes torch's
path."""
from __future__ import annotations

import torch

from .own_kernels import MOST_ROWS, checked_per_device, fits_rows, ready, refused_scale, rows_out, tl, triton

__all__ = ["encoded_rows", "decoded_rows", "encodes", "signs_encoded", "signs_decoded_into"]

_BYTES = 512  # payload bytes per program: 4,096 values, 16 KiB of float32 read or written
_LONGEST_ROW = 1 << 31  # a row's offsets are int32 in the kernels

if triton is not None:
    @triton.jit
    def sent_scale(magnitude, divisor):
        """A payload's scale in a kernel: the correctly rounded quotient, clamped to the largest float with a NaN
        kept (what torch's ``(magnitude / divisor).clamp(max=...)`` gives)."""
        scale = tl.math.div_rn(magnitude, divisor)
        return tl.where(scale > 3.4028234663852886e38, 3.4028234663852886e38, scale)

    @triton.jit
    def _encode(rows_ptr, magnitudes_ptr, divisor_ptr, out_ptr, row_stride, out_stride, nbytes, size,
                BYTES: tl.constexpr):
        """Row ``program_id(1)``'s bytes [BYTES · program_id(0), +BYTES) of its bits (a last byte's bits past the
        row's ``size`` values are 0); the first program of a row writes its scale's four bytes too."""
        row, block = tl.program_id(1).to(tl.int64), tl.program_id(0)
        at = block * BYTES + tl.arange(0, BYTES)
        lane = tl.arange(0, 8)
        inside = at < nbytes
        column = at[:, None] * 8 + lane[None, :]
        values = tl.load(rows_ptr + row * row_stride + column, mask=column < size, other=-1.0)
        flags = (values >= 0).to(tl.int32) << (7 - lane)[None, :]
        out = out_ptr + row * out_stride
        tl.store(out + 4 + at, tl.sum(flags, 1).to(tl.uint8), mask=inside)
        word = sent_scale(tl.load(magnitudes_ptr + row), tl.load(divisor_ptr)).to(tl.int32, bitcast=True)
        quad = tl.arange(0, 4)
        tl.store(out + quad, ((word >> (8 * quad)) & 255).to(tl.uint8), mask=(quad < 4) & (block == 0))

    @triton.jit
    def _decode(payloads_ptr, out_ptr, bad_ptr, payload_stride, out_stride, nbytes, numel,
                FLAGS: tl.constexpr, BYTES: tl.constexpr):
        """Row ``program_id(1)``'s values from its bytes [BYTES · program_id(0), +BYTES): ±its scale, the first
        ``numel``; with ``FLAGS``, the first program of a row writes whether its scale is negative or not
        finite."""
        row, block = tl.program_id(1).to(tl.int64), tl.program_id(0)
        payload = payloads_ptr + row * payload_stride
        quad = tl.arange(0, 4)
        word = tl.sum(tl.load(payload + quad).to(tl.int32) << (8 * quad), 0)  # no two bytes overlap: a sum is an or
        scale = word.to(tl.float32, bitcast=True)
        at = block * BYTES + tl.arange(0, BYTES)
        lane = tl.arange(0, 8)
        inside = at < nbytes
        packed = tl.load(payload + 4 + at, mask=inside, other=0).to(tl.int32)
        flags = (packed[:, None] >> (7 - lane)[None, :]) & 1
        values = tl.where(flags != 0, 1.0, -1.0) * scale
        column = at[:, None] * 8 + lane[None, :]
        tl.store(out_ptr + row * out_stride + column, values, mask=inside[:, None] & (column < numel))
        if FLAGS:
            tl.store(bad_ptr + row + quad * 0, refused_scale(scale), mask=(quad < 1) & (block == 0))


def encoded_rows(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """(count, 4 + ceil(size/8)) uint8: each row's sign payload, its scale ``magnitudes / divisor`` clamped to
    the largest float, then its bits (a last byte padded with 0 bits). ``rows``: float32 (count, size), unit
    stride along a row; ``magnitudes``: (count,) float32; ``divisor``: a 0-d float32 tensor. Needs Triton."""
    count, size = rows.shape
    if rows.dtype != torch.float32 or (size > 1 and rows.stride(1) != 1) or magnitudes.shape != (count,):
        raise ValueError(f"sign_codec.encoded_rows: wants float32 rows of unit stride and a magnitude per row, got "
                         f"{rows.dtype} rows {tuple(rows.shape)}, strides {rows.stride()}, magnitudes "
                         f"{tuple(magnitudes.shape)}")
    nbytes = -(-size // 8)
    out = torch.empty(count, 4 + nbytes, dtype=torch.uint8, device=rows.device)
    if count:
        _encode[(max(1, triton.cdiv(nbytes, _BYTES)), count)](
            rows, magnitudes.float().contiguous(), divisor.float().reshape(1), out, rows.stride(0), out.stride(0),
            nbytes, size, BYTES=_BYTES)
    return out


def decoded_rows(payloads: torch.Tensor, numel: int, out: torch.Tensor | None = None, flags: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each row's first ``numel`` values ±its scale, (count, numel) float32, written into ``out`` where given;
    with ``flags``, whether each row's scale is negative or not finite, (count,) bool, else None).
    ``payloads``: (count, 4 + bytes) uint8, unit stride along a row, with ``numel`` <= 8 · bytes. Needs Triton."""
    count, width = payloads.shape
    nbytes = width - 4
    if payloads.dtype != torch.uint8 or payloads.stride(1) != 1 or nbytes < 0 or not 0 <= numel <= 8 * nbytes:
        raise ValueError(f"sign_codec.decoded_rows: wants uint8 payload rows of unit stride holding {numel} "
                         f"values, got {payloads.dtype} {tuple(payloads.shape)}, strides {payloads.stride()}")
    out = rows_out(out, count, numel, payloads.device, "sign_codec.decoded_rows")
    bad = torch.empty(count, dtype=torch.bool, device=payloads.device) if flags else None
    if count:
        _decode[(max(1, triton.cdiv(nbytes, _BYTES)), count)](
            payloads, out, bad if flags else out, payloads.stride(0), out.stride(0), nbytes, numel,
            FLAGS=flags, BYTES=_BYTES)
    return out, bad


def _taken(tensor: torch.Tensor, count: int) -> bool:
    """Whether this codec runs for ``count`` rows on ``tensor``'s device: our kernels chosen on a GPU
    (``own_kernels.ready``), within a grid, and checked against torch's path on this GPU."""
    return count <= MOST_ROWS and ready(tensor, _works_on)


def encodes(rows: torch.Tensor) -> bool:
    """Whether this codec encodes the (count, size) ``rows`` (see the module docstring)."""
    return rows.dtype == torch.float32 and rows.stride(-1) == 1 and rows.shape[-1] < _LONGEST_ROW \
        and _taken(rows, rows.shape[0])


def signs_encoded(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor | None:
    """``encoded_rows`` where this codec runs (``encodes``); None where torch's path encodes."""
    return encoded_rows(rows, magnitudes, divisor) if encodes(rows) else None


def signs_decoded_into(payloads: torch.Tensor, numel: int, out: torch.Tensor | None, flags: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``decoded_rows`` where this codec runs, into ``out`` where it is a (count, numel) float32 buffer of unit
    stride along a row; None where torch's path decodes."""
    if payloads.dtype != torch.uint8 or payloads.stride(-1) != 1 or numel >= _LONGEST_ROW \
            or not _taken(payloads, payloads.shape[0]):
        return None
    return decoded_rows(payloads, numel, out if fits_rows(out, payloads.shape[0], numel) else None, flags)


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed rows (signed zeros, a NaN, infinities, a magnitude that overflows, one zero, values ending
    inside a byte, a scale to refuse), this codec's bytes, values and flags are those of torch's ops for
    sign's wire format, eager (the first-call check: no compile of torch's path for it)."""
    from .base import columns_as, not_finite_nonnegative
    from .bitpack import pack, sign_units
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(3, 8 * _BYTES * 2 + 40, generator=gen, device=device)
    rows[0, :9] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 0.0, -0.0])
    magnitudes = torch.tensor([3.0, float("inf"), 0.0], device=device)  # (a NaN's bits after a division vary)
    divisor = torch.full((), float(rows.shape[1]), device=device)
    scales = (magnitudes / divisor).clamp(max=torch.finfo(torch.float32).max)
    payloads = encoded_rows(rows, magnitudes, divisor)
    bits = pack((rows >= 0).reshape(-1), 1).view(3, -1)
    if not torch.equal(payloads, torch.cat([scales.view(torch.uint8).view(3, 4), bits], 1)):
        return False
    payloads[1, :4] = torch.tensor([0, 0, 128, 191], dtype=torch.uint8, device=device)  # -1.0: refused
    numel = rows.shape[1] - 5
    values, bad = decoded_rows(payloads, numel)
    scales = columns_as(payloads, 0, 4, torch.float32)
    want = (sign_units(device)[payloads[:, 4:].long()].view(3, -1) * scales)[:, :numel]
    return torch.equal(values, want) and torch.equal(bad, not_finite_nonnegative(scales.view(-1)))


_works_on = checked_per_device("sign's Triton codec", _agrees_with_torch)
