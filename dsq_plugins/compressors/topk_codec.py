"""Top-k's payloads read on a GPU in Triton: each row's dense values, +0.0
outside its kept positions, with the payload's three checks, in two
launches; and the search and the checks the owner's mean shares
(``algorithm._topk_triton``).

On a GPU a received row was inductor's kernel that copied the values and
positions out of the bytes and checked them, then a fill of zeros and a
scatter (or the three in one compiled call whose guard and launcher cost
the host more than its pass). Here one launch checks each row's entries a
stretch at a time (a position outside the vector, positions that do not
increase, a value that is not finite) and one writes the rows: a program
owns a tile of a row, sets it to +0.0, finds the row's entries inside the
tile (positions increase: a count over a sample of them, then over the
stretch between two samples) and writes their values behind a barrier; its
row's first program gathers the checks into the row's flags.

The values are torch's path's for a row that passes its checks (increasing
positions are distinct, so the order of the writes does not matter); a
refused row's are not (positions that do not increase are searched as if
they did, and stay inside their tile), nor need they be: it is refused.
Where Triton is missing, the first call's check on a GPU fails, or
``DSQ_OWN_KERNELS=torch`` says so, ``topk_decoded`` returns None and the
caller takes torch's path."""
from __future__ import annotations

import torch

from .own_kernels import (MOST_ROWS, TORCH_REFERENCES, checked_per_device, fits_rows, lanes, ready, rows_out, tl,
                          triton, word_at)

__all__ = ["checked_partials", "decoded_rows", "entries_below", "entry_word", "runs_on", "topk_decoded"]

ENTRIES = 1024  # a payload's entries read at a time: the samples of a search, a stretch, a check's share
_TILE = 8192  # a row's values per program of the decode
_MOST_STRETCHES = 4096  # a row's checks' stretches: its first program of the decode reads all their flags
_LONGEST_ROW = 1 << 31  # offsets into a row are int32 in the kernels

