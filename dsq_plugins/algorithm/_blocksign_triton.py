"""Blocksign's kernels of a bucket on a GPU, in Triton: a worker's
compensation with the block codes of its sum, the payloads of a bucket's
chunks with the int8 codes of their residual (a worker's and an owner's
encode), one launch each with torch's sum of the kept magnitudes before it,
and an owner's u from its senders' payloads in two.

**The compensation with its codes.** ``_compensated_codes`` was inductor's
kernel of the int8 memory's addition, its test and blocksign's two
reductions per block. Here a program adds whole int8 blocks of the memory
to its tile of g (``_int8_triton.added_tile``), writes v and raises the
status as the memory's own kernel does, and takes the codes of v's blocks
(``blocksign_codec.codes_of``) from the tile it holds, as (int8 blocks,
blocksign blocks in one, block): a blocksign block lies inside one int8
block where its width, a power of two, divides the int8 block's (other
widths take the codec's launch for the codes).

**Payloads with their residual.** ``_payloads_and_residual``'s blocksign
kernel was inductor's, which compared every element's column with its
block's code to subtract ±s and copied the codes beside the scales, for
chunks of whole blocks only. Here a program takes whole int8 blocks of v;
each value finds its chunk (in one run of equal chunks, or the two runs
``layout.chunk_bounds`` cuts a bucket into), its block and its place by
division, subtracts ±its chunk's scale at its block's kept position
(elsewhere nothing: x - 0.0 is x), and the program writes the codes and
each chunk's scale into the payloads and the residual's int8 codes and
block scales (``_int8_triton.int8_codes_of_tile``).

**An owner's u.** One launch checks every sender's scale and positions a
stretch at a time; one forms u from the senders' payloads in order (+0.0
first), divides, adds the memory (two roundings) and forms the status as
sign's kernel does, and, where the owner encodes u with blocksign of the
same width, takes u's codes.

The same bits as torch's path: the scale the correctly rounded quotient of
the chunk's kept magnitudes (torch's sum, taken before the launch) and its
block count, clamped to the largest float; one subtraction; the int8 codes'
roundings. Kernels are compiled without fused multiply-adds. A block of v
holding a NaN keeps its first NaN, where inductor's kernel keeps the block's
last position: the status word fails that step on every rank whatever the
code; a refused sender's u is not torch's either. Where these kernels are
not taken (no Triton, a CPU's tensors, ``DSQ_OWN_KERNELS=torch``, a
first-call check that disagrees), the functions return None and the caller
runs torch's kernels."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..comm import header
from ..compressors import blocksign_codec
from ..compressors.blocksign_codec import codes_of
from ..compressors.kernels import device_constant
from ..compressors.own_kernels import (TORCH_REFERENCES, checked_per_device, lanes, ready, refused_scale,
                                       refused_senders, tl, triton, word_at)
from ..compressors.sign_codec import sent_scale
from ..state.compact import BLOCK, LEVELS, int8_codes
from ..state._int8_triton import added_tile, int8_codes_of_tile

__all__ = ["blocksign_and_residual_rows", "blocksign_and_residual_runs", "blocksign_with_residual",
           "compensated_codes", "compensated_rows", "mean_of_blocksign", "mean_of_blocksign_rows", "Run"]

_BLOCKS = 8  # int8 blocks per program: 2,048 values
_LONGEST = 1 << 31  # offsets into the vector are int32 in the kernels
WARPS = 8  # the payloads with their residual: a program's 2,048 values over 256 threads (its integer arithmetic)
_TILE = 4096  # u's values per program of the mean (its blocks times their width rounded up to a power of two)
_ENTRIES = 1024  # a sender's codes per program of the checks
_MOST_SENDERS = 1024
_MOST_CHECKS = 8192  # senders x checks' stretches per sender: every program of the mean reads all their flags

if triton is not None:
    @triton.jit
    def _compensated(x_ptr, memory_ptr, scales_ptr, out_ptr, status_ptr, codes_ptr, kept_ptr, numel,
                     NONFINITE: tl.constexpr, BLOCKS: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """Int8 blocks [BLOCKS · program_id(0), +BLOCKS) of g plus the memory, and the codes and kept magnitudes
        of the blocksign blocks of ``WIDTH`` values among them."""
        PER: tl.constexpr = BLOCK // WIDTH
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        column = tl.arange(0, WIDTH)
        at = block[:, None, None] * BLOCK + (tl.arange(0, PER)[None, :, None] * WIDTH + column[None, None, :])
        scale = tl.load(scales_ptr + block, mask=block * BLOCK < numel, other=0.0)[:, None, None]
        v = added_tile(x_ptr, memory_ptr, out_ptr, status_ptr, at, at < numel, scale, NONFINITE)
        codes, kept = codes_of(tl.reshape(v, (BLOCKS * PER, WIDTH)), column[None, :], WIDTH, WIDTH)
        coded = tl.program_id(0) * (BLOCKS * PER) + tl.arange(0, BLOCKS * PER)
        tl.store(codes_ptr + coded, codes, mask=coded * WIDTH < numel)
        tl.store(kept_ptr + coded, kept, mask=coded * WIDTH < numel)

    @triton.jit
    def _run_of(at, longer, extra):
        """(each value's row, its place in the row, whether the row is a long one) for rows cut as
        ``layout.chunk_bounds`` cuts them: ``extra`` rows of ``longer`` values, then rows one value shorter."""
        split = extra * longer
        is_long = at < split
        short = tl.maximum(longer - 1, 1)  # (a run of one row length alone divides by nothing here)
        later = tl.maximum(at - split, 0) // short
        row = tl.where(is_long, at // longer, extra + later)
        column = tl.where(is_long, at - row * longer, at - split - later * short)
        return row, column, is_long

    @triton.jit
    def _blocksign_and_residual(v_ptr, long_codes_ptr, short_codes_ptr, long_magnitudes_ptr, short_magnitudes_ptr,
                                long_divisor_ptr, short_divisor_ptr, levels_ptr, long_payloads_ptr,
                                short_payloads_ptr, residual_ptr, scales_ptr, numel, longer, extra, long_blocks,
                                short_blocks, long_stride, short_stride, blocks, BLOCKS: tl.constexpr,
                                BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """Int8 blocks [BLOCKS · program_id(0), +BLOCKS) of the rows (``_run_of``'s two runs, each row in blocksign
        blocks of ``WIDTH``, its last maybe shorter; each run's codes, magnitudes, divisor and payloads apart):
        their residual's codes and scales, and the payload bytes of the blocksign blocks that start among them
        (a row's scale where the row starts)."""
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        at = block[:, None, None] * BLOCK + (tl.arange(0, BLOCK // 8)[None, :, None] * 8
                                             + tl.arange(0, 8)[None, None, :])
        inside = at < numel
        x = tl.load(v_ptr + at, mask=inside, other=0.0)
        row, column, is_long = _run_of(at, longer, extra)
        later = row - extra  # a short row's index in its run
        coded = column // WIDTH
        place = column - coded * WIDTH  # within its blocksign block
        code = tl.where(is_long, tl.load(long_codes_ptr + row * long_blocks + coded, mask=inside & is_long, other=0),
                        tl.load(short_codes_ptr + later * short_blocks + coded, mask=inside & ~is_long, other=0))
        code = code.to(tl.int32)
        magnitude = tl.where(is_long, tl.load(long_magnitudes_ptr + row, mask=inside & is_long, other=0.0),
                             tl.load(short_magnitudes_ptr + later, mask=inside & ~is_long, other=0.0))
        scale = sent_scale(magnitude, tl.where(is_long, tl.load(long_divisor_ptr), tl.load(short_divisor_ptr)))
        signed = tl.where((code & 1) != 0, scale, -scale)
        residual = tl.where(place == (code >> 1), x - signed, x)  # elsewhere nothing: x - 0.0 is x
        residual = tl.where(inside, residual, 0.0)  # zeros pad the last int8 block
        # (the payloads are fewer bytes than the rows' values: int32 offsets)
        payload = tl.where(is_long, long_payloads_ptr + row * long_stride, short_payloads_ptr + later * short_stride)
        tl.store(payload + 4 + coded, code.to(tl.uint8), mask=inside & (place == 0))
        word = scale.to(tl.int32, bitcast=True)
        for q in tl.static_range(4):
            tl.store(payload + q, ((word >> (8 * q)) & 255).to(tl.uint8), mask=inside & (column == 0))
        int8_codes_of_tile(residual, block, at, levels_ptr, residual_ptr, scales_ptr, blocks)

    @triton.jit
    def _check_blocksign(payloads_ptr, partial_ptr, payload_stride, numel, blocks, senders, stretches,
                         WIDTH: tl.constexpr, ENTRIES: tl.constexpr):
        """Stretch ``program_id(0)`` of sender ``program_id(1)``'s codes: whether its scale is refused, whether a
        position lies outside its block, as int8 flags at partial[check, sender, stretch]."""
        stretch, sender = tl.program_id(0), tl.program_id(1)
        row = payloads_ptr + sender.to(tl.int64) * payload_stride
        block = stretch * ENTRIES + tl.arange(0, ENTRIES)
        where = tl.load(row + 4 + block, mask=block < blocks, other=0).to(tl.int32) >> 1
        outside = tl.max(((block < blocks) & ((where >= WIDTH) | (block * WIDTH + where >= numel))).to(tl.int32), 0)
        slot = partial_ptr + sender * stretches + stretch
        tl.store(slot, refused_scale(word_at(row, True, 0).to(tl.float32, bitcast=True)).to(tl.int8))
        tl.store(slot + senders * stretches, outside.to(tl.int8))

    @triton.jit
    def _sent_values(payload, block, column, inside):
        """A sender's values on the tile (blocks, columns): ±its scale at each block's kept position, +0.0 (or the
        scale's zero) elsewhere."""
        scale = word_at(payload, True, 0).to(tl.float32, bitcast=True)
        code = tl.load(payload + 4 + block, mask=inside, other=0).to(tl.int32)
        signed = tl.where((code & 1) != 0, 1.0, -1.0) * scale
        return tl.where(column == (code >> 1)[:, None], signed[:, None], 0.0)

    @triton.jit
    def _mean_of_blocksign(payloads_ptr, partial_ptr, count_ptr, codes_ptr, scales_ptr, u_ptr, flags_ptr, bad_ptr,
                           status_ptr, coded_ptr, kept_ptr, senders, stretches, payload_stride, numel, blocks,
                           written, MEMORY: tl.constexpr, CODED: tl.constexpr, SENDERS: tl.constexpr,
                           STRETCHES: tl.constexpr, WIDTH: tl.constexpr, PADDED: tl.constexpr,
                           TILE: tl.constexpr, BLOCK: tl.constexpr, BAD_PAYLOAD: tl.constexpr,
                           OVERFLOW: tl.constexpr):
        """u's blocks [TILE · program_id(0), +TILE) of ``written`` elements (numel, or whole int8 blocks past it
        where the memory's rows are new), with ``CODED`` their codes; the first program writes the rows' flags and
        a refused row's status."""
        first_refused = refused_senders(partial_ptr, flags_ptr, bad_ptr, status_ptr, senders, stretches,
                                        tl.program_id(0) == 0, 2, SENDERS, STRETCHES, BAD_PAYLOAD)
        block = tl.program_id(0) * TILE + tl.arange(0, TILE)
        column = tl.arange(0, PADDED)[None, :]
        element = block[:, None] * WIDTH + column
        ours = (column < WIDTH) & (element < written)
        first = _sent_values(payloads_ptr, block, column, block < blocks)
        total = tl.where(first == 0, 0.0, first)  # +0.0 + v: -0.0 becomes +0.0
        stride = tl.full((), 0, tl.int64) + payload_stride  # a sender's offset may pass 2^31
        for row in range(1, senders):
            total += _sent_values(payloads_ptr + row * stride, block, column, block < blocks)
        u = tl.math.div_rn(total, tl.load(count_ptr))
        if MEMORY:
            codes = tl.load(codes_ptr + element, mask=ours, other=0).to(tl.float32)
            u = tl.where(element < numel, u, 0.0) + codes * tl.load(scales_ptr + element // BLOCK, mask=ours,
                                                                   other=0.0)
            not_finite = tl.max(tl.ravel((ours & ~(tl.abs(u) <= 3.4028234663852886e38)).to(tl.int32)), 0)
            tl.atomic_min(status_ptr, tl.full((), OVERFLOW, tl.int64),
                          mask=(not_finite > 0) & (first_refused == SENDERS))
        tl.store(u_ptr + element, u, mask=ours)
        if CODED:  # u's own blocks' codes, for the owner's encode of u
            coded, kept = codes_of(tl.where(element < numel, u, 0.0), column, WIDTH, PADDED)
            tl.store(coded_ptr + block, coded, mask=block < blocks)
            tl.store(kept_ptr + block, kept, mask=block < blocks)


def _width_fits(width: int) -> bool:
    """Whether blocksign blocks of ``width`` tile the int8 blocks (a power of two that divides them)."""
    return 2 <= width <= BLOCK and BLOCK % width == 0 and width & (width - 1) == 0


def compensated_rows(g: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, width: int,
                     out: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(v = ``g`` plus the int8 memory (``codes``, at least g's elements, and a scale per ``BLOCK`` of them),
    written into ``out`` (which may be ``g``) or a new vector; its status word, 0-d int64: ``header.NONFINITE``
    where v holds a NaN or an Inf, else 0; blocksign's (codes, kept magnitudes) of v's blocks of ``width``, flat).
    ``g``: flat, contiguous float32 of whole blocks of ``width``, a power of two. Needs Triton."""
    n = g.numel()
    if g.dtype != torch.float32 or g.dim() != 1 or not g.is_contiguous() or codes.numel() < n \
            or scales.numel() * BLOCK < n or not 0 < n < _LONGEST or not _width_fits(width) or n % width:
        raise ValueError(f"compensated_rows: wants a flat contiguous float32 vector of whole blocks of {width} (a "
                         f"power of two up to {BLOCK}) and a memory of its size, got {g.dtype} {tuple(g.shape)}, "
                         f"{codes.numel()} codes, {scales.numel()} scales")
    out = torch.empty_like(g) if out is None else out
    status = torch.zeros((), dtype=torch.int64, device=g.device)
    block_codes = torch.empty(n // width, dtype=torch.uint8, device=g.device)
    kept = torch.empty(n // width, dtype=torch.float32, device=g.device)
    _compensated[(triton.cdiv(n, _BLOCKS * BLOCK),)](g, codes, scales, out, status, block_codes, kept, n,
                                                     NONFINITE=header.NONFINITE, BLOCKS=_BLOCKS, BLOCK=BLOCK,
                                                     WIDTH=width, enable_fp_fusion=False)
    return out, status, (block_codes, kept)


def compensated_codes(g: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, width: int,
                      out: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
    """``compensated_rows`` where these kernels run (``DSQ_OWN_KERNELS``, a GPU's tensors, the first call's check,
    a width that tiles the int8 blocks) and ``out``, where given, is a contiguous vector of ``g``'s size; None
    where the caller runs torch's kernel."""
    fits = out is None or (out.is_contiguous() and out.shape == g.shape and out.dtype == torch.float32)
    if not fits or g.dtype != torch.float32 or g.dim() != 1 or not g.is_contiguous() or not codes.is_contiguous() \
            or not scales.is_contiguous() or not 0 < g.numel() < _LONGEST or not _width_fits(width) \
            or g.numel() % width or not _taken(g):
        return None
    return compensated_rows(g, codes, scales, width, out)


class Run(NamedTuple):
    """A run of equal chunks as rows, for ``blocksign_and_residual_runs``: the rows, their codes, each row's sum of
    kept magnitudes, the blocks per row (0-d float32)."""

    rows: torch.Tensor
    codes: torch.Tensor
    magnitudes: torch.Tensor
    divisor: torch.Tensor


def blocksign_and_residual_runs(v: torch.Tensor, runs: list[Run], levels: torch.Tensor, width: int
                                ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(each run's payloads, (count, 4 + blocks); the int8 codes of v less ±its chunks' scales at each block's
    kept position, padded with zeros to whole int8 blocks; each int8 block's scale): ``v`` contiguous float32,
    cut into one run of equal chunks or two (the first one value longer, as ``layout.chunk_bounds`` cuts it),
    ``runs`` their ``Run``s in order (rows: views of ``v``; codes: contiguous (count, blocks) uint8), in blocks of
    ``width`` (a chunk's last may be shorter). As ``_payloads_and_residual``'s ``_blocksign_and_residual`` gives
    them for chunks of whole blocks. Needs Triton."""
    n = v.numel()
    counts = [run.rows.shape[0] for run in runs]
    shapes_fit = all(run.rows.dim() == 2 and run.codes.is_contiguous() and run.magnitudes.shape == (run.rows.shape[0],)
                     and tuple(run.codes.shape) == (run.rows.shape[0], -(-run.rows.shape[1] // width)) for run in runs)
    if v.dtype != torch.float32 or not v.is_contiguous() or not 2 <= width <= 128 or not 0 < n < _LONGEST \
            or len(runs) not in (1, 2) or not shapes_fit or sum(run.rows.numel() for run in runs) != n \
            or (len(runs) == 2 and runs[0].rows.shape[1] != runs[1].rows.shape[1] + 1):
        raise ValueError(f"blocksign_and_residual_runs: wants a contiguous float32 vector cut into one or two runs of "
                         f"chunks, the longer first, in blocks of 2 to 128, with each run's contiguous codes and a "
                         f"magnitude per chunk, got {v.dtype} of {n} elements, width {width}, runs of "
                         f"{[tuple(run.rows.shape) for run in runs]}, codes {[tuple(r.codes.shape) for r in runs]}")
    long, short = runs[0], runs[-1]
    payloads = [torch.empty(run.rows.shape[0], 4 + run.codes.shape[1], dtype=torch.uint8, device=v.device)
                for run in runs]
    int8_blocks = -(-n // BLOCK)
    residual = torch.empty(int8_blocks * BLOCK, dtype=torch.int8, device=v.device)
    scales = torch.empty(int8_blocks, dtype=torch.float32, device=v.device)
    _blocksign_and_residual[(triton.cdiv(int8_blocks, _BLOCKS),)](
        v, long.codes, short.codes, long.magnitudes.float().contiguous(), short.magnitudes.float().contiguous(),
        long.divisor.float().reshape(1), short.divisor.float().reshape(1), levels.float().reshape(1), payloads[0],
        payloads[-1], residual, scales, n, long.rows.shape[1], counts[0], long.codes.shape[1], short.codes.shape[1],
        payloads[0].stride(0), payloads[-1].stride(0), int8_blocks, BLOCKS=_BLOCKS, BLOCK=BLOCK, WIDTH=width,
        enable_fp_fusion=False, num_warps=WARPS)
    return payloads, residual, scales


def blocksign_and_residual_rows(rows: torch.Tensor, codes: torch.Tensor, magnitudes: torch.Tensor,
                                divisor: torch.Tensor, levels: torch.Tensor, width: int
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``blocksign_and_residual_runs`` of one run, the contiguous float32 (count, size) ``rows``: (the payloads,
    the residual's codes, their scales)."""
    if rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"blocksign_and_residual_rows: wants contiguous rows, got {tuple(rows.shape)}, strides "
                         f"{rows.stride()}")
    (payloads,), residual, scales = blocksign_and_residual_runs(rows.view(-1), [Run(rows, codes, magnitudes,
                                                                                      divisor)], levels, width)
    return payloads, residual, scales


def blocksign_with_residual(v: torch.Tensor, runs: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]],
                            width: int, levels: torch.Tensor
                            ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor] | None:
    """Blocksign's payloads of ``v``'s chunks and their int8 residual where these kernels run: ``runs``, one or
    two (the first one value longer), as (rows, their (codes, kept magnitudes) where v's own pass took them, or
    None: the codec's launch); torch's sum of the kept magnitudes; then ``blocksign_and_residual_runs``. None
    where the caller runs torch's kernels."""
    if v.dtype != torch.float32 or not v.is_contiguous() or not 2 <= width <= 128 or not 0 < v.numel() < _LONGEST \
            or len(runs) not in (1, 2) or not _taken(v):
        return None
    made = []
    for rows, coded in runs:
        codes, kept = blocksign_codec.block_codes_rows(rows, width) if coded is None else coded
        made.append(Run(rows, codes.contiguous(), kept.sum(dim=1), device_constant(float(codes.shape[1]), v.device)))
    return blocksign_and_residual_runs(v, made, levels, width)


def mean_of_blocksign_rows(payloads: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                           scales: torch.Tensor | None, into: torch.Tensor | None, numel: int, width: int,
                           coded: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      tuple[torch.Tensor, torch.Tensor] | None]:
    """(u, the rows' flags (2, senders): a refused scale, a position outside its block; each row's flag; the
    owner's status; with ``coded``, blocksign's (codes, kept magnitudes) of u's blocks of ``width`` as one row,
    else None), as ``_mean_of_payloads``' ``_mean_of_blocksign`` gives them: ``payloads`` (senders, 4 + blocks)
    of a chunk of ``numel`` elements in blocks of ``width``, ``count`` the 0-d divisor, ``codes``/``scales`` the
    server memory's rows (blocks, BLOCK) or None, ``into`` the memory-shaped rows to write u into, or None (u is
    then new: the chunk's elements, or whole blocks where there is a memory). u is flat, or ``into``. Needs
    Triton."""
    senders, length = payloads.shape
    blocks = -(-numel // width)
    stretches = triton.cdiv(blocks, _ENTRIES)
    if payloads.dtype != torch.uint8 or payloads.stride(1) != 1 or length != 4 + blocks or not 0 < numel < _LONGEST \
            or not 0 < senders <= _MOST_SENDERS or (codes is None) != (scales is None) or not 2 <= width <= 128 \
            or lanes(senders) * lanes(stretches) > _MOST_CHECKS or (coded and numel % width):
        raise ValueError(f"mean_of_blocksign_rows: wants uint8 payload rows of unit stride, of {4 + blocks} bytes "
                         f"for {numel} values in blocks of {width}, from 1 to {_MOST_SENDERS} senders, got "
                         f"{payloads.dtype} {tuple(payloads.shape)}, strides {payloads.stride()}")
    memory, device = codes is not None, payloads.device
    written = codes.numel() if memory else numel
    u = into if into is not None else torch.empty(written, dtype=torch.float32, device=device)
    partial = torch.empty(2, senders, stretches, dtype=torch.int8, device=device)
    flags = torch.empty(2, senders, dtype=torch.bool, device=device)
    bad = torch.empty(senders, dtype=torch.bool, device=device)
    status = torch.zeros((), dtype=torch.int64, device=device)
    u_codes = torch.empty(1, blocks if coded else 0, dtype=torch.uint8, device=device)
    u_kept = torch.empty(1, blocks if coded else 0, dtype=torch.float32, device=device)
    _check_blocksign[(stretches, senders)](payloads, partial, payloads.stride(0), numel, blocks, senders, stretches,
                                           WIDTH=width, ENTRIES=_ENTRIES)
    padded = triton.next_power_of_2(width)
    tile = max(1, _TILE // padded)
    _mean_of_blocksign[(triton.cdiv(-(-written // width), tile),)](
        payloads, partial, count.float().reshape(1), codes if memory else u, scales if memory else u, u, flags, bad,
        status, u_codes, u_kept, senders, stretches, payloads.stride(0), numel, blocks, written, MEMORY=memory,
        CODED=coded, SENDERS=lanes(senders), STRETCHES=lanes(stretches), WIDTH=width, PADDED=padded, TILE=tile,
        BLOCK=BLOCK, BAD_PAYLOAD=header.BAD_PAYLOAD, OVERFLOW=header.OVERFLOW, enable_fp_fusion=False)
    return u, flags, bad, status, ((u_codes, u_kept) if coded else None)


def mean_of_blocksign(payloads: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                      scales: torch.Tensor | None, into: torch.Tensor | None, numel: int, width: int,
                      coded: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 tuple[torch.Tensor, torch.Tensor] | None] | None:
    """``mean_of_blocksign_rows`` where it runs: our kernels chosen on this GPU, rows and a memory it reads, and
    the first call's check passed; None where the caller runs torch's kernel."""
    contiguous = codes is None or (codes.is_contiguous() and scales.is_contiguous()
                                   and (into is None or into.is_contiguous()))
    senders, length = payloads.shape if payloads.dim() == 2 else (0, 0)
    blocks = -(-numel // width)
    if not (contiguous and 0 < senders <= _MOST_SENDERS and payloads.stride(-1) == 1 and length == 4 + blocks
            and 0 < numel < _LONGEST and payloads.dtype == torch.uint8 and not (coded and numel % width)
            and lanes(senders) * lanes(-(-blocks // _ENTRIES)) <= _MOST_CHECKS and _taken(payloads)):
        return None
    return mean_of_blocksign_rows(payloads, count, codes, scales, into, numel, width, coded)


def _taken(tensor: torch.Tensor) -> bool:
    """Whether these kernels run for ``tensor``: ours chosen on a GPU (``own_kernels.ready``) and the first
    call's check passed on it."""
    return ready(tensor, _works_on)


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed vectors (signed zeros, ties, infinities, a block all zero, a magnitude that overflows, a vector
    that ends inside an int8 block), every kernel gives what torch's eager ops give: v, its status and its codes
    (the kept magnitudes); the payloads, the residual's codes and scales; an owner's u from three
    senders with a memory written in place, one made new past the chunk's end, and none, with u's codes, and a
    refused row's flags and status, and an overflow's."""
    if not {"blocksign_and_residual", "int8_added_with_status", "mean_of_blocksign"} <= set(TORCH_REFERENCES):
        return False
    from ..compressors.blocksign import block_codes, position_ranks
    merged, added = TORCH_REFERENCES["blocksign_and_residual"], TORCH_REFERENCES["int8_added_with_status"]
    gen = torch.Generator(device=device).manual_seed(0)
    levels = torch.full((), LEVELS, device=device)
    for width, count, size in ((32, 3, 3 * BLOCK), (8, 2, 200), (128, 1, 2 * BLOCK)):
        n = count * size
        g = torch.randn(n, generator=gen, device=device)
        g[:8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0, float("inf"), 3e38, -3e38], device=device)
        g[width: 2 * width] = 0.0
        memory = torch.randint(-127, 128, (-(-n // BLOCK) * BLOCK,), generator=gen, device=device).to(torch.int8)
        scales = torch.rand(-(-n // BLOCK), generator=gen, device=device) / 127
        v, status, (codes, kept) = compensated_rows(g, memory, scales, width)
        want_v, want_status = added(g.clone(), memory, scales)
        want_codes, want_kept = block_codes(want_v.view(-1, width), position_ranks(width, device))
        if not (torch.equal(v, want_v) and torch.equal(status, want_status) and torch.equal(codes, want_codes)
                and torch.equal(kept, want_kept)):
            return False
        rows = torch.where(v.isfinite(), v, 1.0).view(count, -1, width)  # the merged kernel's v is finite
        codes, kept = block_codes(rows, position_ranks(width, device))
        args = (rows, codes, kept.sum(dim=1), torch.full((), float(size // width), device=device))
        if count == 1:
            args = (*args[:2], torch.full((1,), float("inf"), device=device), args[3])  # the scale clamped
        made = blocksign_and_residual_rows(rows.view(count, -1), *args[1:], levels, width)
        if not all(torch.equal(a, b) for a, b in zip(made, merged(*args, levels))) \
                or not _runs_agree(rows.view(-1)[:n - 5], width, levels):
            return False
        if not _mean_agrees(made[0][torch.arange(3, device=device) % count], size, width, gen):  # three senders
            return False
    return True


def _runs_agree(v: torch.Tensor, width: int, levels: torch.Tensor) -> bool:
    """``_agrees_with_torch``'s vector as one chunk and cut into three as ``layout.chunk_bounds`` cuts it (two runs
    where three do not divide it), chunks whose last block is short: the payloads and the residual's int8 codes
    are torch's encode's, and its int8 codes of v less its decode."""
    encode, decode = TORCH_REFERENCES["blocksign_payloads"], TORCH_REFERENCES["blocksign_decoded"]
    n = v.numel()
    for chunks in (1, 3):
        size, extra = divmod(n, chunks)
        cut = [(extra, size + 1), (chunks - extra, size)] if extra else [(chunks, size)]
        rows = list(v.split([count * length for count, length in cut]))
        rows = [piece.view(count, length) for piece, (count, length) in zip(rows, cut)]
        payloads = [encode(r, width) for r in rows]
        dense = torch.cat([decode(p, r.shape[1], width)[0].reshape(-1) for p, r in zip(payloads, rows)])
        runs = []
        for r in rows:
            codes, kept = blocksign_codec.block_codes_rows(r, width)
            runs.append(Run(r, codes, kept.sum(dim=1), torch.full((), float(codes.shape[1]), device=v.device)))
        got, *residual = blocksign_and_residual_runs(v, runs, levels, width)
        if not (all(torch.equal(a, b) for a, b in zip(got, payloads, strict=True))
                and all(torch.equal(a, b) for a, b in zip(residual, int8_codes(v - dense, levels), strict=True))):
            return False
    return True


def _mean_agrees(payloads: torch.Tensor, size: int, width: int, gen: torch.Generator) -> bool:
    """``_agrees_with_torch``'s owner: u from these senders' payloads, with each kind of memory (u's codes with it
    where the chunk is whole blocks), then one sender's scale refused, one's position outside its block, and every
    scale the largest float (u overflows), against ``_mean_of_payloads``' eager kernel."""
    from ..compressors.blocksign import block_codes, position_ranks
    from ..compressors.blocksign import _block_lengths, _block_starts, _units
    reference, device = TORCH_REFERENCES["mean_of_blocksign"], payloads.device
    blocks, senders = payloads.shape[1] - 4, payloads.shape[0]
    decoder = (_block_starts(blocks, width, device), _block_lengths(blocks, width, size, device), _units(device), size)
    count = torch.full((), float(senders), device=device)
    rows = -(-size // BLOCK)
    codes = torch.randint(-127, 128, (rows, BLOCK), generator=gen, device=device).to(torch.int8)
    scales = torch.rand(rows, generator=gen, device=device) / 127
    refused, outside, largest = payloads.clone(), payloads.clone(), payloads.clone()
    refused[1, :4] = torch.tensor([0, 0, 128, 191], dtype=torch.uint8, device=device)  # -1.0
    outside[2, 4] = min(255, 2 * width + 1)  # outside its block where the width is below 128
    largest[:, :4] = torch.tensor([3e38], device=device).view(torch.uint8)
    cases = [(payloads, None, None, None), (payloads, codes, scales, None), (refused, codes, scales, None),
             (outside, None, None, None), (largest, codes, scales, None)]
    if size % BLOCK == 0:
        cases.append((payloads, codes, scales, torch.empty(rows, BLOCK, device=device)))
    for sent, memory, memory_scales, into in cases:
        coded = size % width == 0
        got = mean_of_blocksign_rows(sent, count, memory, memory_scales, into, size, width, coded)
        theirs = None if into is None else torch.empty_like(into)
        want = reference(sent, count, memory, memory_scales, theirs, size, *decoder)
        if not all(torch.equal(a, b) for a, b in zip(got[1:4], want[1:], strict=True)):
            return False
        if sent is not outside and not torch.equal(got[0].reshape(-1)[:size], want[0].reshape(-1)[:size]):
            return False
        if coded and sent is not outside:
            want_codes, want_kept = block_codes(want[0].reshape(-1)[:size].view(1, -1, width),
                                                position_ranks(width, device))
            if not (torch.equal(got[4][0], want_codes) and torch.equal(got[4][1], want_kept)):
                return False
    return True


_works_on = checked_per_device("blocksign's Triton bucket kernels", _agrees_with_torch)
