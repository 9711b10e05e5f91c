"""An owner's u, the mean of its senders' payloads plus its int8 server
error, from the payloads themselves in one kernel where compiled (a GPU).

Otherwise the owner decodes every sender's payload into (senders, chunk)
fp32 rows in one call, and a second call takes their mean and adds the
memory's values: the rows are written out and read back in between, and on
a GPU each call costs the host more than its pass costs the device
(docs/results/gpu.md). Sign's row decode is elementwise (a table lookup
times the row's scale), so its decode, its check of each row's scale, the
mean in sender order and the memory's addition fold into one pass with the
same bits as ``aggregation.mean_rows`` then ``compact``'s addition: the
tests compare them.
"""
from __future__ import annotations

import torch

from ..compressors import Compressor, kernels
from ..compressors.bitpack import sign_units
from ..compressors.sign import SCALE_REFUSED, SignCompressor, checked_signs, checked_signs_fusable
from ..state.compact import Int8Blocks, int8_values, padded_added
from .aggregation import mean_rows, mean_rows_fusable

__all__ = ["mean_of_payloads", "folds_mean"]


def folds_mean(q: Compressor, payloads: torch.Tensor, numel: int, memory: object) -> bool:
    """Whether ``mean_of_payloads`` takes these (senders, bytes) ``payloads`` of ``q`` for a
    chunk of ``numel`` elements with this server error: sign's whole rows (one scale each, bits
    that fill whole bytes) on a device priced by its launches, and an int8 memory."""
    return (type(q) is SignCompressor and q.block is None and kernels.launch_bound(payloads.device)
            and payloads.dim() == 2 and numel > 0 and (payloads.shape[1] - 4) * 8 == numel
            and isinstance(memory, Int8Blocks) and memory.numel() == numel)


def mean_of_payloads(payloads: torch.Tensor, memory: Int8Blocks, out: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(u: the mean of the rows' decodes plus ``memory``'s values, for what ``folds_mean`` takes;
    the checks of the row decode, flags (checks, rows) and each check's words, as
    ``step.rows_checked`` gives them). u is written into the fp32 vector ``out`` where the
    memory is whole blocks, else it is a fresh vector (use what this returns)."""
    codes, count, numel = memory.code_rows(), payloads.shape[0], memory.numel()
    divisor = kernels.device_constant(float(count), payloads.device)
    table = sign_units(payloads.device)
    if codes.numel() != numel:
        u, bad = _padded_mean_of_signs_kernel(payloads, table, divisor, codes, memory.scales, numel=numel * count)
        u = u.view(-1)[:numel]
    else:
        u, bad = _mean_of_signs_kernel(out.view(codes.shape), payloads, table, divisor, codes, memory.scales,
                                       numel=numel * count)
        u = u.view(-1)
    return u, bad.unsqueeze(0), [SCALE_REFUSED]


def _mean_of_signs(out: torch.Tensor, payloads: torch.Tensor, table: torch.Tensor, count: torch.Tensor,
                   codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows ``out``: the mean of the decoded rows plus the int8 rows' values; each row's flag)."""
    values, bad = checked_signs(payloads, table)
    senders = values.view(payloads.shape[0], *codes.shape)
    return torch.add(mean_rows(senders, count), int8_values(codes, scales), out=out), bad


def _mean_of_signs_fusable(out: torch.Tensor, payloads: torch.Tensor, table: torch.Tensor, count: torch.Tensor,
                           codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, bad = checked_signs_fusable(payloads, table)
    senders = values.view(payloads.shape[0], *codes.shape)
    return out.copy_(mean_rows_fusable(senders, count) + codes.to(torch.float32) * scales[:, None]), bad


def _padded_mean_of_signs(payloads: torch.Tensor, table: torch.Tensor, count: torch.Tensor, codes: torch.Tensor,
                          scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean of the decoded rows, padded with zeros to the int8 rows, plus their values: new
    rows; each row's flag), for a memory that ends inside a block."""
    values, bad = checked_signs(payloads, table)
    return padded_added(mean_rows(values, count), codes, scales), bad


def _padded_mean_of_signs_fusable(payloads: torch.Tensor, table: torch.Tensor, count: torch.Tensor,
                                  codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, bad = checked_signs_fusable(payloads, table)
    return padded_added(mean_rows_fusable(values, count), codes, scales), bad


# one kernel where compiled (a GPU), where the decode and the mean with the memory were two; a CPU decodes by
# table in cache-sized blocks and adds each sender in place
_mean_of_signs_kernel = kernels.FusedKernel(_mean_of_signs, _mean_of_signs_fusable, compile_on_cpu=False)
_padded_mean_of_signs_kernel = kernels.FusedKernel(_padded_mean_of_signs, _padded_mean_of_signs_fusable,
                                                   compile_on_cpu=False)