if triton is not None:
    @triton.jit
    def entry_word(at, mask):
        """A payload's int32 word at the bytes ``at``: 0x7FFFFFFF where masked, above every position."""
        return word_at(at, mask, 0x7FFFFFFF)

    @triton.jit
    def entries_below(row, k, target, ENTRIES: tl.constexpr):
        """How many of a row's increasing positions lie below ``target``: a count over every (k / ENTRIES)-th
        of them, then over the stretch between the two samples the answer lies between."""
        lanes = tl.arange(0, ENTRIES)
        spacing = (k + ENTRIES - 1) // ENTRIES
        sampled = lanes * spacing
        below = tl.sum((entry_word(row + 4 * k + 4 * sampled, sampled < k) < target).to(tl.int32), 0)
        first = tl.where(below > 0, (below - 1) * spacing + 1, 0)  # the entry after the last sample below
        end = tl.minimum(below * spacing, k)  # the first sample at or above target, or the row's end
        count = first
        for start in range(first, end, ENTRIES):
            entry = start + lanes
            count += tl.sum((entry_word(row + 4 * k + 4 * entry, entry < end) < target).to(tl.int32), 0)
        return count

    @triton.jit
    def _check(payloads_ptr, partial_ptr, payload_stride, k, numel, rows, stretches, ENTRIES: tl.constexpr):
        """Stretch ``program_id(0)`` of row ``program_id(1)``'s entries: whether a position is outside the
        vector, whether one fails to exceed the one before, whether a value is not finite, as int8 flags at
        partial[check, row, stretch]."""
        stretch, row = tl.program_id(0), tl.program_id(1)
        payload = payloads_ptr + row.to(tl.int64) * payload_stride
        entry = stretch * ENTRIES + tl.arange(0, ENTRIES)
        inside = entry < k
        position = entry_word(payload + 4 * k + 4 * entry, inside)
        before = entry_word(payload + 4 * k + 4 * (entry - 1), inside & (entry > 0))
        value = entry_word(payload + 4 * entry, inside).to(tl.float32, bitcast=True)
        outside = tl.max((inside & ((position < 0) | (position >= numel))).to(tl.int32), 0)
        unordered = tl.max((inside & (entry > 0) & (position <= before)).to(tl.int32), 0)
        not_finite = tl.max((inside & ~(tl.abs(value) <= 3.4028234663852886e38)).to(tl.int32), 0)  # NaN fails
        slot = partial_ptr + row * stretches + stretch
        tl.store(slot, outside.to(tl.int8))
        tl.store(slot + rows * stretches, unordered.to(tl.int8))
        tl.store(slot + 2 * rows * stretches, not_finite.to(tl.int8))

    @triton.jit
    def _decode(payloads_ptr, partial_ptr, out_ptr, flags_ptr, payload_stride, out_stride, k, numel, rows,
                stretches, FLAGS: tl.constexpr, STRETCHES: tl.constexpr, TILE: tl.constexpr,
                ENTRIES: tl.constexpr):
        """Row ``program_id(1)``'s values [TILE · program_id(0), +TILE); with ``FLAGS`` its first program writes
        the row's three flags from the checks' stretches."""
        row, start = tl.program_id(1), tl.program_id(0) * TILE
        payload = payloads_ptr + row.to(tl.int64) * payload_stride
        out = out_ptr + row.to(tl.int64) * out_stride
        if FLAGS:
            stretch = tl.arange(0, STRETCHES)
            for check in tl.static_range(3):
                flag = tl.max(tl.load(partial_ptr + (check * rows + row) * stretches + stretch,
                                      mask=stretch < stretches, other=0), 0)
                tl.store(flags_ptr + check * rows + row, flag != 0, mask=start == 0)
        element = start + tl.arange(0, TILE)
        tl.store(out + element, tl.zeros([TILE], dtype=tl.float32), mask=element < numel)
        end = tl.minimum(start + TILE, numel)
        tl.debug_barrier()  # the zeros are in place before any value is written over them
        for first in range(entries_below(payload, k, start, ENTRIES), entries_below(payload, k, end, ENTRIES),
                           ENTRIES):
            entry = first + tl.arange(0, ENTRIES)
            inside = entry < k
            position = entry_word(payload + 4 * k + 4 * entry, inside)
            inside = inside & (position >= start) & (position < end)  # a refused row's stays in the tile
            tl.store(out + position, entry_word(payload + 4 * entry, inside).to(tl.float32, bitcast=True),
                     mask=inside)


def checked_partials(payloads: torch.Tensor, numel: int, entries: int = ENTRIES) -> torch.Tensor:
    """(3, rows, stretches) int8: per row and stretch of ``entries`` entries whether a position lies outside
    [0, numel), whether positions fail to increase (across a stretch's start too), whether a value is not finite.
    ``payloads``: (rows, 8k) uint8, unit stride along a row. Needs Triton."""
    rows, width = payloads.shape
    k = width // 8
    stretches = triton.cdiv(k, entries)
    partial = torch.empty(3, rows, stretches, dtype=torch.int8, device=payloads.device)
    if rows and k:
        _check[(stretches, rows)](payloads, partial, payloads.stride(0), k, numel, rows, stretches, ENTRIES=entries)
    return partial


