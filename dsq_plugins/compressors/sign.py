"""``sign``: one bit per element plus one scale (1-bit SGD / scaled signSGD).

Wire format, 4 + ceil(numel/8) bytes:
    [0:4]   float32 scale s
    [4:]    sign bits, 1 = non-negative, element 0 in the most significant bit
            of the first byte (numpy.packbits order), zero padding at the end
Decoded value of element i: +s if its bit is 1, else -s. Zero counts as
non-negative, as in DeepSpeed's 1-bit backends.

Scale: ``"mean"`` (default) is mean(|v|), which minimises ||v - s·sign(v)||
and makes the operator a contraction; ``"rms"`` is ||v||/sqrt(numel), what
DeepSpeed's 1-bit Adam used. ``scope="chunk"`` (default) computes it over each
compressed chunk; ``scope="tensor"`` once over the whole vector the reducer
cuts into chunks (DeepSpeed's 1-bit backends: one scale per worker buffer).
The payload format is the same either way.

``block=B`` sends one scale per block of B elements instead (the last block
of a chunk may be shorter), as bfloat16, which keeps float32's range:

    [0:2·K]   K = ceil(numel/B) bfloat16 scales, block 0's first
    [2·K:]    the sign bits, as above

16/B bits more per element (B = 128: 1.125 bits). A pseudo-gradient or a
gradient whose magnitudes differ by layer (embeddings, attention, norms) is
sent far closer by a scale per block than by one for a whole chunk that
spans several layers (docs/results/local-steps.md, "Local steps on the LM", measures
it)."""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from . import bitpack, kernels, sign_codec
from .base import (as_bytes, columns_as, Compressor, from_bytes, not_finite_nonnegative,
                   positive_int, Refusals, refuse_if_any, refuse_rows_if_any, TRUSTED)

__all__ = ["magnitude", "scale_divisor", "SCALES", "SCOPES", "SignCompressor", "signs_decoded", "signs_payload",
           "signs_rows", "signs_rows_fusable", "checked_signs", "checked_signs_fusable",
           "SCALE_REFUSED"]

SCALES = ("mean", "rms")
#: what sign's row decoders say of a row whose scale they refuse
SCALE_REFUSED = "sign: scale in payload is negative or not finite"
_FLOAT32_MAX = torch.finfo(torch.float32).max
_BFLOAT16_MAX = torch.finfo(torch.bfloat16).max
SCOPES = ("chunk", "tensor")


def magnitude(values: torch.Tensor, scale: str) -> torch.Tensor:
    """The one magnitude sent for the signs of ``values`` (non-empty), 0-d:
    mean |v| (``"mean"``) or their root mean square (``"rms"``), clamped so
    that finite values whose sum overflows still make a payload that decodes."""
    magnitudes = kernels.l1_norm(values) if scale == "mean" else values.norm()
    return (magnitudes / scale_divisor(values.numel(), scale, values.device)).clamp(max=_FLOAT32_MAX)


def scale_divisor(size: int, scale: str, device: torch.device) -> torch.Tensor:
    """What the magnitude of ``size`` values is divided by for their scale (``size`` for ``"mean"``, its square
    root for ``"rms"``), as a device constant: CUDA divides by a host number as a multiply by its reciprocal, a
    last bit away from the true division a CPU and a compiled kernel do."""
    return kernels.device_constant(float(size) if scale == "mean" else math.sqrt(size), device)


