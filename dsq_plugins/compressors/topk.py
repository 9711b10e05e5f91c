"""``topk``: the k elements of largest magnitude, with their positions.

Wire format, 8·k bytes:
    [0:4k]    float32 values, in the order of their positions
    [4k:8k]   int32 positions, strictly increasing (0 <= position < numel)
k is ``k`` if given, else max(1, round(ratio·numel)), never above numel; the
receiver derives it from numel the same way, so k itself is not sent.
Biased, a contraction: ||x - C(x)||² <= (1 - k/n)·||x||²."""
from __future__ import annotations

from typing import Callable

import torch

from .base import RowDecoder, SparseCompressor, as_bytes, columns_as, refuse_if_any, refuse_rows_if_any
from . import kernels, radix_select, topk_codec
from .own_kernels import TORCH_REFERENCES
from .finite import NONFINITE_WORDS
from .kernels import CPU_BLOCK, blocks

__all__ = ["kept_payload_rows", "kept_payload_rows_fusable", "kept_rows", "kept_rows_fusable", "top_magnitudes",
           "TopKCompressor"]

# below this many elements torch.topk is as fast as anything cleverer
_SAMPLED_FROM = 1 << 16
_SAMPLE = 1 << 16


def top_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k elements of largest |value|, increasing: the exact
    set, found without a selection over all n elements when n is large.

    A fixed-seed sample estimates a threshold that about 2k elements pass;
    every element above the k-th largest magnitude passes any threshold at or
    below it, so the k largest of the passing candidates are the exact
    top-k. If the estimate was too high (fewer than k pass), the full
    torch.topk runs instead: the result is exact either way, only the time
    differs. Of equal magnitudes at the k-th place, the sampled path keeps
    the first positions (torch.topk's choice is unspecified).

    On a GPU the sample's host round trips (the candidates' count, nonzero's
    size) cost more than torch.topk's one selection, which runs instead."""
    n = flat.numel()
    if n < _SAMPLED_FROM or 4 * k >= n or kernels.launch_bound(flat.device):
        return _full_top_magnitudes(flat, k)
    gen = torch.Generator(device=flat.device).manual_seed(0)
    sample = flat[torch.randint(n, (_SAMPLE,), generator=gen, device=flat.device)].abs()
    passing = max(1, min(_SAMPLE, -(-2 * k * _SAMPLE // n)))
    threshold = torch.topk(sample, passing, sorted=False).values.min()
    candidates = _positions_at_least(flat, threshold)
    if candidates.numel() < k:
        return _full_top_magnitudes(flat, k)
    return candidates[_largest_in_order(flat.index_select(0, candidates).abs_(), k)]


def _full_top_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """``top_magnitudes`` by one selection over all of ``flat``."""
    return torch.topk(flat.abs(), k, sorted=False).indices.sort().values


def _positions_at_least(flat: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Increasing positions of |flat| >= threshold. On a CPU, block by block:
    each block's mask stays in cache, where a full-size one costs its page
    faults twice, written and then scanned (64M elements: 172 -> 139 ms)."""
    parts = blocks(flat)
    if len(parts) == 1:
        return _positions_of(flat.abs() >= threshold)
    scratch = torch.empty(CPU_BLOCK, dtype=flat.dtype, device=flat.device)
    mask = torch.empty(CPU_BLOCK, dtype=torch.bool, device=flat.device)
    found = []
    for a, block in parts:
        m = block.numel()
        torch.ge(torch.abs(block, out=scratch[:m]), threshold, out=mask[:m])
        found.append(_positions_of(mask[:m]).add_(a))
    return torch.cat(found)


def _positions_of(mask: torch.Tensor) -> torch.Tensor:
    """``nonzero(mask)`` for a sparse boolean mask, in two levels: the mask read
    as int64 words first (8 flags each), then only the flags of the words
    that hold any. torch's nonzero costs a few ns per element scanned; this
    scans an eighth of them plus the hit words (at 16M elements and 2% set,
    16 -> 11 ms on this CPU)."""
    whole = mask.numel() // 8 * 8
    if whole == 0:
        return torch.nonzero(mask).squeeze(1)
    words = mask[:whole].view(torch.int64)
    hit = torch.nonzero(words).squeeze(1)
    flag = torch.nonzero(words.index_select(0, hit).view(torch.bool)).squeeze(1)  # 8 flags per hit word
    found = hit.index_select(0, flag >> 3).mul_(8).add_(flag & 7)
    if whole == mask.numel():
        return found
    return torch.cat([found, torch.nonzero(mask[whole:]).squeeze(1).add_(whole)])


def _largest_in_order(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the k largest ``magnitudes``, the first of equals at the k-th
    place: selecting by mask keeps the candidates' increasing order, where
    torch.topk's indices would need a sort."""
    kth = torch.topk(magnitudes, k, sorted=False).values.min()
    keep = magnitudes > kth
    tied = magnitudes == kth
    return keep.logical_or_(tied.logical_and_(tied.cumsum(0) <= k - keep.sum()))


class TopKCompressor(SparseCompressor):
    """``topk``; the wire format is in this module's docstring."""

    name = "topk"
    unbiased = False
    decodes_finite = True  # its values are the vector's own
    checks_finite = True  # the row decode checks the k values themselves, not the dense row they scatter into
    sparse = True
    positions_increase = True

    def payload_nbytes(self, numel: int) -> int:
        return 8 * self.count(numel)

    def _encode(self, flat, seed, shared=None):
        if kernels.launch_bound(flat.device):  # the same selection, by the rows' fused encode
            return self._encode_rows(flat.view(1, -1), [seed])[0]
        k = self.count(flat.numel())
        # increasing, so that every receiver checks the positions are distinct in one pass
        idx = top_magnitudes(flat, k)
        return torch.cat([as_bytes(flat.index_select(0, idx)), as_bytes(idx.to(torch.int32))])

    def encodes_rows(self, device: torch.device) -> bool:
        # a GPU selects every row at once (radix_select, or torch.topk); on a CPU the sampled threshold is the faster
        return kernels.launch_bound(device)

    def _encode_rows(self, rows, seeds, shared=None):
        made = radix_select.payloads_of_largest(rows, self.count(rows.shape[1]))  # a GPU's select writes them
        return made if made is not None else _rows_payload_kernel(rows, self._row_positions(rows), numel=rows.numel())

    def kept_positions(self, rows: torch.Tensor) -> torch.Tensor | None:
        """For chunks of one size as ``rows`` (count, size > 0): each row's kept positions,
        increasing, as ``compress_chunks`` selects them on this device (its payloads are
        ``kept_payload_rows`` of the rows and these). On a GPU ``radix_select`` keeps the first of
        equal magnitudes at the k-th place, as ``top_magnitudes`` does. None where a CPU selects
        chunk by chunk (``top_magnitudes``' sampled threshold)."""
        if rows.shape[1] == 0 or not self.encodes_rows(rows.device):
            return None
        return self._row_positions(rows)

    def _row_positions(self, rows: torch.Tensor) -> torch.Tensor:
        k = self.count(rows.shape[1])
        radix = radix_select.positions_of_largest(rows, k)  # a GPU's selection in a fixed number of launches
        return radix if radix is not None else radix_select.torch_positions(rows, k)

    def decodes_rows(self, device):
        # on a CPU each sender's kept elements are added sparsely, which a dense row of each would outweigh
        return kernels.launch_bound(device)

    def _dense_rows(self, payloads, numel, into, flags):
        made = topk_codec.topk_decoded(payloads, numel, into, flags)  # a GPU's, in Triton
        return None if made is None else (*made, _refusal_words(numel))

    def _decode_rows(self, payloads, numel, seeds, refusals):
        values, flags = _dense(payloads, numel, lambda rows, n: _rows_kernel(rows, n, numel=rows.numel()))
        refuse_rows_if_any(*zip(flags.unbind(), _refusal_words(numel)), refusals=refusals)
        return values

    def kept_rows_decoder(self, payloads, numel):
        if not self.decodes_rows(payloads.device) or numel <= 0:
            return None
        return RowDecoder((numel,), _refusal_words(numel), _rows_into_kernel)

    def subtract_own_rows_(self, rows, payloads, seeds):
        # what each row kept is its own values, so v - Q(v) is v with them zeroed: x - x is +0 exactly for a
        # finite x (a non-finite v fails or skips its step, and nothing staged from it is written)
        if not self.decodes_rows(rows.device):
            return super().subtract_own_rows_(rows, payloads, seeds)
        _, idx, _ = _rows_kernel(payloads, rows.shape[1], numel=payloads.numel())
        return rows.scatter_(1, idx, 0.0)

    def _decode_sparse(self, payload, numel, seed, refusals):
        values, idx, flags = _rows_kernel(payload.view(1, -1), numel, numel=payload.numel())
        refuse_if_any(*zip(flags.unbind(), _refusal_words(numel)), refusals=refusals)
        return idx[0], values[0]  # in range whatever the bytes (a deferred check)


def kept_payload_rows(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Each row's payload: its values at ``idx`` (increasing), then ``idx`` as int32."""
    return torch.cat([rows.gather(1, idx).view(torch.uint8), idx.to(torch.int32).view(torch.uint8)], dim=1)


def kept_payload_rows_fusable(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``kept_payload_rows`` as one compiled kernel writes it (the same bytes)."""
    values = rows.gather(1, idx).view(torch.int32)
    return kernels.side_by_side(kernels.words_as_bytes(values), kernels.words_as_bytes(idx.to(torch.int32)))


# the gather, the cast and the payload's bytes in one kernel where compiled (a GPU)
_rows_payload_kernel = kernels.FusedKernel(kept_payload_rows, kept_payload_rows_fusable, compile_on_cpu=False)


def _checked_rows(payloads: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of top-k payloads (k values, then k positions, each; ``numel``
    > 0): (values, positions clamped into the vector, and (3, rows) flags:
    per row whether a position was outside it; whether they fail to
    increase (increasing, hence distinct, or the decoded value would depend
    on scatter order); whether a value is NaN or Inf (the row decodes to its
    values and zeros, so this is its finiteness without a pass over the
    dense row)). The flags are one tensor so that a deferred check takes
    them as they are."""
    k = payloads.shape[1] // 8
    values = columns_as(payloads, 0, 4 * k, torch.float32)
    idx = columns_as(payloads, 4 * k, 8 * k, torch.int32).to(torch.int64)
    outside, unordered = (idx < 0) | (idx >= numel), idx.diff(dim=-1) <= 0
    flags = torch.stack([outside.any(1), unordered.any(1), values.isfinite().logical_not_().any(1)])
    return values, idx.clamp_(0, numel - 1), flags


def _checked_rows_fusable(payloads: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = payloads.shape[1] // 8
    values = payloads[:, :4 * k].clone().view(torch.float32)  # a copy: one row's would alias the payload
    idx = payloads[:, 4 * k:].contiguous().view(torch.int32).to(torch.int64)
    outside, unordered = (idx < 0) | (idx >= numel), idx.diff(dim=-1) <= 0
    return values, idx.clamp(0, numel - 1), torch.stack([outside.any(1), unordered.any(1), ~values.isfinite().all(1)])


# a row decode's copies out of the bytes and its checks in one kernel where compiled (a GPU)
_rows_kernel = kernels.FusedKernel(_checked_rows, _checked_rows_fusable, compile_on_cpu=False)


def _kept_rows_into(into: torch.Tensor, payloads: torch.Tensor, numel: int) -> torch.Tensor:
    """``_checked_rows`` decoded into the rows ``into`` (``kernels.scattered_into``); the flags."""
    values, idx, flags = _checked_rows(payloads, numel)
    kernels.scattered_into(into, idx, values, False)
    return flags


def _kept_rows_into_fusable(into: torch.Tensor, payloads: torch.Tensor, numel: int) -> torch.Tensor:
    values, idx, flags = _checked_rows_fusable(payloads, numel)
    kernels.scattered_into(into, idx, values, True)
    return flags


# rows decoded into a caller's buffer in one kernel where compiled, where a fill, a scatter and a copy followed it
_rows_into_kernel = kernels.FusedKernel(_kept_rows_into, _kept_rows_into_fusable, compile_on_cpu=False)


def kept_rows(payloads: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_checked_rows`` as a ``RowDecoder`` gives it: (positions, values, flags)."""
    values, idx, flags = _checked_rows(payloads, numel)
    return idx, values, flags


def kept_rows_fusable(payloads: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, idx, flags = _checked_rows_fusable(payloads, numel)
    return idx, values, flags


def _dense(payloads: torch.Tensor, numel: int, checked: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows decoded dense, their (3, rows) flags) from ``checked``'s (values, positions, flags): zeros with
    each row's values scattered at its positions."""
    values, idx, flags = checked(payloads, numel)
    dense = torch.zeros(payloads.shape[0], numel, dtype=torch.float32, device=payloads.device)
    return dense.scatter_(1, idx, values), flags


def _decoded_rows_by_torch(payloads: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_dense`` by torch's eager ops: the reference of a GPU's Triton decode."""
    return _dense(payloads, numel, _checked_rows)


TORCH_REFERENCES["topk_decoded"] = _decoded_rows_by_torch


def _refusal_words(numel: int) -> tuple[str, str, str]:
    """What each of ``_checked_rows``' flags refuses, in words (the last as every decoder's finiteness test)."""
    return (f"topk: payload holds positions outside [0, {numel})",
            "topk: payload positions are not strictly increasing (repeated or out of order)", NONFINITE_WORDS)
