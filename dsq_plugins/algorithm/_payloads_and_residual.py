"""Sign's, blocksign's and top-k's payloads and the worker's or server's
int8 residual of them, from one kernel where compiled.

Sign's residual v - Q(v) is v less ±s by v's own signs, blocksign's is v
less ±s at each block's kept element, top-k's is v with its kept elements
zeroed, so each needs only v and what the encode computes anyway (the
scales; blocksign's codes; top-k's positions). Encoding the payloads and
the residual's int8 codes in one call spares a read of v on a CPU and a
compiled call per bucket on a GPU, where each call costs the host more than
the pass costs the device (docs/results/gpu.md). The payloads are the bytes
``compress_chunks`` sends, and the codes those of encoding the residual
after the exchange (``arithmetic.residual_by_signs``, or a decode and a
subtraction): the tests compare both.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..compressors import Compressor
from ..compressors import kernels, sign_codec
from ..compressors.own_kernels import TORCH_REFERENCES
from ..compressors.base import runs_of_equal_size
from ..compressors.blocksign import BlockSignCompressor, payload_rows, payload_rows_fusable
from ..compressors.sign import SignCompressor, signs_rows, signs_rows_fusable
from ..compressors.topk import TopKCompressor, kept_payload_rows, kept_payload_rows_fusable
from ..state.compact import LEVELS, Int8Blocks, int8_codes
from ._blocksign_triton import blocksign_with_residual
from ._sign_triton import sign_residual_codes, signs_with_residual, takes
from ._topk_triton import tiled_by_the_select, topk_with_residual, topk_with_residual_runs

__all__ = ["payloads_with_residual"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def payloads_with_residual(q: Compressor, v: torch.Tensor, bounds: Sequence[tuple[int, int]],
                           coded: tuple[torch.Tensor, torch.Tensor] | None = None, scratch: bool = False
                           ) -> tuple[list[torch.Tensor], Int8Blocks] | None:
    """(the payload of each chunk of ``v`` as ``q.compress_chunks`` makes it; v - Q(v) as an
    int8 memory stores it), from one kernel, for chunks of one size: sign's whose bits fill whole
    bytes, blocksign's of whole blocks (on a GPU of any length, in one run or two), top-k's where a device selects
    them all at once (a GPU; chunks of any length, in runs, where ``v`` is ``scratch``);
    on a CPU's paths, sign's of one chunk only (``_one_flat_pass``); None elsewhere (the caller
    encodes and forms the residual as before; sign's scale shared by a whole vector,
    ``scope="tensor"``, is not one per chunk either). ``coded``: blocksign's codes of ``v``, formed
    where ``v`` was (``BlockSignCompressor.whole_block_codes``). ``scratch``: ``v`` is the caller's own, which
    nothing reads as v afterwards, so top-k's chunks of any length may form the residual in it on a GPU
    (``_topk_by_runs``); a returned None leaves ``v`` as it was."""
    if type(q) not in _MERGED or getattr(q, "scope", "chunk") != "chunk" or v.dtype != torch.float32 \
            or not v.is_contiguous():
        return None
    runs = runs_of_equal_size(bounds)
    if type(q) is SignCompressor and not (len(runs) == 1 and runs[0][2] % 8 == 0) and takes(v):
        return _signs_by_runs(q, v, bounds, runs)  # a GPU's, in Triton: chunks that are not whole bytes
    if type(q) is BlockSignCompressor:
        made = _blocksign_by_runs(q, v, bounds, runs, coded)  # a GPU's, in Triton: chunks of any length, two runs
        if made is not None:
            return made
    if type(q) is TopKCompressor and scratch and not (len(runs) == 1 and tiled_by_the_select(*runs[0][1:])):
        made = _topk_by_runs(q, v, bounds, runs)  # a GPU's, in Triton: chunks of any length, two runs
        if made is not None:
            return made
    if len(runs) != 1:
        return None
    _, count, size = runs[0]
    if not kernels.launch_bound(v.device) and not _one_flat_pass(q, count):
        return None
    rows, levels = v.view(count, size), kernels.device_constant(LEVELS, v.device)
    made = topk_with_residual(rows, q.count(size), levels) if type(q) is TopKCompressor else None  # a GPU's select
    made = made if made is not None else _by_merged_kernel(q, rows, coded, levels)
    if made is None:
        return None
    payloads, codes, scales = made
    return list(payloads.unbind(0)), Int8Blocks.from_padded(v.numel(), codes, scales)


def _by_merged_kernel(q: Compressor, rows: torch.Tensor, coded: tuple[torch.Tensor, torch.Tensor] | None,
                      levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(payloads, the residual's padded int8 codes, their scales) of ``rows`` from ``_merged_call``'s kernel (on a
    GPU sign's in Triton); None where ``q`` encodes these chunks otherwise."""
    merged = _merged_call(q, rows, coded)
    if merged is None:
        return None
    kernel, args = merged
    made = signs_with_residual(*args, levels) if kernel is _signs_and_residual_kernel else None  # a GPU's Triton
    return made if made is not None else kernel(*args, levels, numel=rows.numel())


