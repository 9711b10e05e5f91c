"""The main job: data-parallel training of a small MLP on sklearn's digits
(ships with scikit-learn, nothing is downloaded) with DoubleSqueeze.

Real processes over torch.distributed (gloo):
    torchrun --nproc_per_node 4 examples/train_digits.py --compressor sign
In-process ranks (threads), for quick experiments with many workers:
    python examples/train_digits.py --workers 8 --compressor topk --ratio 0.01

Prints a progress bar and a summary: test accuracy, loss, bytes each worker
sent per step against an fp32 ring allreduce of the same gradients, time per step.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsq_plugins as dsq  # noqa: E402
from examples.common import Summary, ring_allreduce_bytes  # noqa: E402
from examples.common import progress as progress_bar  # noqa: E402
from examples.quickstart.common import leave  # noqa: E402


def load_digits_split(test_fraction: float = 0.2):
    """sklearn's 1,797 8x8 digits, scaled to [0, 1], a fixed train/test split."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def make_model(seed: int = 0, hidden: int = 64) -> nn.Module:
    """The same initial weights on every rank, drawn from a private generator
    (torch.manual_seed is process-wide: in-process ranks would race on it)."""
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (model[0], model[2]):
            bound = 1 / math.sqrt(layer.in_features)
            for p in (layer.weight, layer.bias):
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    return model


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    test_accuracy: float = 0.0
    test_loss: float = 0.0
    bytes_per_step: float = 0.0
    fp32_allreduce_bytes_per_step: float = 0.0
    seconds_per_step: float = 0.0


def train(comm: dsq.Communicator, *, compressor: str = "sign", error_feedback: str = "both",
          server_compressor: str | None = None, compressor_params: dict | None = None, steps: int = 300,
          lr: float = 0.05, momentum: float = 0.0, batch_size: int = 32, seed: int = 0,
          layerwise: bool = False, server_compressor_params: dict | None = None, staleness: int = 0,
          warmup_steps: int = 0, error_dtype: str = "fp32", progress: bool = False) -> RunResult:
    """Train on ``comm``'s ranks; every rank returns the same RunResult.

    ``staleness=1`` is the paper's asynchronous variant, as the Horovod drop-in
    runs it: step t applies the average of step t-1's gradients (the first
    step applies nothing), and the last average is applied after the loop.
    ``warmup_steps`` ramps the learning rate linearly from lr/warmup_steps up
    to lr over that many steps."""
    if staleness not in (0, 1):
        raise ValueError(f"staleness must be 0 or 1, got {staleness!r}")
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    reducer = dsq.DoubleSqueeze(comm, compressor, server_compressor, error_feedback,
                                compressor_params=compressor_params, layerwise=layerwise, seed=seed,
                                server_compressor_params=server_compressor_params, error_dtype=error_dtype)
    sampler = torch.Generator().manual_seed(seed * 1000 + comm.rank)
    named = [(n, p) for n, p in model.named_parameters()]
    numel = sum(p.numel() for _, p in named)
    result = RunResult()
    bar = progress_bar(steps, progress and comm.rank == 0)
    start = time.perf_counter()
    pending = None  # staleness 1: the average still to apply

    def apply(averaged):
        for (_, p), g in zip(named, averaged):
            p.grad.copy_(g)
        opt.step()

    for step in range(steps):
        if warmup_steps:
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / warmup_steps)
        idx = torch.randint(len(y_train), (batch_size,), generator=sampler)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad()
        loss.backward()
        averaged = reducer.reduce_many([(n, p.grad) for n, p in named])
        if staleness:
            averaged, pending = pending, averaged
        if averaged is not None:
            apply(averaged)
        result.losses.append(loss.item())
        if bar is not None:
            bar.update()
            if len(result.losses) % 25 == 0:
                bar.set_postfix(loss=f"{sum(result.losses[-25:]) / 25:.3f}")
    if pending is not None:
        apply(pending)
    if bar is not None:
        bar.close()
    result.seconds_per_step = (time.perf_counter() - start) / steps
    result.bytes_per_step = comm.bytes_sent / steps
    result.fp32_allreduce_bytes_per_step = ring_allreduce_bytes(numel, comm.size)
    with torch.no_grad():
        logits = model(x_test)
        result.test_loss = float(F.cross_entropy(logits, y_test))
        result.test_accuracy = float((logits.argmax(1) == y_test).float().mean())
    return result


def summary(result: RunResult, args) -> Summary:
    return Summary(f"digits, compressor={args.compressor} error_feedback={args.error_feedback}", args.world,
                   result.test_accuracy, sum(result.losses[-20:]) / min(20, len(result.losses)),
                   result.bytes_per_step, result.fp32_allreduce_bytes_per_step, result.seconds_per_step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compressor", default="sign", choices=list(dsq.COMPRESSORS))
    p.add_argument("--server-compressor", default=None, choices=list(dsq.COMPRESSORS))
    p.add_argument("--error-feedback", default="both", choices=["both", "worker", "none"])
    p.add_argument("--ratio", type=float, default=None, help="top-k / random-k fraction kept")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--layerwise", action="store_true")
    p.add_argument("--error-dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                   help="how the error memories are stored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4, help="in-process ranks when not under torchrun")
    args = p.parse_args(argv)
    params = {"ratio": args.ratio} if args.ratio is not None else None
    kw = dict(compressor=args.compressor, error_feedback=args.error_feedback, compressor_params=params,
              server_compressor=args.server_compressor, steps=args.steps, lr=args.lr, momentum=args.momentum,
              batch_size=args.batch_size, seed=args.seed, layerwise=args.layerwise, error_dtype=args.error_dtype,
              progress=True)
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # launched by torchrun
        import torch.distributed as dist
        dist.init_process_group("gloo")
        comm = dsq.TorchDistributedComm()
        args.world = comm.size
        result = train(comm, **kw)
        if comm.rank == 0:
            print(summary(result, args))
        leave()  # the group once every rank is done, and the process without interpreter teardown (exit 0)
    else:
        args.world = args.workers
        result = dsq.LocalGroup(args.workers).run(lambda comm: train(comm, **kw))[0]
        print(summary(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
