"""An owner's u, the mean of its senders' payloads plus its int8 server
error (or the mean alone: ZeRO's reduce-scatter half pass), from the
payloads themselves in one kernel where compiled (a GPU).

Otherwise the owner decodes every sender's payload into (senders, chunk)
fp32 rows in one call (and, for a sparse operator, a fill and a scatter),
a second call takes their mean and adds the memory's values, and a third
forms the owner's status from the decode's checks: the rows are written
out and read back in between, and on a GPU each call costs the host more
than its pass costs the device (docs/results/gpu.md). Sign's row decode
(a table lookup times the row's scale) and the kept values of top-k and
blocksign (``Compressor.kept_rows_decoder``) continue into the mean in
sender order, the memory's addition and the status in one kernel, with
the same bits as ``aggregation.mean_rows`` then ``compact``'s addition
and ``step.first_true``: the tests compare them. Where the owner's server
encode is blocksign over whole blocks, the kernel also takes u's block codes,
the encode's first pass, over the u it holds (``Folded.coded``): one call
less per bucket.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..comm import header
from ..compressors import Compressor, blocksign, kernels, topk
from ..compressors.bitpack import sign_units
from ..compressors.own_kernels import TORCH_REFERENCES
from ..compressors.finite import extremes_not_finite, extremes_not_finite_fusable
from ..compressors.sign import SCALE_REFUSED, SignCompressor, checked_signs, checked_signs_fusable
from ..state.compact import Int8Blocks, int8_values, padded_added
from ..step import first_true_of
from ._blocksign_triton import mean_of_blocksign
from ._sign_triton import folds, mean_of_signs
from ._topk_triton import mean_of_topk
from .aggregation import mean_rows, mean_rows_fusable

__all__ = ["Folded", "folds_mean", "mean_of_payloads"]


def folds_mean(q: Compressor, payloads: torch.Tensor, numel: int, memory: object) -> bool:
    """Whether ``mean_of_payloads`` takes these (senders, bytes) ``payloads`` of ``q`` for a
    chunk of ``numel`` elements with this server error: on a device priced by its launches,
    with an int8 memory or none, sign's whole rows (one scale each, bits that fill whole bytes) or the
    rows of an operator whose row decoder yields kept values (top-k's, blocksign's)."""
    if not (kernels.launch_bound(payloads.device) and payloads.dim() == 2 and numel > 0
            and (memory is None or isinstance(memory, Int8Blocks) and memory.numel() == numel)):
        return False
    if type(q) is SignCompressor:  # whole bytes for torch's kernel; a GPU's Triton kernel takes a last byte's part
        return q.block is None and ((payloads.shape[1] - 4) * 8 == numel or folds(
            payloads, numel, *((None, None) if memory is None else (memory.codes, memory.scales)), None))
    return type(q) in _KEPT and q.decodes_rows(payloads.device)  # (what ``kept_rows_decoder`` asks too)


class Folded(NamedTuple):
    """What ``mean_of_payloads`` formed in its one kernel."""

    u: torch.Tensor       # the mean of the rows' decodes plus the memory's values
    flags: torch.Tensor   # the row decode's checks, (checks, rows), as ``step.rows_checked`` gives them
    words: list[str]      # what each check refuses
    bad: torch.Tensor     # each row's flag: any of its checks
    status: torch.Tensor  # the owner's: a refused row's, else, with a memory, whether u is finite (``_checked``)
    coded: tuple[torch.Tensor, torch.Tensor] | None = None  # u's blocksign (codes, kept magnitudes), where asked


def mean_of_payloads(q: Compressor, payloads: torch.Tensor, numel: int, memory: Int8Blocks | None,
                     out: torch.Tensor | None, encoder: Compressor | None = None) -> Folded:
    """For what ``folds_mean`` takes (rows of ``numel`` elements), u (with ``memory``'s values
    where given) and the checks of the payloads' decode (``Folded``). u is written into the fp32
    vector ``out`` where given and the memory is whole blocks, else it is a fresh vector.
    ``encoder``: what will encode u; blocksign's codes of u come with it where the kernel can
    form them as blocksign would (``BlockSignCompressor.codes_with``)."""
    count = payloads.shape[0]
    codes, scales = (None, None) if memory is None else (memory.code_rows(), memory.scales)
    whole = codes is not None and codes.numel() == numel and out is not None
    into = out.view(codes.shape) if whole else None
    divisor = kernels.device_constant(float(count), payloads.device)
    if type(q) is SignCompressor:
        made = mean_of_signs(payloads, divisor, codes, scales, into, numel)  # a GPU's, in Triton
        u, flags, bad, status = made if made is not None else _mean_of_signs_kernel(
            payloads, divisor, codes, scales, into, sign_units(payloads.device), numel=numel * count)
        return Folded(u.view(-1)[:numel], flags, [SCALE_REFUSED], bad, status)
    decoder = q.kept_rows_decoder(payloads, numel)
    made = _by_triton(q, payloads, divisor, codes, scales, into, numel, encoder)
    if made is not None:  # a GPU's, in Triton
        u, flags, bad, status, *coded = made
        return Folded(u.view(-1)[:numel], flags, list(decoder.words), bad, status, *coded)
    args = (payloads, divisor, codes, scales, into, numel, *decoder.args)
    coding = _CODED.get(type(q))
    if type(encoder) is blocksign.BlockSignCompressor and coding is not None \
            and encoder.codes_with(coding, numel, numel * count, payloads.device):
        u, flags, bad, status, *coded = coding(blocksign.position_ranks(encoder.block, payloads.device), *args,
                                                numel=numel * count)
        return Folded(u.view(-1)[:numel], flags, list(decoder.words), bad, status, tuple(coded))
    u, flags, bad, status = _KEPT[type(q)](*args, numel=numel * count)
    return Folded(u.view(-1)[:numel], flags, list(decoder.words), bad, status)


def _by_triton(q: Compressor, payloads: torch.Tensor, divisor: torch.Tensor, codes: torch.Tensor | None,
               scales: torch.Tensor | None, into: torch.Tensor | None, numel: int, encoder: Compressor | None
               ) -> tuple | None:
    """Top-k's and blocksign's fold by our Triton kernels where they take it (a GPU), blocksign's with u's codes
    where the owner encodes u with blocksign of the same width; None where torch's kernel runs."""
    if type(q) is topk.TopKCompressor:
        return mean_of_topk(payloads, divisor, codes, scales, into, numel)
    if type(q) is not blocksign.BlockSignCompressor:
        return None
    coded = type(encoder) is blocksign.BlockSignCompressor and encoder.block == q.block and numel % q.block == 0
    return mean_of_blocksign(payloads, divisor, codes, scales, into, numel, q.block, coded)


