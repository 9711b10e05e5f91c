"""When Adam's variance freezes: at a fixed step, or ``"auto"``, when it
has settled.

1-bit Adam (and ``CompressedAdam``) average gradients exactly until the
freeze, then compress the momentum against the variance as it stands. Freeze
too early and the denominators are still moving; too late and the exact
warm-up has cost bytes for nothing. ``"auto"`` looks at the variance itself:
every ``window`` steps it takes a summary of Adam's bias-corrected
denominators, sqrt(v / (1 - beta2^t)) summed per tensor, and the share of
each tensor's coordinates that have had a gradient, and freezes once
neither has moved by more than ``threshold`` (relative) in any tensor since
the last window; at ``max_step`` it freezes anyway, with a warning. The
share is what keeps a young variance from freezing: while a tensor's
coordinates are still getting their first gradients, their variance rests
on a step or two, and frozen that way it would divide their later gradients
by a denominator far too small. Every rank holds
the same variance during the warm-up (its gradients are averaged exactly),
or sums its partitions with the others' (ZeRO), so every rank decides the
same step.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch

from ..errors import ConfigError

log = logging.getLogger("dsq_plugins")

AUTO = "auto"
#: the freeze's defaults, for every optimizer and config that freezes Adam's variance
FREEZE_STEP, MAX_FREEZE_STEP, FREEZE_WINDOW, FREEZE_THRESHOLD = 400, 1000, 20, 0.05


class FreezePolicy:
    """``step``: a positive int, or ``"auto"`` (then ``max_step``, ``window``
    and ``threshold`` apply). ``frozen_at`` is the step the variance froze
    at, once known (at once for a fixed step)."""

    def __init__(self, step: int | str = FREEZE_STEP, *, max_step: int = MAX_FREEZE_STEP, window: int = FREEZE_WINDOW,
                 threshold: float = FREEZE_THRESHOLD):
        check_freeze_options(step, max_step, window, threshold)
        self.auto = step == AUTO
        self.max_step, self.window, self.threshold = max_step, window, float(threshold)
        self.frozen_at: int | None = None if self.auto else int(step)
        self._last: torch.Tensor | None = None
        #: the largest relative change seen at the last window (auto), for logs and studies
        self.last_change: float | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "FreezePolicy":
        """From CompressedAdam's option names (``freeze_step``, ``max_freeze_step``,
        ``freeze_window``, ``freeze_threshold``), the defaults for those absent."""
        return cls(options.get("freeze_step", FREEZE_STEP), max_step=options.get("max_freeze_step", MAX_FREEZE_STEP),
                   window=options.get("freeze_window", FREEZE_WINDOW),
                   threshold=options.get("freeze_threshold", FREEZE_THRESHOLD))

    def frozen(self, applied_steps: int) -> bool:
        return self.frozen_at is not None and applied_steps >= self.frozen_at

    def observe(self, t: int, summary: Callable[[], torch.Tensor]) -> bool:
        """After the warm-up's step ``t``: whether the variance freezes now.
        ``summary()``: ``denominator_sums``' per-tensor summary."""
        if not self.auto or self.frozen_at is not None:
            return self.frozen(t)
        if t % self.window == 0:
            current = settling_measures(summary().detach().to(torch.float64).cpu())
            if self._last is not None and self._last.shape == current.shape and current.numel():  # (none: all frozen)
                self.last_change = float(((current - self._last).abs() / self._last.clamp_min(1e-30)).max())
                if self.last_change < self.threshold:
                    self.frozen_at = t
                    log.warning("dsq_plugins: Adam's variance settled (its denominators moved %.3f < %.3f over the "
                                "last %d steps): frozen at step %d", self.last_change, self.threshold, self.window, t)
            self._last = current
        if self.frozen_at is None and t >= self.max_step:
            self.frozen_at = t
            warnings.warn(f"freeze_step='auto': Adam's variance had not settled by max_freeze_step={self.max_step} "
                          f"(its denominators last moved {self.last_change}); frozen there", stacklevel=3)
        return self.frozen_at is not None

    def state_dict(self) -> dict[str, Any]:
        return {"frozen_at": self.frozen_at, "last": self._last, "last_change": self.last_change}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.auto:
            self.frozen_at = state.get("frozen_at")
            self._last, self.last_change = state.get("last"), state.get("last_change")


def check_freeze_options(step: Any, max_step: Any, window: Any, threshold: Any) -> None:
    """A ``ConfigError`` naming the first bad freeze option."""
    def positive_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1
    if step != AUTO and not positive_int(step):
        raise ConfigError(f"freeze_step must be a positive integer (exact steps before the variance is frozen; "
                          f"with none the frozen variance would be zero and every update m/eps) or 'auto', "
                          f"got {step!r}")
    if not positive_int(max_step):
        raise ConfigError(f"max_freeze_step must be a positive integer, got {max_step!r}")
    if not positive_int(window):
        raise ConfigError(f"freeze_window must be a positive integer, got {window!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ConfigError(f"freeze_threshold must be a positive number, got {threshold!r}")


#: the entries per tensor of ``denominator_sums``' summary
SUMMARY_ENTRIES = 3


def denominator_sums(variances: list[tuple[torch.Tensor, float]], t: int) -> torch.Tensor:
    """Per (v, beta2): the sum of sqrt(v / (1 - beta2^t)), the number of
    coordinates where v > 0, and the number of coordinates, one after the
    other: a ``summary()`` (``SUMMARY_ENTRIES`` per tensor, each additive
    over a tensor's parts, so partitions' summaries add up)."""
    return torch.stack([torch.stack([(v / (1 - beta2 ** t)).sqrt().sum(), (v > 0).sum().to(v.dtype),
                                     torch.tensor(float(v.numel()), dtype=v.dtype, device=v.device)])
                        for v, beta2 in variances]).reshape(-1)


def settling_measures(summary: torch.Tensor) -> torch.Tensor:
    """What ``"auto"`` compares from window to window, per tensor: the summed
    denominators and the share of coordinates that have had a gradient."""
    per_tensor = summary.reshape(-1, SUMMARY_ENTRIES)
    return torch.stack([per_tensor[:, 0], per_tensor[:, 1] / per_tensor[:, 2].clamp_min(1)], dim=1).reshape(-1)


class FreezesVariance:
    """What an optimizer that freezes Adam's variance says about it, from
    its ``freeze`` policy read at the step count ``freeze_clock()``: one
    definition for CompressedAdam and its ZeRO mapping."""

    freeze: FreezePolicy

    def freeze_clock(self) -> int:
        """The steps this optimizer has applied, as its policy counts them."""
        raise NotImplementedError

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen (the next step compresses the momentum)."""
        return self.freeze.frozen(self.freeze_clock())

    @property
    def freeze_step(self) -> int | None:
        """The step the variance freezes (froze) at; None while ``"auto"`` has not decided."""
        return self.freeze.frozen_at

