"""QSGD's and TernGrad's payloads made and read on a GPU in one Triton
launch each: the stochastically rounded codes with the scales' bytes, and
the values with the payload's two checks.

On a GPU these were inductor's kernels and torch's ops: the encode wrote
the scales into the payload by a copy of their own and rounded each row's
codes in a pass that read a byte's values as strided loads; a received
payload was a pass that checked its codes, a cast or a table lookup, a
multiply per bucket, and a row decoder made one call per row. Here the
encode reads a row's values once, draws each one's noise from its index
(``noise.uniform_in_kernel``, the same hash), and writes its bytes, the
scales' included; the decode reads the bytes once, writes the values, and
sets a row's flag where a scale is negative or not finite or a code lies
above the top one. The scales are still torch's reductions (a norm's
rounding depends on its order of summation), computed before the launch.

The bytes and values are exactly those of torch's path (``levels``'
``encode_rows`` and ``decode``): r = |x| / scale (correctly rounded,
a scale that is not positive read as 1) times the levels, floor(r + u)
clamped to the levels, signed as x and offset by the levels; each code
``bits`` wide, most significant first, a last byte's padding 0 bits; a
decoded value (code - levels) times scale / levels. The kernels are compiled
without fused multiply-adds, as ``kernels.EAGER_NUMERICS`` compiles
inductor's. A NaN's code is the device's conversion of a NaN (its step is
refused by the verdict whatever it is). Where Triton is missing, the first
call's check on a GPU fails, or ``DSQ_OWN_KERNELS=torch`` says so, the
functions return None and the caller takes torch's path."""
from __future__ import annotations

import torch

from .noise import uniform_in_kernel
from .own_kernels import (MOST_ROWS, TORCH_REFERENCES, checked_per_device, fits_rows, ready, refused_scale,
                          rows_out, tl, triton, word_at)

__all__ = ["decoded_rows", "encoded_rows", "encodes", "levels_decoded", "runs_on"]

_ELEMENTS = 2048  # values per program: 8 KiB of float32 read (encode) or written (decode)
_HEADER = 1024  # scale bytes per program of the encode
_LONGEST_ROW = 1 << 30  # the noise's index is int32 below 2**30 (noise._hash)

