"""``blocksign``: in every block of ``block`` elements, the one of largest
magnitude, as its position and its sign; one shared magnitude per payload.
Below one bit per element: 8/``block`` bits (0.25 for the default 32).

Wire format, 4 + ceil(numel/block) bytes:
    [0:4]   float32 scale s: the mean magnitude of the kept elements
    [4:]    one byte per block, element 0's block first: 2·position + sign,
            position in [0, block) within the block, sign 1 for non-negative
            (the last block may be shorter; its position is below its length)
Decoded: s·(±1) at each block's kept position, zeros elsewhere.

Top-k with sign-valued entries and positions coded in fixed width: one kept
element per block bounds the position to log2(block) bits, so every payload
has the same size for the same numel (no variable-length code, and plain
torch ops on CUDA). With s the mean kept magnitude it is a contraction,
||x - C(x)||² = ||x||² - k·s², so error feedback applies.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..errors import ConfigError
from .base import (columns_as, Compressor, not_finite_nonnegative, positive_int, refuse_if_any, RowDecoder,
                   refuse_rows_if_any)
from . import blocksign_codec, kernels
from .kernels import FusedKernel
from .own_kernels import TORCH_REFERENCES

__all__ = ["block_codes", "block_codes_fusable", "BlockSignCompressor", "kept_rows", "kept_rows_fusable", "MAX_BLOCK",
           "payload_rows", "payload_rows_fusable", "position_ranks"]

MAX_BLOCK = 128  # 2·position + sign must fit in a byte


def block_codes(rows: torch.Tensor, countdown: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(one byte per block, the blocks along the last dimension: 2·position +
    sign of its largest |x|; that element's magnitude, which the scale sums).
    ``argmax`` picks the first of equal magnitudes."""
    where = rows.abs().argmax(dim=-1)
    kept = rows.gather(-1, where.unsqueeze(-1)).squeeze(-1)
    return (where * 2 + (kept >= 0)).to(torch.uint8), kept.abs()


