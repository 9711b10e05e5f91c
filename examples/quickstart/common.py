"""What every quickstart shares: a small model, a task it can learn, and the
check that training went somewhere (the ranks agree and the loss fell)."""
from __future__ import annotations

import os
import sys
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def batch(rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own batch of a fixed task: the class is where a fixed projection is largest."""
    x = torch.randn(size, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    return x, (x @ teacher).argmax(dim=1)


def loss_of(net: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return F.cross_entropy(net(x), y)


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> tuple[float, float]:
    """``steps`` plain steps on this rank's batches; (mean loss of the first five, of the last five)."""
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(net, rank, step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


def train_averaged(net: torch.nn.Module, opt: torch.optim.Optimizer, reducer, rank: int,
                   steps: Iterable[int]) -> tuple[float, float]:
    """``train``, each gradient replaced by its average over ``reducer`` (a
    ``dsq_plugins.DoubleSqueeze``) before the step (the plain torch guide shows these lines)."""
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = loss_of(net, rank, step)
        loss.backward()
        # [average]
        named = [(name, p.grad) for name, p in net.named_parameters()]
        for (_, p), average in zip(net.named_parameters(), reducer.reduce_many(named)):
            p.grad = average
        # [/average]
        opt.step()
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


def report(first: float, last: float, params: list[torch.Tensor], *, rank: int | None = None,
           gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
    """Check that every rank holds the same weights and the loss fell, and say
    so on rank 0. ``gather``: every rank's copy of a tensor (by default an
    all-gather over torch.distributed, whose group is then left)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    everyone = (gather or _gathered)(flat)
    agree = all(torch.equal(everyone[0], copy) for copy in everyone)
    if (dist.get_rank() if rank is None else rank) == 0:
        print(f"loss {first:.3f} -> {last:.3f}; ranks agree: {agree}")
        print("ok" if agree and last < first else "FAILED")
    if gather is None:
        leave()


def leave() -> None:
    """Leave the gloo group once every rank is done, and end the process
    without interpreter teardown: gloo's threads can abort it ("terminate
    called without an active exception") after all the work succeeded."""
    dist.barrier()  # no rank tears gloo down while a peer's last sends are in flight
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _gathered(flat: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out
