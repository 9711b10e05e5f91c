"""Top-k's payloads of a bucket's chunks and the int8 residual the error
memory keeps, on a GPU, written by the radix select's last launch.

Torch's path selected the positions (``radix_select``'s seven launches),
then ran inductor's kernel of ``_payloads_and_residual._topk_and_residual``:
a gather of the kept values into the payloads, a copy of the rows with the
kept elements zeroed, and that copy's int8 codes. Here the select's last
pass, which has each element's value and whether and where it is kept in
hand, writes the payload's values and positions at their places and, for
its tile of the vector (16 whole int8 blocks), the codes and block scales
of the rows with their kept elements set to +0.0, in the one launch: no
positions are written, and the rows are read once more, not three times.

The same bits as torch's path: the positions of ``radix_select`` (the first
of equals at the k-th place), the values' bits as they are, a kept
element's residual +0.0 (x - x for a finite x) and every other one's its
own bits, the int8 codes of ``state.compact.int8_codes``
(``int8_codes_of_tile``). A tile is whole int8 blocks of the flattened
rows when one row is cut (an owner's chunk, its last block padded with
zeros) or each row is whole blocks.

**Rows of any length, in runs** (``topk_with_residual_runs``: a worker's
bucket cut for several ranks, whose chunks rarely end on an int8 block and
come in two runs one element apart), where the vector is the caller's
scratch: each run's select ends in a pass that writes its payloads and
sets its kept elements to x - x in the vector itself, so that it becomes
v - Q(v), then one launch encodes the whole vector as int8 (its blocks may
straddle rows, which a select's tile cannot hold). Other cuts, like every
other device, take torch's path (the functions return None).

**An owner's u from its senders' top-k payloads** (``mean_of_topk``), where
inductor's kernel of ``_mean_of_payloads``' ``_mean_of_topk`` copied each
row's values and positions out of the bytes, checked them, scattered them
into dense rows of zeros and took their mean. Here one launch checks the
rows (per sender and stretch of entries: a position outside the chunk,
positions that do not increase, a value that is not finite), and one forms
u: a program owns a tile of u, sets it to +0.0, and for each sender in
order finds the sender's entries inside the tile (positions increase: a
count over a sample of them, then over the stretch between two samples)
and adds them in place; the senders' additions are ordered by a barrier.
Skipping the zeros a dense row holds elsewhere is exact: a sum that starts
at +0.0 is never -0.0, so adding +0.0 to it changes nothing. Then u is
divided by the count and the memory's code times its scale added (two
roundings), and the status formed as the sign kernel's: the first refused
row's, else, with a memory, ``header.OVERFLOW`` where u is not finite. For
a refused row u's values are not torch's (a row of positions that do not
increase is searched as if they did, and stays inside the tile): its step
fails on every rank, whatever they are."""
from __future__ import annotations

from typing import Sequence

import torch

from ..comm import header
from ..compressors import radix_select
from ..compressors.topk_codec import ENTRIES, checked_partials, entries_below, entry_word
from ..compressors.own_kernels import (MOST_ROWS, TORCH_REFERENCES, checked_per_device, device_index, lanes,
                                       on_a_gpu, refused_senders, tl, triton)
from ..state.compact import BLOCK, LEVELS
from ..state._int8_triton import int8_codes_of_tile, int8_codes_rows

__all__ = ["mean_of_topk", "mean_of_topk_rows", "payloads_and_residual_runs", "tiled_by_the_select",
           "topk_with_residual", "topk_with_residual_runs"]

_TILE = 2048  # u's elements per program of the mean
_ENTRIES = ENTRIES  # a payload's entries read at a time: the samples of a search, a stretch, a check's share
_MOST_SENDERS = 1024
_MOST_CHECKS = 8192  # senders x checks' stretches per sender: every program of the mean reads all their flags
WARPS = 16  # a program's 4,096 values over 512 threads: under 100 registers a thread, where 4 warps take over 200