def block_codes_fusable(rows: torch.Tensor, countdown: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same codes from two max-reductions, which inductor fuses into one
    pass (argmax over short rows is slow on a CPU): the row's max |x|, then
    the largest ``countdown`` (block - position) among the elements equal to
    it, which is the first of them, as argmax's. A block holding a NaN has a
    NaN maximum that nothing equals: its position is clamped inside the
    block (a compiled gather outside it is a crash, on CUDA a device-side
    assert) and its kept value is the NaN, so the scale is NaN and the
    receiver refuses the payload, as it does eager's (which keeps the first
    NaN; matching NaNs in the pass itself made it twice as slow on a CPU)."""
    a = rows.abs()
    top = a.amax(dim=-1, keepdim=True)
    where = (rows.shape[-1] - torch.where(a == top, countdown, 0.0).amax(dim=-1)).clamp(max=rows.shape[-1] - 1).long()
    top = top.squeeze(-1)
    kept = torch.where(top.isnan(), top, rows.gather(-1, where.unsqueeze(-1)).squeeze(-1))
    return (where * 2 + (kept >= 0)).to(torch.uint8), kept.abs()


_codes_kernel = FusedKernel(block_codes, block_codes_fusable)


class BlockSignCompressor(Compressor):
    """``blocksign``; the wire format is in this module's docstring."""

    name = "blocksign"
    unbiased = False
    sparse = True
    positions_increase = True
    checks_finite = True  # a scale that passes is finite, and every value is ± it
    decodes_finite = True  # its scale is clamped to a finite float (``payload_rows``): own payloads go unchecked

    def __init__(self, block: int = 32, seed: int = 0):
        super().__init__(seed)
        positive_int(block, "blocksign: block")
        if not 2 <= block <= MAX_BLOCK:
            raise ConfigError(f"blocksign: block must be between 2 and {MAX_BLOCK}, got {block}")
        self.block = block

    def params(self):
        return {"block": self.block, **super().params()}

    def payload_nbytes(self, numel: int) -> int:
        return 0 if numel == 0 else 4 + -(-numel // self.block)

    def _encode(self, flat, seed, shared=None):
        return self._encode_rows(flat.view(1, -1), [seed])[0]

    def encodes_rows(self, device: torch.device) -> bool:
        # on a CPU each chunk is already one compiled pass
        return kernels.launch_bound(device)

    def _encode_rows(self, rows, seeds, shared=None):
        """Each row's full blocks as a view (no copy of the chunk), its short
        last block padded with zeros (never picked unless all of it is zero);
        on a GPU, Triton's codec."""
        made = blocksign_codec.blocksign_encoded(rows, self.block)
        if made is not None:
            return made
        parts = self.whole_block_codes(rows)
        if parts is not None:  # whole blocks: the scales' bytes and the codes in one kernel where compiled
            _, codes, magnitudes, divisor = parts
            return _payload_kernel(magnitudes, divisor, codes, numel=rows.numel())
        return _padded_payloads(rows, self.block, lambda blocks, ranks: _codes_kernel(blocks, ranks,
                                                                                     numel=blocks.numel()))

    def whole_block_codes(self, rows: torch.Tensor, coded: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For chunks of one size as ``rows`` (count, size): (the rows as (count, blocks, block), each
        block's code, each row's sum of kept magnitudes, the divisor of all) as ``compress_chunks``
        makes them, whose payloads are ``payload_rows`` of the last three. None where the size is not
        whole blocks (a short last block is padded on its own). ``coded``: the blocks' (codes, kept
        magnitudes) where a kernel that formed ``rows`` also took them (``codes_with``)."""
        count, size = rows.shape
        if size == 0 or size % self.block:
            return None
        blocks = rows.unflatten(1, (-1, self.block))
        divisor = kernels.device_constant(float(size // self.block), rows.device)
        codes, kept = _codes_kernel(blocks, position_ranks(self.block, rows.device), numel=count * size) \
            if coded is None else coded
        return blocks, codes, kept.sum(dim=1), divisor

    def codes_with(self, kernel: kernels.FusedKernel, numel: int, kernel_numel: int, device: torch.device) -> bool:
        """Whether ``kernel``, called over ``kernel_numel`` elements, may also form the codes of a vector
        of ``numel`` elements it writes (a row of whole blocks), for ``whole_block_codes``' ``coded``:
        the codes are then ``block_codes``' or ``block_codes_fusable``'s as this encoder would take them
        on its own, eager or compiled alike."""
        return (numel > 0 and numel % self.block == 0
                and kernel.uses_compiled(kernel_numel, device) == _codes_kernel.uses_compiled(numel, device))

    def decodes_rows(self, device):
        # on a CPU each sender's kept elements are added sparsely, which a dense row of each would outweigh
        return kernels.launch_bound(device)

    def _dense_rows(self, payloads, numel, into, flags):
        made = blocksign_codec.blocksign_decoded(payloads, numel, self.block, into, flags)  # a GPU's, in Triton
        return None if made is None else (*made, self._words(numel))

    def _decode_rows(self, payloads, numel, seeds, refusals):
        values, flags = _dense(*self._kept_and_checked(payloads, numel), payloads.shape[0], numel)
        refuse_rows_if_any(*zip(flags.unbind(), self._words(numel)), refusals=refusals)
        return values

    def subtract_own_rows_(self, rows, payloads, seeds):
        # v - Q(v) is v less ±s at each block's kept position: one scatter-add of the negated values (x + (-y)
        # is x - y exactly), where a dense decode and a subtraction were two more passes
        if not self.decodes_rows(rows.device):
            return super().subtract_own_rows_(rows, payloads, seeds)
        positions, negated, _ = self._kept_and_checked(payloads, rows.shape[1], sign=-1.0)
        return rows.scatter_add_(1, positions, negated)

    def _decode_sparse(self, payload, numel, seed, refusals):
        positions, values, flags = self._kept_and_checked(payload.view(1, -1), numel)
        refuse_if_any(*zip(flags.unbind(), self._words(numel)), refusals=refusals)
        return positions[0], values[0]  # one position per block, distinct by construction

    def kept_rows_decoder(self, payloads, numel):
        if not self.decodes_rows(payloads.device) or numel <= 0:
            return None
        blocks, device = payloads.shape[1] - 4, payloads.device
        return RowDecoder((_block_starts(blocks, self.block, device), _block_lengths(blocks, self.block, numel, device),
                           _units(device), numel), self._words(numel), _rows_into_kernel)

    def _kept_and_checked(self, payloads: torch.Tensor, numel: int, sign: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of this operator's payloads for ``numel`` (> 0) elements, by
        the rows' kernel: (positions, values times ``sign``, (2, rows) flags:
        bad scale, position outside)."""
        blocks, device = payloads.shape[1] - 4, payloads.device
        return _rows_kernel(payloads, _block_starts(blocks, self.block, device),
                            _block_lengths(blocks, self.block, numel, device), _units(device, sign), numel,
                            numel=payloads.numel())

    def _words(self, numel: int) -> tuple[str, str]:
        """What each of ``_kept_and_checked``' flags refuses, in words."""
        return ("blocksign: scale in payload is negative or not finite",
                f"blocksign: payload holds positions outside their blocks of {self.block} (or past {numel})")


def _padded_payloads(rows: torch.Tensor, block: int, codes_of: Callable) -> torch.Tensor:
    """Each row's payload by ``codes_of(blocks, ranks)`` over its whole blocks and eager ``block_codes``
    over its short last block, padded with zeros: torch's encode."""
    size = rows.shape[1]
    whole = size - size % block
    ranks = position_ranks(block, rows.device)
    coded = [codes_of(rows[:, :whole].unflatten(1, (-1, block)), ranks)] if whole else []
    if whole < size:
        coded.append(block_codes(torch.nn.functional.pad(rows[:, whole:], (0, whole + block - size)).unsqueeze(1),
                                 ranks))
    codes, kept = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in zip(*coded))
    divisor = kernels.device_constant(float(kept.shape[1]), rows.device)
    return payload_rows(kept.sum(dim=1), divisor, codes)


