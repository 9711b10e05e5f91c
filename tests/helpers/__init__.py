"""Helpers the tests share: launchers, state comparisons, the CompressedAdam reference."""