def _signs_by_runs(q: SignCompressor, v: torch.Tensor, bounds: Sequence[tuple[int, int]],
                   runs: list[tuple[int, int, int]]) -> tuple[list[torch.Tensor], Int8Blocks] | None:
    """Sign's payloads of chunks that are not whole bytes (a bucket cut into chunks of two lengths, the longer
    first, as ``layout.chunk_bounds`` cuts one; an owner's chunk) and v's residual as int8, on a GPU: each run's
    payloads in one launch, the residual's codes in one more; None for other cuts, and where a payload is not one
    scale and the signs (``block``)."""
    if any(size == 0 for _, _, size in runs) or (len(runs) == 2 and runs[0][2] != runs[1][2] + 1) \
            or len(runs) > 2:
        return None
    payloads, sizing = [], []
    for first, count, size in runs:
        start = bounds[first][0]
        rows = v[start: start + count * size].view(count, size)
        magnitudes = q.chunk_magnitudes(rows)
        if magnitudes is None:
            return None
        encoded = sign_codec.signs_encoded(rows, *magnitudes)
        if encoded is None:
            return None
        payloads += list(encoded.unbind(0))
        sizing.append(magnitudes)
    codes, scales = sign_residual_codes(v, sizing, kernels.device_constant(LEVELS, v.device))
    return payloads, Int8Blocks.from_padded(v.numel(), codes, scales)


def _blocksign_by_runs(q: BlockSignCompressor, v: torch.Tensor, bounds: Sequence[tuple[int, int]],
                       runs: list[tuple[int, int, int]], coded: tuple[torch.Tensor, torch.Tensor] | None
                       ) -> tuple[list[torch.Tensor], Int8Blocks] | None:
    """Blocksign's payloads of chunks of any length, in one run or two (the first one value longer, as
    ``layout.chunk_bounds`` cuts a bucket), and v's residual as int8, on a GPU in Triton: each run's codes, the sums,
    then one launch for every payload and the residual; None for other cuts and where the kernels do not run."""
    if len(runs) > 2 or any(size == 0 for _, _, size in runs) or (len(runs) == 2 and runs[0][2] != runs[1][2] + 1):
        return None
    pieces = [(v[bounds[first][0]: bounds[first][0] + count * size].view(count, size), coded if len(runs) == 1
               else None) for first, count, size in runs]
    return _stored_runs(blocksign_with_residual(v, pieces, q.block, kernels.device_constant(LEVELS, v.device)), v)


def _topk_by_runs(q: TopKCompressor, v: torch.Tensor, bounds: Sequence[tuple[int, int]],
                  runs: list[tuple[int, int, int]]) -> tuple[list[torch.Tensor], Int8Blocks] | None:
    """Top-k's payloads of chunks of any length, in runs, and v - Q(v) as int8, on a GPU: each run's select writes
    its payloads and empties its kept elements in ``v``, then one launch encodes all of v; None (``v`` untouched)
    where a chunk is empty or the kernels do not run."""
    if any(size == 0 for _, _, size in runs):
        return None
    cut = [(bounds[first][0], count, size, q.count(size)) for first, count, size in runs]
    return _stored_runs(topk_with_residual_runs(v, cut, kernels.device_constant(LEVELS, v.device)), v)


def _stored_runs(made: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor] | None, v: torch.Tensor
                 ) -> tuple[list[torch.Tensor], Int8Blocks] | None:
    """A runs kernel's (each run's payload rows, the residual's padded codes, their scales) as the payload of each
    chunk and the int8 memory's residual of ``v``; None stays None."""
    if made is None:
        return None
    payloads, codes, scales = made
    return [row for run in payloads for row in run.unbind(0)], Int8Blocks.from_padded(v.numel(), codes, scales)


def _one_flat_pass(q: Compressor, count: int) -> bool:
    """Whether the merged kernel is one flat pass, the only form in which it pays on a CPU: sign's
    over a single chunk. Over several rows, or blocksign's blocks within them, inductor's CPU code
    finds each element's int8 block across the rows with a division and a remainder and runs
    unvectorized, many times slower than the plain path's two flat passes (docs/results/gpu.md);
    a GPU's code pays for the division in arithmetic it has to spare."""
    return type(q) is SignCompressor and count == 1


