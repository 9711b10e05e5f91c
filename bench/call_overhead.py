"""What one call of a compiled kernel costs the host, against an eager op:
on a GPU a bucket's passes are small enough that the host's time per call,
not the pass over memory, sets their pace (docs/results/gpu.md), so this
prices each way of calling the same small fused function.

    python -m bench.call_overhead [--device cuda|cpu] [--numel 4096] [--calls 2000]

Each row is the host's microseconds per call, over ``--calls`` calls issued
without a sync in between (the device runs behind), and the fewest of five
such runs. The function is a multiply-add of two vectors: eager as two ops
and as one (``torch.add(alpha=)``), then compiled as ``kernels.compiled``
compiles the library's kernels (any size, eager's numerics), and the ways
that may cost less per call: a size fixed at compile time, no inductor
options, guards skipped once warm, CUDA graphs (``reduce-overhead``), and a
``FusedKernel`` (the library's wrapper: the compile mode read per call, a
lock shared by threads, and once dynamo has compiled its graph, that graph
called behind its guard without torch.compile's per-call machinery,
``compressors._direct_calls``)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch

from dsq_plugins.compressors import kernels


def multiply_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * 2.0 + b


def variants(device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """Ways to call ``multiply_add``, by name."""
    fused = kernels.FusedKernel(multiply_add)
    found = {
        "eager, two ops": multiply_add,
        "eager, one op (add alpha=)": lambda a, b: torch.add(b, a, alpha=2.0),
        "compiled as the library does (dynamic, eager's numerics)": kernels.compiled(multiply_add),
        "compiled, dynamic, no options": torch.compile(multiply_add, dynamic=True),
        "compiled, this size only (dynamic=False)": torch.compile(multiply_add, dynamic=False),
        "FusedKernel (the library's wrapper)": lambda a, b: fused(a, b, numel=a.numel()),
    }
    if device.type == "cuda":
        found["compiled, CUDA graphs (reduce-overhead)"] = torch.compile(multiply_add, mode="reduce-overhead")
    return found


def host_us(fn: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor, calls: int,
            device: torch.device, unguarded: bool = False) -> float:
    """Fewest host microseconds per call over five runs of ``calls`` calls."""
    for _ in range(5):  # compile, and warm
        fn(a, b)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if unguarded else None
        start = time.perf_counter()
        for _ in range(calls):
            fn(a, b)
        spent = time.perf_counter() - start
        if stance is not None:
            torch.compiler.set_stance("default")
        best = min(best, spent)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return 1e6 * best / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--numel", type=int, default=4096)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    a, b = torch.randn(args.numel, device=device), torch.randn(args.numel, device=device)
    print(f"host us per call on {device}, {args.numel} elements, fewest of 5 runs of {args.calls} calls")
    print("| call | host us |\n|---|---:|")
    for name, fn in variants(device).items():
        try:
            cost = f"{host_us(fn, a, b, args.calls, device):.1f}"
        except Exception as exc:  # noqa: BLE001 - one way failing (CUDA graphs, say) leaves the others' figures
            cost = f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})"
        print(f"| {name} | {cost} |", flush=True)
    try:
        unguarded = f"{host_us(kernels.compiled(multiply_add), a, b, args.calls, device, unguarded=True):.1f}"
    except Exception as exc:  # noqa: BLE001 - an older torch without the stance's option
        unguarded = f"unavailable ({type(exc).__name__})"
    print(f"| compiled as the library does, guards skipped once warm | {unguarded} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
