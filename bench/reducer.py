"""The reducer's own cost: one DoubleSqueeze step over n gloo ranks on this
machine (no model, no shaping), for each operator, against
``torch.distributed.all_reduce`` of the same fp32 vector measured in the same
run, and the time each rank spends per step outside collectives (from
``cProfile``: everything but the waits on gloo; wall time, so with more
ranks than cores it counts the time a rank waited for a core too).

    OMP_NUM_THREADS=1 python -m bench.reducer [-n 4] [--compressors sign topk blocksign]

The gradients are shaped as ``bench.slowlink``'s model's parameters (12.0M
floats in ten tensors, in the reverse order the engines hand them over, so
in the same buckets), so the two can be read together: the slow-link step is
backward plus this, minus what overlap hides.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dsq_plugins as dsq

from .slowlink_worker import make_model

PARAMS = {"topk": {"ratio": 0.01}}
WAITS = ("wait", "allgather", "all_to_all_single", "allreduce", "barrier")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def _outside_collectives(profile: cProfile.Profile) -> float:
    """Seconds the profiled calls spent in Python and torch, less the gloo waits."""
    stats = pstats.Stats(profile).stats
    total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
    waiting = sum(tt for (_, _, name), (_, _, tt, _, _) in stats.items() if any(w in name for w in WAITS))
    return total - waiting


def _rank(rank: int, n: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    comm = dsq.TorchDistributedComm()
    gen = torch.Generator().manual_seed(rank)
    named = reversed(list(make_model().named_parameters()))
    pieces = [(name, torch.randn(p.shape, generator=gen)) for name, p in named]
    flat = torch.cat([t.reshape(-1) for _, t in pieces])
    rows = {"all_reduce (fp32)": (_timed(lambda: dist.all_reduce(flat.clone()), args.warmup, args.steps), None)}
    for name in args.compressors:
        reducer = dsq.DoubleSqueeze(comm, name, compressor_params=PARAMS.get(name))
        grads = [(n_, t.clone()) for n_, t in pieces]
        step = lambda: reducer.reduce_many(grads, in_place=True)  # noqa: E731
        wall = _timed(step, args.warmup, args.steps)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            step()
        profile.disable()
        rows[name] = (wall, _outside_collectives(profile) / args.steps)
    queue.put((rank, rows))
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--compressors", nargs="+", default=["sign", "topk", "blocksign"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.n, port, args, queue)) for r in range(args.n)]
    for proc in procs:
        proc.start()
    results = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join()
    base = results[0]["all_reduce (fp32)"][0]
    print(f"n = {args.n} gloo ranks on {os.cpu_count()} cores, bench.slowlink's model's gradients, "
          f"mean of {args.steps} steps after {args.warmup}")
    print("| step | ms/step | x all_reduce | ms/rank/step outside collectives |")
    print("|---|---:|---:|---:|")
    for name, (wall, _) in results[0].items():
        cpu = [results[r][name][1] for r in results]
        cpu_ms = "" if cpu[0] is None else f"{1e3 * sum(cpu) / len(cpu):.0f}"
        print(f"| {name} | {1e3 * wall:.0f} | {wall / base:.2f} | {cpu_ms} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