def signs_payload(values: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[fp32 s][a bit per value, 1 = non-negative, packbits order]: sign's wire format."""
    return torch.cat([as_bytes(s.reshape(1)), bitpack.pack_nonnegative(values)])


def signs_decoded(payload: torch.Tensor, count: int, name: str, refusals: Refusals = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``count`` values ±s of a ``signs_payload`` (written into ``out``
    where ``kernels.lookup`` can); a negative or non-finite s is a
    ``PayloadError`` naming the operator ``name``."""
    s = from_bytes(payload[:4], torch.float32)
    if refusals is not TRUSTED:
        refuse_if_any((not_finite_nonnegative(s), f"{name}: scale in payload is negative or not finite"),
                      refusals=refusals)
    into = None if out is None or out.dim() != 1 else out.view(1, -1)
    decoded = sign_codec.signs_decoded_into(payload.view(1, -1), count, into, flags=False)  # a GPU's, in Triton
    if decoded is not None:
        return decoded[0].view(-1)
    return kernels.lookup(bitpack.sign_units(payload.device), payload[4:], count, scale=s, out=out)  # ±s exactly


class SignCompressor(Compressor):
    """``sign``; the wire format is in this module's docstring."""

    name = "sign"
    unbiased = False
    decodes_finite = True  # its scales are clamped to a finite float
    checks_finite = True  # a scale that passes is finite, and every value is ± it

    def __init__(self, scale: str = "mean", scope: str = "chunk", block: int | None = None, seed: int = 0):
        super().__init__(seed)
        if scale not in SCALES:
            raise ConfigError(f"sign: scale must be one of {SCALES}, got {scale!r}")
        if scope not in SCOPES:
            raise ConfigError(f"sign: scope must be one of {SCOPES}, got {scope!r}")
        if block is not None:
            positive_int(block, "sign: block")
            if scope == "tensor":
                raise ConfigError("sign: block (a scale per block) and scope='tensor' (one per vector) exclude "
                                  "each other")
        self.scale = scale
        self.scope = scope
        self.block = None if block is None else int(block)

    def params(self):
        blocked = {} if self.block is None else {"block": self.block}
        return {"scale": self.scale, "scope": self.scope, **blocked, **super().params()}

    def _scale_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.new_zeros(()) if flat.numel() == 0 else magnitude(flat, self.scale)

    def _row_scales(self, rows: torch.Tensor) -> torch.Tensor:
        """The scale of each row (a chunk), clamped as ``magnitude``'s."""
        divisor = scale_divisor(rows.shape[1], self.scale, rows.device)
        return (self._row_magnitudes(rows) / divisor).clamp_(max=_FLOAT32_MAX)

    def _row_magnitudes(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row's sum of |v| (``"mean"``) or L2 norm (``"rms"``): its scale
        before the division by ``scale_divisor``; one row's by the vector
        reductions (``magnitude``'s), several rows' by one along the rows."""
        if rows.shape[0] == 1:
            row = rows[0]
            return (kernels.l1_norm(row) if self.scale == "mean" else row.norm()).reshape(1)
        return rows.abs().sum(dim=1) if self.scale == "mean" else rows.norm(dim=1)

    def chunk_magnitudes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For chunks of one size as ``rows`` (count, size): (each row's magnitude, the divisor of
        all), of which ``compress_chunks`` makes each chunk's scale on this device (the quotient,
        clamped as ``magnitude``'s), to the same bits. None where a payload is not one scale and
        the signs (``block``)."""
        if self.block is not None:
            return None
        divisor = scale_divisor(rows.shape[1], self.scale, rows.device)
        if rows.shape[0] == 1 or self.encodes_rows(rows.device):
            return self._row_magnitudes(rows), divisor
        return torch.cat([self._row_magnitudes(row.view(1, -1)) for row in rows]), divisor  # each chunk's own

    def prepare(self, flat: torch.Tensor):
        return self._scale_of(flat.to(torch.float32)) if self.scope == "tensor" else None

    def payload_nbytes(self, numel: int) -> int:
        if numel == 0:
            return 0
        scales = 4 if self.block is None else 2 * -(-numel // self.block)
        return scales + bitpack.packed_nbytes(numel, 1)

    def _encode(self, flat: torch.Tensor, seed, shared=None):
        if self.block is not None:
            return self._encode_blocks(flat)
        if shared is None and kernels.launch_bound(flat.device) and (flat.numel() % 8 == 0
                                                                     or sign_codec.encodes(flat.view(1, -1))):
            return self._encode_rows(flat.view(1, -1), None)[0]  # the same bytes, in the rows' fused kernel
        if shared is None and self.scale == "mean":  # the scale and the bits from one read of flat
            payload, l1 = bitpack.nonnegative_bits_and_l1(flat, header=4)
            divisor = scale_divisor(flat.numel(), self.scale, flat.device)
            payload[:4] = as_bytes((l1 / divisor).clamp_(max=_FLOAT32_MAX).reshape(1))
            return payload
        return signs_payload(flat, self._scale_of(flat) if shared is None else shared)

    def _encode_blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """``block``'s wire format: a bfloat16 scale per block, then the bits."""
        whole = flat.numel() - flat.numel() % self.block
        scales = torch.empty(-(-flat.numel() // self.block), dtype=torch.float32, device=flat.device)
        if whole:
            scales[:whole // self.block] = self._row_scales(flat[:whole].view(-1, self.block))
        if whole < flat.numel():
            scales[-1] = magnitude(flat[whole:], self.scale)
        scales = scales.clamp_(max=_BFLOAT16_MAX).to(torch.bfloat16)  # float32's largest would round to inf
        return torch.cat([as_bytes(scales), bitpack.pack_nonnegative(flat)])

    def encodes_rows(self, device: torch.device) -> bool:
        # on a CPU each chunk's one sweep (scale and bits from one read) is the faster; blocks are per chunk
        return kernels.launch_bound(device) and self.block is None

    def _encode_rows(self, rows, seeds, shared=None):
        if self.block is not None:
            return torch.stack([self._encode_blocks(row) for row in rows])
        count, size = rows.shape
        ours = shared is None and sign_codec.encodes(rows)  # a GPU's, in Triton
        if ours or (shared is None and size % 8 == 0):  # the scales, their bytes and the bits in one kernel
            divisor, magnitudes = scale_divisor(size, self.scale, rows.device), self._row_magnitudes(rows)
            if ours:
                return sign_codec.encoded_rows(rows, magnitudes, divisor)
            return _signs_rows_kernel(rows, magnitudes, divisor, numel=rows.numel())
        scale = self._row_scales(rows) if shared is None else shared.reshape(1).expand(count).contiguous()
        payload = torch.empty(count, self.payload_nbytes(size), dtype=torch.uint8, device=rows.device)
        payload[:, :4] = scale.view(torch.uint8).view(count, 4)
        if size % 8 == 0:  # the rows' bits follow one another: one pack
            payload[:, 4:] = bitpack.pack_nonnegative(rows.reshape(-1)).view(count, -1)
        else:  # each row padded to whole bytes with zero bits, as a chunk's payload is
            flags = torch.zeros(count, -(-size // 8) * 8, dtype=torch.bool, device=rows.device)
            flags[:, :size] = rows >= 0
            payload[:, 4:] = bitpack.pack(flags.reshape(-1), 1).view(count, -1)
        return payload

    def _decode(self, payload, numel, seed, refusals):
        if self.block is None:
            return signs_decoded(payload, numel, "sign", refusals)
        return self._decode_blocks(payload, numel, refusals)

    def _decode_into(self, payload, numel, seed, refusals, into):
        if self.block is None:
            return signs_decoded(payload, numel, "sign", refusals, out=into)
        return self._decode_blocks(payload, numel, refusals)

    def decodes_rows(self, device):
        return self.block is None

    def _decode_rows(self, payloads, numel, seeds, refusals):
        return self._decode_rows_into(payloads, numel, seeds, refusals, None)

    def _decode_rows_into(self, payloads, numel, seeds, refusals, into):
        if refusals is not TRUSTED and kernels.launch_bound(payloads.device):
            return self._checked_rows_decoded(payloads, numel, refusals, into)
        if refusals is TRUSTED:
            decoded = sign_codec.signs_decoded_into(payloads, numel, into, flags=False)  # a GPU's, in Triton
            if decoded is not None:
                return decoded[0]
            s = columns_as(payloads, 0, 4, torch.float32)  # (rows, 1): each row's scale
        else:
            s, bad = _checked_scales_kernel(payloads, numel=payloads.numel())
            refuse_rows_if_any((bad, SCALE_REFUSED), refusals=refusals)
        return kernels.lookup_rows(bitpack.sign_units(payloads.device), payloads[:, 4:], numel, scales=s, out=into)

    def _checked_rows_decoded(self, payloads: torch.Tensor, numel: int, refusals: Refusals,
                              into: torch.Tensor | None) -> torch.Tensor:
        """Received rows decoded and their scales checked in one kernel where
        compiled (a GPU's call per decode is its cost, not the pass)."""
        decoded = sign_codec.signs_decoded_into(payloads, numel, into, flags=True)  # a GPU's, in Triton
        if decoded is not None:
            refuse_rows_if_any((decoded[1], SCALE_REFUSED), refusals=refusals)
            return decoded[0]
        table, count = bitpack.sign_units(payloads.device), payloads.shape[0]
        n = count * (payloads.shape[1] - 4) * 8  # the values every row's bytes decode to
        if kernels.fills_rows(into, count, numel, n, table.dtype):
            values, bad = _checked_signs_into_kernel(into, payloads, table, numel=n)
        else:
            values, bad = _checked_signs_kernel(payloads, table, numel=n)
            values = values[:, :numel]
        refuse_rows_if_any((bad, SCALE_REFUSED), refusals=refusals)
        return values

    def sign_scale(self, payload):
        if self.block is not None or payload.numel() < 4:
            return None
        return from_bytes(payload[:4], torch.float32).reshape(())

    def subtract_own_(self, vector, payload, numel, seed):
        if self.block is not None or numel == 0:
            return super().subtract_own_(vector, payload, numel, seed)
        return self.subtract_own_rows_(vector.view(1, -1), payload.view(1, -1), [seed]).view(-1)

    def subtract_own_rows_(self, rows, payloads, seeds):
        # v - Q(v) is v less +s where v >= 0 (the bit its encode set) and -s elsewhere: read from v itself, with
        # the scales from the payloads, in one pass where compiled; the table decode wrote ±s out to be read back
        if self.block is not None:
            return super().subtract_own_rows_(rows, payloads, seeds)
        return _own_residual_kernel(rows, columns_as(payloads, 0, 4, torch.float32), numel=rows.numel())

    def _decode_blocks(self, payload: torch.Tensor, numel: int, refusals: Refusals) -> torch.Tensor:
        """``block``'s wire format back to values: ±1 by table, then each block times its scale."""
        count = -(-numel // self.block)
        s = from_bytes(payload[:2 * count], torch.bfloat16).float()
        if refusals is not TRUSTED:
            refuse_if_any((not_finite_nonnegative(s), "sign: a block's scale in payload is negative or not finite"),
                          refusals=refusals)
        out = kernels.lookup(bitpack.sign_units(payload.device), payload[2 * count:], numel)
        whole = numel - numel % self.block
        out[:whole].view(-1, self.block).mul_(s[:whole // self.block, None])
        out[whole:].mul_(s[-1])
        return out


def signs_rows(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """sign's payload of each row (its size a multiple of 8): its scale,
    ``magnitudes / divisor`` clamped to a finite float, then its bits."""
    count = rows.shape[0]
    scales = (magnitudes / divisor).clamp_(max=_FLOAT32_MAX)
    payload = torch.empty(count, 4 + rows.shape[1] // 8, dtype=torch.uint8, device=rows.device)
    payload[:, :4] = scales.view(torch.uint8).view(count, 4)
    payload[:, 4:] = bitpack.pack_nonnegative(rows.reshape(-1)).view(count, -1)
    return payload


def signs_rows_fusable(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """``signs_rows`` as one compiled kernel writes it (the same bytes)."""
    # the scales' bytes by shifts of their bits (a float's bytes in memory order), so that one kernel writes all
    count = rows.shape[0]
    word = (magnitudes / divisor).clamp(max=_FLOAT32_MAX).view(torch.int32).view(count, 1)
    bits = bitpack.nonnegative_bits_fusable(rows.reshape(-1)).view(count, -1)
    return kernels.side_by_side(kernels.words_as_bytes(word), bits)


# sign's whole encode of a bucket's chunks after their reductions: one kernel where compiled (not on a CPU,
# where each chunk's one sweep is the faster)
_signs_rows_kernel = kernels.FusedKernel(signs_rows, signs_rows_fusable, compile_on_cpu=False)


def _checked_scales(payloads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's scale, (rows, 1) fp32; whether it is negative or not finite, one flag per row)."""
    s = columns_as(payloads, 0, 4, torch.float32)
    return s, not_finite_nonnegative(s.reshape(-1))


def _checked_scales_fusable(payloads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = columns_as(payloads, 0, 4, torch.float32)
    return s, ~((s >= 0) & (s <= _FLOAT32_MAX)).reshape(-1)  # NaN fails both comparisons


# the scales' copy and check in one kernel where compiled; a few bytes, so compiling pays at any size (not on a CPU)
_checked_scales_kernel = kernels.FusedKernel(_checked_scales, _checked_scales_fusable, compile_on_cpu=False,
                                             compile_from=1)



def checked_signs(payloads: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's values ±s, (rows, whole bytes · 8); the flag of each row whose scale is
    negative or not finite): a received row's decode with its check."""
    s, bad = _checked_scales(payloads)
    return kernels.scaled_rows_of(table, payloads[:, 4:], s), bad


def checked_signs_fusable(payloads: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s, bad = _checked_scales_fusable(payloads)
    return kernels.scaled_rows_of_fusable(table, payloads[:, 4:], s), bad


def _checked_signs_into(out: torch.Tensor, payloads: torch.Tensor, table: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``checked_signs`` written into the rows ``out`` (a caller's buffer that the bytes fill exactly)."""
    values, bad = checked_signs(payloads, table)
    return out.copy_(values), bad


def _checked_signs_into_fusable(out: torch.Tensor, payloads: torch.Tensor, table: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    values, bad = checked_signs_fusable(payloads, table)
    return out.copy_(values), bad


# received rows' decode and scale check in one kernel where compiled, where they were two (not on a CPU, whose
# table decode runs in cache-sized blocks)
_checked_signs_kernel = kernels.FusedKernel(checked_signs, checked_signs_fusable, compile_on_cpu=False)
_checked_signs_into_kernel = kernels.FusedKernel(_checked_signs_into, _checked_signs_into_fusable,
                                                 compile_on_cpu=False)


def _own_residual(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows -= `` their own sign payloads' values, in place: each row less its
    scale (``scales``: (rows, 1)) where the row is non-negative, plus it elsewhere.
    ±s exactly, as the table decode gives them (-0.0 counts as non-negative, as
    the encode's bit does), so the same bits as decoding and subtracting."""
    return rows.sub_(torch.where(rows >= 0, scales, -scales))


def _own_residual_fusable(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return rows.copy_(rows - torch.where(rows >= 0, scales, -scales))


# a worker's residual of the chunks it encoded: one pass where compiled (a CPU's too), where a decode and a
# subtraction were two
_own_residual_kernel = kernels.FusedKernel(_own_residual, _own_residual_fusable)
