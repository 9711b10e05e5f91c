"""The host's time per bucket: what one more bucket of a step costs the
host, the reducer's Python and its compiled calls, when the buckets are
too small for their passes to matter. On a GPU the host's time, not the
device's, set the hook's pace (docs/results/gpu.md), so this is the CPU's
proxy for it; a CPU's figure prices Python and dynamo on this CPU, not a
GPU host's.

    python -m bench.bucket_host [--device cpu|cuda] [--compressors sign topk blocksign]
                                [--numel 4096] [--buckets 16] [--steps 40]

One rank (a gloo or nccl group of one), ``DoubleSqueeze.reduce_many`` over
``--buckets`` buckets of ``--numel`` elements against one bucket of them, the
step's verdict deferred (``verdict="step"``), every kernel compiled
(``DSQ_COMPILE=always``) and, on a CPU, the paths a GPU takes
(``kernels.gpu_paths``). Each row: the median microseconds per step of each,
the host's microseconds per extra bucket, and how many compiled calls a
bucket makes, of one tensor and of all of them (a bucket of several tensors,
as ``reduce_many`` hands the reducer, should cost the calls of one): calls
that ran compiled, not those of a kernel whose compile failed (it runs eager
from then on, the same bits, and only a log line says so). Then, for the
step of many buckets, each compiled kernel's host time per call split into
dynamo's guard and the graph's call (AOTAutograd's wrappers, inductor's
code, the launch), and what is left of a bucket: the library's own Python
and its eager ops. With ``--profile``, that step under cProfile: each
bucket's host time by whose code spends it (each module of the library,
torch's Python, the C functions: torch's ops and the compiled kernels),
which cProfile inflates in proportion to the Python calls made.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import pstats
import sys
import tempfile

import torch
import torch.distributed as dist

from bench.gpu import profiled, timed
from dsq_plugins.compressors import kernels


def per_bucket(compressor: str, device: str, numel: int, buckets: int, steps: int, profile: bool = False) -> dict:
    """The host's cost of ``buckets`` buckets against one, for ``compressor`` (``profile``: and by owner)."""
    import dsq_plugins as dsq
    from dsq_plugins.comm import TorchDistributedComm
    comm = TorchDistributedComm(None)
    named = [(f"p{i}", torch.randn(numel, device=device)) for i in range(buckets)]
    row: dict[str, float] = {}
    calls = [0]
    counted = kernels.FusedKernel.__call__
    called: set[kernels.FusedKernel] = set()

    def counting(self, *args, numel):  # a call that ran compiled (not one of a kernel whose compile failed)
        result = counted(self, *args, numel=numel)
        compiled = self.uses_compiled(numel, args[0].device)
        calls[0] += compiled
        if compiled:
            called.add(self)
        return result

    for count in (1, buckets):
        mb = buckets // count * numel * 4 / 1e6 * 1.0001  # each bucket holds buckets / count tensors
        reducer = dsq.DoubleSqueeze(comm, compressor, bucket_mb=mb, verdict="step")
        step = lambda reducer=reducer: reducer.reduce_many(named)  # noqa: E731
        for _ in range(5):  # compile and warm
            step()
        row[f"{count}"] = 1000 * timed(step, device, steps)
        kernels.FusedKernel.__call__ = counting
        try:
            calls[0] = 0
            step()
            row[f"calls{count}"] = calls[0] / count
        finally:
            kernels.FusedKernel.__call__ = counted
    row["per_bucket"] = (row[f"{buckets}"] - row["1"]) / (buckets - 1)
    row["split"] = guard_and_graph(called, step, device, steps, buckets)
    row["owners"] = by_owner(step, device, steps, buckets) if profile else []
    return row


