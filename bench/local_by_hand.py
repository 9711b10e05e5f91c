"""Exact local steps (DiLoCo) on the small GPT, written out by hand in one
process: no dsq_plugins, no communicator, the workers' models side by side.

    python -m bench.local_by_hand --sync-every 10 --outer-lr 0.7 --outer-momentum 0.9

Why: issue 45's probe reported exact local steps at H = 10 ending at 1.847
(below AdamW's 1.904) with the settings bench.lm's local study uses (400
steps, AdamW lr 1e-3 constant, 40 exact steps first, 4 workers, outer
Nesterov lr 0.7 momentum 0.9), where ``dsq.LocalSteps`` ends at 1.9470. This
is a second implementation of the same algorithm, sharing only the model and
the data (examples/lm.py), to tell an error in LocalSteps from a difference
in the probe's settings: it prints the test loss every 100 steps.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.lm import GPT, GPTConfig, loss_of, test_loss, train_batch  # noqa: E402


def run(*, workers: int, steps: int, exact_steps: int, sync_every: int, lr: float, outer_lr: float,
        outer_momentum: float, batch: int, seed: int) -> list[tuple[int, float]]:
    """(step, test loss) every 100 steps and at the end."""
    config = GPTConfig()
    models = [GPT(config, seed=seed) for _ in range(workers)]
    inner = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0, foreach=False) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(p) for p in anchor]
    curve = []
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(models, inner)):
            inputs, targets = train_batch(seed, rank, step, batch, config.context)
            opt.zero_grad(set_to_none=False)
            loss_of(model, inputs, targets).backward()
        if step < exact_steps:  # the warm-up: every worker steps on the exact average
            for same in zip(*[m.parameters() for m in models]):
                mean = sum(p.grad for p in same) / workers
                for p in same:
                    p.grad.copy_(mean)
        for opt in inner:
            opt.step()
        if step + 1 <= exact_steps:
            anchor = [p.detach().clone() for p in models[0].parameters()]
        elif (step + 1 - exact_steps) % sync_every == 0:
            with torch.no_grad():
                for i, same in enumerate(zip(*[m.parameters() for m in models])):
                    delta = anchor[i] - sum(same) / workers  # the averaged pseudo-gradient
                    momentum[i].mul_(outer_momentum).add_(delta)
                    anchor[i] = anchor[i] - outer_lr * (delta + outer_momentum * momentum[i])  # Nesterov
                    for p in same:
                        p.copy_(anchor[i])
        if (step + 1) % 100 == 0 or step + 1 == steps:
            curve.append((step + 1, test_loss(models[0])))
    return curve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--exact-steps", type=int, default=40)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    curve = run(workers=args.workers, steps=args.steps, exact_steps=args.exact_steps, sync_every=args.sync_every,
                lr=args.lr, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, batch=args.batch,
                seed=args.seed)
    for step, loss in curve:
        print(f"step {step}: test loss {loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
