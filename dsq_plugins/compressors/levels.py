"""Stochastic rounding onto 2s+1 evenly spaced levels in [-scale, scale],
per bucket of elements: the common core of QSGD (scale = L2 norm of the
bucket, s levels) and TernGrad (scale = max |x| of the bucket, s = 1).

Element x with scale c is sent as an integer q in [-s, s] with
P(|q| = l+1) = r - l for r = s·|x|/c and l = floor(r), so E[q·c/s] = x.
On the wire q + s is a (2s+1)-valued code packed at 2, 4 or 8 bits. The
noise u comes from ``noise`` (a hash of the seed and the element's index,
computed inside the compiled rounding pass), not from a generator's stream."""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ConfigError
from . import bitpack, kernels, levels_codec, noise
from .base import (as_bytes, Compressor, from_bytes, host_values, not_finite_nonnegative, refuse_if_any,
                   refuse_rows_if_any, Refusals, TRUSTED)
from .own_kernels import TORCH_REFERENCES

__all__ = ["code_bits", "decode", "decode_rows", "encode", "encode_rows", "LevelsCompressor", "MAX_LEVELS", "nbuckets",
    "payload_nbytes"]

MAX_LEVELS = {2: 1, 4: 7, 8: 127}


def code_bits(levels: int) -> int:
    """Smallest of 2, 4, 8 bits that holds the 2*levels+1 codes."""
    for bits in (2, 4, 8):
        if levels <= MAX_LEVELS[bits]:
            return bits
    raise ConfigError(f"at most {MAX_LEVELS[8]} levels are supported, got {levels}")