if triton is not None:
    kept_in_block, store_payload = radix_select.kept_in_block, radix_select.store_payload

    @triton.jit
    def _payloads_and_residual(rows_ptr, hist_ptr, kept_ptr, words_ptr, levels_ptr, codes_ptr, scales_ptr,
                               stride, n, rows, k, blocks, row_blocks, int8_blocks,
                               BLOCK: tl.constexpr, SCAN: tl.constexpr, INT8: tl.constexpr):
        """Block ``program_id(0)`` of row ``program_id(1)``: its kept values' bits and positions at their places
        in the row's payload, seen as (rows, 2k) words; the int8 codes and scales of its ``BLOCK // INT8``
        memory blocks (those of the row: ``row_blocks`` per row) with the kept elements +0.0."""
        row, block = tl.program_id(1), tl.program_id(0)
        offsets, values, kept, place = kept_in_block(rows_ptr, hist_ptr, kept_ptr, stride, n, rows, k, blocks,
                                                     row, block, BLOCK, SCAN)
        store_payload(words_ptr, row, k, offsets, values, kept, place)
        residual = tl.where(kept > 0, 0.0, values)  # values past the row's end are 0.0: a last block's padding
        start = row.to(tl.int64) * n  # a multiple of INT8: one row, or rows of whole blocks
        local = block * (BLOCK // INT8) + tl.arange(0, BLOCK // INT8)
        memory_block = tl.where(local < row_blocks, start // INT8 + local, int8_blocks)  # past the row: not written
        int8_codes_of_tile(tl.reshape(residual, [BLOCK // INT8, INT8 // 8, 8]), memory_block,
                           tl.reshape(start + offsets, [BLOCK // INT8, INT8 // 8, 8]), levels_ptr, codes_ptr,
                           scales_ptr, int8_blocks)

    @triton.jit
    def _payloads_and_kept_emptied(rows_ptr, hist_ptr, kept_ptr, words_ptr, stride, n, rows, k, blocks,
                                   BLOCK: tl.constexpr, SCAN: tl.constexpr):
        """Block ``program_id(0)`` of row ``program_id(1)``: its kept values' bits and positions at their places
        in the row's payload, as the select's own last pass writes them, and each kept element of the rows set to
        itself less itself (+0.0 for a finite x, as torch's subtraction of the decode): the rows become v - Q(v).
        A program reads only its own block's values, so its writes race no other program's reads."""
        row, block = tl.program_id(1), tl.program_id(0)
        offsets, values, kept, place = kept_in_block(rows_ptr, hist_ptr, kept_ptr, stride, n, rows, k, blocks,
                                                     row, block, BLOCK, SCAN)
        store_payload(words_ptr, row, k, offsets, values, kept, place)
        tl.store(rows_ptr + row.to(tl.int64) * stride + offsets, values - values, mask=kept > 0)

    @triton.jit
    def _mean_of_topk(payloads_ptr, partial_ptr, count_ptr, codes_ptr, scales_ptr, u_ptr, flags_ptr, bad_ptr,
                      status_ptr, senders, stretches, payload_stride, k, numel, written, MEMORY: tl.constexpr,
                      SENDERS: tl.constexpr, STRETCHES: tl.constexpr, TILE: tl.constexpr,
                      ENTRIES: tl.constexpr, BLOCK: tl.constexpr, BAD_PAYLOAD: tl.constexpr,
                      OVERFLOW: tl.constexpr):
        """u's elements [TILE · program_id(0), +TILE) of ``written`` (numel, or whole blocks past it where the
        memory's rows are new); the first program writes the rows' flags and a refused row's status."""
        first_refused = refused_senders(partial_ptr, flags_ptr, bad_ptr, status_ptr, senders, stretches,
                                        tl.program_id(0) == 0, 3, SENDERS, STRETCHES, BAD_PAYLOAD)
        start = tl.program_id(0) * TILE
        element = start + tl.arange(0, TILE)
        kept = element < written
        tl.store(u_ptr + element, tl.zeros([TILE], dtype=tl.float32), mask=kept)  # +0.0, the sum's start
        end = tl.minimum(start + TILE, numel)
        stride = tl.full((), 0, tl.int64) + payload_stride  # a sender's offset may pass 2^31
        for row in range(0, senders):
            payload = payloads_ptr + row * stride
            tl.debug_barrier()  # the previous sender's additions are in place
            for first in range(entries_below(payload, k, start, ENTRIES), entries_below(payload, k, end, ENTRIES),
                               ENTRIES):
                entry = first + tl.arange(0, ENTRIES)
                inside = entry < k
                position = entry_word(payload + 4 * k + 4 * entry, inside)
                inside = inside & (position >= start) & (position < end)  # a refused row's stays in the tile
                value = entry_word(payload + 4 * entry, inside).to(tl.float32, bitcast=True)
                at = u_ptr + position
                tl.store(at, tl.load(at, mask=inside, other=0.0) + value, mask=inside)
        tl.debug_barrier()
        u = tl.math.div_rn(tl.load(u_ptr + element, mask=kept, other=0.0), tl.load(count_ptr))
        if MEMORY:
            codes = tl.load(codes_ptr + element, mask=kept, other=0).to(tl.float32)
            u = tl.where(element < numel, u, 0.0) + codes * tl.load(scales_ptr + element // BLOCK, mask=kept,
                                                                   other=0.0)
            not_finite = tl.max((kept & ~(tl.abs(u) <= 3.4028234663852886e38)).to(tl.int32), 0)  # NaN fails
            tl.atomic_min(status_ptr, tl.full((), OVERFLOW, tl.int64),
                          mask=(not_finite > 0) & (first_refused == SENDERS))
        tl.debug_barrier()  # every thread has read its sums before any writes u over them
        tl.store(u_ptr + element, u, mask=kept)


def payloads_and_residual_rows(rows: torch.Tensor, k: int, levels: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's top-k payload, (count, 8k) uint8; the int8 codes of the flattened rows with their kept
    elements +0.0, padded to whole blocks; their block scales). ``rows``: float32 (count, n), contiguous, one row
    or rows of whole int8 blocks; ``levels``: the int8 levels, a 0-d float32 tensor. Needs Triton."""
    count, n = rows.shape
    if not rows.is_contiguous() or not tiled_by_the_select(count, n):
        raise ValueError(f"topk_with_residual: wants contiguous rows, one of them or each whole blocks of {BLOCK}, "
                         f"got {tuple(rows.shape)}, strides {rows.stride()}")
    counts = radix_select.counted(rows, k)
    words = torch.empty(count, 2 * k, dtype=torch.int32, device=rows.device)
    int8_blocks = -(-rows.numel() // BLOCK)
    codes = torch.empty(int8_blocks * BLOCK, dtype=torch.int8, device=rows.device)
    scales = torch.empty(int8_blocks, dtype=torch.float32, device=rows.device)
    _payloads_and_residual[(counts.blocks, count)](
        rows, counts.hist, counts.kept, words, levels.reshape(1), codes, scales, rows.stride(0), n, count, k,
        counts.blocks, -(-n // BLOCK), int8_blocks, BLOCK=radix_select.KEEP_BLOCK, SCAN=radix_select.SCAN,
        INT8=BLOCK, num_warps=WARPS)
    return words.view(torch.uint8), codes, scales


def topk_with_residual(rows: torch.Tensor, k: int, levels: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``payloads_and_residual_rows`` where it runs: the radix select taken (``radix_select.taken``), rows it
    tiles, and its first-call check passed on this GPU; None where torch's path runs."""
    count, n = rows.shape
    if not (rows.is_contiguous() and tiled_by_the_select(count, n) and 1 <= k <= n and _taken(rows)):
        return None
    return payloads_and_residual_rows(rows, k, levels)


def tiled_by_the_select(count: int, n: int) -> bool:
    """Whether the select's own last pass writes the int8 codes of v - Q(v) for ``count`` rows of ``n``: its
    tiles are then whole int8 blocks of the flattened rows (one row, its last block padded with zeros, or rows
    of whole blocks). Other cuts take ``topk_with_residual_runs``."""
    return count == 1 or n % BLOCK == 0


def _taken(rows: torch.Tensor) -> bool:
    return radix_select.taken(rows) and _works_on(device_index(rows))


def payloads_and_residual_runs(v: torch.Tensor, runs: Sequence[tuple[torch.Tensor, int]], levels: torch.Tensor
                               ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(each run's top-k payloads, (count, 8k) uint8; the int8 codes of v - Q(v), padded to whole blocks; their
    block scales) for a vector cut into rows of any length, in runs of rows of one length (a bucket cut for
    several ranks): ``runs``, each (rows, k), are views of ``v`` (flat, contiguous float32) that cover it in
    order. ``v`` is overwritten with v - Q(v): the caller's scratch, as a worker's compensated vector is. Each
    run's select, whose last launch writes the payloads and empties the kept elements, then one launch for the
    codes of all of v (its int8 blocks may straddle rows, which the select's tiles cannot). Needs Triton."""
    if not _covered_in_order(v, [rows for rows, _ in runs]):
        raise ValueError(f"payloads_and_residual_runs: wants a flat contiguous float32 vector and contiguous row "
                         f"views of it that cover it in order, got {v.dtype} {tuple(v.shape)} and rows "
                         f"{[tuple(rows.shape) for rows, _ in runs]}")
    payloads = []
    for rows, k in runs:
        counts = radix_select.counted(rows, k)
        count, n = rows.shape
        words = torch.empty(count, 2 * k, dtype=torch.int32, device=v.device)
        _payloads_and_kept_emptied[(counts.blocks, count)](
            rows, counts.hist, counts.kept, words, rows.stride(0), n, count, k, counts.blocks,
            BLOCK=radix_select.KEEP_BLOCK, SCAN=radix_select.SCAN, num_warps=radix_select.PAYLOAD_WARPS)
        payloads.append(words.view(torch.uint8))
    codes, scales = int8_codes_rows(v, None, levels, BLOCK)
    return payloads, codes, scales


def topk_with_residual_runs(v: torch.Tensor, runs: Sequence[tuple[int, int, int, int]], levels: torch.Tensor
                            ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor] | None:
    """``payloads_and_residual_runs`` of ``v`` cut into ``runs``, each (first element, rows, their length, k),
    where it runs: the radix select taken for ``v`` (one test, asked before ``v`` is cut: its runs share its
    device, dtype and unit stride), every run within a grid's rows with k from 1 to its length, a vector within
    int32 offsets, and the first-call check passed on this GPU; None where torch's path runs (``v`` untouched)."""
    if not (0 < v.numel() < (1 << 31) and radix_select.taken(v.view(1, -1))
            and all(count <= MOST_ROWS and 1 <= k <= n for _, count, n, k in runs)):
        return None
    pieces = [(v[start: start + count * n].view(count, n), k) for start, count, n, k in runs]
    return payloads_and_residual_runs(v, pieces, levels) if _runs_work_on(device_index(v)) else None


def _covered_in_order(v: torch.Tensor, rows: Sequence[torch.Tensor]) -> bool:
    """Whether ``v`` is flat contiguous float32 and ``rows`` are contiguous 2-d views of its storage that
    follow one another from its first element to its last."""
    if not (v.dim() == 1 and v.is_contiguous() and v.dtype == torch.float32 and rows):
        return False
    at = v.storage_offset()
    for run in rows:
        if not (run.dim() == 2 and run.is_contiguous() and run.dtype == torch.float32 and run.numel() > 0
                and run.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                and run.storage_offset() == at):
            return False
        at += run.numel()
    return at == v.storage_offset() + v.numel()


def mean_of_topk_rows(payloads: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                      scales: torch.Tensor | None, into: torch.Tensor | None, numel: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, the rows' flags (3, senders): a position outside the chunk, positions that do not increase, a value
    that is not finite; each row's flag; the owner's status), as ``_mean_of_payloads``' ``_mean_of_topk`` gives
    them: ``payloads`` (senders, 8k) of a chunk of ``numel`` elements, ``count`` the 0-d divisor, ``codes``/
    ``scales`` the server memory's rows (blocks, BLOCK) or None, ``into`` the memory-shaped rows to write u
    into, or None (u is then new: the chunk's elements, or whole blocks where there is a memory). u is flat, or
    ``into``. Needs Triton."""
    senders, width = payloads.shape
    k = width // 8
    stretches = triton.cdiv(k, _ENTRIES)
    if payloads.dtype != torch.uint8 or payloads.stride(1) != 1 or width % 8 or not 0 < k <= numel \
            or not 0 < senders <= _MOST_SENDERS or (codes is None) != (scales is None) \
            or lanes(senders) * lanes(stretches) > _MOST_CHECKS:
        raise ValueError(f"mean_of_topk_rows: wants uint8 payload rows of unit stride, of 8k bytes for k <= "
                         f"{numel}, from 1 to {_MOST_SENDERS} senders, got {payloads.dtype} "
                         f"{tuple(payloads.shape)}, strides {payloads.stride()}")
    memory = codes is not None
    written = codes.numel() if memory else numel
    u = into if into is not None else torch.empty(written, dtype=torch.float32, device=payloads.device)
    flags = torch.empty(3, senders, dtype=torch.bool, device=payloads.device)
    bad = torch.empty(senders, dtype=torch.bool, device=payloads.device)
    status = torch.zeros((), dtype=torch.int64, device=payloads.device)
    partial = checked_partials(payloads, numel, _ENTRIES)
    _mean_of_topk[(triton.cdiv(written, _TILE),)](
        payloads, partial, count.float().reshape(1), codes if memory else u, scales if memory else u, u, flags, bad,
        status, senders, stretches, payloads.stride(0), k, numel, written, MEMORY=memory,
        SENDERS=lanes(senders), STRETCHES=lanes(stretches), TILE=_TILE, ENTRIES=_ENTRIES, BLOCK=BLOCK,
        BAD_PAYLOAD=header.BAD_PAYLOAD, OVERFLOW=header.OVERFLOW, enable_fp_fusion=False)
    return u, flags, bad, status


def mean_of_topk(payloads: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                 scales: torch.Tensor | None, into: torch.Tensor | None, numel: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``mean_of_topk_rows`` where it runs: our kernels chosen on this GPU (``own_kernels.on_a_gpu``), rows and a
    memory it reads, and its first-call check passed; None where the caller runs torch's kernel."""
    contiguous = codes is None or (codes.is_contiguous() and scales.is_contiguous()
                                   and (into is None or into.is_contiguous()))
    senders, width = payloads.shape if payloads.dim() == 2 else (0, 0)
    if not (contiguous and 0 < senders <= _MOST_SENDERS and payloads.stride(-1) == 1 and width % 8 == 0
            and 0 < width // 8 <= numel < (1 << 31) and payloads.dtype == torch.uint8
            and lanes(senders) * lanes(-(-width // 8 // _ENTRIES)) <= _MOST_CHECKS
            and on_a_gpu(payloads) and _mean_works_on(device_index(payloads))):
        return None
    return mean_of_topk_rows(payloads, count, codes, scales, into, numel)


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed rows without ties (one row ending inside an int8 block, rows of whole blocks over several
    programs, every element kept), the payloads, codes and scales are torch's kernel's from the radix select's
    positions (the first-call check)."""
    reference = TORCH_REFERENCES["topk_and_residual"]
    gen = torch.Generator(device=device).manual_seed(0)
    levels = torch.full((), float(LEVELS), device=device)
    for count, n, k in ((1, 1000, 17), (3, 2 * radix_select.KEEP_BLOCK + BLOCK, 300), (2, BLOCK, BLOCK)):
        rows = torch.randn(count, n, generator=gen, device=device)
        want = reference(rows, radix_select.torch_positions(rows, k), levels)
        got = payloads_and_residual_rows(rows, k, levels)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            return False
    return True


def _mean_agrees_with_torch(device: torch.device) -> bool:
    """On fixed senders' payloads (no memory; a memory written in place; one made new past the chunk's end; a
    sender whose positions do not increase; every sender's values near the largest float with a memory, so that u
    overflows), u, the flags and the status are those of torch's kernel (the first-call check)."""
    if not {"mean_of_topk", "topk_and_residual"} <= set(TORCH_REFERENCES):
        return False
    reference = TORCH_REFERENCES["mean_of_topk"]
    gen = torch.Generator(device=device).manual_seed(0)
    levels, count = torch.full((), float(LEVELS), device=device), torch.full((), 3.0, device=device)
    for size, spoil in ((BLOCK * 12, None), (BLOCK * 12 - 5, None), (BLOCK * 4, "unordered"), (BLOCK * 4, "huge")):
        senders = torch.randn(4, size, generator=gen, device=device)
        k = size // 10
        payloads = TORCH_REFERENCES["topk_and_residual"](senders[:3], radix_select.torch_positions(senders[:3], k),
                                                         levels)[0]
        if spoil == "unordered":  # sender 1's first two positions swapped
            payloads[1, 4 * k: 4 * k + 8] = payloads[1, 4 * k: 4 * k + 8].view(2, 4).flip(0).reshape(-1).clone()
        if spoil == "huge":
            payloads[:, : 4 * k] = torch.tensor([3e38], device=device).view(torch.uint8).repeat(3, k)
        _, codes, scales = TORCH_REFERENCES["topk_and_residual"](senders[3:], radix_select.torch_positions(
            senders[3:], k), levels)
        memories = [(None, None, None), (codes.view(-1, BLOCK), scales, None)]
        if codes.numel() == size:
            memories.append((codes.view(-1, BLOCK), scales, torch.empty(size // BLOCK, BLOCK, device=device)))
        for memory in memories:
            got = mean_of_topk_rows(payloads, count, *memory, size)
            theirs = memory if memory[2] is None else (*memory[:2], torch.empty_like(memory[2]))
            want = reference(payloads, count, *theirs, size, size)
            same_u = spoil == "unordered" or torch.equal(got[0].view(-1)[:size], want[0].reshape(-1)[:size])
            if not (same_u and all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))):
                return False
    return True


def _runs_by_torch(v: torch.Tensor, shapes: Sequence[tuple[int, int, int]], levels: torch.Tensor
                   ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]], torch.Tensor]:
    """What ``payloads_and_residual_runs`` gives for ``v`` cut into runs of ``shapes``, each (rows, their length,
    k), by torch's ops: (each run's payloads, torch's kernel's; the runs as it takes them, views of ``v``; v - Q(v),
    a new vector whose kept elements are x - x)."""
    payloads_of = TORCH_REFERENCES["topk_and_residual"]
    runs, payloads, residual, start = [], [], v.clone(), 0
    for count, n, k in shapes:
        rows = v[start: start + count * n].view(count, n)
        positions = radix_select.torch_positions(rows, k)
        payloads.append(payloads_of(rows, positions, levels)[0])
        kept = residual[start: start + count * n].view(count, n)
        values = kept.gather(1, positions)
        kept.scatter_(1, positions, values - values)
        runs.append((rows, k))
        start += count * n
    return payloads, runs, residual


def _runs_agree_with_torch(device: torch.device) -> bool:
    """On fixed vectors without ties (two runs of rows one element apart, as a bucket is cut for several ranks,
    their int8 blocks straddling rows; one run over several programs; rows of a few elements, every one kept),
    each run's payloads are torch's kernel's, v becomes v with the kept elements +0.0, and the codes and scales
    are ``compact.int8_codes``' of that (the first-call check)."""
    encode = TORCH_REFERENCES.get("int8_codes")
    if encode is None:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    levels = torch.full((), float(LEVELS), device=device)
    for shapes in (((3, 1001, 50), (2, 1000, 50)), ((2, radix_select.KEEP_BLOCK + 300, 40),), ((2, 3, 3), (1, 2, 2))):
        v = torch.randn(sum(count * n for count, n, _ in shapes), generator=gen, device=device)
        want, runs, residual = _runs_by_torch(v, shapes, levels)
        payloads, codes, scales = payloads_and_residual_runs(v, runs, levels)
        want_codes, want_scales = encode(residual, levels)
        if not (all(torch.equal(a, b) for a, b in zip(payloads, want, strict=True)) and torch.equal(v, residual)
                and torch.equal(codes, want_codes) and torch.equal(scales, want_scales)):
            return False
    return True


_works_on = checked_per_device("top-k's payloads with their residual in Triton", _agrees_with_torch)
_runs_work_on = checked_per_device("top-k's payloads with their residual, rows of any length, in Triton",
                                   _runs_agree_with_torch)
_mean_works_on = checked_per_device("top-k's owner's mean in Triton", _mean_agrees_with_torch)
