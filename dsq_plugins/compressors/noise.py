"""Uniform noise for stochastic rounding, computed from (seed, element
index) by an integer hash instead of drawn from a generator's stream.

A counter-based draw needs no state and no noise tensor: inside a compiled
quantiser (``levels``) it is a few integer operations per element in the
same pass, where ``torch.rand`` with a seeded CPU generator (mt19937) took
66 ms for 16M numbers, more than two clones of them. The same seed gives
the same noise on every device (CPU, CUDA), eager or compiled: the
arithmetic is exact. Receivers never need the noise; it only has to be
uniform, independent of the values, and replayable for tests.

The hash: two rounds of xor-shift-multiply (h ^= h >> 16; h *= 0x45d9f3b)
over 32-bit words, kept in int64 with multipliers below 2**31 so no product
overflows. The element index plus the seed's low word is mixed, the result
xored with the high word and mixed again; its top 24 bits give u in [0, 1)
on the float32 grid of 2**-24, as ``torch.rand``'s."""
from __future__ import annotations

import torch

from .kernels import CPU_BLOCK

_MASK = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B
_OFFSET = 0x9E3779B9  # 2**32 / the golden ratio


def seed_words(seed: int) -> tuple[int, int]:
    """The two 32-bit words of a (63-bit) seed that key the hash; the low
    one offset by an odd constant, so that seed 0 does not map element 0 to
    the hash's fixed point (0 -> 0)."""
    return (seed + _OFFSET) & _MASK, (seed >> 32) & _MASK


def _mix(h: torch.Tensor) -> torch.Tensor:
    """Two xor-shift-multiply rounds on int64 values below 2**32."""
    h = h ^ (h >> 16)
    h = (h * _MULTIPLIER) & _MASK
    h = h ^ (h >> 16)
    h = (h * _MULTIPLIER) & _MASK
    return h ^ (h >> 16)


def uniform_at(index: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """u in [0, 1), float32, for int64 element indices ``index`` under the
    seed words (``low``, ``high``); any shape; written with plain torch ops
    so a compiler fuses it into the caller's pass."""
    h = _mix((index + low) & _MASK)
    h = _mix(h ^ high)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def uniform_into(out: torch.Tensor, first: int, low: int, high: int) -> torch.Tensor:
    """``uniform_at``'s values for elements ``first`` .. ``first + out.numel()``,
    written into the contiguous float32 ``out`` (the eager path). On a CPU
    the hash runs in place on cache-sized int64 blocks: the one-shot form
    makes a dozen full-size int64 temporaries, 9x slower at 16M elements."""
    flat = out.view(-1)
    if flat.numel() == 0:
        return out
    if out.device.type != "cpu":
        return out.copy_(uniform_at(torch.arange(first, first + flat.numel(), device=out.device), low, high)
                         .view(out.shape))
    size = min(CPU_BLOCK, flat.numel())
    h, t = torch.empty(size, dtype=torch.int64), torch.empty(size, dtype=torch.int64)
    for a in range(0, flat.numel(), size):
        m = min(size, flat.numel() - a)
        hh, tt = h[:m], t[:m]
        torch.arange(first + a + low, first + a + low + m, out=hh).bitwise_and_(_MASK)
        _mix_(hh, tt).bitwise_xor_(high)
        _mix_(hh, tt).bitwise_right_shift_(8)
        torch.mul(hh, 1.0 / (1 << 24), out=flat[a: a + m])
    return out


def _mix_(h: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``_mix`` in place, with one scratch tensor of h's size."""
    for _ in range(2):
        h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=scratch))
        h.mul_(_MULTIPLIER).bitwise_and_(_MASK)
    return h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=scratch))


def uniform(numel: int, seed: int, device: torch.device | str = "cpu", start: int = 0) -> torch.Tensor:
    """Elements ``start`` .. ``start + numel`` of the noise for ``seed``, as a tensor."""
    return uniform_into(torch.empty(numel, device=device), start, *seed_words(seed))
