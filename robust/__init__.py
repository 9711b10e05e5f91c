"""Byzantine-robust extras for dsq_plugins: robust server aggregation
(median, trimmed mean, Krum, centered clipping), signSGD with majority vote,
Election Coding, and fault injection. Importing it registers the
aggregators by name with dsq_plugins."""
from . import aggregators  # noqa: F401  (registers the rules)
from .election import (
                       ElectionSampler,
                       bernoulli_code,
                       breaks_with,
                       deterministic_code,
                       election_gradient,
                       is_perfectly_tolerant,
                       minimum_redundancy,
                       redundancy,
                       simple_code,
)
from .faults import ATTACKS, ENV, FaultSpec, spec_from_env

__all__ = ["ATTACKS", "ENV", "ElectionSampler", "FaultSpec", "bernoulli_code", "breaks_with", "deterministic_code",
           "election_gradient", "is_perfectly_tolerant", "minimum_redundancy", "redundancy", "simple_code",
           "spec_from_env"]
