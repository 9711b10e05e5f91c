"""Uniform noise for stochastic rounding, computed from (seed, element
index) by an integer hash instead of drawn from a generator's stream.

A counter-based draw needs no state and no noise tensor: inside a compiled
quantiser (``levels``) it is a few integer operations per element in the
same pass, where ``torch.rand`` with a seeded CPU generator (mt19937) costs
more than two clones of the numbers it draws. The same seed gives
the same noise on every device (CPU, CUDA), eager or compiled: the
arithmetic is exact. Receivers never need the noise; it only has to be
uniform, independent of the values, and replayable for tests.

The hash works on 30-bit words held in int32, where a CPU multiplies eight
at a time (AVX2 has no 64-bit vector multiply: the int64 form this replaced
took 2.6x as long). Every intermediate stays below 2**31, so nothing
overflows (overflow of a signed int is undefined in the C++ and CUDA a
compiler emits): a product mod 2**30 is built from 15-bit halves
(``_times``). Element i's word is (i mod 2**30 + the seed's low word) mod
2**30, xored with the seed's high word plus i >> 30; then two rounds of
xor-shift-multiply (as in the 32-bit "lowbias" hashes); the top 24 of its
30 bits give u in [0, 1) on the float32 grid of 2**-24, as ``torch.rand``'s."""
from __future__ import annotations

import torch

from .kernels import blocks
from .own_kernels import tl, triton

__all__ = ["index_dtype", "seed_words", "uniform", "uniform_at", "uniform_in_kernel", "uniform_into", "WORD"]

WORD = (1 << 30) - 1
_LOW_HALF = (1 << 15) - 1
_MULTIPLIERS = (0x3ECF976B, 0x3589E48B)  # odd, below 2**30; chosen by avalanche and lag-correlation tests
_SHIFTS = (15, 14, 12)
_MASK64 = (1 << 64) - 1


def seed_words(seed: int) -> tuple[int, int]:
    """The two 30-bit words that key the hash, from a seed scrambled by
    splitmix64's finaliser (plain Python, once per call): seeds that differ
    in a few bits, such as consecutive ones, get unrelated words, so their
    streams are neither shifts of one another nor correlated."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & WORD, (z >> 32) & WORD


def _times(h: torch.Tensor, c: int) -> torch.Tensor:
    """h·c mod 2**30 for int32 h below 2**30, no intermediate reaching 2**31:
    lo·c_lo + ((hi·c_lo + lo·c_hi) mod 2**15) · 2**15, with 15-bit halves."""
    c_lo, c_hi = c & _LOW_HALF, c >> 15
    lo, hi = h & _LOW_HALF, h >> 15
    return (lo * c_lo + (((hi * c_lo + lo * c_hi) & _LOW_HALF) << 15)) & WORD


def _hash(index: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Element ``index``'s 30-bit word (int32): its low 30 bits keyed by
    ``low``, one xor-shift-multiply round, the high word (plus index >> 30)
    xored in, a second round, a final xor-shift. An int32 ``index`` must be
    below 2**30 (so index >> 30 is 0): the vector's int64 arithmetic is then
    skipped, a fifth of QSGD's rounding pass on a CPU."""
    if index.dtype == torch.int32:
        h, key = (index + low) & WORD, high
    else:
        h = ((index & WORD).to(torch.int32) + low) & WORD
        key = ((index >> 30).to(torch.int32) + high) & WORD
    h = _times(h ^ (h >> _SHIFTS[0]), _MULTIPLIERS[0]) ^ key
    h = _times(h ^ (h >> _SHIFTS[1]), _MULTIPLIERS[1])
    return h ^ (h >> _SHIFTS[2])


if triton is not None:
    _WORD = tl.constexpr(WORD)
    _HALF = tl.constexpr(_LOW_HALF)
    _FIRST_LO, _FIRST_HI = tl.constexpr(_MULTIPLIERS[0] & _LOW_HALF), tl.constexpr(_MULTIPLIERS[0] >> 15)
    _SECOND_LO, _SECOND_HI = tl.constexpr(_MULTIPLIERS[1] & _LOW_HALF), tl.constexpr(_MULTIPLIERS[1] >> 15)
    _SHIFT_1, _SHIFT_2, _SHIFT_3 = (tl.constexpr(shift) for shift in _SHIFTS)

    @triton.jit
    def _times_in_kernel(h, C_LO: tl.constexpr, C_HI: tl.constexpr):
        """``_times`` inside a Triton kernel, on int32 words."""
        lo, hi = h & _HALF, h >> 15
        return (lo * C_LO + (((hi * C_LO + lo * C_HI) & _HALF) << 15)) & _WORD

    @triton.jit
    def uniform_in_kernel(index, low, high):
        """``uniform_at`` inside a Triton kernel, the same bits: ``index`` int32 below 2**30, ``low`` and ``high``
        the seed's int32 words."""
        h = (index + low) & _WORD
        h = _times_in_kernel(h ^ (h >> _SHIFT_1), _FIRST_LO, _FIRST_HI) ^ high
        h = _times_in_kernel(h ^ (h >> _SHIFT_2), _SECOND_LO, _SECOND_HI)
        h = h ^ (h >> _SHIFT_3)
        return (h >> 6).to(tl.float32) * (1.0 / (1 << 24))


def index_dtype(first: int, numel: int) -> torch.dtype:
    """The narrowest index type ``_hash`` takes for elements ``first`` .. ``first + numel``."""
    return torch.int32 if first + numel <= (1 << 30) else torch.int64


def uniform_at(index: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """u in [0, 1), float32, for element indices ``index`` (int64, or int32
    below 2**30: ``index_dtype``) under the seed words (``low``, ``high``);
    any shape; plain torch ops, so a compiler fuses it into the caller's pass."""
    return (_hash(index, low, high) >> 6).to(torch.float32) * (1.0 / (1 << 24))


def uniform_into(out: torch.Tensor, first: int, low: int, high: int) -> torch.Tensor:
    """``uniform_at``'s values for elements ``first`` .. ``first + out.numel()``,
    written into the contiguous float32 ``out`` (the eager path). On a CPU
    block by block (``kernels.blocks``), so the hash's temporaries stay in
    cache: at once, they are a dozen full-size tensors, several times slower
    at 16M elements."""
    for a, block in blocks(out.view(-1)):
        start, m = first + a, block.numel()
        index = torch.arange(start, start + m, device=out.device, dtype=index_dtype(start, m))
        block.copy_(uniform_at(index, low, high))
    return out


def uniform(numel: int, seed: int, device: torch.device | str = "cpu", start: int = 0) -> torch.Tensor:
    """Elements ``start`` .. ``start + numel`` of the noise for ``seed``, as a tensor."""
    return uniform_into(torch.empty(numel, device=device), start, *seed_words(seed))