def nbuckets(numel: int, bucket: int | None) -> int:
    """How many scales a payload carries."""
    if numel == 0:
        return 0
    return 1 if bucket is None else -(-numel // bucket)


def payload_nbytes(numel: int, levels: int, bucket: int | None) -> int:
    """Wire size: one fp32 scale per bucket plus the packed codes."""
    if numel == 0:
        return 0
    return 4 * nbuckets(numel, bucket) + bitpack.packed_nbytes(numel, code_bits(levels))


def _bucket_views(rows: torch.Tensor, width: int) -> list[torch.Tensor]:
    """Views of each row of ``rows`` (chunks) as its whole buckets (chunk,
    bucket, element) and its short last bucket (chunk, 1, rest), without
    copying them into a padded matrix."""
    size = rows.shape[1]
    whole = size - size % width
    return ([rows[:, :whole].unflatten(1, (-1, width))] if whole else []) + \
        ([rows[:, whole:].unsqueeze(1)] if whole < size else [])


def _rows(flat: torch.Tensor, width: int) -> list[torch.Tensor]:
    """``_bucket_views`` of one vector: its whole buckets as a 2-D view, then the short last one as one row."""
    return [part[0] for part in _bucket_views(flat.view(1, -1), width)]


def _with_bucket_values(flat: torch.Tensor, width: int, values: torch.Tensor):
    """(rows, the per-bucket ``values`` of those rows as a column) for each view of ``_rows``."""
    start = 0
    for part in _rows(flat, width):
        yield part, values[start: start + part.shape[0]].unsqueeze(1)
        start += part.shape[0]


def _quantize(x: torch.Tensor, scale: torch.Tensor, first: int, low: int, high: int, levels: int) -> torch.Tensor:
    """Codes q + levels of the rows ``x`` (bucket scales ``scale``, a column),
    whose elements are numbered from ``first`` in the noise of the seed words
    (``low``, ``high``). floor(r + u) with u ~ U[0, 1) is l + 1 with
    probability r - l: the same rounding as comparing u with r - l, in place."""
    u = noise.uniform_into(torch.empty(x.shape, device=x.device), first, low, high)
    # divide, then multiply: levels / scale overflows for tiny scales, |x| / scale never exceeds 1
    r = x.abs().div_(scale).mul_(levels)
    mag = r.add_(u).floor_().clamp_(max=levels)
    return mag.copysign_(x).add_(levels).to(torch.uint8)  # -0.0 + levels is levels


def _rounded_codes(x: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, low, high, levels: int) -> torch.Tensor:
    """``_quantize``'s codes as one fusable expression, element x[i] with the
    noise of ``index[i]`` (broadcast); ``low`` and ``high`` are ints, or int32
    columns giving each row its own seed words."""
    mag = (x.abs() / scale * levels + noise.uniform_at(index, low, high)).floor().clamp(max=levels)
    return (mag.copysign(x) + levels).to(torch.uint8)


def _abs_max(rows: torch.Tensor) -> torch.Tensor:
    """max |x| along the last dimension with no |x| temporary (two
    reductions); abs_ makes a -0.0 maximum +0.0, as the fused form's |x| does."""
    return torch.maximum(rows.amax(dim=-1), -rows.amin(dim=-1)).abs_()


def _abs_max_fusable(rows: torch.Tensor) -> torch.Tensor:
    return rows.abs().amax(dim=-1)  # one read of the rows when compiled: 37 -> 19 ms for 64M elements on a CPU


# a maximum is exact whatever the order, so the compiled reduction gives the same bits
_abs_max_kernel = kernels.FusedKernel(_abs_max, _abs_max_fusable, compile_from=1 << 21)  # where it pays on a CPU


def _write_codes(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, first: int, low: int, high: int,
                 levels: int, bits: int) -> torch.Tensor:
    """``_quantize``'s codes of the rows ``x``, packed ``bits`` each, written into
    ``out`` (x's rows by their packed bytes): straight into the payload."""
    codes = _quantize(x, scale, first, low, high, levels).reshape(-1)
    return out.copy_(bitpack.pack(codes, bits).view(out.shape))


def _write_codes_fusable(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, first: int, low: int, high: int,
                         levels: int, bits: int) -> torch.Tensor:
    """The same bytes in one pass: the codes of a byte combined where they are
    made, no code array (with a 64M-element vector, 64 MB that a CPU would
    page-fault in). Each row's width is a whole number of bytes."""
    per = 8 // bits
    # shaped by out's bytes, so the compiler knows the result has out's shape and writes it in place
    grouped = x.view(x.shape[0], out.shape[-1], per)
    index = torch.arange(out.numel() * per, device=x.device, dtype=noise.index_dtype(first, x.numel())
                         ).view(grouped.shape) + first
    return out.copy_(_combined(lambda j: _rounded_codes(grouped[..., j], scale, index[..., j], low, high, levels),
                               bits))


def _combined(codes_at, bits: int) -> torch.Tensor:
    """Bytes of 8/``bits`` codes each, most significant first (``bitpack.pack``'s
    order), as a fusable expression: ``codes_at(j)`` gives the codes of the
    j-th element of every byte. Made per byte from strided views, a compiler
    emits one loop over the bytes; codes made first and then grouped, it
    materialised the code array and packed it in a second, scalar loop."""
    per = 8 // bits
    if per == 1:
        return codes_at(0)
    combined = codes_at(0) << (8 - bits)
    for j in range(1, per):
        combined = combined | (codes_at(j) << (8 - bits * (j + 1)))
    return combined


def _codes_kernel_for(bits: int) -> kernels.FusedKernel:
    """``_write_codes`` for one code width, which the compiler must see as a
    constant: a dynamic compile makes every int it reads from an argument or
    a closure a symbol, and with the width a symbol the bytes' strided reads
    and shifts are runtime values, which inductor's C++ does not vectorise
    (TernGrad's codes pass on this project's CPU: 7 ns per element so, 2.4
    with the width a constant). A string in the closure is a constant
    (guarded), so the width is carried as one."""
    def write_codes(out, x, scale, first, low, high, levels):
        return _write_codes(out, x, scale, first, low, high, levels, bits)

    tag = str(bits)  # a constant to the compiler, where an int would be a symbol (_codes_kernel_for)

    def write_codes_fusable(out, x, scale, first, low, high, levels):
        return _write_codes_fusable(out, x, scale, first, low, high, levels, int(tag))

    return kernels.FusedKernel(write_codes, write_codes_fusable)


_codes_kernels = {bits: _codes_kernel_for(bits) for bits in MAX_LEVELS}


def _write_row_codes_fusable(out: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor, width: int, low, high,
                             levels: int, bits: int) -> torch.Tensor:
    """The codes of every chunk of a stack (rows), each numbered from 0 under
    its own seed words (int32 columns), into ``out`` (rows by their packed
    bytes), in one pass of any shape: each element finds its bucket's scale
    by index, and the positions past a row's end (its last byte's padding)
    are zero bits, as ``bitpack.pack`` pads."""
    size, per = rows.shape[1], 8 // bits
    padded = out.shape[1] * per
    index = torch.arange(padded, device=rows.device, dtype=noise.index_dtype(0, padded))
    x = torch.nn.functional.pad(rows, (0, padded - size))  # a masked read when compiled, no copy
    bucket_scale = scale.index_select(1, (index // width).clamp(max=scale.shape[1] - 1))
    bucket_scale = torch.where(bucket_scale > 0, bucket_scale, 1.0)  # an all-zero bucket's codes are all zero
    grouped, index, bucket_scale = (t.unflatten(-1, (out.shape[1], per)) for t in (x, index, bucket_scale))

    def codes_at(j):
        return torch.where(index[..., j] < size, _rounded_codes(grouped[..., j], bucket_scale[..., j], index[..., j],
                                                                 low, high, levels), 0)

    return out.copy_(_combined(codes_at, bits))


def _row_codes_kernel_for(bits: int) -> kernels.FusedKernel:
    """``_write_row_codes_fusable`` for one code width: a bucket's chunks in
    one pass where the compiler runs; the eager form is ``_write_chunk_codes``
    chunk by chunk."""
    def write_row_codes(out, rows, scale, width, low, high, levels):
        for r, (lo, hi) in enumerate(zip(_ints(low), _ints(high))):
            _write_chunk_codes(out[r], rows[r], scale[r], width, lo, hi, levels, bits)
        return out

    tag = str(bits)  # a constant to the compiler, where an int would be a symbol (_codes_kernel_for)

    def write_row_codes_fusable(out, rows, scale, width, low, high, levels):
        return _write_row_codes_fusable(out, rows, scale, width, low, high, levels, int(tag))

    return kernels.FusedKernel(write_row_codes, write_row_codes_fusable)


_row_codes_kernels = {bits: _row_codes_kernel_for(bits) for bits in MAX_LEVELS}


def _ints(words) -> list[int]:
    """Seed words as Python ints: given so, or read back from a tensor (a
    host sync on a GPU, paid only where a failed compile left the eager form)."""
    return words.reshape(-1).tolist() if isinstance(words, torch.Tensor) else list(words)


def _row_scales(rows: torch.Tensor, width: int, norm: str) -> torch.Tensor:
    """(rows, buckets): each row's bucket scales (``norm``: "l2" or "max"),
    clamped to a finite float (see sign.py), the whole buckets of every row
    by one reduction over a view, the short last ones by another."""
    parts = [part.norm(dim=-1) if norm == "l2" else _abs_max_kernel(part, numel=part.numel())
             for part in _bucket_views(rows, width)]
    scales = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # a reduction's result is fresh: no copy
    return scales.clamp_(max=torch.finfo(torch.float32).max)


def _nonzero_scales(scale: torch.Tensor) -> torch.Tensor:
    """The scales a chunk's values are divided by: an all-zero bucket's 0 as 1 (its codes are all zero)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _packed_codes(flat: torch.Tensor, scale: torch.Tensor, width: int, low: int, high: int, levels: int,
                  bits: int) -> torch.Tensor:
    """One chunk's codes by eager ops, part by part (whole buckets, the short last one), then packed once."""
    codes = [_quantize(part, bucket_scale, first, low, high, levels).reshape(-1)
             for first, part, bucket_scale in _numbered(flat, width, _nonzero_scales(scale))]
    return bitpack.pack(torch.cat(codes), bits)


def _write_chunk_codes(out: torch.Tensor, flat: torch.Tensor, scale: torch.Tensor, width: int, low: int, high: int,
                       levels: int, bits: int) -> torch.Tensor:
    """One chunk's packed codes into ``out``, element i rounded with
    ``noise.uniform``'s element i for the seed words, part by part (whole
    buckets, the short last one)."""
    per = 8 // bits
    if width % per:  # buckets that do not fill whole bytes: every code, then one packing
        return out.copy_(_packed_codes(flat, scale, width, low, high, levels, bits))
    safe = _nonzero_scales(scale)
    for first, part, bucket_scale in _numbered(flat, width, safe):
        whole = part.shape[1] // per * per  # only the short last bucket can end inside a byte
        rows = out[first // per: (first + part.shape[0] * whole) // per].view(part.shape[0], whole // per)
        if whole:
            _codes_kernels[bits](rows, part[:, :whole], bucket_scale, first, low, high, levels,
                                 numel=rows.numel() * per)
        if whole < part.shape[1]:
            end = first + part.numel()
            _write_codes(out[end // per: end // per + 1].view(1, 1), part[:, whole:], bucket_scale, end - end % per,
                         low, high, levels, bits)
    return out


def encode(flat: torch.Tensor, levels: int, bucket: int | None, norm: str, seed: int) -> torch.Tensor:
    """Scales (``norm``: "l2" or "max" per bucket) then stochastically rounded
    codes, written into the payload (on a GPU, by ``levels_codec``'s one launch)."""
    numel = flat.numel()
    width = numel if bucket is None else bucket
    bits = code_bits(levels)
    scale = _row_scales(flat.view(1, -1), width, norm)
    if levels_codec.encodes(flat.view(1, -1)):
        words = host_values(noise.seed_words(seed), torch.int32, flat.device).view(1, 2)
        return levels_codec.encoded_rows(flat.view(1, -1), scale, words, levels, bits, width)[0]
    scale = scale[0]
    payload = torch.empty(4 * scale.numel() + bitpack.packed_nbytes(numel, bits), dtype=torch.uint8,
                          device=flat.device)
    payload[: 4 * scale.numel()] = as_bytes(scale)
    _write_chunk_codes(payload[4 * scale.numel():], flat, scale, width, *noise.seed_words(seed), levels, bits)
    return payload


def encode_rows(rows: torch.Tensor, levels: int, bucket: int | None, norm: str, seeds: Sequence[int]) -> torch.Tensor:
    """``encode``'s payload of each row of ``rows`` (equal-sized chunks), row
    r with ``seeds[r]``, as one (rows, payload) tensor: every chunk's bucket
    scales by one reduction, and where the compiler runs every chunk's codes
    by one pass (on a GPU, ``levels_codec``'s one launch, the scales' bytes
    included)."""
    width = rows.shape[1] if bucket is None else bucket
    bits = code_bits(levels)
    scale = _row_scales(rows, width, norm)
    words = [noise.seed_words(seed) for seed in seeds]
    if levels_codec.encodes(rows):
        columns = host_values([w for pair in words for w in pair], torch.int32, rows.device).view(-1, 2)
        return levels_codec.encoded_rows(rows, scale, columns, levels, bits, width)
    return _payload_rows(rows, scale, width, words, levels, bits)


def _payload_rows(rows: torch.Tensor, scale: torch.Tensor, width: int, words: Sequence[tuple[int, int]], levels: int,
                  bits: int) -> torch.Tensor:
    """``encode_rows``' payloads by torch's kernels, from the rows' bucket scales and seed words."""
    count, size = rows.shape
    kernel = _row_codes_kernels[bits]
    if kernel.uses_compiled(rows.numel(), rows.device):  # as tensors: as ints, a compiled pass recompiles per seed
        columns = host_values(words, torch.int32, rows.device).view(count, 2, 1)
        low, high = columns[:, 0], columns[:, 1]
    else:
        low, high = [w[0] for w in words], [w[1] for w in words]
    nb = scale.shape[1]
    payload = torch.empty(count, 4 * nb + bitpack.packed_nbytes(size, bits), dtype=torch.uint8, device=rows.device)
    payload[:, : 4 * nb] = scale.view(torch.uint8).view(count, 4 * nb)
    kernel(payload[:, 4 * nb:], rows, scale, width, low, high, levels, numel=rows.numel())
    return payload


def _payloads_by_torch(rows: torch.Tensor, levels: int, bits: int, width: int, words: Sequence[tuple[int, int]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket scales, payloads) of ``rows`` by torch's eager ops, row by row (no compile): the reference of a
    GPU's Triton encode (``levels_codec``); the scales by "max" for one level (TernGrad's), else by "l2"."""
    scale = _row_scales(rows, width, "max" if levels == 1 else "l2")
    payloads = [torch.cat([as_bytes(row_scale), _packed_codes(row, row_scale, width, low, high, levels, bits)])
                for row, row_scale, (low, high) in zip(rows, scale, words)]
    return scale, torch.stack(payloads)


TORCH_REFERENCES["levels_payloads"] = _payloads_by_torch


def _numbered(flat: torch.Tensor, width: int, values: torch.Tensor):
    """``_with_bucket_values`` with the index of each part's first element."""
    first = 0
    for part, column in _with_bucket_values(flat, width, values):
        yield first, part, column
        first += part.numel()


def _refusals_words(what: str, levels: int) -> tuple[str, str]:
    return (f"{what}: bucket scales in payload are negative or not finite",
            f"{what}: payload holds codes above {2 * levels}")


def decode(payload: torch.Tensor, numel: int, levels: int, bucket: int | None, what: str,
           refusals: Refusals = None) -> torch.Tensor:
    """Inverse of ``encode``, refusing negative or non-finite scales and out-of-range codes."""
    checks: Refusals = refusals if refusals is TRUSTED else []
    values = decode_rows(payload.view(1, -1), numel, levels, bucket, what, checks)
    if values is None:
        return _decoded_by_torch(payload, numel, levels, bucket, what, refusals)
    if checks is not TRUSTED:
        refuse_if_any(*checks, refusals=refusals)
    return values[0]


def decode_rows(payloads: torch.Tensor, numel: int, levels: int, bucket: int | None, what: str, refusals: Refusals,
                into: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every row of ``payloads`` decoded by ``levels_codec``'s one launch, into ``into`` where it fits, each
    check one device bool per row in ``refusals`` (a list, or ``TRUSTED``); None where torch's path decodes."""
    made = levels_codec.levels_decoded(payloads, numel, levels, code_bits(levels), numel if bucket is None else bucket,
                                       into, flags=refusals is not TRUSTED)
    if made is None:
        return None
    values, bad = made
    if bad is not None:
        refuse_rows_if_any(*zip(bad, _refusals_words(what, levels)), refusals=refusals)
    return values


def _decoded_by_torch(payload: torch.Tensor, numel: int, levels: int, bucket: int | None, what: str,
                      refusals: Refusals = None) -> torch.Tensor:
    """``decode`` by torch's ops."""
    nb = nbuckets(numel, bucket)
    scale = from_bytes(payload[: 4 * nb], torch.float32)
    bits = code_bits(levels)
    packed = payload[4 * nb:]
    scale_words, code_words = _refusals_words(what, levels)
    bad_scale = (not_finite_nonnegative(scale), scale_words)
    step = scale / scale.new_full((), levels)  # a device tensor: CUDA divides by a host number as by its reciprocal
    refuse_if_any(bad_scale, (bitpack.holds_code_above(packed, bits, 2 * levels), code_words), refusals=refusals)
    if bits == 8:  # one code per byte: convert, no table
        out = packed.to(torch.float32).sub_(levels)
    else:
        values = bitpack.byte_table(bits, payload.device).to(torch.float32).sub_(levels)  # each byte's, unscaled
        if bucket is None:
            return kernels.lookup(values.mul_(step), packed, numel)
        out = kernels.lookup(values, packed, numel)
    for part, bucket_step in _with_bucket_values(out, numel if bucket is None else bucket, step):
        part.mul_(bucket_step)
    return out


def _decoded_rows_by_torch(payloads: torch.Tensor, numel: int, levels: int, bits: int, width: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, (2, rows) flags: a refused scale, a code above the top one) of each row by torch's eager ops (no
    compile): the reference of a GPU's Triton decode (``levels_codec``)."""
    nb = nbuckets(numel, width)
    values, flags = [], []
    for payload in payloads:
        scale = from_bytes(payload[: 4 * nb].contiguous(), torch.float32)
        packed = payload[4 * nb:]
        row = bitpack.unpack(packed, bits, numel).to(torch.float32).sub_(levels)
        for part, bucket_step in _with_bucket_values(row, width, scale / scale.new_full((), levels)):
            part.mul_(bucket_step)
        values.append(row)
        flags.append(torch.stack([not_finite_nonnegative(scale).any(), bitpack.holds_code_above(packed, bits,
                                                                                                2 * levels)]))
    return torch.stack(values), torch.stack(flags, dim=1)


TORCH_REFERENCES["levels_decoded"] = _decoded_rows_by_torch


class LevelsCompressor(Compressor):
    """What QSGD and TernGrad share: this module's wire format, with
    ``levels`` levels per sign, bucket scales by ``norm`` ("l2" or "max")
    and an optional ``bucket_size``."""

    levels: int
    norm: str
    bucket_size: int | None

    def payload_nbytes(self, numel):
        return payload_nbytes(numel, self.levels, self.bucket_size)

    def _encode(self, flat, seed, shared=None):
        return encode(flat, self.levels, self.bucket_size, self.norm, seed)

    def encodes_rows(self, device):
        return kernels.launch_bound(device)  # on a CPU each chunk is already one compiled pass

    def _encode_rows(self, rows, seeds, shared=None):
        return encode_rows(rows, self.levels, self.bucket_size, self.norm, seeds)

    def _decode(self, payload, numel, seed, refusals):
        return decode(payload, numel, self.levels, self.bucket_size, self.name, refusals)

    def decodes_rows(self, device):
        return levels_codec.runs_on(device)  # a GPU's one launch; elsewhere each row is decoded on its own

    def _decode_rows(self, payloads, numel, seeds, refusals):
        return self._decode_rows_into(payloads, numel, seeds, refusals, None)

    def _decode_rows_into(self, payloads, numel, seeds, refusals, into):
        made = decode_rows(payloads, numel, self.levels, self.bucket_size, self.name, refusals, into)
        return made if made is not None else self._decode_each_row(payloads, numel, seeds, refusals)
