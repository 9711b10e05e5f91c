"""An int8 memory added to a vector on a GPU in one Triton launch, with the
status word of the sum: a worker's compensation ``g + e`` and its test.

Torch's path (``compact``'s ``added_rows_with_status`` and, for a vector that
ends inside an int8 block, ``padded_added_with_status``) was inductor's code,
whose finiteness test is a reduction of its own over the sum and which, for
a vector that ends inside a block, wrote a padded copy. Here a program adds
whole blocks of the memory to its tile of the vector, writes the sum once
(the vector's own elements only), and raises the status, zeroed before the
launch, to ``header.NONFINITE`` by an atomic maximum where its tile holds a
NaN or an Inf (the same value from any program). Each value is the code
times its block's scale, then added: two roundings, as torch's, so the
kernel is compiled without fused multiply-adds.

``int8_codes_of_tile`` is the memory's encoding (``compact.int8_codes``) of a
tile inside another kernel: the kernels that form a residual (sign's,
top-k's) write its codes in the pass that forms it."""
from __future__ import annotations

import torch

from ..comm import header
from ..compressors.own_kernels import TORCH_REFERENCES, checked_per_device, ready, tl, triton

__all__ = ["added_tile", "added_with_status", "added_rows", "int8_codes_of_tile", "int8_codes_rows", "int8_encoded"]

_BLOCKS = 8  # int8 blocks per program: 2,048 values
_LONGEST = 1 << 31  # offsets into the vector are int32 in the kernel

