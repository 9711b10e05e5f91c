"""How a step ends. State changes only by whole steps: what the buckets of
a step stage is written when every bucket succeeded (``StepScope``), and a
problem on one rank becomes the same error on every rank, judged at each
collective (``IMMEDIATE``) or once per step (``Deferred``, ``StepVerdict``)."""
from ._checks import IMMEDIATE, Checked, Checks, Deferred, decode_finite, explainer
from ._scope import StepScope
from ._statuses import UNCHANGED, Skipped, raise_for_statuses, statuses_meant
from ._step import APPLIED, FAILED, SKIPPED, Problem, Round, Step
from ._verdict import LearnedPlans, Plan, StepVerdict, first_true, first_true_of, nonfinite

__all__ = ["APPLIED", "FAILED", "IMMEDIATE", "SKIPPED", "UNCHANGED", "Checked", "Checks", "Deferred", "LearnedPlans",
           "Plan", "Problem", "Round", "Skipped", "Step", "StepScope", "StepVerdict", "decode_finite", "explainer",
           "first_true", "first_true_of", "nonfinite", "raise_for_statuses", "statuses_meant"]
