"""Calls of a compiled kernel's graphs without ``torch.compile``'s per-call machinery.

A call of a ``torch.compile`` function costs the host far more than the kernel it runs: the wrapper
that sets up frame evaluation, dynamo's cache lookup and its layers of context wrappers come to
several times the compiled graph's own call (docs/results/gpu.md measures both). On a GPU that host
time is what a step waits on; a bucket makes several such calls.

What dynamo keeps for a function is a list of cache entries, each a guard and the transformed code
it runs when the guard holds: code that unpacks the arguments and calls the compiled graph. Once
dynamo has made them, ``DirectCalls`` runs that same code itself behind that same guard: the guard
sees the same frame (the arguments and the closure's values by name), so a call it admits is the
call dynamo would have made, and one it refuses (another dtype, a size dynamo specialised, aliased
arguments, grad mode, a changed global) goes the usual way, which compiles what it needs; the
entries are read again after it. Code with a graph break is left to dynamo (its resume functions
are frames dynamo must evaluate), as is anything this torch does not expose as expected.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
import types
from typing import Any, Callable, Iterator

import torch

__all__ = ["DirectCalls", "MISSED"]

log = logging.getLogger("dsq_plugins")

#: what ``DirectCalls.__call__`` returns where no entry admits the call (its caller calls the usual way)
MISSED: Any = object()


class DirectCalls:
    """The graphs dynamo compiled for ``fn``, called directly (see the module docstring). Call
    ``refresh()`` after each call made the usual way; ``self(args)`` is the result, or ``MISSED``."""

    def __init__(self, fn: Callable[..., Any]):
        code = fn.__code__
        positional = not code.co_flags & inspect.CO_VARKEYWORDS and not code.co_kwonlyargcount
        self._fn = fn
        self._names = code.co_varnames[:code.co_argcount] if positional else None
        # a ``*rest`` parameter is one local of the frame, the tuple of the arguments past the named ones
        self._rest = code.co_varnames[code.co_argcount] if positional and code.co_flags & inspect.CO_VARARGS \
            else None
        self._free = code.co_freevars
        self._entries: list[tuple[Callable[[dict], bool], Callable[..., Any]]] = []
        self._broken = self._names is None

    def __call__(self, args: tuple) -> Any:
        if not self._entries or _inside_dynamo():
            return MISSED
        named = len(self._names)
        if len(args) != named and (self._rest is None or len(args) < named):
            return MISSED
        frame = dict(zip(self._names, args))
        if self._rest is not None:
            frame[self._rest] = args[named:]
        if self._free:  # a closure's values are part of the frame its guards read
            frame.update(zip(self._free, (cell.cell_contents for cell in self._fn.__closure__)))
        for at, (admits, run) in enumerate(self._entries):
            try:
                admitted = admits(frame)
            except Exception as exc:  # a guard that reads its frame otherwise in this torch
                self._give_up(exc)
                return MISSED
            if admitted:
                if at:  # the last one used is tried first, as dynamo does: a guard costs as much as a graph's call
                    self._entries = [self._entries[at], *self._entries[:at], *self._entries[at + 1:]]
                return run(*args)
        return MISSED

    def refresh(self) -> None:
        """Read dynamo's entries for ``fn`` again (after a call that may have compiled one)."""
        if self._broken:
            return
        try:
            self._entries = [entry for entry in map(self._direct, _cache_entries(self._fn.__code__)) if entry]
        except Exception as exc:  # a torch whose entries look otherwise
            self._give_up(exc)

    @contextlib.contextmanager
    def timed(self) -> Iterator[list[float]]:
        """While open, the host's time of the calls made direct: yields [calls run, seconds in the guards
        tried, seconds in the graphs run] (``bench.bucket_host`` reports them per call). The entries are
        put back as they were after; entries read again meanwhile (``refresh``) are not timed."""
        spent = [0, 0.0, 0.0]

        def timed_entry(admits: Callable[[dict], bool], run: Callable[..., Any]
                        ) -> tuple[Callable[[dict], bool], Callable[..., Any]]:
            def timed_admits(frame: dict) -> bool:
                start = time.perf_counter()
                try:
                    return admits(frame)
                finally:
                    spent[1] += time.perf_counter() - start

            def timed_run(*args: Any) -> Any:
                start = time.perf_counter()
                try:
                    return run(*args)
                finally:
                    spent[0] += 1
                    spent[2] += time.perf_counter() - start
            return timed_admits, timed_run

        kept = self._entries
        self._entries = [timed_entry(*entry) for entry in kept]
        try:
            yield spent
        finally:
            self._entries = kept

    def _give_up(self, exc: Exception) -> None:
        """Every call goes the usual way from now on (the same results, at torch.compile's cost)."""
        self._broken, self._entries = True, []
        log.info("dsq_plugins: %s keeps torch.compile's own calls (%s: %s)", self._fn.__name__,
                 type(exc).__name__, exc)

    def _direct(self, entry: Any) -> tuple[Callable[[dict], bool], Callable[..., Any]] | None:
        """(the entry's guard, its code as a function of ``fn``'s arguments), or None where the code
        is not one graph's call (a graph break's resume function, other free variables)."""
        code = entry.code
        if code.co_freevars != self._free or any(name.startswith("__resume_at") for name in code.co_names):
            return None
        run = types.FunctionType(code, self._fn.__globals__, self._fn.__name__, self._fn.__defaults__,
                                 self._fn.__closure__)
        return entry.guard_manager.check, run


def _inside_dynamo() -> bool:
    """Whether dynamo is tracing this call, or runs frames under its callback here (code that a user's own
    ``torch.compile`` left to Python): a frame started here would be dynamo's to evaluate, so the call goes
    the usual way, which handles both."""
    return torch.compiler.is_compiling() or _callback_reader()() is not None


@functools.lru_cache(maxsize=None)
def _callback_reader() -> Callable[[], Any]:
    """What reads dynamo's frame callback on this thread (a torch without one: every call is treated as inside)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback  # noqa: PLC2701 - dynamo's own reader
    except ImportError:
        return lambda: True
    return get_eval_frame_callback


def _cache_entries(code: types.CodeType) -> list[Any]:
    """Dynamo's cache entries for ``code``, in the order it tries them."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: PLC2701 - dynamo's one reader of them
    return list(_debug_get_cache_entry_list(code))