def _payloads_by_torch(rows: torch.Tensor, block: int) -> torch.Tensor:
    """The payload rows by torch's eager ops: the reference of a GPU's Triton codec."""
    return _padded_payloads(rows, block, block_codes)


def _decoded_rows_by_torch(payloads: torch.Tensor, numel: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows decoded dense, their (2, rows) flags) by torch's eager ops: the reference of a GPU's Triton codec."""
    blocks, device = payloads.shape[1] - 4, payloads.device
    return _dense(*kept_rows(payloads, _block_starts(blocks, block, device),
                             _block_lengths(blocks, block, numel, device), _units(device), numel),
                  payloads.shape[0], numel)


def _dense(positions: torch.Tensor, values: torch.Tensor, flags: torch.Tensor, rows: int, numel: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of zeros with the kept ``values`` scattered at their ``positions``, the ``flags``)."""
    dense = torch.zeros(rows, numel, dtype=torch.float32, device=values.device)
    return dense.scatter_(1, positions, values), flags


TORCH_REFERENCES["blocksign_payloads"] = _payloads_by_torch
TORCH_REFERENCES["blocksign_decoded"] = _decoded_rows_by_torch


def payload_rows(magnitudes: torch.Tensor, divisor: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Each row's payload: its scale, the mean kept magnitude (their sum
    ``magnitudes`` / ``divisor``, clamped to a finite float), then its codes."""
    scale = (magnitudes / divisor).clamp_(max=torch.finfo(torch.float32).max)
    return torch.cat([scale.view(torch.uint8).view(-1, 4), codes], dim=1)


def payload_rows_fusable(magnitudes: torch.Tensor, divisor: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``payload_rows`` as one compiled kernel writes it (the same bytes)."""
    scale = (magnitudes / divisor).clamp(max=torch.finfo(torch.float32).max)
    return kernels.side_by_side(kernels.words_as_bytes(scale.view(torch.int32).view(-1, 1)), codes)