if triton is not None:
    @triton.jit
    def _floor_of_nonnegative(v):
        """floor(v) for v >= 0 by truncation, where libdevice's floor flushes subnormals to zero; from 2**23 on
        (an infinity, a NaN too) a float is its own floor."""
        return tl.where(v < 8388608.0, v.to(tl.int32).to(tl.float32), v)

    @triton.jit
    def _encode(rows_ptr, scales_ptr, words_ptr, out_ptr, row_stride, out_stride, size, nbytes, buckets,
                LEVELS: tl.constexpr, BITS: tl.constexpr, WIDTH: tl.constexpr, ELEMENTS: tl.constexpr,
                HEADER: tl.constexpr):
        """Row ``program_id(1)``'s values [ELEMENTS · program_id(0), +ELEMENTS) as their codes' bytes, and the
        row's scale bytes [HEADER · program_id(0), +HEADER). ``WIDTH``: the buckets' width, or 0 for one bucket
        per row."""
        PER: tl.constexpr = 8 // BITS
        BYTES: tl.constexpr = ELEMENTS // PER
        row, block = tl.program_id(1).to(tl.int64), tl.program_id(0)
        index = block * ELEMENTS + tl.arange(0, ELEMENTS)
        inside = index < size
        x = tl.load(rows_ptr + row * row_stride + index, mask=inside, other=0.0)
        if WIDTH == 0:
            scale = tl.load(scales_ptr + row * buckets)
        else:
            scale = tl.load(scales_ptr + row * buckets + index // WIDTH, mask=inside, other=1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        u = uniform_in_kernel(index, tl.load(words_ptr + 2 * row), tl.load(words_ptr + 2 * row + 1))
        magnitude = _floor_of_nonnegative(tl.math.div_rn(tl.abs(x), safe) * LEVELS + u)
        magnitude = tl.where(magnitude > LEVELS, LEVELS, magnitude)  # a NaN stays, as torch's clamp keeps it
        code = (tl.where(x < 0, -magnitude, magnitude) + LEVELS).to(tl.int16).to(tl.int32)  # inductor's cast
        code = tl.where(inside, code, 0) << (8 - BITS * (index % PER + 1))
        at = block * BYTES + tl.arange(0, BYTES)
        packed = tl.sum(tl.reshape(code, [BYTES, PER]), 1) if PER > 1 else code  # no two codes overlap
        out = out_ptr + row * out_stride
        tl.store(out + 4 * buckets + at, packed.to(tl.uint8), mask=at < nbytes)
        header = block * HEADER + tl.arange(0, HEADER)
        in_header = header < 4 * buckets
        word = tl.load(scales_ptr + row * buckets + header // 4, mask=in_header, other=0.0).to(tl.int32, bitcast=True)
        tl.store(out + header, ((word >> (8 * (header % 4))) & 255).to(tl.uint8), mask=in_header)

    @triton.jit
    def _decode(payloads_ptr, out_ptr, bad_ptr, payload_stride, out_stride, numel, nbytes, buckets, count,
                LEVELS: tl.constexpr, BITS: tl.constexpr, WIDTH: tl.constexpr, ELEMENTS: tl.constexpr,
                FLAGS: tl.constexpr):
        """Row ``program_id(1)``'s values [ELEMENTS · program_id(0), +ELEMENTS) from its bytes; with ``FLAGS``,
        a program that reads a refused scale sets the row's flag ``bad[0, row]``, one that reads a code above
        the top one ``bad[1, row]`` (``bad`` (2, count), zeroed before the launch; every writer writes 1)."""
        PER: tl.constexpr = 8 // BITS
        BYTES: tl.constexpr = ELEMENTS // PER
        row, block = tl.program_id(1).to(tl.int64), tl.program_id(0)
        payload = payloads_ptr + row * payload_stride
        at = block * BYTES + tl.arange(0, BYTES)
        packed = tl.load(payload + 4 * buckets + at, mask=at < nbytes, other=0).to(tl.int32)
        if PER > 1:
            lane = tl.arange(0, PER)
            codes = tl.reshape((packed[:, None] >> (8 - BITS * (lane + 1))[None, :]) & ((1 << BITS) - 1),
                               [ELEMENTS])
        else:
            codes = packed
        index = block * ELEMENTS + tl.arange(0, ELEMENTS)
        inside = index < numel
        if WIDTH == 0:
            word = word_at(payload, True, 0)
        else:
            word = word_at(payload + 4 * (index // WIDTH), inside, 0)
        scale = word.to(tl.float32, bitcast=True)
        values = (codes - LEVELS).to(tl.float32) * tl.math.div_rn(scale, tl.full((), LEVELS, tl.float32))
        tl.store(out_ptr + row * out_stride + index, values, mask=inside)
        if FLAGS:
            refused = refused_scale(scale)  # past the row, 0.0
            if WIDTH != 0:
                refused = tl.max(refused.to(tl.int32)) > 0
            tl.store(bad_ptr + row, 1, mask=refused)
            above = tl.max((codes > 2 * LEVELS).to(tl.int32)) > 0  # a last byte's padding codes too; past it, 0
            tl.store(bad_ptr + count + row, 1, mask=above)


def _width_constant(width: int, size: int) -> int:
    """The kernels' ``WIDTH``: 0 where a row is one bucket, else the buckets' width."""
    return 0 if width >= size else width


def encoded_rows(rows: torch.Tensor, scales: torch.Tensor, words: torch.Tensor, levels: int, bits: int,
                 width: int) -> torch.Tensor:
    """(count, 4 · buckets + packed bytes) uint8: each row's payload, its ``scales`` (count, buckets) float32
    as bytes, then its codes rounded with the noise of its seed ``words`` ((count, 2) int32, ``noise.seed_words``
    of each row's seed), ``bits`` each, for buckets of ``width`` values. ``rows``: float32 (count, size), unit
    stride along a row. Needs Triton."""
    count, size = rows.shape
    buckets = -(-size // width) if size else 0
    if rows.dtype != torch.float32 or (size > 1 and rows.stride(1) != 1) or tuple(scales.shape) != (count, buckets) \
            or tuple(words.shape) != (count, 2) or words.dtype != torch.int32 or 8 % bits or 2 * levels >= 1 << bits:
        raise ValueError(f"levels_codec.encoded_rows: wants float32 rows of unit stride, a scale per bucket of "
                         f"{width} and two seed words per row for {levels} levels in {bits} bits, got {rows.dtype} "
                         f"rows {tuple(rows.shape)}, strides {rows.stride()}, scales {tuple(scales.shape)}, words "
                         f"{words.dtype} {tuple(words.shape)}")
    nbytes = -(-size * bits // 8)
    out = torch.empty(count, 4 * buckets + nbytes, dtype=torch.uint8, device=rows.device)
    if count and size:
        programs = max(triton.cdiv(size, _ELEMENTS), triton.cdiv(4 * buckets, _HEADER))
        _encode[(programs, count)](rows, scales.float().contiguous(), words.contiguous(), out, rows.stride(0),
                                   out.stride(0), size, nbytes, buckets, LEVELS=levels, BITS=bits,
                                   WIDTH=_width_constant(width, size), ELEMENTS=_ELEMENTS, HEADER=_HEADER,
                                   enable_fp_fusion=False)
    return out


def decoded_rows(payloads: torch.Tensor, numel: int, levels: int, bits: int, width: int,
                 out: torch.Tensor | None = None, flags: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each row's ``numel`` values, (count, numel) float32, written into ``out`` where given; with ``flags``,
    (2, count) bool: whether a row holds a refused scale (negative or not finite), and whether it holds a code
    above 2 · levels, else None). ``payloads``: (count, 4 · buckets + packed bytes) uint8, unit stride along a
    row. Needs Triton."""
    count, length = payloads.shape
    buckets = -(-numel // width) if numel else 0
    nbytes = -(-numel * bits // 8)
    if payloads.dtype != torch.uint8 or (length > 1 and payloads.stride(1) != 1) or length != 4 * buckets + nbytes:
        raise ValueError(f"levels_codec.decoded_rows: wants uint8 payload rows of unit stride of "
                         f"{4 * buckets + nbytes} bytes for {numel} values, got {payloads.dtype} "
                         f"{tuple(payloads.shape)}, strides {payloads.stride()}")
    out = rows_out(out, count, numel, payloads.device, "levels_codec.decoded_rows")
    bad = torch.zeros(2, count, dtype=torch.bool, device=payloads.device) if flags else None
    if count and numel:
        _decode[(triton.cdiv(numel, _ELEMENTS), count)](
            payloads, out, bad if flags else out, payloads.stride(0), out.stride(0), numel, nbytes, buckets, count,
            LEVELS=levels, BITS=bits, WIDTH=_width_constant(width, numel), ELEMENTS=_ELEMENTS, FLAGS=flags,
            enable_fp_fusion=False)
    return out, bad


def runs_on(device: torch.device) -> bool:
    """Whether this codec may run on ``device`` at all (a row decoder's question, before it has rows): our
    kernels chosen on this GPU (``own_kernels.chosen_on``) and checked against torch's path on it."""
    return ready(device, _works_on)


def _taken(tensor: torch.Tensor, count: int, size: int) -> bool:
    """Whether this codec runs for ``count`` rows of ``size`` values on ``tensor``'s device: ``runs_on`` it,
    within a grid and the noise's index."""
    return count <= MOST_ROWS and size < _LONGEST_ROW and ready(tensor, _works_on)


def encodes(rows: torch.Tensor) -> bool:
    """Whether this codec encodes the (count, size) float32 ``rows``, so that its caller makes the seed words a
    tensor for it."""
    return rows.dtype == torch.float32 and (rows.shape[1] <= 1 or rows.stride(1) == 1) \
        and _taken(rows, *rows.shape)


def levels_decoded(payloads: torch.Tensor, numel: int, levels: int, bits: int, width: int,
                   out: torch.Tensor | None = None, flags: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``decoded_rows`` where this codec runs, into ``out`` where it is a (count, numel) float32 buffer of unit
    stride along a row; None where torch's path decodes."""
    if payloads.dtype != torch.uint8 or payloads.dim() != 2 or payloads.stride(-1) != 1 \
            or not _taken(payloads, payloads.shape[0], numel):
        return None
    fits = fits_rows(out, payloads.shape[0], numel)
    return decoded_rows(payloads, numel, levels, bits, width, out if fits else None, flags)


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed rows (signed zeros, subnormals, an all-zero bucket, a short last bucket, values ending inside a
    byte, a zero scale, a scale to refuse, a code above the top one), for each code width and for buckets and
    one bucket per row, this codec's bytes, values and flags are those of torch's path (the reference
    ``levels`` registers)."""
    encode, decode = TORCH_REFERENCES["levels_payloads"], TORCH_REFERENCES["levels_decoded"]
    gen = torch.Generator(device=device).manual_seed(0)
    for levels, bits, width, size in ((1, 2, 1 << 20, 1001), (7, 4, 96, 1003), (127, 8, 512, 3 * _ELEMENTS + 5)):
        rows = torch.randn(3, size, generator=gen, device=device)
        rows[0, :6] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38], device=device)
        rows[1, : min(width, size)] = 0.0
        seeds = [(11, 12), (1 << 29, 5), (0, (1 << 30) - 1)]
        scales, want = encode(rows, levels, bits, width, seeds)
        words = torch.tensor(seeds, dtype=torch.int32, device=device)
        got = encoded_rows(rows, scales, words, levels, bits, width)
        if not torch.equal(got, want):
            return False
        got[1, :4] = torch.tensor([0, 0, 128, 191], dtype=torch.uint8, device=device)  # -1.0: refused
        got[2, -1] = 255  # codes above the top one, and in a last byte's padding where there is one
        values, bad = decoded_rows(got, size, levels, bits, width)
        want_values, want_bad = decode(got, size, levels, bits, width)
        if not (torch.equal(values, want_values) and torch.equal(bad, want_bad)):
            return False
    return True


_works_on = checked_per_device("the levels' Triton codec", _agrees_with_torch)
