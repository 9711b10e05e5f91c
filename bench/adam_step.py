"""``CompressedAdam.step()`` against AdamW(foreach)'s, after the freeze, on
models ``bench.gpu``'s proxy is not: a wide MLP (few large tensors) and a
deep narrow net (many small ones). One in-process rank, one CPU thread,
random gradients; median ms of the optimizer's step alone.

    python -m bench.adam_step [--steps 25] [--bucket-mb 0.0165 0.066 0.264 25] [--stages]

``--bucket-mb``: instead, the host's share of ``step()`` by the momentum
exchange's bucket size, on the GPU's paths and kernels (``kernels.gpu_paths``,
every kernel compiled) over 64 tensors of 4,096 elements, a few too small for
their arithmetic to matter: each bucket costs the host its own exchange (the
calls of a bucket's passes), which on a GPU a short step cannot hide.

``--stages``: instead, where ``CompressedAdam.step()``'s time goes on a CPU,
on these models and ``bench.gpu``'s proxy GPT: each fused kernel's share and
the rest (eager ops, the exchange's Python), in ms and in clones of an fp32
vector as long as the model (a pass that reads and writes it once), beside
AdamW(foreach)'s step in the same unit. On a CPU a step's time is its passes
over memory, so this says how many passes each side makes.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

import dsq_plugins as dsq

MODELS = ("wide-mlp", "deep-narrow")
#: ``--stages`` also splits the step on bench.gpu's CPU proxy model
STAGE_MODELS = MODELS + ("gpt-proxy",)


def model_of(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt-proxy":
        from bench.gpu import model_for
        return model_for("cpu")[0]
    if kind == "wide-mlp":
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    layers: list[torch.nn.Module] = []
    for _ in range(60):
        layers += [torch.nn.Linear(96, 96), torch.nn.LayerNorm(96)]
    return torch.nn.Sequential(*layers)


def measure(comm, kind: str, steps: int) -> dict:
    model = model_of(kind)
    # AdamW's default weight decay for both: the same work (without it each skips its decay)
    ours = dsq.CompressedAdam(list(model.named_parameters()), comm=comm, lr=1e-4, weight_decay=0.01, freeze_step=1)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    times: dict[str, list[float]] = {"compressed_adam": [], "adamw": []}
    for _ in range(steps):
        for name, opt in (("compressed_adam", ours), ("adamw", adamw)):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            start = time.perf_counter()
            opt.step()
            times[name].append(1000 * (time.perf_counter() - start))
    warm = max(1, steps // 5)  # the freeze and first steps out
    ms = {name: statistics.median(t[warm:]) for name, t in times.items()}
    params = list(model.parameters())
    return {"model": kind, "params": sum(p.numel() for p in params), "tensors": len(params), **ms}


def by_bucket_size(comm, sizes_mb: list[float], steps: int) -> tuple[list[tuple[float, int, float]], float]:
    """([(bucket_mb, buckets, median host ms of ``CompressedAdam.step()``) for each size], AdamW(foreach)'s
    median ms), over 64 tensors of 4,096 elements with random gradients."""
    from dsq_plugins.compressors import kernels
    named = [(f"p{i}", torch.nn.Parameter(torch.randn(4096))) for i in range(64)]
    params = [p for _, p in named]
    rows = []
    with kernels.gpu_paths():
        for mb in sizes_mb:
            opt = dsq.CompressedAdam(named, comm=comm, lr=1e-4, weight_decay=0.01, freeze_step=1, bucket_mb=mb,
                                     verdict="step")
            buckets = len(opt.compressed.layout([(name, tuple(p.shape)) for name, p in named]))
            rows.append((mb, buckets, _median_step_ms(opt, params, steps)))
        adamw = _median_step_ms(torch.optim.AdamW(params, lr=1e-4, foreach=True), params, steps)
    return rows, adamw


def stages(comm, kind: str, steps: int) -> dict:
    """``CompressedAdam.step()`` on ``kind`` after the freeze, split: the median ms of each fused kernel's
    calls in a step (by name, in the order called) and of the whole step; AdamW(foreach)'s step; a clone of
    an fp32 vector of the model's size, the unit of a pass over memory."""
    from bench.gpu import timed
    from dsq_plugins.compressors import kernels
    model = model_of(kind)
    params = list(model.parameters())
    ours = dsq.CompressedAdam(list(model.named_parameters()), comm=comm, lr=1e-4, weight_decay=0.01, freeze_step=1)
    adamw = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    per_step: list[collections.Counter] = []  # each step's ms in each fused kernel, by name
    untimed = kernels.FusedKernel.__call__

    def timing(self, *args, numel):
        start = time.perf_counter()
        try:
            return untimed(self, *args, numel=numel)
        finally:
            per_step[-1][self.eager.__name__] += 1000 * (time.perf_counter() - start)

    _median_step_ms(ours, params, 5)  # the freeze, the compiles
    whole = []
    kernels.FusedKernel.__call__ = timing
    try:
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn_like(p)
            per_step.append(collections.Counter())
            start = time.perf_counter()
            ours.step()
            whole.append(1000 * (time.perf_counter() - start))
    finally:
        kernels.FusedKernel.__call__ = untimed
    vector = torch.randn(sum(p.numel() for p in params))
    fused = {name: statistics.median(step[name] for step in per_step) for name in per_step[0]}
    return {"model": kind, "params": vector.numel(), "clone": timed(vector.clone, "cpu", steps),
            "step": statistics.median(whole), "fused": fused, "adamw": _median_step_ms(adamw, params, steps)}


