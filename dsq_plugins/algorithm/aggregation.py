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

import inspect
from typing import Any, Callable, Sequence, Union

import torch

from ..comm import rows
from ..compressors import kernels
from ..compressors.decoded import Decoded
from ..errors import ConfigError

__all__ = ["AGGREGATORS", "dense_rows", "get_aggregator", "is_robust", "mean", "mean_of", "mean_rows",
           "mean_rows_fusable", "register_aggregator"]

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
    count = kernels.device_constant(float(len(contributions)), total.device, total.dtype)
    together = dense_rows(contributions) if kernels.launch_bound(total.device) else None
    if together is not None and _mean_kernel.uses_compiled(together.numel(), total.device):
        return _mean_kernel(together, count, numel=together.numel())  # one kernel for every sender's row
    first, *rest = contributions
    if first.is_sparse:
        first.add_to_(total.zero_())
    else:  # 0 + x as x + 0 (the same bits, -0.0 to +0.0 included): a pass fewer than a fill and an add
        torch.add(first.values, 0.0, out=total)
    for c in rest:
        c.add_to_(total)
    return total if not rest else total.div_(count)  # x / 1 is x


def dense_rows(contributions: Sequence[Decoded]) -> torch.Tensor | None:
    """Several dense contributions that are the rows of one tensor (a row
    decoder's output) as that (count, numel) view; None otherwise."""
    if len(contributions) < 2 or any(c.is_sparse for c in contributions):
        return None
    return rows([c.values for c in contributions])


def mean_rows(rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``mean_of`` over the rows of ``rows``: summed from zero in row order, then divided by ``count``."""
    total = torch.zeros_like(rows[0])
    for row in rows:
        total.add_(row)
    return total.div_(count)


def mean_rows_fusable(rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``mean_rows`` as one compiled kernel computes it (the same bits)."""
    # 0 + row turns -0.0 into 0.0, which a compiler folding "0 + x" into x would not: said plainly instead
    total = torch.where(rows[0] == 0, 0.0, rows[0])
    for j in range(1, rows.shape[0]):  # the same order of additions, unrolled for the ranks' count
        total = total + rows[j]
    return total / count


# the whole average in one pass where compiled (a GPU), where it was a fill, an add per sender and a division
_mean_kernel = kernels.FusedKernel(mean_rows, mean_rows_fusable, compile_on_cpu=False)


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