def by_owner(step, device: str, steps: int, buckets: int) -> list[tuple[str, float, float]]:
    """(whose code, host us per bucket, calls per bucket) over ``steps`` of ``step`` under cProfile, most first:
    each library module, torch's Python, the C functions (torch's ops, the compiled kernels' code), the rest."""
    profile = profiled(step, device, steps)
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    package = os.path.dirname(os.path.dirname(os.path.abspath(kernels.__file__)))  # dsq_plugins/
    for (path, _, _), (_, count, own, _, _) in pstats.Stats(profile).stats.items():
        if path.startswith(package + os.sep):
            owner = os.path.relpath(path, os.path.dirname(package))
        elif path == "~":
            owner = "C functions (torch's ops, compiled kernels)"
        elif f"{os.sep}torch{os.sep}" in path or "torchinductor" in path:
            owner = "torch's Python"
        else:
            owner = "other Python"
        spent[owner] += own
        calls[owner] += count
    per = steps * buckets
    return [(owner, 1e6 * seconds / per, calls[owner] / per) for owner, seconds in spent.most_common()]


def guard_and_graph(called: set[kernels.FusedKernel], step, device: str, steps: int, buckets: int
                    ) -> dict[str, tuple[float, float, float]]:
    """For each kernel in ``called``: (its calls per bucket, host us per call in dynamo's guard, in the
    graph's call), over ``steps`` of ``step``, each of ``buckets`` buckets (``DirectCalls.timed``)."""
    with contextlib.ExitStack() as timing:
        spent = {kernel.eager.__name__: timing.enter_context(kernel.direct_calls.timed())
                 for kernel in called if kernel.direct_calls is not None}
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    return {name: (n / steps / buckets, 1e6 * guard / max(n, 1), 1e6 * graph / max(n, 1))
            for name, (n, guard, graph) in sorted(spent.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compressors", nargs="+", default=["sign", "topk", "blocksign"])
    p.add_argument("--numel", type=int, default=4096)
    p.add_argument("--buckets", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile", action="store_true", help="then the step of many buckets under cProfile, by owner")
    args = p.parse_args(argv)
    if args.buckets < 2:
        p.error("--buckets must be at least 2")
    os.environ["DSQ_COMPILE"] = "always"
    torch.set_num_threads(1)
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{store.name}",
                                rank=0, world_size=1)
        paths = kernels.gpu_paths() if args.device == "cpu" else contextlib.nullcontext()
        print(f"host us per step on {args.device}, one rank, buckets of {args.numel} elements, "
              f"median of {args.steps} steps")
        print(f"| compressor | 1 bucket | {args.buckets} buckets | per extra bucket | compiled calls / bucket | "
              f"compiled calls, 1 bucket of {args.buckets} tensors |")
        print("|---|---:|---:|---:|---:|---:|")
        splits = {}
        with paths:
            for name in args.compressors:
                row = per_bucket(name, args.device, args.numel, args.buckets, args.steps, args.profile)
                splits[name] = row
                print(f"| {name} | {row['1']:.0f} | {row[str(args.buckets)]:.0f} | {row['per_bucket']:.0f} | "
                      f"{row[f'calls{args.buckets}']:.1f} | {row['calls1']:.0f} |", flush=True)
        print(f"\nhost us per compiled call, {args.buckets} buckets: dynamo's guard and the graph's call")
        print("| compressor | kernel | calls / bucket | guard us | graph us |")
        print("|---|---|---:|---:|---:|")
        for name, row in splits.items():
            in_calls = 0.0
            for kernel, (per, guard, graph) in row["split"].items():
                in_calls += per * (guard + graph)
                print(f"| {name} | {kernel} | {per:.1f} | {guard:.1f} | {graph:.1f} |")
            print(f"| {name} | the rest of a bucket (the library's Python, its eager ops) | | | "
                  f"{row['per_bucket'] - in_calls:.0f} |", flush=True)
        if args.profile:
            print(f"\nhost us per bucket under cProfile, {args.buckets} buckets, by whose code spends it")
            print("| compressor | whose code | us / bucket | calls / bucket |")
            print("|---|---|---:|---:|")
            for name, row in splits.items():
                owners = row["owners"]
                for owner, us, count in owners:
                    print(f"| {name} | {owner} | {us:.1f} | {count:.1f} |")
                print(f"| {name} | all | {sum(us for _, us, _ in owners):.0f} | "
                      f"{sum(count for _, _, count in owners):.0f} |", flush=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
