"""What the library's own Triton kernels share: Triton itself, where it is
installed (a CPU build of torch brings none), and the one-time check on each
GPU that a kernel family compiles and gives the bytes torch's path gives;
and the kernel helpers several families call (a payload's unaligned word,
a received scale's refusal).

Each family (top-k's radix select, sign's and blocksign's codecs and bucket
kernels, QSGD's and TernGrad's codec, the int8 memory's addition) keeps torch's path as its
fallback and its reference: where Triton is missing, its compiler fails, or
its result differs on fixed inputs, the family logs one line and torch runs,
the same bytes at torch's cost. With ``TRITON_INTERPRET=1`` (set before
Triton is imported) the kernels run on a CPU's tensors, which is how the
tests check them without a GPU."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from typing import Callable, Iterator

import torch

__all__ = ["triton", "tl", "checked_per_device", "chosen", "chosen_on", "device_index", "fits_rows",
           "interpreted_on_cpu", "lanes", "MOST_ROWS", "own_kernels", "on_a_gpu", "on_the_current_gpu", "OWN_KERNELS",
           "ready", "refused_scale", "refused_senders", "rows_out", "TORCH_REFERENCES", "word_at"]

#: ``DSQ_OWN_KERNELS``: ``triton``, the library's own Triton kernels where they apply (the default), or ``torch``,
#: torch's compiled paths for the same bytes (the control a benchmark compares them with). Top-k's selection has
#: its own switch, ``DSQ_TOPK_SELECT``.
OWN_KERNELS = ("triton", "torch")

#: torch's kernels that our kernels replace, by name, as the modules that own them register them (those modules
#: import the kernels' modules, not the other way): the first-call checks' references
TORCH_REFERENCES: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {}

log = logging.getLogger("dsq_plugins")

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None:
    @triton.jit
    def word_at(at, mask, OTHER: tl.constexpr):
        """The little-endian int32 word at the bytes ``at`` (a payload's row need not be 4-byte aligned), a byte at
        a time; ``OTHER`` where masked."""
        word = tl.load(at, mask=mask, other=OTHER & 255).to(tl.int32)
        for q in tl.static_range(1, 4):
            word = word | (tl.load(at + q, mask=mask, other=(OTHER >> (8 * q)) & 255).to(tl.int32) << (8 * q))
        return word

    @triton.jit
    def refused_scale(scale):
        """Whether a received scale is negative or not finite (a NaN fails both comparisons): what every
        decoder's check refuses."""
        return ~((scale >= 0) & (scale <= 3.4028234663852886e38))

    @triton.jit
    def refused_senders(partial_ptr, flags_ptr, bad_ptr, status_ptr, senders, stretches, first_program,
                        CHECKS: tl.constexpr, SENDERS: tl.constexpr, STRETCHES: tl.constexpr,
                        BAD_PAYLOAD: tl.constexpr):
        """An owner's mean's first step: every sender's ``CHECKS`` flags gathered from the checks' int8 flags per
        stretch (partial[check, sender, stretch]); the first program writes them (flags[check, sender]), each
        sender's any (``bad``) and the first refused sender's status. Returns that sender, ``SENDERS`` if none."""
        sender = tl.arange(0, SENDERS)
        stretch = tl.arange(0, STRETCHES)
        slots = sender[:, None] * stretches + stretch[None, :]
        taken = (sender[:, None] < senders) & (stretch[None, :] < stretches)
        refused = tl.zeros([SENDERS], dtype=tl.int32)
        for check in tl.static_range(CHECKS):
            flag = tl.max(tl.load(partial_ptr + check * senders * stretches + slots, mask=taken, other=0), 1)
            tl.store(flags_ptr + check * senders + sender, flag != 0, mask=(sender < senders) & first_program)
            refused = refused | flag.to(tl.int32)
        first_refused = tl.min(tl.where(refused != 0, sender, SENDERS), 0)
        tl.store(bad_ptr + sender, refused != 0, mask=(sender < senders) & first_program)
        quad = tl.arange(0, 4)
        tl.store(status_ptr + quad * 0, (BAD_PAYLOAD + first_refused).to(tl.int64),
                 mask=(quad < 1) & first_program & (first_refused < SENDERS))
        return first_refused


#: the most rows one launch takes: a CUDA grid's second dimension, along which a family's kernels lay their rows
MOST_ROWS = 65535


def lanes(n: int) -> int:
    """``n`` up to a power of two, at least 2: a kernel's block of lanes for ``n`` senders or stretches."""
    return max(2, 1 << (n - 1).bit_length())


def fits_rows(out: torch.Tensor | None, count: int, numel: int) -> bool:
    """Whether ``out`` is (count, numel) float32 rows of unit stride along a row: a caller's buffer a decode may
    write into (elsewhere it writes new rows)."""
    return out is not None and out.dtype == torch.float32 and tuple(out.shape) == (count, numel) \
        and (numel <= 1 or out.stride(1) == 1)


def rows_out(out: torch.Tensor | None, count: int, numel: int, device: torch.device, where: str) -> torch.Tensor:
    """The rows a decode writes: ``out`` where it ``fits_rows``, new ones where None, else a ValueError naming
    ``where``."""
    if out is None:
        return torch.empty(count, numel, dtype=torch.float32, device=device)
    if not fits_rows(out, count, numel):
        raise ValueError(f"{where}: out must be float32 ({count}, {numel}) of unit stride, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


def chosen(variable: str, choices: tuple[str, ...]) -> str:
    """The environment's choice ``variable`` (its first of ``choices`` by default); a misspelt value is an
    error naming it, not a silent default."""
    value = os.environ.get(variable, choices[0])
    if value not in choices:
        raise ValueError(f"{variable}={value!r}: expected one of {', '.join(choices)}")
    return value


def own_kernels() -> str:
    """``DSQ_OWN_KERNELS``, checked (read at every call, so a benchmark can switch it)."""
    return chosen("DSQ_OWN_KERNELS", OWN_KERNELS)


def on_a_gpu(tensor: torch.Tensor) -> bool:
    """Whether the library's own kernels may take ``tensor`` (``chosen_on`` its device)."""
    return chosen_on(tensor.device)


def chosen_on(device: torch.device) -> bool:
    """Whether the library's own kernels may run on ``device``: chosen, the current GPU (Triton launches on the
    current device), and a little-endian host (the kernels write a float's bytes in the order a payload's reader
    on the host reads them)."""
    return own_kernels() == "triton" and sys.byteorder == "little" and _the_current_gpu(device)


def on_the_current_gpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on the current CUDA device, where Triton launches."""
    return _the_current_gpu(tensor.device)


def _the_current_gpu(device: torch.device) -> bool:
    if device.type == "cpu":
        return _INTERPRETED_ON_CPU[0] > 0
    return device.type == "cuda" and device.index in (None, torch.cuda.current_device())


#: open ``interpreted_on_cpu`` blocks
_INTERPRETED_ON_CPU = [0]


@contextlib.contextmanager
def interpreted_on_cpu() -> Iterator[None]:
    """Until the block closes, the library's kernels take a CPU's tensors as they take the current GPU's, run by
    Triton's interpreter: how the CPU proxy counts what a GPU's step launches (``bench.gpu --own-kernels``).
    Each family's first-call check then runs on the CPU too. Needs ``TRITON_INTERPRET=1`` set before Triton was
    imported (a compiled kernel cannot take a CPU's tensors)."""
    if triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpreted_on_cpu needs Triton, with TRITON_INTERPRET=1 set before it was imported")
    _INTERPRETED_ON_CPU[0] += 1
    try:
        yield
    finally:
        _INTERPRETED_ON_CPU[0] -= 1


def ready(where: torch.Tensor | torch.device, works: Callable[[int], bool]) -> bool:
    """Whether a family of kernels (its ``works``, from ``checked_per_device``) runs for a tensor or on a device:
    ours chosen there (``chosen_on``) and its first-call check passed there."""
    device = where if isinstance(where, torch.device) else where.device
    return chosen_on(device) and works(device_index(device))


def device_index(tensor: torch.Tensor | torch.device) -> int:
    """The CUDA device ``tensor`` lives on (or that ``device`` is), as an index (plain ``cuda`` is the current
    one); -1 for a CPU (``interpreted_on_cpu``'s)."""
    device = tensor if isinstance(tensor, torch.device) else tensor.device
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def checked_per_device(family: str, agrees: Callable[[torch.device], bool]) -> Callable[[int], bool]:
    """``works(device_index)``: whether ``family``'s kernels compile and ``agrees(device)`` (their bytes are
    torch's on fixed inputs), checked once per process and device (a few host reads, before any step reads
    one). Where not, torch's path runs, with one line in the log saying why."""
    @functools.lru_cache(maxsize=None)
    def works(index: int) -> bool:
        if triton is None:
            log.info("dsq_plugins: %s runs as torch ops (no Triton)", family)
            return False
        device = torch.device("cpu") if index < 0 else torch.device("cuda", index)  # (-1: the interpreter's CPU)
        try:
            if agrees(device):
                return True
            log.warning("dsq_plugins: %s disagreed with torch's path on %s; torch's path runs", family, device)
        except Exception as failure:  # a Triton that cannot compile these kernels: torch's path still works
            log.warning("dsq_plugins: %s failed on %s (%s); torch's path runs", family, device, failure)
        return False
    return works
