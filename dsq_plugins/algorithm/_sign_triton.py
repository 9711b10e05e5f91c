"""Sign's kernels of a bucket on a GPU, in Triton: the payloads of its
chunks with the int8 codes of their residual (a worker's and an owner's
encode), and an owner's u from its senders' payloads (the mean, the server
memory's values and the status), one launch each.

**Payloads with their residual.** The vector read once; the payloads,
codes and block scales written once.

``_payloads_and_residual``'s sign kernel (``_signs_and_residual``) was
inductor's code on a GPU, which read a byte's values as eight strided
loads and each int8 block's values again for its scale. Here a program
takes whole int8 blocks of the bucket's vector as one tile (blocks, bytes,
8): each byte's eight values are a row of it, so the bits are shifts and a
sum along that row, and each block's largest residual a reduction over its
tile. A chunk's values start on a byte (a chunk's size is a multiple of 8),
so each byte belongs to one chunk: its chunk's scale is computed per byte,
and the first byte of a chunk writes the scale's four bytes in front of
its bits. An int8 block may span two chunks, as in torch's path.

The same bits as torch's path (``int8_codes`` of ``v - ±s``): the scale is
the correctly rounded quotient of the chunk's magnitude and its divisor,
clamped to the largest float; the residual one subtraction; a block's
scale its largest magnitude divided by the levels; a code the quotient
rounded half to even (the float trick of adding and subtracting 1.5 · 2^23,
exact below 2^22, where every code lies), clamped to the levels. Where this
path is not taken (no Triton, a CPU's tensors, ``DSQ_OWN_KERNELS=torch``, a
first-call check that disagrees), ``signs_with_residual`` returns None and
the caller runs torch's kernel.

**An owner's u.** ``_mean_of_payloads``' sign kernel (``_mean_of_signs``)
decoded every sender's row by a gathered table before its mean. Here a
program reads a tile of bytes from each sender in turn, adds its ±s in
sender order from +0.0 (``aggregation.mean_rows``), divides by the count,
adds the memory's code times its block's scale (two roundings: the kernel
is compiled without fused multiply-adds, as ``kernels.EAGER_NUMERICS``
compiles inductor's), and writes u once. Every program reads every sender's
scale to find the first refused row; the first program writes the rows'
flags and that row's status, and where no row is refused a program whose
u holds a NaN or an Inf lowers the status, zeroed before the launch, to
``header.OVERFLOW`` by an atomic minimum (the same value from any program,
so the order does not matter)."""
from __future__ import annotations

import torch

from ..compressors.own_kernels import TORCH_REFERENCES, checked_per_device, ready, refused_scale, tl, triton
from ..comm import header
from ..compressors import sign_codec
from ..state.compact import BLOCK, LEVELS, int8_codes
from ..state._int8_triton import int8_codes_of_tile

__all__ = ["folds", "mean_of_signs", "mean_of_signs_rows", "sign_residual_codes", "signs_with_residual",
           "signs_and_residual_rows", "takes"]

_BLOCKS = 8  # int8 blocks per program: 2,048 values
_LONGEST = 1 << 31  # offsets into the vector are int32 in the kernel
_MEAN_BYTES = 256  # bytes of every sender's payload per program of the mean: 2,048 values of u
_MOST_SENDERS = 1024  # every program reads every sender's scale at once