# the scale's division, its bytes and the codes side by side in one kernel where compiled (a GPU)
_payload_kernel = FusedKernel(payload_rows, payload_rows_fusable, compile_on_cpu=False)


def kept_rows(payloads: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, units: torch.Tensor,
              numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of payloads (a scale, then a code per block) decoded to (kept
    positions in the vector, clamped into it; their values; (2, rows) flags:
    per row whether its scale is negative or not finite, whether a position
    is outside its block). One position per block, in range whatever the
    bytes. The flags are one tensor so that a deferred check takes them as
    they are."""
    scale = columns_as(payloads, 0, 4, torch.float32)
    codes = payloads[:, 4:]
    where = codes >> 1
    positions = (starts + where).clamp_(max=numel - 1)
    flags = torch.stack([not_finite_nonnegative(scale.reshape(-1)), (where >= lengths).any(1)])
    return positions, units[codes.to(torch.int64)] * scale, flags


def kept_rows_fusable(payloads: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, units: torch.Tensor,
                      numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = columns_as(payloads, 0, 4, torch.float32)
    codes = payloads[:, 4:]
    where = codes >> 1
    bad_scale = ~((scale >= 0) & (scale <= torch.finfo(torch.float32).max)).reshape(-1)  # NaN fails both
    return (starts + where).clamp(max=numel - 1), units[codes.to(torch.int64)] * scale, \
        torch.stack([bad_scale, (where >= lengths).any(1)])


# a row decode's scale copy, checks, positions and values in one kernel where compiled (a GPU)
_rows_kernel = FusedKernel(kept_rows, kept_rows_fusable, compile_on_cpu=False)


def _kept_rows_into(into: torch.Tensor, payloads: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                    units: torch.Tensor, numel: int) -> torch.Tensor:
    """``kept_rows`` decoded into the rows ``into`` (``kernels.scattered_into``); the flags."""
    positions, values, flags = kept_rows(payloads, starts, lengths, units, numel)
    kernels.scattered_into(into, positions, values, False)
    return flags


def _kept_rows_into_fusable(into: torch.Tensor, payloads: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                            units: torch.Tensor, numel: int) -> torch.Tensor:
    positions, values, flags = kept_rows_fusable(payloads, starts, lengths, units, numel)
    kernels.scattered_into(into, positions, values, True)
    return flags


# rows decoded into a caller's buffer in one kernel where compiled, where a fill, a scatter and a copy followed it
_rows_into_kernel = FusedKernel(_kept_rows_into, _kept_rows_into_fusable, compile_on_cpu=False)


@functools.lru_cache(maxsize=None)
def position_ranks(block: int, device: torch.device) -> torch.Tensor:
    """block, block - 1, ..., 1 (float32): what the fusable encoder ranks equal magnitudes by."""
    return torch.arange(block, 0, -1, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _units(device: torch.device, sign: float = 1.0) -> torch.Tensor:
    """(256,) float32: the sign a code byte stands for, +1 where its low bit is set, else -1 (times ``sign``)."""
    return torch.where(torch.arange(256, device=device) % 2 == 1, sign, -sign)


@functools.lru_cache(maxsize=16)  # a few chunk sizes per model
def _block_lengths(blocks: int, block: int, numel: int, device: torch.device) -> torch.Tensor:
    """Each block's length (uint8: the last may be shorter): a position at or past it is outside its block."""
    lengths = torch.full((blocks,), block, dtype=torch.uint8, device=device)
    if blocks:
        lengths[-1] = numel - (blocks - 1) * block
    return lengths


@functools.lru_cache(maxsize=16)  # a few chunk sizes per model
def _block_starts(blocks: int, block: int, device: torch.device) -> torch.Tensor:
    """0, block, 2·block, ...: where each block starts (int64, for index ops); the same every step."""
    return torch.arange(blocks, device=device, dtype=torch.int64) * block
