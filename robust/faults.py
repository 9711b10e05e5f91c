"""Fault injection, as the robust layer exports it: the spec and the attacks
live in ``dsq_plugins.testing.faults``, and the reducer applies them inside its
exchange (``DoubleSqueeze(faults=...)`` or ``DSQ_FAULTS``)."""
from dsq_plugins.testing.faults import ATTACKS, ENV, PASSES, FaultInjector, FaultSpec, spec_from_env

__all__ = ["ATTACKS", "ENV", "PASSES", "FaultInjector", "FaultSpec", "spec_from_env"]
