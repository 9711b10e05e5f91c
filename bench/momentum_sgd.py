"""Momentum SGD behind 1-bit DoubleSqueeze gradients, and the advice that
goes with it: sklearn's digits, the examples' MLP (hidden 64), 4 workers in
process, batch 32 each, 300 steps; each row's test accuracy against exact
averaging with the same optimizer.

    python -m bench.momentum_sgd [--seeds 3]

Rows: SGD with momentum 0.9 after the exchange (the optimizer as the user
has it, the hook's way) at several learning rates, and the momentum moved
in front of the compressor (``worker_momentum=0.9``, plain SGD after it:
what is compressed is then each worker's momentum, as Signum does)."""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

#: (label, lr, the optimizer's momentum, the reducer's worker_momentum, compressor)
ROWS = [
    ("exact, SGD momentum 0.9, lr 0.1", 0.1, 0.9, 0.0, "none"),
    ("exact, SGD momentum 0.9, lr 0.01", 0.01, 0.9, 0.0, "none"),
    *[(f"sign, SGD momentum 0.9, lr {lr}", lr, 0.9, 0.0, "sign") for lr in (0.1, 0.03, 0.01, 0.003)],
    *[(f"sign, worker_momentum 0.9 + SGD, lr {lr}", lr, 0.0, 0.9, "sign") for lr in (0.1, 0.03, 0.01)],
]


def run(lr: float, momentum: float, worker_momentum: float, compressor: str, seed: int, steps: int = 300) -> float:
    import dsq_plugins as dsq
    from examples.train_digits import load_digits_split, make_model
    (x, y), (xt, yt) = load_digits_split()

    def per_rank(comm):
        model = make_model(seed=seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        options = dict(error_feedback="none") if compressor == "none" else dict(worker_momentum=worker_momentum)
        reducer = dsq.DoubleSqueeze(comm, compressor, **options)
        named = list(model.named_parameters())
        gen = torch.Generator().manual_seed(1000 * seed + comm.rank)
        for _ in range(steps):
            idx = torch.randint(len(y), (32,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            reducer.reduce_many([(n, p.grad) for n, p in named], in_place=True)
            opt.step()
        with torch.no_grad():
            return float((model(xt).argmax(1) == yt).float().mean())
    return dsq.LocalGroup(4).run(per_rank)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"digits MLP (hidden 64), 4 workers x batch 32, 300 steps, {args.seeds} seed(s)\n")
    print("| row | test accuracy, per seed | mean |\n|---|---|---:|")
    for label, lr, momentum, worker_momentum, compressor in ROWS:
        accs = [run(lr, momentum, worker_momentum, compressor, s) for s in range(args.seeds)]
        print(f"| {label} | {', '.join(f'{100 * a:.1f}%' for a in accs)} | {100 * statistics.mean(accs):.1f}% |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
