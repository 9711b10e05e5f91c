"""Sign's payloads and the worker's or server's int8 residual of them,
from one kernel where compiled.

Sign's residual v - Q(v) is v less ±s by v's own signs, so it needs only v
and the scales, which the encode computes anyway. Encoding the payloads and
the residual's int8 codes in one call spares a read of v on a CPU and a
compiled call per bucket on a GPU, where each call costs the host more than
the pass costs the device (docs/results/gpu.md). The payloads are the bytes
``compress_chunks`` sends, and the codes those of encoding the residual
after the exchange (``arithmetic.residual_by_signs``, or a decode and a
subtraction): the tests compare both.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..compressors import Compressor
from ..compressors import kernels
from ..compressors.base import runs_of_equal_size
from ..compressors.sign import SignCompressor, signs_rows, signs_rows_fusable
from ..state.compact import LEVELS, Int8Blocks, int8_codes

__all__ = ["signs_with_residual"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def signs_with_residual(q: Compressor, v: torch.Tensor, bounds: Sequence[tuple[int, int]], shared: Any = None
                        ) -> tuple[list[torch.Tensor], Int8Blocks] | None:
    """(the payload of each chunk of ``v`` as ``q.compress_chunks`` makes it; v - Q(v) as an
    int8 memory stores it), from one kernel, for sign's chunks of one size whose bits fill whole
    bytes; None elsewhere (the caller encodes and forms the residual as before)."""
    if type(q) is not SignCompressor or shared is not None or v.dtype != torch.float32 or not v.is_contiguous():
        return None
    runs = runs_of_equal_size(bounds)
    if len(runs) != 1 or runs[0][2] == 0 or runs[0][2] % 8:
        return None
    _, count, size = runs[0]
    rows = v.view(count, size)
    sizing = q.chunk_magnitudes(rows)
    if sizing is None:
        return None
    levels = kernels.device_constant(LEVELS, v.device)
    payloads, codes, scales = _signs_and_residual_kernel(rows, *sizing, levels, numel=v.numel())
    return list(payloads.unbind(0)), Int8Blocks.from_padded(v.numel(), codes, scales)


def _residual_rows(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """Each row less ±its scale by its own signs (+ where >= 0, -0.0 included), flat:
    the scale as ``signs_rows`` writes it, so ±s exactly as the payload decodes."""
    s = (magnitudes / divisor).clamp(max=_FLOAT32_MAX).view(-1, 1)
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