def _merged_call(q: Compressor, rows: torch.Tensor, coded: tuple[torch.Tensor, torch.Tensor] | None
                 ) -> tuple[kernels.FusedKernel, tuple] | None:
    """The kernel that encodes ``rows`` (a run of equal chunks) with ``q`` and their residual, and
    its arguments but the int8 levels, from the pieces ``q``'s encode computes; None where ``q``
    encodes these chunks otherwise."""
    if type(q) is TopKCompressor:
        positions = q.kept_positions(rows)
        return None if positions is None else (_topk_and_residual_kernel, (rows, positions))
    if type(q) is BlockSignCompressor:
        parts = q.whole_block_codes(rows, coded)
        return None if parts is None else (_blocksign_and_residual_kernel, parts)
    sizing = q.chunk_magnitudes(rows) if rows.shape[1] % 8 == 0 and rows.shape[1] else None
    return None if sizing is None else (_signs_and_residual_kernel, (rows, *sizing))


def _sent_scales(magnitudes: torch.Tensor, divisor: torch.Tensor, dims: int) -> torch.Tensor:
    """Each row's scale as its payload holds it (the quotient clamped to a finite float, as
    ``signs_rows`` and ``payload_rows`` write it), shaped to broadcast over ``dims`` dimensions."""
    return (magnitudes / divisor).clamp(max=_FLOAT32_MAX).view(-1, *[1] * (dims - 1))


def _residual_rows(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """Each row less ±its scale by its own signs (+ where >= 0, -0.0 included), flat:
    ±s exactly as the payload decodes."""
    s = _sent_scales(magnitudes, divisor, rows.dim())
    return (rows - torch.where(rows >= 0, s, -s)).reshape(-1)


def _signs_and_residual(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor, levels: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the payload rows, the residual's padded int8 codes, their block scales)."""
    return (signs_rows(rows, magnitudes, divisor),
            *int8_codes(_residual_rows(rows, magnitudes, divisor), levels))


def _signs_and_residual_fusable(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor,
                                levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (signs_rows_fusable(rows, magnitudes, divisor),
            *int8_codes(_residual_rows(rows, magnitudes, divisor), levels))


_signs_and_residual_kernel = kernels.FusedKernel(_signs_and_residual, _signs_and_residual_fusable)
TORCH_REFERENCES["signs_and_residual"] = _signs_and_residual  # the reference of a GPU's Triton kernel


def _kept_residual(blocks: torch.Tensor, codes: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor
                   ) -> torch.Tensor:
    """Each block less ±its row's scale at its kept element (the code's position and sign), flat;
    elsewhere less 0.0, which keeps every value's bits."""
    s = _sent_scales(magnitudes, divisor, blocks.dim())
    kept = torch.arange(blocks.shape[-1], device=blocks.device) == (codes >> 1).long().unsqueeze(-1)
    signed = torch.where((codes & 1).bool().unsqueeze(-1), s, -s)
    return (blocks - torch.where(kept, signed, 0.0)).reshape(-1)


def _blocksign_and_residual(blocks: torch.Tensor, codes: torch.Tensor, magnitudes: torch.Tensor,
                            divisor: torch.Tensor, levels: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocksign's payload rows, the residual's padded int8 codes, their block scales)."""
    return (payload_rows(magnitudes, divisor, codes),
            *int8_codes(_kept_residual(blocks, codes, magnitudes, divisor), levels))


def _blocksign_and_residual_fusable(blocks: torch.Tensor, codes: torch.Tensor, magnitudes: torch.Tensor,
                                    divisor: torch.Tensor, levels: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (payload_rows_fusable(magnitudes, divisor, codes),
            *int8_codes(_kept_residual(blocks, codes, magnitudes, divisor), levels))


_blocksign_and_residual_kernel = kernels.FusedKernel(_blocksign_and_residual, _blocksign_and_residual_fusable)
TORCH_REFERENCES["blocksign_and_residual"] = _blocksign_and_residual  # the reference of a GPU's Triton kernel


def _topk_and_residual(rows: torch.Tensor, positions: torch.Tensor, levels: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k's payload rows, the residual's padded int8 codes, their block scales): the rows with
    their kept elements set to +0.0, which is x - x for each finite kept x (a non-finite v fails
    its step before anything is stored), and every other value's bits as they are (x - 0.0)."""
    return kept_payload_rows(rows, positions), *int8_codes(rows.scatter(1, positions, 0.0).reshape(-1), levels)


def _topk_and_residual_fusable(rows: torch.Tensor, positions: torch.Tensor, levels: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (kept_payload_rows_fusable(rows, positions),
            *int8_codes(rows.scatter(1, positions, 0.0).reshape(-1), levels))


_topk_and_residual_kernel = kernels.FusedKernel(_topk_and_residual, _topk_and_residual_fusable)
TORCH_REFERENCES["topk_and_residual"] = _topk_and_residual  # the reference of a GPU's Triton kernel

#: the operators whose payloads and residual come from one kernel (their exact types: a subclass may encode
#: otherwise)
_MERGED = (SignCompressor, BlockSignCompressor, TopKCompressor)
