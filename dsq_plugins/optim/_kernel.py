"""The arithmetic of Adam after its variance froze, as plain functions on
tensors: written once, called by ``CompressedAdam`` and by its ZeRO mapping
(``deepspeed_ext.zero_adam``), which hold their state differently but must
take the same step.

    denominator = sqrt(v / (1 - beta2^T)) + eps        (T: the freeze step)
    p <- p·(1 - lr·wd) - lr / (1 - beta1^t) · m / denominator

A coordinate whose frozen variance is exactly zero never had a gradient in
the warm-up: its momentum is kept at zero (any other value would move it by
m/eps; DeepSpeed's 1-bit Adam asked users for this mask).
"""
from __future__ import annotations

import math

import torch

__all__ = ["clip_to_norm", "adam_denominator", "adam_step_", "without_variance_"]


def adam_denominator(v: torch.Tensor, beta2: float, t: int, eps: float) -> torch.Tensor:
    """Adam's bias-corrected denominator at step ``t`` (a new tensor); at the
    freeze step it is final."""
    return (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)


def without_variance_(m: torch.Tensor, no_variance: torch.Tensor) -> torch.Tensor:
    """``m`` with zeros where ``no_variance`` (in place)."""
    return m.masked_fill_(no_variance, 0.0)


def adam_step_(p: torch.Tensor, m: torch.Tensor, denominator: torch.Tensor, *, lr: float, beta1: float,
                 weight_decay: float, t: int) -> None:
    """AdamW's step ``t`` with momentum ``m`` against ``denominator`` (frozen or current),
    in torch.optim.AdamW's order of operations (decay, then the update)."""
    p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m, denominator, value=-lr / (1 - beta1 ** t))


def clip_to_norm(grads: list[torch.Tensor], max_norm: float, *, in_place: bool = False) -> list[torch.Tensor]:
    """``grads`` scaled to a global L2 norm of at most ``max_norm`` (0: as
    they are), by torch.nn.utils.clip_grad_norm_'s formula; new tensors
    unless ``in_place``."""
    if not max_norm:
        return grads
    norm = torch.nn.utils.get_total_norm(grads, 2.0)  # what clip_grad_norm_ computes
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return [g.mul_(coef) for g in grads] if in_place else [g * coef for g in grads]
