"""Server-side aggregation rules: a function from the stacked decompressed
contributions of one chunk, shape (contributors, chunk elements), to one
aggregated chunk. The reducer only calls the rule; ``robust`` registers the
Byzantine-tolerant ones (median, trimmed mean, Krum, majority vote, ...).

Rules are registered as factories taking keyword parameters
(``get_aggregator("trimmed_mean", f=2)``). A rule whose ``takes_seed``
attribute is true is also called with ``seed=``, derived by the reducer from
the bucket, step and chunk, for reproducible randomness (e.g. breaking ties).
A rule whose ``takes_previous`` attribute is true is also called with
``previous=``, its own last aggregate for the same chunk (None at first),
which the reducer keeps with the rest of a step's state.
A rule registered with ``robust=True`` tolerates faulty contributions, so the
reducer then leaves malformed payloads out instead of stopping every rank."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence, Union

import torch

from ..compressors.decoded import Decoded
from ..errors import ConfigError

__all__ = ["AGGREGATORS", "get_aggregator", "is_robust", "mean", "mean_of", "register_aggregator"]

AggregatorFn = Callable[..., torch.Tensor]
AggregatorSpec = Union[str, AggregatorFn]


def mean(contributions: torch.Tensor) -> torch.Tensor:
    """The plain average, DoubleSqueeze's server rule (``mean_of`` its rows)."""
    return mean_of([Decoded(row, row.numel()) for row in contributions], torch.empty_like(contributions[0]))


def mean_of(contributions: Sequence[Decoded], total: torch.Tensor) -> torch.Tensor:
    """The average of decoded contributions, built in ``total`` (overwritten):
    summed from zero in contributor order, then divided. The order is fixed
    so that sparse contributions can be added one at a time, without
    stacking them, for the same bits (``torch.mean`` reorders its sum from 8
    rows on). The divisor is a tensor on ``total``'s device: CUDA divides
    by a host number as a multiply by its reciprocal, a last bit away from
    the CPU's division, and ranks on either must agree."""
    total.zero_()
    for c in contributions:
        c.add_to_(total)
    return total.div_(_count(len(contributions), total.dtype, total.device))


@functools.lru_cache(maxsize=None)
def _count(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` as a 0-d device tensor, made once (a fill is a launch on a GPU, at every bucket)."""
    return torch.full((), n, dtype=dtype, device=device)


_FACTORIES: dict[str, Callable[..., AggregatorFn]] = {"mean": lambda: mean}
_ROBUST: set[str] = set()
AGGREGATORS = _FACTORIES  # name -> factory; the public view of what is registered


def register_aggregator(name: str, factory: Callable[..., AggregatorFn], *, robust: bool = False) -> None:
    """Make ``factory(**params)`` selectable as ``aggregator=name``."""
    if not callable(factory):
        raise TypeError(f"aggregator {name!r} must be registered with a callable factory")
    _FACTORIES[name] = factory
    if robust:
        _ROBUST.add(name)


def is_robust(spec: AggregatorSpec) -> bool:
    """Whether the rule tolerates faulty contributions (registered with ``robust=True``)."""
    return spec in _ROBUST if isinstance(spec, str) else bool(getattr(spec, "robust", False))


def get_aggregator(spec: AggregatorSpec, **params: Any) -> AggregatorFn:
    """The rule for a name (built with ``params``) or a callable as given."""
    if callable(spec):
        if params:
            raise ConfigError("aggregator parameters were given with an aggregator function")
        return spec
    if spec not in _FACTORIES:
        raise ConfigError(f"unknown aggregator {spec!r}; available: {', '.join(sorted(_FACTORIES))} "
                          f"(robust rules are registered by `import robust`)")
    factory = _FACTORIES[spec]
    allowed = [p for p in inspect.signature(factory).parameters]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ConfigError(f"aggregator {spec!r} has no parameter {', '.join(map(repr, unknown))}; "
                          f"its parameters are: {', '.join(allowed) or 'none'}")
    try:
        return factory(**params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"aggregator {spec!r}: {exc}") from None
