"""Optimizers that compress what they exchange: ``CompressedAdam`` (Adam's
momentum through DoubleSqueeze once its variance freezes), ``LocalSteps``
(local steps, the pseudo-gradient through DoubleSqueeze every H), and the freeze
policy and the Adam arithmetic every engine shares."""
from ._adam import ADAM_FAMILY, CompressedAdam, frozen_update_, preconditioned_, warn_if_adam
from ._flat import FlatMoments
from ._freeze import AUTO, SUMMARY_ENTRIES, FreezePolicy, FreezesVariance, check_freeze_options, denominator_sums
from ._frozen import FrozenDenominators, ZeroVariance
from ._kernel import (DENOMINATOR_FLOOR, adam_denominator, adam_step_, clip_coefficient, clip_to_norm,
                      denominator_floor, preconditioned_momentum_, preconditioned_step_, without_variance_)
from ._local_steps import LocalSteps

__all__ = ["ADAM_FAMILY", "AUTO", "CompressedAdam", "DENOMINATOR_FLOOR", "FlatMoments", "FreezePolicy",
           "FreezesVariance", "LocalSteps", "SUMMARY_ENTRIES", "adam_denominator", "adam_step_", "check_freeze_options",
           "clip_coefficient", "clip_to_norm", "denominator_floor", "denominator_sums", "frozen_update_",
           "FrozenDenominators", "preconditioned_", "preconditioned_momentum_", "preconditioned_step_", "warn_if_adam",
           "without_variance_", "ZeroVariance"]
