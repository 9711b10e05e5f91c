"""Fault injection: the spec and the attacks live in ``dsq_plugins.faults``
(the reducer applies them inside its exchange, ``DoubleSqueeze(faults=...)``);
this module keeps the names the robust layer has always exported.

``FaultyComm`` and ``maybe_inject``, which wrapped a communicator and had to
guess chunk sizes from collective tags, are gone: pass ``faults=`` to the
reducer (or set ``DSQ_FAULTS``)."""
from __future__ import annotations

from typing import Any

from dsq_plugins.errors import ConfigError
from dsq_plugins.faults import ATTACKS, ENV, PASSES, FaultInjector, FaultSpec, spec_from_env

__all__ = ["ATTACKS", "ENV", "PASSES", "FaultInjector", "FaultSpec", "FaultyComm", "maybe_inject", "spec_from_env"]


def FaultyComm(*args: Any, **kwargs: Any):  # noqa: N802 - the old class name, kept to explain its removal
    """Removed: use ``DoubleSqueeze(comm, ..., faults=spec)``."""
    raise ConfigError("robust.FaultyComm was replaced by DoubleSqueeze(comm, ..., faults=spec): the reducer "
                      "injects the fault inside its exchange, with the real chunk sizes")


def maybe_inject(*args: Any, **kwargs: Any):
    """Removed: ``DoubleSqueeze`` reads ``faults=`` and ``DSQ_FAULTS`` itself."""
    raise ConfigError("robust.maybe_inject was replaced by DoubleSqueeze(comm, ..., faults=spec), which also "
                      "reads DSQ_FAULTS")