def _plus_memory(senders: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                 scales: torch.Tensor | None, into: torch.Tensor | None, fusable: bool) -> torch.Tensor:
    """The mean of the (count, numel) rows ``senders`` plus the int8 rows' values: into the rows
    ``into`` (a memory of whole blocks), else new rows padded to whole blocks; the mean alone
    without ``codes``; as a compiled kernel writes it where ``fusable`` (the same bits)."""
    mean = mean_rows_fusable if fusable else mean_rows
    if codes is None:  # no memory: the mean alone
        return mean(senders, count)
    if into is None:
        return padded_added(mean(senders, count), codes, scales)
    total = mean(senders.view(senders.shape[0], *codes.shape), count)
    if fusable:
        return into.copy_(total + codes.to(torch.float32) * scales[:, None])
    return torch.add(total, int8_values(codes, scales), out=into)


def _checked(u: torch.Tensor, flags: torch.Tensor, codes: torch.Tensor | None, fusable: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, flags, each row's flag, the status they give an owner): the first refused row's, else, where u
    goes on to a server error (``codes``: there is one), ``header.OVERFLOW`` if u holds a NaN or an Inf
    (payloads whose scales are near the largest float can overflow their mean), else OK."""
    bad = flags.any(0)
    status = first_true_of(bad, header.BAD_PAYLOAD)
    if codes is not None:
        not_finite = (extremes_not_finite_fusable if fusable else extremes_not_finite)(u, None)
        status = torch.where(status == header.OK, not_finite.to(torch.int64) * header.OVERFLOW, status)
    return u, flags, bad, status


def _mean_of_signs(payloads: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                   scales: torch.Tensor | None, into: torch.Tensor | None, table: torch.Tensor
                   ) -> tuple[torch.Tensor, ...]:
    values, bad = checked_signs(payloads, table)
    return _checked(_plus_memory(values, count, codes, scales, into, False), bad.unsqueeze(0), codes, False)


def _mean_of_signs_fusable(payloads: torch.Tensor, count: torch.Tensor, codes: torch.Tensor | None,
                           scales: torch.Tensor | None, into: torch.Tensor | None, table: torch.Tensor
                           ) -> tuple[torch.Tensor, ...]:
    values, bad = checked_signs_fusable(payloads, table)
    return _checked(_plus_memory(values, count, codes, scales, into, True), bad.unsqueeze(0), codes, True)


# one kernel where compiled (a GPU), where the decode, the mean with the memory and the status were three calls;
# a CPU decodes by table in cache-sized blocks and adds each sender in place
_mean_of_signs_kernel = kernels.FusedKernel(_mean_of_signs, _mean_of_signs_fusable, compile_on_cpu=False)
TORCH_REFERENCES["mean_of_signs"] = _mean_of_signs  # the reference of a GPU's Triton kernel


def _mean_of_kept(decode: Callable, fusable: bool, payloads: torch.Tensor, count: torch.Tensor,
                  codes: torch.Tensor | None, scales: torch.Tensor | None, into: torch.Tensor | None, size: int,
                  *args: object) -> tuple[torch.Tensor, ...]:
    """Going on from a row decoder's kept values (``compressors.base.RowDecoder``): each row dense
    over its ``size`` elements (its values at its positions, +0.0 elsewhere, as ``decode_rows``
    scatters them), then ``_plus_memory`` and the status."""
    positions, values, flags = decode(payloads, *args)
    dense = torch.zeros(payloads.shape[0], size, dtype=torch.float32, device=payloads.device)
    dense = dense.scatter(1, positions, values) if fusable else dense.scatter_(1, positions, values)
    return _checked(_plus_memory(dense, count, codes, scales, into, fusable), flags, codes, fusable)


# each operator's function of its own: dynamo's limit on graphs counts per function
def _mean_of_topk(*args):
    return _mean_of_kept(topk.kept_rows, False, *args)


def _mean_of_topk_fusable(*args):
    return _mean_of_kept(topk.kept_rows_fusable, True, *args)


def _mean_of_blocksign(*args):
    return _mean_of_kept(blocksign.kept_rows, False, *args)


def _mean_of_blocksign_fusable(*args):
    return _mean_of_kept(blocksign.kept_rows_fusable, True, *args)


# (``args``: the fold's, ``mean_of_payloads``' order; the sixth is the chunk's length)
def _mean_of_blocksign_coded(ranks: torch.Tensor, *args):
    return _with_codes(_mean_of_blocksign(*args), args[5], ranks, blocksign.block_codes)


def _mean_of_blocksign_coded_fusable(ranks: torch.Tensor, *args):
    return _with_codes(_mean_of_blocksign_fusable(*args), args[5], ranks, blocksign.block_codes_fusable)


def _with_codes(formed: tuple[torch.Tensor, ...], size: int, ranks: torch.Tensor, codes_of: Callable
                ) -> tuple[torch.Tensor, ...]:
    """``formed`` (u first) and the blocksign codes of u's first ``size`` elements as one row of
    blocks of ``ranks``' length, as ``BlockSignCompressor.whole_block_codes`` takes them."""
    u = formed[0].reshape(-1)[:size].view(1, -1, ranks.shape[0])
    return (*formed, *codes_of(u, ranks))


#: the operators whose row decoder yields kept values (``kept_rows_decoder``), by exact type (a subclass may decode
#: otherwise), with their kernel: one where compiled (a GPU), where the decode, a fill and a scatter, the mean with
#: the memory and the status were three calls and two ops
_KEPT = {
    topk.TopKCompressor: kernels.FusedKernel(_mean_of_topk, _mean_of_topk_fusable, compile_on_cpu=False),
    blocksign.BlockSignCompressor: kernels.FusedKernel(_mean_of_blocksign, _mean_of_blocksign_fusable,
                                                       compile_on_cpu=False),
}
#: the same kernels with a blocksign encoder's codes of u (``mean_of_payloads``' ``encoder``): blocksign's
#: own, where both passes use it
_CODED = {
    blocksign.BlockSignCompressor: kernels.FusedKernel(_mean_of_blocksign_coded, _mean_of_blocksign_coded_fusable,
                                                       compile_on_cpu=False),
}
TORCH_REFERENCES["mean_of_topk"] = _mean_of_topk  # the references of a GPU's Triton kernels
TORCH_REFERENCES["mean_of_blocksign"] = _mean_of_blocksign
