"""Fault injection: what a faulty rank sends instead of its honest payloads,
on either pass (``FaultSpec``, the ``DSQ_FAULTS`` syntax)."""
from .faults import ENV, FaultSpec, NoFaults, fault_hook, spec_from_env

__all__ = ["ENV", "FaultSpec", "NoFaults", "fault_hook", "spec_from_env"]
