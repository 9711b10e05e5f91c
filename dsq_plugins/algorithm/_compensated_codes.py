"""A worker's compensated vector v = g + d_worker and blocksign's block codes
of it, from the compensation's own kernel where compiled (a GPU).

Blocksign's encode begins with a pass that finds each block's largest
magnitude (``blocksign.block_codes``); the merged encode then writes the
payloads and v's int8 residual from those codes
(``payloads_with_residual``). The compensation's kernel, which adds the
int8 worker error to g and tests the sum, already holds v: it takes the
codes there, and the worker's encode is one call where it was two, as the
owner's fold does for the server's encode (``mean_of_payloads``' ``encoder``).
The codes are the ones ``BlockSignCompressor.whole_block_codes`` would take
of v, eager or compiled alike (``codes_with``): the tests compare them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..compressors import Compressor, blocksign, kernels
from ..compressors.base import runs_of_equal_size
from ._blocksign_triton import compensated_codes
from ..state.compact import (BLOCK, Int8Blocks, OnePass, added_rows_with_status, added_rows_with_status_fusable,
                             padded_added_with_status, padded_added_with_status_fusable)

__all__ = ["compensated_with_codes"]


def compensated_with_codes(g: torch.Tensor, memory: object, out: torch.Tensor | None, encoder: Compressor | None,
                           bounds: Sequence[tuple[int, int]]
                           ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
    """(v = ``g`` + the int8 ``memory``'s values, v's status word, blocksign's (codes, kept magnitudes)
    of v as (chunks, blocks) rows), from one kernel, where ``encoder`` is blocksign, its blocks
    tile the memory's, and it will encode v's chunks (``bounds``: of one size, of whole blocks)
    on a device priced by its launches; None elsewhere (the caller compensates as before).
    ``out``: where v may be built, as in ``compact.added_with_status`` (use the v this returns)."""
    if type(encoder) is not blocksign.BlockSignCompressor or not isinstance(memory, Int8Blocks) \
            or not kernels.launch_bound(g.device) or memory.numel() != g.numel() or BLOCK % encoder.block:
        return None
    runs = runs_of_equal_size(bounds)
    if len(runs) != 1 or runs[0][2] == 0 or runs[0][2] % encoder.block:
        return None
    numel = g.numel()
    made = compensated_codes(g, memory.codes, memory.scales, encoder.block, out)  # a GPU's, in Triton
    if made is not None:
        v, status, (codes, kept) = made
        return v, status, (codes.view(runs[0][1], -1), kept.view(runs[0][1], -1))
    kernel = _PADDED_CODED if numel % BLOCK else _WHOLE_CODED
    # (the kernel covers the memory's whole blocks: checked before ``one_pass`` may allocate v's buffer)
    if not encoder.codes_with(kernel, numel, memory.scales.numel() * BLOCK, g.device):
        return None
    one = memory.one_pass(g, out)
    if one is None:
        return None
    values, status, codes, kept = kernel(blocksign.position_ranks(encoder.block, g.device), *_tiled(one, encoder.block),
                                         numel=one.numel)
    v = values.view(-1)[:numel] if one.padded else one.out
    count, blocks = runs[0][1], numel // encoder.block
    return v, status, (codes.view(-1)[:blocks].view(count, -1), kept.view(-1)[:blocks].view(count, -1))


def _tiled(one: OnePass, block: int) -> tuple[torch.Tensor, ...]:
    """``one``'s arguments with the whole form's rows as (rows, blocks per row, ``block``) and each
    row's scale as (rows, 1), which broadcast as the rows of ``BLOCK`` did: the kernel then takes
    the codes over the last dimension of what it adds, with no reshape inside it (inductor's C++
    code indexes a reshaped vector element by element, many times slower)."""
    if one.padded:
        return one.args
    out_rows, x_rows, code_rows, scales = one.args
    tiles = lambda rows: rows.view(rows.shape[0], -1, block)  # noqa: E731
    x_tiles = tiles(x_rows)
    return (x_tiles if out_rows is x_rows else tiles(out_rows)), x_tiles, tiles(code_rows), scales.view(-1, 1)


def _with_codes(formed: tuple[torch.Tensor, torch.Tensor], ranks: torch.Tensor, codes_of: Callable
                ) -> tuple[torch.Tensor, ...]:
    """``formed`` (v's rows, its status) and the blocksign codes of each row's blocks of ``ranks``'
    length (a padded row's last ones are of its padding: the caller drops them)."""
    v = formed[0]
    return (*formed, *codes_of(v.view(v.shape[0], -1, ranks.shape[0]), ranks))


# each form's functions of its own: dynamo's limit on graphs counts per function
def _whole_coded(ranks: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _with_codes(added_rows_with_status(*args), ranks, blocksign.block_codes)


def _whole_coded_fusable(ranks: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _with_codes(added_rows_with_status_fusable(*args), ranks, blocksign.block_codes_fusable)


def _padded_coded(ranks: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _with_codes(padded_added_with_status(*args), ranks, blocksign.block_codes)


def _padded_coded_fusable(ranks: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _with_codes(padded_added_with_status_fusable(*args), ranks, blocksign.block_codes_fusable)


#: the compensation's two forms (``compact.OnePass``) with blocksign's codes of v
_WHOLE_CODED = kernels.FusedKernel(_whole_coded, _whole_coded_fusable)
_PADDED_CODED = kernels.FusedKernel(_padded_coded, _padded_coded_fusable)
