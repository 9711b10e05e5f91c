"""Server-side aggregation rules: a function from the stacked decompressed
contributions of one chunk, shape (contributors, chunk elements), to one
aggregated chunk. The reducer only calls the rule; ``robust`` registers the
Byzantine-tolerant ones (median, trimmed mean, Krum, ...) by name."""
from __future__ import annotations

from typing import Callable, Union

import torch

from .errors import ConfigError

AggregatorFn = Callable[[torch.Tensor], torch.Tensor]
AggregatorSpec = Union[str, AggregatorFn]


def mean(contributions: torch.Tensor) -> torch.Tensor:
    """The plain average, DoubleSqueeze's server rule."""
    return contributions.mean(dim=0)


AGGREGATORS: dict[str, AggregatorFn] = {"mean": mean}


def register_aggregator(name: str, fn: AggregatorFn) -> None:
    """Make ``fn`` selectable as ``aggregator=name``."""
    if not callable(fn):
        raise TypeError(f"aggregator {name!r} must be callable")
    AGGREGATORS[name] = fn


def get_aggregator(spec: AggregatorSpec) -> AggregatorFn:
    if callable(spec):
        return spec
    if spec not in AGGREGATORS:
        raise ConfigError(f"unknown aggregator {spec!r}; available: {', '.join(sorted(AGGREGATORS))} "
                          f"(robust rules are registered by `import robust`)")
    return AGGREGATORS[spec]
