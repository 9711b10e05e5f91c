"""Top-k's selection on a GPU in seven launches: the kept positions of each
row, increasing, by a radix select of our own in Triton.

``torch.topk(rows.abs(), k, sorted=False)`` followed by a sort of its
indices costs some 30 launches per selection on CUDA (three per digit of
the key, then the placement, then a radix sort of k int64 positions), and a
bucket selects twice (worker and server). Here a float's magnitude is read
as its bit pattern with the sign cleared: for non-negative floats the
integers order as the floats do (NaN above Inf, as torch.topk orders it).
Four passes each count one byte of that key among the elements whose
higher bytes match the k-th largest key found so far; each pass finds its
byte from the previous passes' counts (a few hundred integers per row,
re-read by every program rather than launching a kernel to do it). Then one
pass counts, per block, the elements above the k-th key and those equal to
it, and a last one writes each kept position at its place: positions come
out in order, with no sort. Of equal magnitudes at the k-th place the first
positions are kept, as torch.topk's CUDA kernels and ``top_magnitudes``
choose.

Launches: a fill of the counts, four counting passes, the block counts and
the writes, whatever the number of rows, their length or k. The last launch
writes the positions (``radix_positions``), or top-k's payloads themselves,
each kept value's bits and its position at its place (``radix_payloads``),
or, through ``counted`` and ``kept_in_block``, whatever a caller's own last
launch makes of each element's place (the algorithm's payloads with their
int8 residual). Where Triton
is missing, the rows are not float32, or the first call's check against
torch.topk fails, ``positions_of_largest`` returns None and the caller
selects with torch. ``DSQ_TOPK_SELECT=torch`` chooses torch's selection
(the control for a benchmark); ``radix`` (the default) this one. With
``TRITON_INTERPRET=1`` the kernels run on a CPU's tensors too, which is how
the tests check them without a GPU."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .own_kernels import MOST_ROWS, checked_per_device, chosen, device_index, on_the_current_gpu, tl, triton

__all__ = ["counted", "Counted", "kept_in_block", "KEEP_BLOCK", "payloads_of_largest", "positions_of_largest",
           "PAYLOAD_WARPS", "radix_payloads", "radix_positions", "SCAN", "store_payload", "taken", "torch_positions",
           "SELECTIONS"]

SELECTIONS = ("radix", "torch")
_DIGITS = 4  # bytes of a float32 key, most significant first
_COUNT_BLOCK = 2048  # elements per program of a counting pass
KEEP_BLOCK = 4096  # elements per program of the last two passes (whole int8 blocks of a memory: 16)
SCAN = 1024  # earlier blocks' counts summed at a time by the writing pass
PAYLOAD_WARPS = 8  # the payload's writing pass: 80 registers a thread, where 4 warps take over 180

if triton is not None:
    @triton.jit
    def _kth_key_so_far(hist_ptr, row, rows, k, PASSES: tl.constexpr):
        """The bytes of the row's k-th largest key that passes 0..PASSES-1 found (as an int32 with the
        lower bytes zero), and how many elements whose key has those bytes are still to be kept."""
        digits = tl.arange(0, 256)
        prefix = tl.zeros((), dtype=tl.int32)
        remaining = tl.zeros((), dtype=tl.int32) + k
        for p in tl.static_range(PASSES):
            counts = tl.load(hist_ptr + (p * rows + row) * 256 + 255 - digits)  # largest byte first
            from_top = tl.cumsum(counts, 0)
            first = tl.min(tl.where(from_top >= remaining, digits, 256), 0)
            remaining -= tl.sum(tl.where(digits < first, counts, 0), 0)
            prefix = prefix | ((255 - first) << (24 - 8 * p))
        return prefix, remaining

    @triton.jit
    def _values_and_keys(rows_ptr, row, stride, n, offsets):
        """The row's values at ``offsets`` (0.0 past its end), their keys (a magnitude's bits), which are inside."""
        inside = offsets < n
        values = tl.load(rows_ptr + row.to(tl.int64) * stride + offsets, mask=inside, other=0.0)
        return values, values.to(tl.int32, bitcast=True) & 0x7FFFFFFF, inside

    @triton.jit
    def _count_digits(rows_ptr, hist_ptr, stride, n, rows, k, PASS: tl.constexpr, BLOCK: tl.constexpr):
        """Counts byte PASS of the keys whose higher bytes are the k-th key's, into hist[PASS, row]."""
        row = tl.program_id(1)
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        _, key, counted = _values_and_keys(rows_ptr, row, stride, n, offsets)
        if PASS > 0:
            prefix, _ = _kth_key_so_far(hist_ptr, row, rows, k, PASS)
            counted = counted & ((key >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
        digit = tl.where(counted, (key >> (24 - 8 * PASS)) & 255, 256)  # 256: not counted
        counts = tl.histogram(digit, 512)
        bins = tl.arange(0, 512)
        tl.atomic_add(hist_ptr + (PASS * rows + row) * 256 + bins, counts, mask=(bins < 256) & (counts > 0))

    @triton.jit
    def _count_kept(rows_ptr, hist_ptr, kept_ptr, stride, n, rows, k, blocks, BLOCK: tl.constexpr):
        """Per block: how many keys lie above the k-th key, and how many equal it."""
        row, block = tl.program_id(1), tl.program_id(0)
        _, key, inside = _values_and_keys(rows_ptr, row, stride, n, block * BLOCK + tl.arange(0, BLOCK))
        kth, _ = _kth_key_so_far(hist_ptr, row, rows, k, 4)
        slot = (row * blocks + block) * 2
        tl.store(kept_ptr + slot, tl.sum((inside & (key > kth)).to(tl.int32), 0))
        tl.store(kept_ptr + slot + 1, tl.sum((inside & (key == kth)).to(tl.int32), 0))

    @triton.jit
    def kept_in_block(rows_ptr, hist_ptr, kept_ptr, stride, n, rows, k, blocks, row, block,
                      BLOCK: tl.constexpr, SCAN: tl.constexpr):
        """For block ``block`` of row ``row`` after the counting passes (``counted``): (its offsets in the row,
        its values, which are kept (int32 0 or 1), each kept one's place in the row's k). Kept: after the earlier
        blocks' kept ones, in order; of the keys equal to the k-th, the first ``remaining`` of the row."""
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        values, key, inside = _values_and_keys(rows_ptr, row, stride, n, offsets)
        kth, tied_kept = _kth_key_so_far(hist_ptr, row, rows, k, 4)
        above_earlier = tl.zeros([SCAN], dtype=tl.int32)
        tied_earlier = tl.zeros([SCAN], dtype=tl.int32)
        for start in range(0, block, SCAN):
            earlier = start + tl.arange(0, SCAN)
            slots = (row * blocks + earlier) * 2
            above_earlier += tl.load(kept_ptr + slots, mask=earlier < block, other=0)
            tied_earlier += tl.load(kept_ptr + slots + 1, mask=earlier < block, other=0)
        above_before = tl.sum(above_earlier, 0)
        tied_before = tl.sum(tied_earlier, 0)
        above = (inside & (key > kth)).to(tl.int32)
        tied = (inside & (key == kth)).to(tl.int32)
        tied_rank = tied_before + tl.cumsum(tied, 0) - tied  # the row's equal keys before this one
        kept = above | (tied & (tied_rank < tied_kept).to(tl.int32))
        place = above_before + tl.minimum(tied_before, tied_kept) + tl.cumsum(kept, 0) - kept
        return offsets, values, kept, place

    @triton.jit
    def _write_kept(rows_ptr, hist_ptr, kept_ptr, out_ptr, stride, n, rows, k, blocks,
                    BLOCK: tl.constexpr, SCAN: tl.constexpr):
        """Each kept position at its place in the row's k (int64)."""
        row, block = tl.program_id(1), tl.program_id(0)
        offsets, _, kept, place = kept_in_block(rows_ptr, hist_ptr, kept_ptr, stride, n, rows, k, blocks, row,
                                                block, BLOCK, SCAN)
        tl.store(out_ptr + row.to(tl.int64) * k + place, offsets.to(tl.int64), mask=kept > 0)

    @triton.jit
    def _write_payload(rows_ptr, hist_ptr, kept_ptr, words_ptr, stride, n, rows, k, blocks,
                       BLOCK: tl.constexpr, SCAN: tl.constexpr):
        """Each kept value's bits and its position (int32) at its place in the row's top-k payload, seen as
        (rows, 2k) words: the values, then the positions."""
        row, block = tl.program_id(1), tl.program_id(0)
        offsets, values, kept, place = kept_in_block(rows_ptr, hist_ptr, kept_ptr, stride, n, rows, k, blocks, row,
                                                     block, BLOCK, SCAN)
        store_payload(words_ptr, row, k, offsets, values, kept, place)

    @triton.jit
    def store_payload(words_ptr, row, k, offsets, values, kept, place):
        """The kept ones of ``kept_in_block``'s values and offsets at their places in the row's top-k payload,
        seen as (rows, 2k) int32 words: the values' bits, then the positions."""
        payload = words_ptr + row.to(tl.int64) * (2 * k)
        tl.store(payload + place, values.to(tl.int32, bitcast=True), mask=kept > 0)
        tl.store(payload + k + place, offsets, mask=kept > 0)


class Counted(NamedTuple):
    """The selection's counts after its first six launches: each pass's digit counts (``hist``), each block's
    keys above and equal to the k-th (``kept``), and the blocks per row; a last pass (``kept_in_block``) then
    knows each element's place."""
    hist: torch.Tensor
    kept: torch.Tensor
    blocks: int


def counted(rows: torch.Tensor, k: int) -> Counted:
    """The counting launches of the select of each row's ``k`` largest |values| (``rows``: float32 (count, n),
    unit stride along a row, 1 <= k <= n; a GPU's tensors, or a CPU's under ``TRITON_INTERPRET=1``)."""
    count, n = rows.shape
    if rows.dtype != torch.float32 or (n > 1 and rows.stride(1) != 1) or not 1 <= k <= n:
        raise ValueError(f"radix_select: wants float32 rows of unit stride and 1 <= k <= n, "
                         f"got {rows.dtype}, strides {rows.stride()}, k={k}, n={n}")
    hist = torch.zeros(_DIGITS, count, 256, dtype=torch.int32, device=rows.device)
    stride = rows.stride(0)
    counting = (triton.cdiv(n, _COUNT_BLOCK), count)
    for p in range(_DIGITS):
        _count_digits[counting](rows, hist, stride, n, count, k, PASS=p, BLOCK=_COUNT_BLOCK)
    blocks = triton.cdiv(n, KEEP_BLOCK)
    kept = torch.empty(count, blocks, 2, dtype=torch.int32, device=rows.device)
    _count_kept[(blocks, count)](rows, hist, kept, stride, n, count, k, blocks, BLOCK=KEEP_BLOCK)
    return Counted(hist, kept, blocks)


def radix_positions(rows: torch.Tensor, k: int, counts: Counted | None = None) -> torch.Tensor:
    """(count, k) int64: each row's positions of its k largest |values|,
    increasing, the first of equals at the k-th place. ``rows``: float32,
    (count, n) with unit stride along a row, 1 <= k <= n. Needs Triton
    (a GPU's tensors, or a CPU's under ``TRITON_INTERPRET=1``). ``counts``:
    ``counted(rows, k)``, where the caller has them already."""
    counts = counted(rows, k) if counts is None else counts
    count, n = rows.shape
    out = torch.empty(count, k, dtype=torch.int64, device=rows.device)
    _write_kept[(counts.blocks, count)](rows, counts.hist, counts.kept, out, rows.stride(0), n, count, k, counts.blocks,
                                        BLOCK=KEEP_BLOCK, SCAN=SCAN)
    return out


def radix_payloads(rows: torch.Tensor, k: int, counts: Counted | None = None) -> torch.Tensor:
    """(count, 8k) uint8: each row's top-k payload (its k kept values in the order of their positions, then the
    positions as int32, the wire format of ``topk``) from the same selection as ``radix_positions``, the last
    launch writing the payload's bytes where the other writes positions."""
    counts = counted(rows, k) if counts is None else counts
    count, n = rows.shape
    words = torch.empty(count, 2 * k, dtype=torch.int32, device=rows.device)
    _write_payload[(counts.blocks, count)](rows, counts.hist, counts.kept, words, rows.stride(0), n, count, k,
                                           counts.blocks, BLOCK=KEEP_BLOCK, SCAN=SCAN, num_warps=PAYLOAD_WARPS)
    return words.view(torch.uint8)


def positions_of_largest(rows: torch.Tensor, k: int) -> torch.Tensor | None:
    """``radix_positions(rows, k)`` where it is chosen and works on this
    device; None where the caller selects with torch instead (so too for
    more rows than a CUDA grid holds along its second dimension)."""
    return radix_positions(rows, k) if taken(rows) else None


def payloads_of_largest(rows: torch.Tensor, k: int) -> torch.Tensor | None:
    """``radix_payloads(rows, k)`` where the radix select is taken (``positions_of_largest``' rule); None where
    the caller makes the payloads from torch's selection."""
    return radix_payloads(rows, k) if taken(rows) else None


def taken(rows: torch.Tensor) -> bool:
    """Whether the radix select selects in ``rows``: chosen, float32 rows of unit stride on the current GPU,
    within a grid, and its first-call check passed there."""
    return selection() == "radix" and on_the_current_gpu(rows) and rows.dtype == torch.float32 \
        and rows.stride(-1) == 1 and rows.shape[0] <= MOST_ROWS and _works_on(device_index(rows))


def torch_positions(rows: torch.Tensor, k: int) -> torch.Tensor:
    """What ``radix_positions`` gives, by torch.topk and a sort of its indices: the selection
    where the radix select is not taken, and the reference its first-call check compares with."""
    return torch.topk(rows.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values


def selection() -> str:
    """``DSQ_TOPK_SELECT``: ``radix`` (the default) or ``torch``."""
    return chosen("DSQ_TOPK_SELECT", SELECTIONS)


def _agrees_with_torch(device: torch.device) -> bool:
    """The radix select's positions are torch's on fixed rows without ties, and its payloads are those values and
    positions side by side (the first-call check)."""
    gen = torch.Generator(device=device).manual_seed(0)
    for count, n, k in ((3, 1000, 17), (2, 3 * KEEP_BLOCK + 5, 400), (1, 5, 5)):
        rows = torch.randn(count, n, generator=gen, device=device)
        positions = torch_positions(rows, k)
        payloads = torch.cat([rows.gather(1, positions).view(torch.uint8),
                              positions.to(torch.int32).view(torch.uint8)], dim=1)
        if not (torch.equal(radix_positions(rows, k), positions) and torch.equal(radix_payloads(rows, k), payloads)):
            return False
    return True


_works_on = checked_per_device("top-k's radix select", _agrees_with_torch)