def _median_step_ms(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> float:
    """Median ms of ``opt.step()`` over ``steps`` steps of random gradients, its first fifth (the freeze) left out."""
    times = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        start = time.perf_counter()
        opt.step()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times[max(1, steps // 5):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=None)
    p.add_argument("--stages", action="store_true", help="instead, where CompressedAdam.step()'s time goes")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.stages:
        for kind in STAGE_MODELS:
            r = dsq.LocalGroup(1).run(lambda comm: stages(comm, kind, args.steps))[0]
            unit = r["clone"]
            print(f"\n{kind}: {r['params']:,} parameters, a clone of them {unit:.2f} ms")
            print("| stage of CompressedAdam.step() | ms | clones |")
            print("|---|---:|---:|")
            for name, ms in r["fused"].items():
                print(f"| {name} (fused) | {ms:.2f} | {ms / unit:.1f} |")
            rest = r["step"] - sum(r["fused"].values())
            print(f"| the rest: eager ops, the exchange's Python | {rest:.2f} | {rest / unit:.1f} |")
            print(f"| **the step** | {r['step']:.2f} | {r['step'] / unit:.1f} |")
            print(f"| AdamW(foreach)'s step | {r['adamw']:.2f} | {r['adamw'] / unit:.1f} |")
        return 0
    if args.bucket_mb:
        os.environ["DSQ_COMPILE"] = "always"
        rows, adamw = dsq.LocalGroup(1).run(lambda comm: by_bucket_size(comm, args.bucket_mb, args.steps))[0]
        print("| bucket_mb | buckets | CompressedAdam.step() host ms | x AdamW(foreach) |")
        print("|---:|---:|---:|---:|")
        for mb, buckets, ms in rows:
            print(f"| {mb:g} | {buckets} | {ms:.1f} | {ms / adamw:.1f} |")
        print(f"\nAdamW(foreach): {adamw:.2f} ms")
        return 0
    print("| model | parameters | tensors | CompressedAdam ms | AdamW(foreach) ms | x AdamW |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in MODELS:
        r = dsq.LocalGroup(1).run(lambda comm: measure(comm, kind, args.steps))[0]
        print(f"| {r['model']} | {r['params']:,} | {r['tensors']} | {r['compressed_adam']:.1f} | {r['adamw']:.1f} | "
              f"{r['compressed_adam'] / r['adamw']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
