"""Optimizers that compress what they exchange: ``CompressedAdam`` (Adam's
momentum through DoubleSqueeze once its variance freezes) and the freeze
policy every engine shares."""
from ._adam import ADAM_FAMILY, CompressedAdam, frozen_update_, warn_if_adam
from ._freeze import AUTO, FreezePolicy, FreezesVariance, check_freeze_options, denominator_sums

__all__ = ["ADAM_FAMILY", "AUTO", "CompressedAdam", "FreezePolicy", "FreezesVariance", "check_freeze_options",
           "denominator_sums", "frozen_update_", "warn_if_adam"]
