"""Election Coding (Sohn et al., NeurIPS 2020): signSGD with majority vote
where each worker computes gradients of several data partitions and sends
one bit per coordinate, the sign of the sum of its partitions' signs.

n workers, the mini-batch split into n partitions, an n x n 0/1 allocation
matrix G (G[i, j] = 1: worker i computes partition j). For a sign pattern m
in {-1, +1}^n of the partition gradients (one coordinate), worker i votes
sign(G_i . m) (0 on a tie) and the result is the majority of the votes.

G is *perfectly b-tolerant* (n odd) when the vote equals majority(m) for
every m whatever b workers send, that is when for every m

    sum_i sign(G_i . m) * majority(m) >= 2b + 1.

Each sign(G_i . m) is monotone in m, so only the patterns with exactly
(n+1)/2 signs agreeing with the majority can violate it; the search below
uses that, ``is_perfectly_tolerant`` checks every pattern anyway.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable, Sequence

import torch

from dsq_plugins.errors import ConfigError


def _check_nb(n: int, b: int) -> None:
    if n < 1 or n % 2 == 0:
        raise ConfigError(f"election codes need an odd number of workers, got n={n}")
    if not 0 <= b < n / 2:
        raise ConfigError(f"b must satisfy 0 <= b < n/2 = {n / 2}, got b={b}")


def _matrix(n: int, rows: Iterable[Iterable[int]]) -> torch.Tensor:
    g = torch.zeros(n, n, dtype=torch.int64)
    for i, row in enumerate(rows):
        for j in row:
            g[i, j] = 1
    return g


def bernoulli_code(n: int, p: float, seed: int = 0) -> torch.Tensor:
    """Random G with independent Bernoulli(p) entries (the paper's random
    codes: tolerant with high probability, not perfectly)."""
    if not 0 < p <= 1:
        raise ConfigError(f"p must be in (0, 1], got {p}")
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n, n, generator=gen) < p).to(torch.int64)


def simple_code(n: int, b: int) -> torch.Tensor:
    """2b+1 workers compute every partition; the others, in pairs, hold
    disjoint odd-sized halves of n-1 partitions. A pair can never outvote the
    majority (two odd local minorities of n-1 partitions would make a global
    minority), so the 2b+1 full workers decide: perfectly b-tolerant."""
    _check_nb(n, b)
    full = list(range(n))
    rows = [full] * (2 * b + 1)
    half = (n - 1) // 2 if ((n - 1) // 2) % 2 else (n - 1) // 2 - 1
    for pair in range((n - 2 * b - 1) // 2):
        shift = pair % n
        order = [(shift + j) % n for j in range(n)]
        rows += [order[:half], order[half: n - 1]]
    return _matrix(n, rows)


def deterministic_code(n: int, b: int) -> torch.Tensor:
    """A perfectly b-tolerant G of minimum redundancy: the identity for b = 0
    (r = 1); for b >= 1, 2b+1 workers that compute every partition and n-2b-1
    that compute none and abstain (r = 2b+1). ``minimum_redundancy`` finds
    nothing cheaper for any n <= 7 (exhaustive); the ``simple_code`` pairs only
    add compute, since a pair never lowers the margin and never raises the
    2b+1 it must reach on its tightest pattern."""
    _check_nb(n, b)
    if b == 0:
        return torch.eye(n, dtype=torch.int64)
    return _matrix(n, [range(n)] * (2 * b + 1))


def redundancy(g: torch.Tensor) -> float:
    """r = ones(G) / n: partitions computed per worker, on average."""
    return float(g.sum()) / g.shape[0]


def _all_patterns(n: int) -> torch.Tensor:
    bits = torch.arange(2 ** n).unsqueeze(1) >> torch.arange(n) & 1
    return bits * 2 - 1


def margins(g: torch.Tensor) -> torch.Tensor:
    """sum_i sign(G_i . m) * majority(m), for every m in {-1,+1}^n."""
    m = _all_patterns(g.shape[1])
    votes = torch.sign(m @ g.T)
    return votes.sum(dim=1) * torch.sign(m.sum(dim=1))


def is_perfectly_tolerant(g: torch.Tensor, b: int) -> bool:
    """Exhaustive over all 2^n sign patterns."""
    return bool((margins(g) >= 2 * b + 1).all())


def breaks_with(g: torch.Tensor, f: int) -> bool:
    """Can f workers that vote against the majority, chosen after seeing the
    pattern, make the vote wrong or tied for some pattern?"""
    m = _all_patterns(g.shape[1])
    honest = torch.sign(m @ g.T) * torch.sign(m.sum(dim=1)).unsqueeze(1)  # +1: votes with the majority
    strongest = honest.sort(dim=1, descending=True).values[:, :f].sum(dim=1)
    final = honest.sum(dim=1) - strongest - f
    return bool((final <= 0).any())


def minimum_redundancy(n: int, b: int, time_limit: float = 60.0) -> tuple[int, torch.Tensor | None, bool]:
    """(fewest ones, a G with that many, whether the search finished) over all
    n x n 0/1 matrices that are perfectly b-tolerant, by depth-first search
    over multisets of rows with cost and feasibility pruning."""
    _check_nb(n, b)
    need = 2 * b + 1
    hard = [set(c) for c in itertools.combinations(range(n), (n + 1) // 2)]  # the majority's positions
    subsets = [()] + [s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]
    gains = []
    for s in subsets:
        gains.append(tuple((0 if not s else _sign(sum(1 if j in h else -1 for j in s))) for h in hard))
    # a row never helps if it votes against the majority somewhere and for it nowhere: drop those
    useful = [i for i, gvec in enumerate(gains) if i == 0 or max(gvec) > 0]
    useful.sort(key=lambda i: len(subsets[i]))
    simple = simple_code(n, b)
    best_cost, best_rows = int(simple.sum()), None
    deadline = time.monotonic() + time_limit
    finished = True

    def dfs(start: int, rows: list[int], total: list[int], cost: int) -> None:
        nonlocal best_cost, best_rows, finished
        left = n - len(rows)
        if min(total) >= need:
            if cost < best_cost or best_rows is None and cost <= best_cost:
                best_cost, best_rows = cost, list(rows)
            return
        if left == 0 or any(t + left < need for t in total):
            return
        if time.monotonic() > deadline:
            finished = False
            return
        for pos in range(start, len(useful)):
            i = useful[pos]
            c = len(subsets[i])
            if cost + c * 1 >= best_cost + (1 if best_rows is None else 0):
                break  # rows are sorted by cost: nothing further is cheaper
            rows.append(i)
            dfs(pos, rows, [t + gv for t, gv in zip(total, gains[i])], cost + c)
            rows.pop()

    dfs(0, [], [0] * len(hard), 0)
    if best_rows is None:
        return best_cost, simple, finished
    return best_cost, _matrix(n, [subsets[i] for i in best_rows]), finished


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


class ElectionSampler:
    """Hands each worker the mini-batches of its partitions.

    Every worker draws the same global mini-batch (a shared seed and step),
    splits it into n partitions of ``partition_size`` examples, and keeps the
    partitions its row of G names."""

    def __init__(self, g: torch.Tensor, rank: int, dataset_size: int, partition_size: int, seed: int = 0):
        self.g, self.rank, self.n = g, rank, g.shape[0]
        self.dataset_size, self.partition_size, self.seed = dataset_size, partition_size, seed
        self.assigned = [j for j in range(self.n) if int(g[rank, j])]

    def batches(self, step: int) -> list[torch.Tensor]:
        """Index tensors of this worker's partitions at ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        everything = torch.randint(self.dataset_size, (self.n, self.partition_size), generator=gen)
        return [everything[j] for j in self.assigned]


def election_gradient(params: Sequence[torch.Tensor], partition_losses: Sequence[Callable[[], torch.Tensor]]
                      ) -> list[torch.Tensor]:
    """One gradient per assigned partition (r x the compute of plain
    training), reduced to the local vote sign(sum of partition signs) per
    coordinate (0 on a tie). The result replaces the gradients fed to a
    reducer with the sign compressor and the majority aggregator."""
    tally = [torch.zeros_like(p) for p in params]
    for loss_fn in partition_losses:
        grads = torch.autograd.grad(loss_fn(), list(params))
        for t, gr in zip(tally, grads):
            t.add_(torch.sign(gr))
    return [torch.sign(t) for t in tally]


if __name__ == "__main__":  # the minimum-redundancy table quoted in the README
    for n in (3, 5, 7):
        for b in range(1, (n + 1) // 2):
            ones, g, done = minimum_redundancy(n, b, time_limit=120)
            print(f"n={n} b={b}: minimum r={ones / n:.2f} (search finished: {done}); "
                  f"deterministic_code r={redundancy(deterministic_code(n, b)):.2f}; "
                  f"simple_code r={redundancy(simple_code(n, b)):.2f}")
