"""Byzantine-robust server rules for the sharded exchange. Each is a function
of the stacked decompressed contributions of one chunk, shape
(contributors, elements), registered by name with ``dsq_plugins`` so that
``aggregator="median"`` works in the reducer, in ``horovod_ext`` and in the
DeepSpeed JSON section.

They run per chunk on the chunk's owner: coordinate-wise rules (median,
trimmed mean, majority) are unaffected by that; Krum and centered clipping
measure distances over the chunk, not the whole gradient.
Contributions already excluded as malformed are not in the stack, so rules
adapt to however many remain."""
from __future__ import annotations

import torch

from dsq_plugins.algorithm.aggregation import register_aggregator
from dsq_plugins.errors import ConfigError


def _middle(sorted_values: torch.Tensor, low: int, high: int) -> torch.Tensor:
    return sorted_values[low:high].mean(dim=0)


def median() -> callable:
    """Coordinate-wise median (the mean of the two middle values for an even count)."""
    def aggregate(c: torch.Tensor) -> torch.Tensor:
        n = c.shape[0]
        s = c.sort(dim=0).values
        return _middle(s, (n - 1) // 2, n // 2 + 1)
    return aggregate


def trimmed_mean(f: int = 1) -> callable:
    """Coordinate-wise mean after dropping the f largest and f smallest values
    (fewer if fewer than 2f+1 contributions remain)."""
    if f < 0:
        raise ConfigError(f"f must be >= 0, got {f}")

    def aggregate(c: torch.Tensor) -> torch.Tensor:
        n = c.shape[0]
        trim = min(f, (n - 1) // 2)
        return _middle(c.sort(dim=0).values, trim, n - trim)
    return aggregate


def krum(f: int = 1, m: int = 1) -> callable:
    """(Multi-)Krum (Blanchard et al., 2017): score each contribution by the
    summed squared distance to its n-f-2 nearest others, average the m best."""
    if f < 0 or m < 1:
        raise ConfigError(f"krum needs f >= 0 and m >= 1, got f={f}, m={m}")

    def aggregate(c: torch.Tensor) -> torch.Tensor:
        n = c.shape[0]
        if n <= 2:
            return c.mean(dim=0)
        d = torch.cdist(c.unsqueeze(0), c.unsqueeze(0)).squeeze(0).pow(2)
        k = max(1, min(n - 1, n - f - 2))
        nearest = d.sort(dim=1).values[:, 1: k + 1]  # column 0 is the distance to itself
        best = nearest.sum(dim=1).argsort()[: min(m, n)]
        return c[best].mean(dim=0)
    return aggregate


def centered_clip(tau: float | None = None, iters: int = 3, history: bool = False) -> callable:
    """Centered clipping (Karimireddy et al., 2021): v <- v + mean_i
    clip(c_i - v, tau), started from the coordinate-wise median, or with
    ``history=True`` from the chunk's previous aggregate (the paper's
    "learning from history": the reducer hands it over, staged with the
    step). ``tau=None`` takes the median distance of the contributions to
    the centre."""
    if iters < 1:
        raise ConfigError(f"iters must be >= 1, got {iters}")
    start = median()

    def aggregate(c: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        v = start(c) if previous is None else previous
        for _ in range(iters):
            diff = c - v
            norms = diff.norm(dim=1, keepdim=True)
            radius = norms.median() if tau is None else torch.tensor(float(tau))
            scale = torch.clamp(radius / norms.clamp_min(1e-12), max=1.0)
            v = v + (diff * scale).mean(dim=0)
        return v
    aggregate.takes_previous = history
    return aggregate


def majority() -> callable:
    """signSGD with majority vote (Bernstein et al., 2019): each contributor
    has exactly one vote per coordinate, sign(c), so no scale can sway it;
    ties go to a seeded random sign. The result carries the median magnitude
    of the contributions, so learning rates stay those of the other rules."""
    def aggregate(c: torch.Tensor, seed: int = 0) -> torch.Tensor:
        votes = torch.sign(c).sum(dim=0)
        gen = torch.Generator(device=c.device).manual_seed(seed)
        coin = torch.randint(0, 2, votes.shape, generator=gen, device=c.device).to(c.dtype) * 2 - 1
        direction = torch.where(votes == 0, coin, torch.sign(votes))
        return direction * c.abs().median(dim=0).values
    aggregate.takes_seed = True
    return aggregate


for _name, _factory in [("median", median), ("trimmed_mean", trimmed_mean), ("krum", krum),
                        ("centered_clip", centered_clip), ("majority", majority)]:
    register_aggregator(_name, _factory, robust=True)