if triton is not None:
    sent_scale = sign_codec.sent_scale  # sign's wire format, in a kernel

    @triton.jit
    def _signs_and_residual(v_ptr, magnitudes_ptr, divisor_ptr, levels_ptr, payloads_ptr, codes_ptr, scales_ptr,
                            numel, row_bytes, payload_stride, blocks, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
        """Int8 blocks [BLOCKS · program_id(0), +BLOCKS) of the vector: their codes and scales, the payload bytes
        of their values, and the scale bytes of each chunk that starts among them."""
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        nbyte = tl.arange(0, BLOCK // 8)
        lane = tl.arange(0, 8)
        byte = block[:, None] * (BLOCK // 8) + nbyte[None, :]  # (blocks, bytes): the vector's byte index
        at = byte[:, :, None] * 8 + lane[None, None, :]  # (blocks, bytes, 8): the vector's element index
        inside = at < numel
        byte_inside = byte * 8 < numel
        x = tl.load(v_ptr + at, mask=inside, other=0.0)
        row = byte // row_bytes
        column = byte - row * row_bytes
        scale = sent_scale(tl.load(magnitudes_ptr + row, mask=byte_inside, other=0.0), tl.load(divisor_ptr))
        nonnegative = x >= 0
        sent = scale[:, :, None]
        residual = tl.where(inside, x - tl.where(nonnegative, sent, -sent), 0.0)  # zeros pad the last block
        payload = payloads_ptr + row.to(tl.int64) * payload_stride
        bits = tl.sum(nonnegative.to(tl.int32) << (7 - lane)[None, None, :], 2)
        tl.store(payload + 4 + column, bits.to(tl.uint8), mask=byte_inside)
        word = scale.to(tl.int32, bitcast=True)
        starts = byte_inside & (column == 0)
        for q in tl.static_range(4):
            tl.store(payload + q, ((word >> (8 * q)) & 255).to(tl.uint8), mask=starts)
        int8_codes_of_tile(residual, block, at, levels_ptr, codes_ptr, scales_ptr, blocks)

    @triton.jit
    def _sign_residual_codes(v_ptr, long_magnitudes_ptr, short_magnitudes_ptr, long_divisor_ptr,
                             short_divisor_ptr, levels_ptr, codes_ptr, scales_ptr, numel, longer, extra, blocks,
                             BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
        """Int8 blocks [BLOCKS · program_id(0), +BLOCKS) of v less ±its chunk's scale: the first ``extra`` chunks
        of ``longer`` values (their magnitudes and divisor the long ones), the rest one value shorter."""
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        at = block[:, None, None] * BLOCK + (tl.arange(0, BLOCK // 8)[None, :, None] * 8
                                             + tl.arange(0, 8)[None, None, :])
        inside = at < numel
        x = tl.load(v_ptr + at, mask=inside, other=0.0)
        split = extra * longer
        is_long = at < split
        row = tl.where(is_long, at // longer, (at - split) // (longer - 1))  # the chunk within its run
        magnitude = tl.where(is_long, tl.load(long_magnitudes_ptr + row, mask=inside & is_long, other=0.0),
                             tl.load(short_magnitudes_ptr + row, mask=inside & ~is_long, other=0.0))
        divisor = tl.where(is_long, tl.load(long_divisor_ptr), tl.load(short_divisor_ptr))
        scale = sent_scale(magnitude, divisor)
        residual = tl.where(inside, x - tl.where(x >= 0, scale, -scale), 0.0)  # zeros pad the last block
        int8_codes_of_tile(residual, block, at, levels_ptr, codes_ptr, scales_ptr, blocks)

    @triton.jit
    def _signs_of(payload, at, inside, lane):
        """A sender's values ±s for the bytes ``at`` of its payload row, (bytes, 8)."""
        quad = tl.arange(0, 4)
        scale = tl.sum(tl.load(payload + quad).to(tl.int32) << (8 * quad), 0).to(tl.float32, bitcast=True)
        packed = tl.load(payload + 4 + at, mask=inside, other=0).to(tl.int32)
        return tl.where(((packed[:, None] >> (7 - lane)[None, :]) & 1) != 0, 1.0, -1.0) * scale

    @triton.jit
    def _mean_of_signs(payloads_ptr, count_ptr, codes_ptr, scales_ptr, u_ptr, bad_ptr, status_ptr, senders,
                       payload_stride, nbytes, numel, written, MEMORY: tl.constexpr, SENDERS: tl.constexpr,
                       BYTES: tl.constexpr, BLOCK: tl.constexpr, BAD_PAYLOAD: tl.constexpr,
                       OVERFLOW: tl.constexpr):
        """u's elements [8 · BYTES · program_id(0), +8 · BYTES) of ``written`` (numel, or whole blocks past it
        where the memory's rows are new); the first program writes the rows' flags and a refused row's status."""
        first_program = tl.program_id(0) == 0
        sender = tl.arange(0, SENDERS)
        quad = tl.arange(0, 4)
        words = tl.load(payloads_ptr + sender[:, None].to(tl.int64) * payload_stride + quad[None, :],
                        mask=(sender < senders)[:, None], other=0).to(tl.int32)
        scales = tl.sum(words << (8 * quad)[None, :], 1).to(tl.float32, bitcast=True)
        refused = (sender < senders) & refused_scale(scales)
        first_refused = tl.min(tl.where(refused, sender, SENDERS), 0)
        tl.store(bad_ptr + sender, refused, mask=(sender < senders) & first_program)
        tl.store(status_ptr + quad * 0, (BAD_PAYLOAD + first_refused).to(tl.int64),
                 mask=(quad < 1) & first_program & (first_refused < SENDERS))
        at = tl.program_id(0) * BYTES + tl.arange(0, BYTES)
        lane = tl.arange(0, 8)
        inside = at < nbytes
        first = _signs_of(payloads_ptr, at, inside, lane)
        total = tl.where(first == 0, 0.0, first)  # +0.0 + v: -0.0 becomes +0.0
        stride = tl.full((), 0, tl.int64) + payload_stride  # a sender's offset may pass 2^31
        for row in range(1, senders):
            total += _signs_of(payloads_ptr + row * stride, at, inside, lane)
        u = tl.math.div_rn(total, tl.load(count_ptr))
        element = at[:, None] * 8 + lane[None, :]
        kept = element < written
        if MEMORY:
            codes = tl.load(codes_ptr + element, mask=kept, other=0).to(tl.float32)
            u = tl.where(element < numel, u, 0.0) + codes * tl.load(scales_ptr + element // BLOCK, mask=kept,
                                                                   other=0.0)
            not_finite = tl.max((kept & ~(tl.abs(u) <= 3.4028234663852886e38)).to(tl.int32), 1)
            not_finite = tl.max(not_finite, 0)  # NaN fails the comparison
            tl.atomic_min(status_ptr, tl.full((), OVERFLOW, tl.int64),
                          mask=(not_finite > 0) & (first_refused == SENDERS))
        tl.store(u_ptr + element, u, mask=kept)


def signs_and_residual_rows(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor,
                            levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's sign payload, (count, 4 + size/8) uint8; the int8 codes of the rows less ±their scales,
    flat and padded with zeros to whole blocks; each block's scale), as ``_payloads_and_residual``'s
    ``_signs_and_residual`` gives them. ``rows``: contiguous float32 (count, size), size a multiple of 8;
    ``magnitudes``: (count,); ``divisor`` and ``levels``: 0-d. Needs Triton."""
    count, size = rows.shape
    if rows.dtype != torch.float32 or not rows.is_contiguous() or size % 8 or not size \
            or magnitudes.shape != (count,) or rows.numel() >= _LONGEST:
        raise ValueError(f"signs_and_residual_rows: wants contiguous float32 rows whose length is a positive "
                         f"multiple of 8 and a magnitude per row, got {rows.dtype} {tuple(rows.shape)}, strides "
                         f"{rows.stride()}, magnitudes {tuple(magnitudes.shape)}")
    blocks = -(-rows.numel() // BLOCK)
    payloads = torch.empty(count, 4 + size // 8, dtype=torch.uint8, device=rows.device)
    codes = torch.empty(blocks * BLOCK, dtype=torch.int8, device=rows.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=rows.device)
    _signs_and_residual[(triton.cdiv(blocks, _BLOCKS),)](
        rows, magnitudes.float().contiguous(), divisor.float().reshape(1), levels.float().reshape(1), payloads,
        codes, scales, rows.numel(), size // 8, payloads.stride(0), blocks, BLOCKS=_BLOCKS, BLOCK=BLOCK)
    return payloads, codes, scales


def signs_with_residual(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor, levels: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``signs_and_residual_rows`` where our kernels run (``DSQ_OWN_KERNELS``, a GPU's tensors, the first call's
    check); None where the caller runs torch's kernel."""
    if rows.dtype != torch.float32 or not rows.is_contiguous() or rows.numel() >= _LONGEST or not _taken(rows):
        return None
    return signs_and_residual_rows(rows, magnitudes, divisor, levels)


def _taken(rows: torch.Tensor) -> bool:
    """Whether these kernels run for ``rows``: ours chosen on a GPU (``own_kernels.ready``) and the first call's
    check passed on it."""
    return ready(rows, _works_on)


def sign_residual_codes(v: torch.Tensor, runs: list[tuple[torch.Tensor, torch.Tensor]], levels: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the int8 codes of v less ±each chunk's scale, padded with zeros to whole blocks; each block's scale),
    as ``state.compact.int8_codes`` gives them. ``v``: contiguous float32, cut into one run of equal chunks or two
    (a run one value longer first, as ``layout.chunk_bounds`` cuts it); ``runs``: each run's (magnitudes,
    divisor), a chunk's scale being ``magnitude / divisor`` clamped to the largest float. Needs Triton."""
    n, counts = v.numel(), [magnitudes.numel() for magnitudes, _ in runs]
    if v.dtype != torch.float32 or not v.is_contiguous() or not 0 < n < _LONGEST or len(runs) not in (1, 2) \
            or n % sum(counts) != (counts[0] if len(runs) == 2 else 0):
        raise ValueError(f"sign_residual_codes: wants a contiguous float32 vector cut into one or two runs of "
                         f"chunks, the longer first, got {v.dtype} of {n} elements and runs of {counts} chunks")
    (long_magnitudes, long_divisor), (short_magnitudes, short_divisor) = runs[0], runs[-1]
    extra = counts[0] if len(runs) == 2 else 0
    longer = n // sum(counts) + 1
    blocks = -(-n // BLOCK)
    codes = torch.empty(blocks * BLOCK, dtype=torch.int8, device=v.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=v.device)
    _sign_residual_codes[(triton.cdiv(blocks, _BLOCKS),)](
        v, long_magnitudes.float().contiguous(), short_magnitudes.float().contiguous(),
        long_divisor.float().reshape(1), short_divisor.float().reshape(1), levels.float().reshape(1), codes, scales,
        n, longer, extra, blocks, BLOCKS=_BLOCKS, BLOCK=BLOCK)
    return codes, scales


def takes(v: torch.Tensor) -> bool:
    """Whether these kernels run for the vector ``v``: ours chosen on a GPU, contiguous float32 within int32
    offsets, and the first call's check passed on it."""
    return v.dtype == torch.float32 and v.is_contiguous() and v.numel() < _LONGEST and _taken(v)


def mean_of_signs_rows(payloads: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                       scales: torch.Tensor | None, into: torch.Tensor | None, numel: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, the rows' flags (1, senders), each row's flag, the owner's status), as ``_mean_of_payloads``'
    ``_mean_of_signs`` gives them: ``payloads`` (senders, 4 + bytes) of a chunk of ``numel`` elements (8 · bytes
    unless given: a last byte may hold fewer), ``count`` the 0-d divisor, ``codes``/``scales`` the server
    memory's rows (blocks, BLOCK) or None, ``into`` the memory-shaped rows to write u into, or None (u is then
    new: the chunk's elements, or whole blocks where there is a memory). Needs Triton."""
    senders, width = payloads.shape
    nbytes = width - 4
    numel = 8 * nbytes if numel is None else numel
    if payloads.dtype != torch.uint8 or payloads.stride(1) != 1 or not 0 < senders <= _MOST_SENDERS \
            or not 0 < numel < _LONGEST or -(-numel // 8) != nbytes or (codes is None) != (scales is None):
        raise ValueError(f"mean_of_signs_rows: wants uint8 payload rows of unit stride from 1 to {_MOST_SENDERS} "
                         f"senders for {numel} elements, got {payloads.dtype} {tuple(payloads.shape)}, strides "
                         f"{payloads.stride()}")
    memory = codes is not None
    written = codes.numel() if memory else numel
    u = into if into is not None else torch.empty(written, dtype=torch.float32, device=payloads.device)
    bad = torch.empty(senders, dtype=torch.bool, device=payloads.device)
    status = torch.zeros((), dtype=torch.int64, device=payloads.device)
    _mean_of_signs[(triton.cdiv(written, 8 * _MEAN_BYTES),)](
        payloads, count.float().reshape(1), codes if memory else u, scales if memory else u, u, bad, status,
        senders, payloads.stride(0), nbytes, numel, written, MEMORY=memory,
        SENDERS=max(2, triton.next_power_of_2(senders)), BYTES=_MEAN_BYTES, BLOCK=BLOCK,
        BAD_PAYLOAD=header.BAD_PAYLOAD, OVERFLOW=header.OVERFLOW, enable_fp_fusion=False)
    return u, bad.unsqueeze(0), bad, status


def folds(payloads: torch.Tensor, numel: int, codes: torch.Tensor | None, scales: torch.Tensor | None,
          into: torch.Tensor | None) -> bool:
    """Whether ``mean_of_signs`` takes these senders' payloads of a chunk of ``numel`` elements (which need
    not fill whole bytes) with this memory: ours chosen on a GPU, rows it can read, the first call's check."""
    contiguous = codes is None or (codes.is_contiguous() and scales.is_contiguous()
                                   and (into is None or into.is_contiguous()))
    return contiguous and payloads.dim() == 2 and payloads.shape[0] <= _MOST_SENDERS \
        and payloads.stride(-1) == 1 and 0 < numel < _LONGEST and -(-numel // 8) == payloads.shape[1] - 4 \
        and _taken(payloads)


def mean_of_signs(payloads: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                  scales: torch.Tensor | None, into: torch.Tensor | None, numel: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``mean_of_signs_rows`` where these kernels take it (``folds``); None where the caller runs torch's."""
    numel = 8 * (payloads.shape[1] - 4) if numel is None else numel
    if not folds(payloads, numel, codes, scales, into):
        return None
    return mean_of_signs_rows(payloads, count, codes, scales, into, numel)


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed rows, both kernels give what torch's ops give, eager: the payloads, codes and scales of chunks
    that end inside an int8 block, signed zeros, a chunk all zero, an overflowing magnitude; an owner's u from
    three senders with a memory written in place, one made new past the chunk's end, and none; a refused row's
    status, and an overflow's."""
    from ..compressors.bitpack import sign_units
    if not {"signs_and_residual", "mean_of_signs"} <= set(TORCH_REFERENCES):
        return False
    _signs_and_residual, _mean_of_signs = TORCH_REFERENCES["signs_and_residual"], TORCH_REFERENCES["mean_of_signs"]
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(3, 8 * 41, generator=gen, device=device) * torch.logspace(-3, 3, 8 * 41, device=device)
    rows[0, :4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
    rows[2] = 0.0
    magnitudes = torch.cat([rows[0].abs().sum().reshape(1), torch.tensor([float("inf"), 0.0], device=device)])
    divisor, levels = torch.full((), 8.0 * 41, device=device), torch.full((), LEVELS, device=device)
    with torch.no_grad():
        if not _same(signs_and_residual_rows(rows, magnitudes, divisor, levels),
                     _signs_and_residual(rows, magnitudes, divisor, levels)):
            return False
        ragged = rows.view(-1)[:-1]  # three chunks cut as chunk_bounds cuts them: two one value longer
        if not _same(sign_residual_codes(ragged, [(magnitudes[:2], divisor), (magnitudes[2:], levels)], levels),
                     _torch_residual_codes(ragged, magnitudes, divisor, levels)):
            return False
        count, table = torch.full((), 3.0, device=device), sign_units(device)
        for size, refused, scale in ((8 * 41, None, None), (8 * 64, 1, -1.0), (8 * 64, None, 3e38)):
            senders = torch.randn(4, size, generator=gen, device=device)
            payloads = signs_and_residual_rows(senders[:3], senders[:3].abs().sum(1), divisor, levels)[0]
            _, codes, scales = signs_and_residual_rows(senders[3:], senders[3:].abs().sum(1), divisor, levels)
            if scale is not None:  # one sender's scale refused, or every sender's the largest (u overflows)
                scale_bytes = torch.tensor([scale], device=device).view(torch.uint8)
                payloads[slice(None) if refused is None else refused, :4] = scale_bytes
            memories = [(None, None, None), (codes.view(-1, BLOCK), scales, None)]
            if codes.numel() == size:  # a memory of whole blocks: u written into rows of its shape
                memories.append((codes.view(-1, BLOCK), scales, torch.empty(size // BLOCK, BLOCK, device=device)))
            for memory in memories:
                got = mean_of_signs_rows(payloads, count, *memory)
                theirs = memory if memory[2] is None else (*memory[:2], torch.empty_like(memory[2]))
                want = _mean_of_signs(payloads, count, *theirs, table)
                if not _same((got[0].view(-1)[:size], *got[1:]), (want[0].reshape(-1)[:size], *want[1:])):
                    return False
    return True


def _torch_residual_codes(v: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor, levels: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The check's reference for ``sign_residual_codes`` of three chunks cut as ``chunk_bounds`` cuts them, the
    first two one longer, scaled by ``divisor`` and the third by ``levels``: torch's ops."""
    size = v.numel() // 3
    scales = torch.cat([magnitudes[:2] / divisor, magnitudes[2:] / levels]).clamp(max=torch.finfo(torch.float32).max)
    s = scales.repeat_interleave(torch.tensor([size + 1, size + 1, size], device=v.device))
    return int8_codes(v - torch.where(v >= 0, s, -s), levels)


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want, strict=True))


_works_on = checked_per_device("sign's Triton bucket kernels", _agrees_with_torch)
