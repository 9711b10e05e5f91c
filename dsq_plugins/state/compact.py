"""Error memories stored in fewer bytes than fp32 (``error_dtype``).

An error memory holds, for every element, what compression has dropped
and still owes the model: a full-size vector per worker, and a chunk of
one per owner. In fp32 that is 4 bytes per parameter per rank, as much
as the model itself; for a 7B-parameter model 28 GB per GPU. Stored
compactly it costs:

* ``"int8"`` (the default): 1 byte plus one fp32 scale per block of
  ``BLOCK`` elements (1.016 bytes): each block's largest magnitude maps to
  127 and every element is rounded to the nearest of the 255 levels;
* ``"bf16"``: 2 bytes, each element rounded to 8 significant bits;
* ``"fp32"``: 4 bytes per element, exact.

The rounding is deterministic (nearest, no seed), so a run resumed from a
checkpoint continues bit for bit. What rounding drops from the memory is
lost, not fed back: a second-order error on the first-order error that
error feedback keeps (LoCo, Xie et al., keeps its compensation in 8 bits
with Adam; ``bench.convergence`` and ``bench.lm`` measure the cost here).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..compressors.finite import extremes_not_finite, status_of
from ..compressors.kernels import FusedKernel, device_constant, launch_bound
from ..compressors.own_kernels import TORCH_REFERENCES
from ..errors import StateError
from . import _int8_triton

__all__ = ["added", "added_rows_with_status", "added_rows_with_status_fusable", "added_with_status", "BLOCK",
           "dtype_of", "ERROR_DTYPES", "from_state", "Int8Blocks", "int8_codes", "int8_values", "LEVELS", "load",
           "nbytes", "OnePass", "PADDED_FROM", "padded_added", "padded_added_with_status",
           "padded_added_with_status_fusable", "store", "Stored", "to_state"]

ERROR_DTYPES = ("fp32", "bf16", "int8")
BLOCK = 256  # elements sharing one int8 scale
LEVELS = 127.0  # the largest int8 code
PADDED_FROM = 32  # int8 codes of a vector of at least this many blocks are kept padded to whole blocks


class Int8Blocks:
    """A vector of ``numel()`` elements as int8 codes and one fp32 scale per
    block of ``BLOCK``. A vector of at least ``PADDED_FROM`` blocks keeps
    its codes padded to whole blocks (zeros after the last element; under
    1/``PADDED_FROM`` more bytes), so that storing and loading a memory,
    twice per bucket and step, are a few whole-buffer ops with no copy to
    pad or trim. A small vector keeps its codes trimmed: its bytes stay
    1 + 4/BLOCK per element."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, numel: int | None = None):
        self.codes, self.scales = codes, scales
        self._numel = codes.numel() if numel is None else int(numel)

    @classmethod
    def encode(cls, x: torch.Tensor) -> "Int8Blocks":
        flat = x.detach().reshape(-1).to(torch.float32)
        # by a device tensor: CUDA divides by a host number as a multiply by its reciprocal, a last bit away
        # from the CPU's division, and then a memory kept on a GPU would not be the one a CPU keeps
        levels = device_constant(LEVELS, flat.device)
        made = _int8_triton.int8_encoded(flat, None, levels, BLOCK)  # a GPU's, in Triton
        return cls.from_padded(flat.numel(), *(made if made is not None else _encode_kernel(
            flat, levels, numel=_padded(flat.numel()))))

    @classmethod
    def encode_difference(cls, a: torch.Tensor, b: torch.Tensor) -> "Int8Blocks":
        """``encode(a - b)`` (fp32, flat, one size) without ``a - b`` written out: a residual
        (v - Q(v)) subtracted and encoded in one pass where compiled, the same bits."""
        levels = device_constant(LEVELS, a.device)
        made = _int8_triton.int8_encoded(a, b, levels, BLOCK)  # a GPU's, in Triton
        return cls.from_padded(a.numel(), *(made if made is not None else _difference_kernel(
            a, b, levels, numel=_padded(a.numel()))))

    @classmethod
    def encode_sign_residual(cls, a: torch.Tensor, scale: torch.Tensor) -> "Int8Blocks":
        """``encode_difference(a, b)`` where b is ±``scale`` by the sign of ``a`` (+ where
        a >= 0, -0.0 included): the residual of a sign payload of ``a`` itself (``scale``
        0-d, its one scale), with b never read from memory, nor written to it."""
        return cls.from_padded(a.numel(), *_sign_residual_kernel(a, scale, device_constant(LEVELS, a.device),
                                                           numel=_padded(a.numel())))

    @classmethod
    def from_padded(cls, n: int, codes: torch.Tensor, scales: torch.Tensor) -> "Int8Blocks":
        """The encoding of ``n`` elements from its padded codes (trimmed for a small vector)."""
        if n < PADDED_FROM * BLOCK:
            codes = codes[:n].clone()
        return cls(codes, scales, n)

    def decode(self) -> torch.Tensor:
        rows = self.code_rows()
        return _decode_kernel(rows, self.scales, numel=rows.numel()).view(-1)[:self._numel]

    def code_rows(self) -> torch.Tensor:
        """The codes as (blocks, ``BLOCK``) rows, a small vector's trimmed codes padded with zeros."""
        blocks, codes = self.scales.numel(), self.codes
        if codes.numel() != blocks * BLOCK:
            codes = F.pad(codes, (0, blocks * BLOCK - codes.numel()))
        return codes.view(blocks, BLOCK)

    def added_to(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x + self.decode()`` (``x`` fp32, flat), the memory's values never
        written out on their own: the whole blocks in one pass where compiled,
        into ``out`` when given (which may be ``x``), and the elements of a last,
        partial block by two small ops. Where launches are the cost (a GPU), a
        vector that ends inside a block is instead one pass over a padded copy,
        returned as a new tensor: use what this returns, not ``out``."""
        return self._added(x, out, with_status=False)[0]

    def added_with_status(self, x: torch.Tensor, out: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``added_to(x, out)``, its status word: a device int64, 1 where the sum
        holds a NaN or an Inf, else 0), the test in the addition's own pass where
        compiled: a compensated vector is tested before it is sent, and this
        spares that test its own read of the vector (and, on a GPU, its launch)."""
        return self._added(x, out, with_status=True)

    def one_pass(self, x: torch.Tensor, out: torch.Tensor | None = None) -> "OnePass | None":
        """How one kernel adds this memory to ``x`` (fp32, flat, of this size), for ``added_to`` and for
        kernels that compute more in that pass; None for an empty vector, and where a CPU adds a last,
        partial block apart."""
        n = x.numel()
        if n == 0:
            return None
        if n % BLOCK:
            if not launch_bound(x.device):
                return None
            rows = self.code_rows()
            return OnePass(True, (x, rows, self.scales), rows.numel(), None)
        out = torch.empty_like(x) if out is None else out
        x_rows = x.view(-1, BLOCK)
        out_rows = x_rows if out is x else out.view(-1, BLOCK)  # in place, one object: one input of the graph
        return OnePass(False, (out_rows, x_rows, self.codes[:n].view(-1, BLOCK), self.scales), n, out)

    def _added(self, x: torch.Tensor, out: torch.Tensor | None, with_status: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        made = _int8_triton.added_with_status(x, self.codes, self.scales, BLOCK, out, with_status)  # a GPU's
        return made if made is not None else self._added_by_torch(x, out, with_status)

    def _added_by_torch(self, x: torch.Tensor, out: torch.Tensor | None, with_status: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_added`` by torch's kernels (compiled where they pay)."""
        n = x.numel()
        whole = n // BLOCK * BLOCK
        one = self.one_pass(x, out)
        if one is not None and one.padded:
            kernel = _padded_added_status_kernel if with_status else _padded_added_kernel
            result = kernel(*one.args, numel=one.numel)
            values, status = result if with_status else (result, None)
            return values.view(-1)[:n], status  # the padding adds zeros times finite scales: finite
        if one is not None:
            if with_status:
                return one.out, _added_status_kernel(*one.args, numel=n)[1]
            _added_kernel(*one.args, numel=n)
            return one.out, None
        # a CPU's vector that ends inside a block: its whole blocks in one pass, the rest by two small ops
        out = torch.empty_like(x) if out is None else out
        status = None
        if whole:
            head = lambda t: t[:whole].view(-1, BLOCK)  # noqa: E731 - the whole blocks, as rows
            x_rows = head(x)
            out_rows = x_rows if out is x else head(out)
            args = (out_rows, x_rows, head(self.codes), self.scales[: whole // BLOCK])
            if with_status:
                status = _added_status_kernel(*args, numel=whole)[1]
            else:
                _added_kernel(*args, numel=whole)
        if whole < n:
            tail = torch.add(x[whole:], int8_values(self.codes[whole:n].view(1, -1), self.scales[-1:]).view(-1),
                             out=out[whole:])
            if with_status:
                tail_status = _with_status(tail)[1]
                status = tail_status if status is None else status.bitwise_or_(tail_status)
        return out, status

    def numel(self) -> int:
        return self._numel

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def to(self, device: torch.device) -> "Int8Blocks":
        return Int8Blocks(self.codes.to(device), self.scales.to(device), self._numel)

    def state(self) -> dict[str, torch.Tensor]:
        return {"int8": self.codes[:self._numel].detach().cpu().clone(), "scales": self.scales.detach().cpu().clone()}


class OnePass(NamedTuple):
    """The one kernel that adds an int8 memory to a vector (``Int8Blocks.one_pass``): ``padded``,
    ``args`` = (x, code rows, scales) for a vector that ends inside a block, whose kernel returns
    new padded rows (``padded_added``); else ``args`` = (out rows, x rows, code rows, scales), whose
    kernel writes ``out`` (``added_rows_with_status``). ``numel``: the elements the kernel covers."""

    padded: bool
    args: tuple[torch.Tensor, ...]
    numel: int
    out: torch.Tensor | None  # the flat vector the whole-rows kernel writes


def int8_codes(flat: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes of ``flat`` padded with zeros to whole blocks, one scale
    per block): each block's largest magnitude maps to ``levels`` (127),
    every element rounded to the nearest level. Exact elementwise ops and
    a maximum, so its compiled twin gives the same bits; compiled, the
    padding is part of the one pass."""
    rows = _zero_padded(flat, -flat.numel() % BLOCK).view(-1, BLOCK)
    scales = rows.abs().amax(dim=1).div(levels)
    divisor = scales.masked_fill(scales == 0, 1.0)
    return torch.round(rows / divisor[:, None]).clamp_(-127, 127).to(torch.int8).view(-1), scales


def _padded(n: int) -> int:
    """``n`` elements' count padded to whole blocks."""
    return -(-n // BLOCK) * BLOCK


def _int8_codes_of_difference(a: torch.Tensor, b: torch.Tensor, levels: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_codes(a - b)``: the subtraction rounds once, as eager's."""
    return int8_codes(a - b, levels)


def _int8_codes_of_sign_residual(a: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_codes(a - (±scale by a's sign))``: ±scale exactly, as a sign payload's decode."""
    return int8_codes(a - torch.where(a >= 0, scale, -scale), levels)


def int8_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``int8_codes``' rows."""
    return codes.to(torch.float32) * scales[:, None]


def _added_eager(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` plus the values of the rows ``codes``, into the rows ``out``
    (which may be ``x``), as two passes: the decode, then the addition."""
    return torch.add(x, int8_values(codes, scales), out=out)


def _added_fusable(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``_added_eager`` as one pass: each value multiplied, then added (two
    roundings, as eager's; no FMA under ``kernels.EAGER_NUMERICS``). Every
    tensor comes in as rows: a reshape inside the graph of the vector it
    writes makes inductor's C++ index element by element, many times slower."""
    return out.copy_(x + codes.to(torch.float32) * scales[:, None])


def padded_added(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` padded with zeros to the rows ``codes``, plus their values: new rows
    (a GPU's one kernel for a vector that ends inside a block)."""
    return _zero_padded(x, codes.numel() - x.numel()).view(codes.shape) + int8_values(codes, scales)


def _zero_padded(flat: torch.Tensor, tail: int) -> torch.Tensor:
    """``flat`` and ``tail`` zeros. Eager skips the copy where there are none; a compiled kernel always
    pads (by a symbolic count, maybe 0), so that one graph serves every length: a branch on the count
    would guard on its divisibility and compile a second graph for the other case."""
    if torch.compiler.is_compiling() or tail:
        return F.pad(flat, (0, tail))
    return flat


def _with_status(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``values``, their status word: 1 where they hold a NaN or an Inf, else 0)."""
    return values, status_of(extremes_not_finite(values, None))


def _with_status_fusable(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # the test as "any element not finite", which inductor folds into the loop that makes values (an aminmax it
    # does not)
    return values, status_of((~torch.isfinite(values)).any())


def added_rows_with_status(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``_added_eager``, the status word of what it wrote): a worker's compensation."""
    return _with_status(_added_eager(out, x, codes, scales))


def added_rows_with_status_fusable(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``added_rows_with_status`` as one compiled pass (the test folded into the loop that adds)."""
    values, status = _with_status_fusable(x + codes.to(torch.float32) * scales[:, None])
    return out.copy_(values), status


def padded_added_with_status(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``padded_added``, the status word of what it made): a GPU's compensation of a vector
    that ends inside a block."""
    return _with_status(padded_added(x, codes, scales))


def padded_added_with_status_fusable(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``padded_added_with_status`` as one compiled pass."""
    return _with_status_fusable(padded_added(x, codes, scales))


# one fused pass each where compiled (Triton on CUDA: a memory is stored and loaded twice per bucket and step)
_encode_kernel = FusedKernel(int8_codes)
_difference_kernel = FusedKernel(_int8_codes_of_difference)
_sign_residual_kernel = FusedKernel(_int8_codes_of_sign_residual)
_decode_kernel = FusedKernel(int8_values)
_added_kernel = FusedKernel(_added_eager, _added_fusable)
_padded_added_kernel = FusedKernel(padded_added)
# the same with the sum's finiteness test in its pass (a worker's compensated vector)
_added_status_kernel = FusedKernel(added_rows_with_status, added_rows_with_status_fusable)
_padded_added_status_kernel = FusedKernel(padded_added_with_status, padded_added_with_status_fusable)


def _added_by_torch_of(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch's ``added_with_status`` of ``x`` and an int8 memory's padded codes and scales: the reference of
    a GPU's Triton addition (``_int8_triton``)."""
    return Int8Blocks(codes, scales, x.numel())._added_by_torch(x, None, with_status=True)


TORCH_REFERENCES["int8_added_with_status"] = _added_by_torch_of  # the references of a GPU's Triton kernels
TORCH_REFERENCES["int8_codes"] = int8_codes

Stored = Any  # a torch.Tensor (fp32 or bf16) or Int8Blocks


def store(x: torch.Tensor, dtype: str) -> Stored:
    """``x`` (fp32) kept as ``dtype``."""
    if dtype == "int8":
        return Int8Blocks.encode(x)
    if dtype == "bf16":
        return x.detach().to(torch.bfloat16)
    return x.detach().to(torch.float32)


def load(stored: Stored) -> torch.Tensor:
    """The fp32 values of what ``store`` kept (a fresh tensor unless it was kept in fp32)."""
    if isinstance(stored, Int8Blocks):
        return stored.decode()
    return stored if stored.dtype == torch.float32 else stored.to(torch.float32)


def added(x: torch.Tensor, stored: Stored, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + load(stored)`` (``x`` fp32, flat, of the stored size), built in ``out``
    when given (which may be ``x``) where the device allows (see ``Int8Blocks.added_to``:
    use what this returns): an int8 memory's decode and the addition are one pass where compiled."""
    if isinstance(stored, Int8Blocks):
        return stored.added_to(x, out)
    return torch.add(x, load(stored), out=out)


def added_with_status(x: torch.Tensor, stored: Stored, out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``added(x, stored, out)``, its status word where the addition's pass
    gives it: an int8 memory's (``Int8Blocks.added_with_status``); None otherwise)."""
    if isinstance(stored, Int8Blocks):
        return stored.added_with_status(x, out)
    return added(x, stored, out), None


def dtype_of(stored: Stored) -> str:
    if isinstance(stored, Int8Blocks):
        return "int8"
    return "bf16" if stored.dtype == torch.bfloat16 else "fp32"


def nbytes(stored: Stored) -> int:
    if isinstance(stored, Int8Blocks):
        return stored.nbytes
    return stored.numel() * stored.element_size()


def to_state(stored: Stored) -> Any:
    """What a checkpoint holds: a tensor, or ``{"int8": codes, "scales": ...}``."""
    if isinstance(stored, Int8Blocks):
        return stored.state()
    return stored.detach().cpu().clone()


def from_state(name: str, value: Any) -> Stored:
    """A checkpoint entry as it was stored (its own dtype)."""
    if isinstance(value, dict) and set(value) == {"int8", "scales"}:
        codes, scales = value["int8"], value["scales"]
        if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.int8 and isinstance(scales, torch.Tensor)
                and scales.numel() == -(-codes.numel() // BLOCK)):
            raise StateError(f"error memory {name!r}: an int8 entry needs int8 codes and one scale per {BLOCK}")
        return Int8Blocks(codes.detach().clone(), scales.detach().to(torch.float32).clone())
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise StateError(f"error memory {name!r}: expected a float tensor or an int8 entry, got "
                         f"{type(value).__name__}")
    return value.detach().clone() if value.dtype in (torch.float32, torch.bfloat16) else value.detach().float()
