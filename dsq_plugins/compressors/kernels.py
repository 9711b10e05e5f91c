"""Fused kernels for the compressors' passes over memory, compiled with
``torch.compile`` (inductor: C++ on a CPU, Triton on CUDA) where that pays,
the same torch ops run eagerly everywhere else.

Only exact work is compiled: bit packing and integer code arithmetic, never
a floating-point reduction and never a random draw (the generator's stream
is part of what sender and receiver share), so compiled and eager kernels
produce the same bytes (``tests/test_kernels.py`` compares them).

``DSQ_COMPILE`` chooses: ``auto`` (the default) compiles for tensors of at
least ``COMPILE_FROM`` elements, where one fused pass saves more than the
call costs and the one-time compile (seconds, cached on disk by inductor)
is repaid; ``always``; ``never``. A compile that fails logs one line and
that kernel stays eager for the rest of the process."""
from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Callable

import torch

log = logging.getLogger("dsq_plugins")

MODES = ("auto", "always", "never")
COMPILE_FROM = 1 << 20


def compile_mode() -> str:
    """``DSQ_COMPILE``, checked (read at every call, so tests can switch it)."""
    mode = os.environ.get("DSQ_COMPILE", "auto")
    if mode not in MODES:
        from ..errors import ConfigError
        raise ConfigError(f"DSQ_COMPILE must be one of {MODES}, got {mode!r}")
    return mode


class FusedKernel:
    """An eager torch function and its compiled twin; ``numel`` (the elements
    the call works over) picks which one runs. ``fusable``, when given, is
    the same computation written the way inductor fuses best (the eager
    form may use tricks, such as reinterpreting bytes as int64, that make
    it fast eagerly and that a compiler handles poorly); it must return the
    same bits, which the tests check."""

    def __init__(self, eager: Callable[..., torch.Tensor], fusable: Callable[..., torch.Tensor] | None = None,
                 compile_on_cpu: bool = True):
        functools.update_wrapper(self, eager)
        self.eager = eager
        self.fusable = fusable or eager
        self.compile_on_cpu = compile_on_cpu  # False where the eager form is the faster one on a CPU (bench.kernels)
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._failed = False
        self._lock = threading.Lock()  # the Horovod exchange runs on its own thread

    def uses_compiled(self, numel: int, device: torch.device) -> bool:
        """Whether a call over ``numel`` elements on ``device`` runs the compiled form."""
        mode = compile_mode()
        if self._failed or mode == "never":
            return False
        return mode == "always" or (numel >= COMPILE_FROM and (self.compile_on_cpu or device.type != "cpu"))

    def __call__(self, *args, numel: int) -> torch.Tensor:
        if self.uses_compiled(numel, args[0].device):
            try:
                with self._lock:
                    if self._compiled is None:
                        self._compiled = torch.compile(self.fusable, dynamic=True)
                return self._compiled(*args)
            except Exception as exc:  # no compiler, an unsupported op, ...: eager still works
                self._failed = True
                log.warning("dsq_plugins: compiling %s failed (%s: %s); it runs as eager torch ops from now on",
                            self.eager.__name__, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return self.eager(*args)


def lookup(table: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Decode by table: row ``b`` of ``table`` holds what byte ``b`` stands
    for (``bitpack.byte_table``); one gather writes the output once (no
    per-bit passes). ``packed`` may already be int32 row indices."""
    return _lookup_kernel(table, packed.to(torch.int32), numel=packed.numel() * table.shape[1]).reshape(-1)[:numel]


def _rows_of(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, rows)


# CUDA's index_select copies rows of a few floats at a twentieth of memory speed (1.3 ms for 16M floats
# on an H100, bench.kernels), where the compiled gather runs at memory speed; on a CPU eager is the faster
_lookup_kernel = FusedKernel(_rows_of, compile_on_cpu=False)


# On a CPU a full-size temporary costs page faults worth several copies (see bench.kernels), and
# an L1 norm by torch.linalg.vector_norm runs at a fifth of memory speed and sums in plain fp32
# (2% off at 16M elements). Sweeping in blocks that stay in cache avoids both.
CPU_BLOCK = 1 << 17


def blocks(flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(start, view) of ``flat`` in cache-sized blocks on a CPU; the whole of it on an accelerator."""
    if flat.device.type != "cpu" or flat.numel() <= CPU_BLOCK:
        return [(0, flat)]
    return [(a, flat[a: a + CPU_BLOCK]) for a in range(0, flat.numel(), CPU_BLOCK)]


def l1_norm(flat: torch.Tensor) -> torch.Tensor:
    """sum |flat| as a 0-d fp32 tensor, pairwise-accurate, with no full-size temporary."""
    parts = blocks(flat)
    if len(parts) == 1:
        return flat.abs().sum()
    scratch = torch.empty(CPU_BLOCK, dtype=flat.dtype, device=flat.device)
    partial = torch.empty(len(parts), dtype=flat.dtype, device=flat.device)
    for i, (_, block) in enumerate(parts):
        partial[i] = torch.abs(block, out=scratch[: block.numel()]).sum()
    return partial.sum()