if triton is not None:
    @triton.jit
    def added_tile(x_ptr, codes_ptr, out_ptr, status_ptr, at, inside, scale, NONFINITE: tl.constexpr,
                   STATUS: tl.constexpr = True):
        """The memory's values (its codes at the tile's element indices ``at``, times ``scale``, broadcast to them)
        added to ``x`` there: written where ``inside`` and returned; with ``STATUS`` the status raised to
        ``NONFINITE`` where the sum holds a NaN or an Inf (a NaN fails the comparison)."""
        x = tl.load(x_ptr + at, mask=inside, other=0.0)
        codes = tl.load(codes_ptr + at, mask=inside, other=0).to(tl.float32)
        total = x + codes * scale
        tl.store(out_ptr + at, total, mask=inside)
        if STATUS:
            not_finite = tl.max(tl.ravel((inside & ~(tl.abs(total) <= 3.4028234663852886e38)).to(tl.int32)), 0)
            tl.atomic_max(status_ptr, tl.full((), NONFINITE, tl.int64), mask=not_finite > 0)
        return total

    @triton.jit
    def _added(x_ptr, codes_ptr, scales_ptr, out_ptr, status_ptr, numel, NONFINITE: tl.constexpr,
               BLOCKS: tl.constexpr, BLOCK: tl.constexpr, STATUS: tl.constexpr):
        """Elements [BLOCKS · BLOCK · program_id(0), +BLOCKS · BLOCK) of ``x`` plus the memory's values."""
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        at = block[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        scale = tl.load(scales_ptr + block, mask=block * BLOCK < numel, other=0.0)[:, None]
        added_tile(x_ptr, codes_ptr, out_ptr, status_ptr, at, at < numel, scale, NONFINITE, STATUS)

    @triton.jit
    def _codes(a_ptr, b_ptr, levels_ptr, codes_ptr, scales_ptr, numel, blocks, DIFFERENCE: tl.constexpr,
               BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
        """The int8 codes and scales of blocks [BLOCKS · program_id(0), +BLOCKS) of ``a`` (less ``b`` with
        ``DIFFERENCE``: one rounding), zeros past its end."""
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        at = block[:, None, None] * BLOCK + (tl.arange(0, BLOCK // 8)[None, :, None] * 8
                                             + tl.arange(0, 8)[None, None, :])
        inside = at < numel
        x = tl.load(a_ptr + at, mask=inside, other=0.0)
        if DIFFERENCE:
            x = x - tl.load(b_ptr + at, mask=inside, other=0.0)
        int8_codes_of_tile(x, block, at, levels_ptr, codes_ptr, scales_ptr, blocks)

    @triton.jit
    def int8_codes_of_tile(residual, block, at, levels_ptr, codes_ptr, scales_ptr, blocks):
        """``compact.int8_codes`` of a (blocks, bytes, 8) tile in a kernel, the same bits: each block's scale, its
        largest magnitude over the levels (at ``scales_ptr + block``), and each value's quotient by it rounded half
        to even (at ``codes_ptr + at``, the tile's element indices); blocks from ``blocks`` on are not written."""
        largest = tl.max(tl.max(tl.abs(residual), 2), 1)
        block_scale = tl.math.div_rn(largest, tl.load(levels_ptr))
        tl.store(scales_ptr + block, block_scale, mask=block < blocks)
        divisor = tl.where(block_scale == 0, 1.0, block_scale)[:, None, None]
        quotient = tl.math.div_rn(residual, divisor)
        rounded = (quotient + 12582912.0) - 12582912.0  # to the nearest integer, half to even
        codes = tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)
        tl.store(codes_ptr + at, codes, mask=block[:, None, None] < blocks)


def added_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int,
               out: torch.Tensor | None = None, status: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``x`` plus the int8 memory (``codes``, at least ``x``'s elements, and a scale per ``block`` of them),
    written into ``out`` (which may be ``x``) or a new vector; with ``status`` its status word, a 0-d int64: 1
    where the sum holds a NaN or an Inf, else 0; else None). ``x``: flat, contiguous float32. Needs Triton."""
    n = x.numel()
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous() or codes.numel() < n \
            or scales.numel() * block < n or not 0 < n < _LONGEST:
        raise ValueError(f"added_rows: wants a flat contiguous float32 vector and a memory of its size, got "
                         f"{x.dtype} {tuple(x.shape)}, {codes.numel()} codes, {scales.numel()} scales")
    out = torch.empty_like(x) if out is None else out
    word = torch.zeros((), dtype=torch.int64, device=x.device) if status else None
    _added[(triton.cdiv(n, _BLOCKS * block),)](x, codes, scales, out, word if status else out, n,
                                               NONFINITE=header.NONFINITE, BLOCKS=_BLOCKS, BLOCK=block, STATUS=status,
                                               enable_fp_fusion=False)
    return out, word


def added_with_status(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int,
                      out: torch.Tensor | None, status: bool = True) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``added_rows`` where our kernels run (``DSQ_OWN_KERNELS``, a GPU's tensors, the first call's check) and
    ``out``, where given, is a contiguous vector of ``x``'s size; None where the caller runs torch's kernel."""
    fits = out is None or (out.is_contiguous() and out.shape == x.shape and out.dtype == torch.float32)
    if not fits or x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous() or not codes.is_contiguous() \
            or not scales.is_contiguous() or not 0 < x.numel() < _LONGEST or not _taken(x):
        return None
    return added_rows(x, codes, scales, block, out, status)


def int8_codes_rows(a: torch.Tensor, b: torch.Tensor | None, levels: torch.Tensor, block: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the int8 codes of ``a`` (less ``b``, where given, rounded once), padded with zeros to whole blocks of
    ``block``; each block's scale), as ``compact.int8_codes`` gives them. ``a``, ``b``: flat contiguous float32
    of one size. Needs Triton."""
    n = a.numel()
    if not _vectors_fit(a, b):
        raise ValueError(f"int8_codes_rows: wants flat contiguous float32 vectors of one size, got {a.dtype} "
                         f"{tuple(a.shape)}" + ("" if b is None else f" and {b.dtype} {tuple(b.shape)}"))
    blocks = -(-n // block)
    codes = torch.empty(blocks * block, dtype=torch.int8, device=a.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=a.device)
    _codes[(triton.cdiv(blocks, _BLOCKS),)](a, a if b is None else b, levels.float().reshape(1), codes, scales, n,
                                            blocks, DIFFERENCE=b is not None, BLOCKS=_BLOCKS, BLOCK=block)
    return codes, scales


def int8_encoded(a: torch.Tensor, b: torch.Tensor | None, levels: torch.Tensor, block: int
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``int8_codes_rows`` where our kernels run and take these vectors; None where the caller runs torch's."""
    return int8_codes_rows(a, b, levels, block) if _vectors_fit(a, b) and _taken(a) else None


def _vectors_fit(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether ``a`` (and ``b``, where given) are flat contiguous float32 vectors of one size within int32 offsets."""
    return a.dtype == torch.float32 and a.dim() == 1 and a.is_contiguous() and 0 < a.numel() < _LONGEST and (
        b is None or (b.dtype == torch.float32 and b.shape == a.shape and b.is_contiguous()))


def _taken(x: torch.Tensor) -> bool:
    """Whether this kernel runs for ``x``: ours chosen on a GPU (``own_kernels.ready``) and the first call's check
    passed on it."""
    return ready(x, _works_on)


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed vectors (whole blocks and one that ends inside a block, in place and not, a sum that overflows),
    the sums and status words are those of torch's ops, and without the status the sums; the int8 codes and
    scales of a vector and of a difference are ``compact.int8_codes``'."""
    reference, encode = TORCH_REFERENCES.get("int8_added_with_status"), TORCH_REFERENCES.get("int8_codes")
    if reference is None or encode is None:  # compact's, registered there
        return False
    levels = torch.full((), 127.0, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    block = 256
    for n, scale in ((3 * block, 1.0), (2 * block + 40, 1.0), (block, 1e38)):
        codes = torch.randint(-127, 128, (-(-n // block) * block,), generator=gen, device=device).to(torch.int8)
        scales = torch.rand(-(-n // block), generator=gen, device=device) * scale / 127
        x = torch.randn(n, generator=gen, device=device) * scale
        want = reference(x.clone(), codes, scales)
        for into in (None, x.clone()):
            got = added_rows(x if into is None else into, codes, scales, block, into)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                return False
        if not torch.equal(added_rows(x, codes, scales, block, status=False)[0], want[0]):
            return False
        other = torch.randn(n, generator=gen, device=device)
        for b in (None, other) if scale == 1.0 else ():  # (an overflowing difference's NaN codes vary by device)
            want_codes = encode(x if b is None else x - b, levels)
            if not all(torch.equal(p, q) for p, q in zip(int8_codes_rows(x, b, levels, block), want_codes)):
                return False
    return True


_works_on = checked_per_device("the int8 memory's Triton addition", _agrees_with_torch)