def decoded_rows(payloads: torch.Tensor, numel: int, out: torch.Tensor | None = None, flags: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each row's ``numel`` values, its kept values at their positions and +0.0 elsewhere, (rows, numel) float32,
    written into ``out`` where given; with ``flags``, (3, rows) bool: whether a row holds a position outside the
    vector, positions that do not increase, a value that is not finite, else None). ``payloads``: (rows, 8k)
    uint8 for k from 1 to ``numel``, unit stride along a row. Needs Triton."""
    rows, width = payloads.shape
    k = width // 8
    if payloads.dtype != torch.uint8 or (width > 1 and payloads.stride(1) != 1) or width % 8 \
            or not 0 < k <= numel < _LONGEST_ROW or triton.cdiv(k, ENTRIES) > _MOST_STRETCHES:
        raise ValueError(f"topk_codec.decoded_rows: wants uint8 payload rows of unit stride of 8k bytes for k from "
                         f"1 to {numel}, got {payloads.dtype} {tuple(payloads.shape)}, strides {payloads.stride()}")
    out = rows_out(out, rows, numel, payloads.device, "topk_codec.decoded_rows")
    partial = checked_partials(payloads, numel, ENTRIES) if flags else None
    bad = torch.empty(3, rows, dtype=torch.bool, device=payloads.device) if flags else None
    if rows:
        stretches = triton.cdiv(k, ENTRIES)
        _decode[(triton.cdiv(numel, _TILE), rows)](
            payloads, partial if flags else payloads, out, bad if flags else out, payloads.stride(0), out.stride(0),
            k, numel, rows, stretches, FLAGS=flags, STRETCHES=lanes(stretches), TILE=_TILE,
            ENTRIES=ENTRIES, num_warps=8)
    return out, bad


def runs_on(device: torch.device) -> bool:
    """Whether this codec may run on ``device`` at all: our kernels chosen on this GPU
    (``own_kernels.chosen_on``) and checked against torch's path on it."""
    return ready(device, _works_on)


def _taken(tensor: torch.Tensor, rows: int, numel: int, k: int) -> bool:
    """Whether this codec decodes ``rows`` payloads of k entries for ``numel`` values on ``tensor``'s device:
    ``runs_on`` it, within a grid, int32 offsets and the stretches a row's flags gather."""
    return rows <= MOST_ROWS and 0 < k <= numel < _LONGEST_ROW and -(-k // ENTRIES) <= _MOST_STRETCHES \
        and ready(tensor, _works_on)


def topk_decoded(payloads: torch.Tensor, numel: int, out: torch.Tensor | None = None, flags: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``decoded_rows`` where this codec runs, into ``out`` where it is a (rows, numel) float32 buffer of unit
    stride along a row; None where torch's path decodes."""
    if payloads.dtype != torch.uint8 or payloads.dim() != 2 or payloads.stride(-1) != 1 or payloads.shape[1] % 8 \
            or not _taken(payloads, payloads.shape[0], numel, payloads.shape[1] // 8):
        return None
    return decoded_rows(payloads, numel, out if fits_rows(out, payloads.shape[0], numel) else None, flags)


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed payloads (rows over several programs, every element kept, one kept, signed zeros and
    subnormals among the values, a NaN, a position outside, positions that do not increase), the values of
    every row that passes and every row's flags are those of torch's path (the reference ``topk`` registers)."""
    decode = TORCH_REFERENCES["topk_decoded"]
    gen = torch.Generator(device=device).manual_seed(0)
    for numel, k in ((3 * _TILE + 5, 300), (1000, 1000), (70, 1)):
        start = _TILE % numel  # a tile's first element, kept by every row
        others = torch.stack([torch.randperm(numel - 1, generator=gen, device=device)[:k - 1] for _ in range(4)])
        chosen = torch.cat([torch.full((4, 1), start, device=device), others + (others >= start).long()], dim=1)
        positions = chosen.sort(dim=1).values.to(torch.int32)
        values = torch.randn(4, k, generator=gen, device=device)
        values[0, -min(k, 4):] = torch.tensor([0.0, -0.0, 1e-45, -1e-45], device=device)[: min(k, 4)]
        values[1, 0] = float("nan")
        payloads = torch.cat([values.view(torch.uint8), positions.view(torch.uint8)], dim=1)
        payloads[2, 4 * k: 4 * k + 4] = torch.tensor([numel], dtype=torch.int32, device=device).view(torch.uint8)
        if k > 1:
            payloads[3, 4 * k: 4 * k + 8] = payloads[3, 4 * k: 4 * k + 8].view(2, 4).flip(0).reshape(-1).clone()
        got, bad = decoded_rows(payloads, numel)
        want, want_bad = decode(payloads, numel)
        passed = ~want_bad.any(0)
        if not (torch.equal(bad, want_bad) and torch.equal(got[passed], want[passed])):
            return False
    return True


_works_on = checked_per_device("top-k's Triton decode", _agrees_with_torch)
