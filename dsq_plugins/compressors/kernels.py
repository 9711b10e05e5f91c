"""Fused kernels for the compressors' passes over memory, compiled with
``torch.compile`` (inductor: C++ on a CPU, Triton on CUDA) where that pays,
the same torch ops run eagerly everywhere else.

Only work whose result does not depend on the order of operations is
compiled: bit packing, integer code arithmetic (the counter-based noise
included), elementwise float operations (one rounding each, the same in C++,
Triton and eager) and a maximum; never a floating-point sum, whose order a
compiler chooses. So compiled and eager kernels produce the same bytes
(``tests/test_kernels.py`` compares them). "One rounding each" needs three
of inductor's options on CUDA (``EAGER_NUMERICS``): by default Triton
contracts a multiply and an add into one rounding (an FMA), divides
approximately, and flushes subnormals to zero, where eager CUDA does none
of these. A multiply-add that eager rounds once (``add(alpha=)``) is
written as ``fused_multiply_add``.

``DSQ_COMPILE`` chooses: ``auto`` (the default) compiles for tensors of at
least ``COMPILE_FROM`` elements (or the kernel's own ``compile_from``),
where one fused pass saves more than the call costs and the one-time
compile (seconds, cached on disk by inductor) is repaid over a run's steps;
``always``; ``never``. A kernel whose graph for any size fails to compile
is compiled for each size instead (``compiled``); a compile that fails then
too logs one line and that kernel stays eager for the rest of the process
(``DSQ_SIZED_GRAPHS``: which large calls get a graph of their own sizes, see ``FusedKernel``);
threads take turns at compiled calls (``_COMPILED_CALLS``)."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import types
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ._direct_calls import MISSED, DirectCalls

__all__ = ["blocks", "COMPILE_FAILED", "COMPILE_FROM", "compile_mode", "compiled", "COMPILED_PER_SIZE", "CPU_BLOCK",
           "device_constant", "EAGER_NUMERICS", "failed_compiles", "fills_rows", "fused_multiply_add", "FusedKernel",
           "gpu_paths", "l1_norm", "launch_bound", "lookup", "lookup_rows", "MODES", "scaled_rows_of",
           "scaled_rows_of_fusable", "scattered_into", "side_by_side", "words_as_bytes"]

log = logging.getLogger("dsq_plugins")

MODES = ("auto", "always", "never")
# On this project's CPU the compiled rounding and block passes are 4-5x faster than eager from 64K
# elements on (a call costs about 55 us more); a bucket's chunks are often below 1M with 8 ranks or more
COMPILE_FROM = 1 << 16


#: inductor's options for every compiled kernel: eager's numerics on CUDA (no FMA contraction, divisions rounded
#: to nearest, subnormals kept); a C++ kernel on a CPU has them already
EAGER_NUMERICS = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True,
                  "eager_numerics.disable_ftz": True}


def compiled(fn: Callable[..., torch.Tensor], sized: bool = False) -> Callable[..., torch.Tensor]:
    """``fn`` compiled as every fused kernel is: for any size (``dynamic``), with eager's numerics, by
    inductor without AOTAutograd's on-disk cache (``_inductor_without_aot_cache``). Where a graph for
    any size fails to compile, ``fn`` is compiled for each size it is called with from then on: some
    torch versions' Triton code cannot split a reduction over a symbolic padded size (blocksign's
    residual on torch 2.11), which a graph of fixed sizes does not have; a bucket layout has few sizes.
    ``sized``: a graph for each size from the start (``FusedKernel``'s large calls)."""
    for_each_size = torch.compile(fn, dynamic=False, backend=_inductor_without_aot_cache)
    if sized:
        @functools.wraps(fn)
        def each(*args: object) -> torch.Tensor:
            with torch._dynamo.config.patch(recompile_limit=SIZED_GRAPHS + 1):  # one graph per shape it takes
                return for_each_size(*args)
        return each
    for_any_size = torch.compile(fn, dynamic=True, backend=_inductor_without_aot_cache)
    any_size_failed = False

    @functools.wraps(fn)
    def call(*args: object) -> torch.Tensor:
        nonlocal any_size_failed
        if not any_size_failed:
            try:
                return for_any_size(*args)
            except Exception as exc:
                if _traced_elsewhere(exc):
                    raise
                any_size_failed = True
                log.info(COMPILED_PER_SIZE, fn.__name__, *_named(exc))
        return for_each_size(*args)
    return call


#: how many shapes of a kernel's large calls get graphs of their own, and from how many elements a call is large
SIZED_GRAPHS = 4
SIZED_FROM = 1 << 20


def sized_graphs_mode() -> str:
    """``DSQ_SIZED_GRAPHS``, checked: which large calls get graphs of their own sizes (``FusedKernel``)."""
    mode = os.environ.get("DSQ_SIZED_GRAPHS", "auto")
    if mode not in MODES:
        from ..errors import ConfigError
        raise ConfigError(f"DSQ_SIZED_GRAPHS must be one of {MODES}, got {mode!r}")
    return mode


#: the line a kernel logs where its graph for any size failed to compile (it compiles for each size then)
COMPILED_PER_SIZE = "dsq_plugins: compiling %s for any size failed (%s: %s); it compiles for each size from now on"


def _inductor_without_aot_cache(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor with ``EAGER_NUMERICS``, its AOTAutograd cache off while it compiles. That cache's key
    leaves out how inputs overlap: a graph compiled where ``out`` and ``x`` were two views of one buffer
    was loaded by a later process for a separate ``out``, and left ``out`` unwritten. Inductor's own
    cache (what takes seconds to rebuild: the generated C++ or Triton) keys the graph AOTAutograd makes,
    which does differ, and stays on."""
    from torch._functorch import config as functorch_config  # noqa: PLC2701 - the switch exists only there
    from torch._inductor.compile_fx import compile_fx  # noqa: PLC2701 - torch.compile's own inductor entry
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(graph, example_inputs, config_patches=EAGER_NUMERICS)


def compile_mode() -> str:
    """``DSQ_COMPILE``, checked (read at every call, so tests can switch it)."""
    mode = os.environ.get("DSQ_COMPILE", "auto")
    if mode not in MODES:
        from ..errors import ConfigError
        raise ConfigError(f"DSQ_COMPILE must be one of {MODES}, got {mode!r}")
    return mode


#: how many ``gpu_paths`` blocks are open, in any thread: a count, not a saved flag, because a
#: ``LocalGroup``'s ranks are threads whose blocks open and close interleaved
_GPU_PATHS = 0
_GPU_PATHS_LOCK = threading.Lock()


def launch_bound(device: torch.device) -> bool:
    """Whether work on ``device`` is priced by its launches and host reads
    (a GPU), not by passes over memory (a CPU). The one rule behind every
    choice of path by device: batched rows or one call per chunk, a single
    gather or cache-sized blocks, a selection or a sampled threshold. Under
    ``gpu_paths`` a CPU takes the GPU's paths, which is how the CPU proxy
    (``bench.gpu --device cpu``) counts what a GPU would launch."""
    return _GPU_PATHS > 0 or device.type != "cpu"


class gpu_paths:
    """``with gpu_paths():`` every device takes the paths a GPU takes
    (``launch_bound``) until the last open block closes, whichever thread
    opened it. The results are the same bits either way; only the count
    and cost of the ops differ."""

    def __enter__(self) -> "gpu_paths":
        global _GPU_PATHS
        with _GPU_PATHS_LOCK:
            _GPU_PATHS += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _GPU_PATHS
        with _GPU_PATHS_LOCK:
            _GPU_PATHS -= 1


class FusedKernel:
    """An eager torch function and its compiled twin; ``numel`` (the elements
    the call works over) picks which one runs. ``fusable``, when given, is
    the same computation written the way inductor fuses best (the eager
    form may use tricks, such as reinterpreting bytes as int64, that make
    it fast eagerly and that a compiler handles poorly); it must return the
    same bits, which the tests check.

    Large calls (``SIZED_FROM`` elements on) of the first ``SIZED_GRAPHS``
    shapes a kernel meets run graphs compiled for those sizes, where
    ``DSQ_SIZED_GRAPHS`` says so; every other call runs the one graph for
    any size. A training job calls a kernel at the few sizes of its
    buckets, and inductor's C++ for known sizes ran faster on a CPU (for
    sign's payloads with their int8 residual, twice as fast:
    docs/results/gpu.md); small calls, whose sizes a test suite varies
    most, share one graph rather than compile one each. The sized graphs
    are compiled from a copy of ``fusable``'s code, so that dynamo keeps
    them apart from the graph for any size, which would admit their calls
    too. ``DSQ_SIZED_GRAPHS``: ``auto`` (the default: on a CPU, where it was
    measured; on a GPU each graph is a Triton compile, and what it saves
    there is not measured yet), ``always``, ``never``."""

    def __init__(self, eager: Callable[..., torch.Tensor], fusable: Callable[..., torch.Tensor] | None = None,
                 compile_on_cpu: bool = True, compile_from: int = COMPILE_FROM):
        functools.update_wrapper(self, eager)
        self.eager = eager
        self.fusable = fusable or eager
        self.compile_on_cpu = compile_on_cpu  # False where the eager form is the faster one on a CPU (bench.kernels)
        self.compile_from = compile_from  # the size from which compiling pays, in elements
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._direct: DirectCalls | None = None
        self._sized_compiled: Callable[..., torch.Tensor] | None = None  # large calls' graphs of their sizes
        self._sized_direct: DirectCalls | None = None
        self._sized: set[tuple] = set()  # the shapes given graphs of their own
        self._failed = False

    @property
    def direct_calls(self) -> DirectCalls | None:
        """The direct calls of this kernel's compiled graphs (None until its first compiled call)."""
        return self._direct

    def uses_compiled(self, numel: int, device: torch.device) -> bool:
        """Whether a call over ``numel`` elements on ``device`` runs the compiled form."""
        mode = compile_mode()
        if self._failed or mode == "never":
            return False
        return mode == "always" or (numel >= self.compile_from and (self.compile_on_cpu or device.type != "cpu"))

    def __call__(self, *args, numel: int) -> torch.Tensor:
        if self.uses_compiled(numel, args[0].device):
            # without autograd whatever the caller's mode: the graphs compute no gradient, and dynamo guards on
            # the mode, so an optimizer's no_grad step and a hook's backward would each compile their own
            with _COMPILED_CALLS, torch.no_grad():
                sized_graphs_mode()  # a bad DSQ_SIZED_GRAPHS is the caller's error, not a failed compile
                try:
                    call, direct = self._graphs_for(args)
                    detached = _without_bases(args)
                    result = direct(detached)  # a graph dynamo made, past its per-call machinery
                    if result is MISSED:
                        result = call(*detached)
                        direct.refresh()
                    return result
                except Exception as exc:  # no compiler, an unsupported op, ...: eager still works
                    if not _traced_elsewhere(exc):
                        self._failed = True
                        log.warning(COMPILE_FAILED, self.eager.__name__, *_named(exc))
        return self.eager(*args)

    def _graphs_for(self, args: tuple) -> tuple[Callable[..., torch.Tensor], DirectCalls]:
        """The compiled function and direct calls for ``args``: of their sizes (a large call of one of the
        first ``SIZED_GRAPHS`` shapes, where ``DSQ_SIZED_GRAPHS`` says so), or for any size."""
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
        if shapes in self._sized or (len(self._sized) < SIZED_GRAPHS and _sized_here(args)):
            if self._sized_compiled is None:
                copy = _with_own_code(self.fusable)
                self._sized_compiled, self._sized_direct = compiled(copy, sized=True), DirectCalls(copy)
            self._sized.add(shapes)
            return self._sized_compiled, self._sized_direct
        if self._compiled is None:
            self._compiled, self._direct = compiled(self.fusable), DirectCalls(self.fusable)
        return self._compiled, self._direct


def _sized_here(args: tuple) -> bool:
    """Whether a call with ``args``, of a shape not yet given a graph, gets a graph of its sizes."""
    mode = sized_graphs_mode()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if mode == "never" or not tensors or max(a.numel() for a in tensors) < SIZED_FROM:
        return False
    return mode == "always" or tensors[0].device.type == "cpu"


def _with_own_code(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` with a code object of its own (dynamo keeps its graphs per code object)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return functools.update_wrapper(copy, fn)


#: the one line a kernel logs when its compile fails (it then runs eager for the rest of the process)
COMPILE_FAILED = "dsq_plugins: compiling %s failed (%s: %s); it runs as eager torch ops from now on"


@contextlib.contextmanager
def failed_compiles() -> Iterator[list[str]]:
    """The messages of the fused kernels whose compile failed while open, on any thread: each such
    kernel runs eager from then on, with the same bits, so a run that means to measure or test the
    compiled paths checks that this stayed empty (``bench.gpu``, the tests' ``conftest``)."""
    failures: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg == COMPILE_FAILED:
                failures.append(record.getMessage())
    handler = Collect(level=logging.WARNING)
    log.addHandler(handler)
    try:
        yield failures
    finally:
        log.removeHandler(handler)


def _without_bases(args: tuple) -> tuple:
    """Tensor views passed as tensors of their own (``detach``: the same memory, no ``_base``). Dynamo
    guards on a view's base, its size too under dynamic shapes, so one kernel called with a slice of a
    bucket, a whole tensor and a view of another shape compiled a graph for each. Views alike (one base,
    the same place and shape: ``out`` over its own input, each view made on its own) become one tensor,
    as an in-place call of one object is: two tensors over one storage are inputs AOTAutograd merges
    into a base of theirs, which it fails to trace at symbolic sizes, and the kernel went eager."""
    views = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a._is_view()]
    if not views:
        return args
    detached, made = list(args), {}
    for i in views:
        a = args[i]
        alike = (id(a._base), a.storage_offset(), a.shape, a.stride(), a.dtype)
        if alike not in made:
            made[alike] = a.detach()
        detached[i] = made[alike]
    return tuple(detached)


#: Compiled calls from several threads (LocalGroup's ranks, Horovod's exchange thread, the DDP hook's) take
#: turns: while one thread traces a kernel, torch refuses a compiled call from any other, and a kernel that
#: was refused would otherwise stay eager for good
_COMPILED_CALLS = threading.RLock()


def _named(exc: Exception) -> tuple[str, str]:
    """(``exc``'s type, its message's first line): what a compile's log line says of why it failed."""
    message = str(exc)
    return type(exc).__name__, message.splitlines()[0] if message else ""


def _traced_elsewhere(exc: Exception) -> bool:
    """Whether ``exc`` is torch refusing a compiled call because some other thread (a user's own
    ``torch.compile``, say) was tracing at that moment: that call runs eagerly (the same bits), and
    the kernel stays compiled for the next."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("Detected that you are using FX")


def fused_multiply_add(a: torch.Tensor, b: float | torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a·b + c`` rounded once: what eager ``torch.add(c, a, alpha=b)`` computes
    on a CPU with FMA instructions and on CUDA, and, inside a compiled kernel,
    inductor's own FMA, which the default lowering of ``add(alpha=)`` on a CPU
    is not. A compiled kernel takes ``b`` as a 0-d tensor (inductor's on-disk
    cache does not key an FMA's constant number); eager, as a number."""
    if torch.compiler.is_compiling():
        return _inductor_fma(a, b, c)
    return torch.add(c, a, alpha=b)


def _inductor_fma(a: torch.Tensor, b: float | torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    from torch._inductor import inductor_prims  # noqa: PLC2701 - the one public-enough way to ask inductor for an FMA
    return inductor_prims.fma(a, b, c)


@functools.lru_cache(maxsize=None)
def device_constant(value: float, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``value`` as a 0-d tensor on ``device``, made once (a fill is a launch
    on a GPU, at every bucket). Divide by it, not by the host number: CUDA
    divides by a host number as a multiply by its reciprocal, a last bit
    away from the true division a CPU and a compiled kernel do."""
    return torch.full((), value, dtype=dtype, device=device)


def words_as_bytes(words: torch.Tensor) -> torch.Tensor:
    """The bytes of (rows, n) int32 ``words`` in memory order, (rows, 4n)
    uint8, by shifts: what ``.view(torch.uint8)`` gives, written so that a
    compiled kernel computes it in the pass that writes a payload (a
    reinterpreting view or a cat would be a copy of its own there)."""
    rows, n = words.shape
    each = words[:, :, None].expand(rows, n, 4).reshape(rows, 4 * n)
    byte = torch.arange(4 * n, device=words.device) % 4
    shifts = (byte if sys.byteorder == "little" else 3 - byte) * 8
    return ((each >> shifts) & 0xFF).to(torch.uint8)


def scattered_into(into: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, fusable: bool) -> torch.Tensor:
    """The rows ``into`` set to +0.0 with ``values`` at ``positions`` (a sparse operator's row decode
    written into a caller's buffer, as ``decode_rows`` scatters onto zeros); as a compiled kernel
    writes it where ``fusable`` (the same bits)."""
    if fusable:
        return into.copy_(torch.zeros_like(into).scatter(1, positions, values))
    return into.zero_().scatter_(1, positions, values)


def side_by_side(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``torch.cat([left, right], dim=1)`` of two uint8 (rows, n) tensors as
    two zero-padded halves or-ed: pointwise, so one compiled kernel writes
    the whole payload."""
    return F.pad(left, (0, right.shape[1])) | F.pad(right, (left.shape[1], 0))


def lookup(table: torch.Tensor, packed: torch.Tensor, numel: int, scale: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode by table: row ``b`` of ``table`` holds what byte ``b`` stands
    for (``bitpack.byte_table``); one gather writes the output once (no
    per-bit passes). ``scale``: a one-element tensor every value is
    multiplied by (the same bits as a table multiplied first; where
    compiled, one kernel casts the bytes, gathers and scales). ``out``: a
    flat buffer of ``numel`` elements to write the values into, where the bytes
    fill it exactly (use what this returns: it is ``out`` then, a new tensor otherwise)."""
    n = packed.numel() * table.shape[1]
    fills = out is not None and n == numel == out.numel() and out.dtype == table.dtype and out.is_contiguous()
    if not launch_bound(packed.device) and not _lookup_kernel.uses_compiled(n, packed.device):
        return _lookup_blocked(table if scale is None else table * scale, packed, numel, out if fills else None)
    if scale is None:
        return _lookup_kernel(table, packed, numel=n).reshape(-1)[:numel]
    if fills:
        return _scaled_lookup_into_kernel(out.view(1, -1), table, packed.reshape(1, -1), scale.reshape(1, 1),
                                          numel=n).view(-1)
    return _scaled_lookup_kernel(table, packed.reshape(1, -1), scale.reshape(1, 1), numel=n).reshape(-1)[:numel]


def lookup_rows(table: torch.Tensor, packed: torch.Tensor, numel: int, scales: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``lookup`` of each row of ``packed`` (count, bytes): (count, numel),
    every row in the one gather; ``scales`` (count, 1): each row's scale.
    ``out``: a (count, numel) buffer to write scaled rows into, where the
    bytes fill each row exactly (use what this returns)."""
    count = packed.shape[0]
    n = packed.numel() * table.shape[1]
    fills = scales is not None and fills_rows(out, count, numel, n, table.dtype)
    if not launch_bound(packed.device) and not _lookup_kernel.uses_compiled(n, packed.device):
        # scaled in place, in ``out`` or in the lookup's own fresh rows: a second large tensor each call
        # costs a CPU more in page faults than the multiply itself
        values = _lookup_blocked(table, packed.reshape(-1), n, out.view(-1) if fills else None)
        values = values.view(count, -1)[:, :numel]
        return values if scales is None else values.mul_(scales)
    if scales is None:
        return _lookup_kernel(table, packed, numel=n).view(count, -1)[:, :numel]
    if fills:
        return _scaled_lookup_into_kernel(out, table, packed, scales, numel=n)
    return _scaled_lookup_kernel(table, packed, scales, numel=n)[:, :numel]


def fills_rows(out: torch.Tensor | None, count: int, numel: int, n: int, dtype: torch.dtype) -> bool:
    """Whether ``out`` is a contiguous (count, numel) buffer of ``dtype`` that ``n`` decoded values,
    ``count`` rows of them, fill exactly (no row's last byte decodes past its end): a row decoder may
    then write into it."""
    return (out is not None and n == count * numel and tuple(out.shape) == (count, numel) and out.dtype == dtype
            and out.is_contiguous())


def _lookup_blocked(table: torch.Tensor, packed: torch.Tensor, numel: int, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The CPU's lookup, block by block: the bytes' int32 row indices (which
    index_select needs) live in a cache-sized scratch, not in a tensor four
    times the payload's size that a large vector page-faults in (TernGrad, 64M
    elements: 43 ms of a 230 ms decode). ``out``: where to write, every byte's row."""
    per = table.shape[1]
    out = torch.empty(packed.numel() * per, dtype=table.dtype) if out is None else out
    source = _one_element_rows(table)
    size = max(1, min(CPU_BLOCK, packed.numel()))
    rows = torch.empty(size, dtype=torch.int32)
    for a in range(0, packed.numel(), size):
        m = min(size, packed.numel() - a)
        block = out[a * per: (a + m) * per]
        torch.index_select(source, 0, rows[:m].copy_(packed[a: a + m]),
                           out=block.view(source.dtype) if source is not table else block.view(m, per))
    return out[:numel]


# A table row of 8 or 16 bytes gathered as one element of that width: index_select copies single
# elements far faster than rows (TernGrad's 2-bit decode, rows of four floats: 74 -> 55 ms for 16M
# elements on this project's CPU, about a clone). A pure copy of bits, so the values are the same.
_ONE_ELEMENT_ROWS = {8: torch.int64, 16: torch.complex128}


def _one_element_rows(table: torch.Tensor) -> torch.Tensor:
    """``table`` as a vector of one wide element per row where a dtype that wide exists, else itself."""
    wide = _ONE_ELEMENT_ROWS.get(table.shape[1] * table.element_size())
    return table if wide is None or not table.is_contiguous() else table.view(wide).reshape(-1)


def _rows_of(table: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Row ``b`` of ``table`` for each byte ``b`` of ``packed`` (any shape): (bytes, row length)."""
    rows = packed.reshape(-1).to(torch.int32)
    source = _one_element_rows(table)
    if source is table:
        return table.index_select(0, rows)
    return source.index_select(0, rows).view(table.dtype).view(-1, table.shape[1])


def _rows_of_fusable(table: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # Triton has no complex128: the compiled gather takes the rows as they are
    return table.index_select(0, packed.reshape(-1).to(torch.int32))


def scaled_rows_of(table: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``_rows_of`` for each row of ``packed`` (count, bytes), times that row's scale (``scales``: (count, 1))."""
    return _rows_of(table, packed).view(packed.shape[0], -1) * scales


def scaled_rows_of_fusable(table: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``scaled_rows_of`` as a compiled kernel gathers it (the rows as they are: the same values)."""
    return _rows_of_fusable(table, packed).view(packed.shape[0], -1) * scales


def _scaled_rows_into(out: torch.Tensor, table: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor
                      ) -> torch.Tensor:
    """``scaled_rows_of`` written into the rows ``out`` (a caller's output: no copy of the values after)."""
    return out.copy_(scaled_rows_of(table, packed, scales))


def _scaled_rows_into_fusable(out: torch.Tensor, table: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor
                              ) -> torch.Tensor:
    return out.copy_(scaled_rows_of_fusable(table, packed, scales))


# CUDA's index_select copies rows of a few floats at a twentieth of memory speed (1.3 ms for 16M floats
# on an H100, bench.kernels), where the compiled gather runs at memory speed; on a CPU eager is the faster
_lookup_kernel = FusedKernel(_rows_of, _rows_of_fusable, compile_on_cpu=False)
# sign's decoders: the bytes' cast, the gather and the scale in one kernel where compiled
_scaled_lookup_kernel = FusedKernel(scaled_rows_of, scaled_rows_of_fusable, compile_on_cpu=False)
# the same into a caller's buffer (a served chunk decoded into the average): one kernel where compiled
_scaled_lookup_into_kernel = FusedKernel(_scaled_rows_into, _scaled_rows_into_fusable, compile_on_cpu=False)


# On a CPU a full-size temporary costs page faults worth several copies (see bench.kernels), and
# an L1 norm by torch.linalg.vector_norm runs at a fifth of memory speed and sums in plain fp32
# (2% off at 16M elements). Sweeping in blocks that stay in cache avoids both.
CPU_BLOCK = 1 << 17


def blocks(flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(start, view) of ``flat`` in cache-sized blocks on a CPU; the whole of it on an accelerator."""
    if launch_bound(flat.device) or flat.numel() <= CPU_BLOCK:
        return [(0, flat)]
    return [(a, flat[a: a + CPU_BLOCK]) for a in range(0, flat.numel(), CPU_BLOCK)]


#: where the one-pass L1 was measured to give the same bits and to pay (below it, the same time)
ONE_PASS_L1_FROM = 1 << 20


def l1_norm(flat: torch.Tensor) -> torch.Tensor:
    """sum |flat| as a 0-d fp32 tensor, pairwise-accurate, with no full-size temporary. On CUDA, from
    ``ONE_PASS_L1_FROM`` elements, one reduction (``vector_norm``) where abs then sum wrote and read |flat|
    again: the same bits where measured (an H200, ``bench.sign_stages``), in one pass instead of three."""
    if flat.device.type == "cuda" and flat.dtype == torch.float32 and flat.numel() >= ONE_PASS_L1_FROM:
        return torch.linalg.vector_norm(flat, 1)
    parts = blocks(flat)
    if len(parts) == 1:
        return flat.abs().sum()
    scratch = torch.empty(CPU_BLOCK, dtype=flat.dtype, device=flat.device)
    partial = torch.empty(len(parts), dtype=flat.dtype, device=flat.device)
    for i, (_, block) in enumerate(parts):
        partial[i] = torch.abs(block, out=scratch[: block.numel()]).sum()
    return partial.sum()
