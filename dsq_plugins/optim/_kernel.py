"""The arithmetic of Adam after its variance froze, as plain functions on
tensors: written once, called by ``CompressedAdam`` and by its ZeRO mapping
(``deepspeed_ext.zero_adam``), which hold their state differently but must
take the same step.

    denominator = max(sqrt(v / (1 - beta2^T)) + eps, floor)      (T: the freeze step)
    p <- p·(1 - lr·wd) - lr / (1 - beta1^t) · m / denominator

The floor is ``DENOMINATOR_FLOOR`` times the mean denominator of the
tensor's coordinates that had a gradient in the warm-up. Without it, a
coordinate whose gradients were rare in the warm-up (an input that is almost
always zero, a dead ReLU unit) keeps a denominator near eps for the rest of
the run, and any momentum it gets later, from a gradient or from the
compressor (sign hands every coordinate of a chunk the same magnitude), moves
it by m/eps: the divergence a ReLU MLP showed at the freeze
(docs/results/lm-adam.md, "CompressedAdam where gradients are rare"). Plain Adam is
protected by its moving variance; a frozen one needs the floor.

A coordinate whose frozen variance is exactly zero never had a gradient in
the warm-up: its momentum is kept at zero (any other value would move it by
m/eps; DeepSpeed's 1-bit Adam asked users for this mask).
"""
from __future__ import annotations

import functools
import math
from typing import List, Union

import torch

from ..compressors.kernels import FusedKernel, device_constant, fused_multiply_add

__all__ = ["DENOMINATOR_FLOOR", "clip_coefficient", "clip_to_norm", "adam_denominator", "adam_step_",
           "denominator_floor", "preconditioned_momentum_", "preconditioned_step_", "without_variance_"]

#: the frozen denominator's floor, a fraction of the mean denominator of its tensor's live coordinates
DENOMINATOR_FLOOR = 0.1


Tensors = Union[torch.Tensor, List[torch.Tensor]]  # one tensor, or a param group's (one multi-tensor op each)


def adam_denominator(v: Tensors, beta2: float, t: int, eps: float) -> Tensors:
    """Adam's bias-corrected denominator at step ``t`` (new tensors); at the
    freeze step it is final."""
    if isinstance(v, torch.Tensor):
        return (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
    denominators = torch._foreach_sqrt(v)
    torch._foreach_div_(denominators, math.sqrt(1 - beta2 ** t))
    torch._foreach_add_(denominators, eps)
    return denominators


def denominator_floor(denominator: torch.Tensor, v: torch.Tensor, fraction: float = DENOMINATOR_FLOOR
                      ) -> torch.Tensor:
    """``fraction`` times the mean of ``denominator`` where ``v`` > 0 (a 0-d
    tensor on the device, 0 where no coordinate has a variance): read by no
    host, so it costs no sync."""
    live = v > 0
    return (denominator * live).sum() / live.sum().clamp_min(1) * fraction


def without_variance_(m: torch.Tensor, no_variance: torch.Tensor) -> torch.Tensor:
    """``m`` with zeros where ``no_variance`` (in place)."""
    return m.masked_fill_(no_variance, 0.0)


def adam_step_(p: Tensors, m: Tensors, denominator: Tensors, *, lr: float, beta1: float, weight_decay: float,
               t: int) -> None:
    """AdamW's step ``t`` with momentum ``m`` against ``denominator`` (frozen or current),
    in torch.optim.AdamW's order of operations (decay, then the update)."""
    if isinstance(p, torch.Tensor):
        _decay_(p, lr, weight_decay)
        p.addcdiv_(m, denominator, value=-lr / (1 - beta1 ** t))
        return
    _decay_(p, lr, weight_decay)
    torch._foreach_addcdiv_(p, m, denominator, value=-lr / (1 - beta1 ** t))


def _decay_(p: Tensors, lr: float, weight_decay: float) -> None:
    """AdamW's decoupled decay, p·(1 - lr·weight_decay); none without weight decay, as
    torch.optim.AdamW skips it (a multiply by 1 changes no bit, and costs a pass)."""
    if not weight_decay:
        return
    if isinstance(p, torch.Tensor):
        p.mul_(1 - lr * weight_decay)
    else:
        torch._foreach_mul_(p, 1 - lr * weight_decay)


def preconditioned_momentum_(out: torch.Tensor, m: torch.Tensor, g: torch.Tensor, denominator: torch.Tensor,
                             beta1: float) -> torch.Tensor:
    """u = (beta1·m + (1 - beta1)·g) / denominator, written into ``out``: what
    each rank exchanges after the freeze, from its own gradient, in one pass
    where compiled (the multiply, the multiply-add and the division each
    rounded as the eager ops round them, so the bits are the same)."""
    beta1 = float(beta1)
    factors = (device_constant(beta1, out.device), device_constant(1 - beta1, out.device))
    return _preconditioned_kernel(beta1)(out, m, g, denominator, *factors, numel=out.numel())


@functools.lru_cache(maxsize=None)
def _preconditioned_kernel(beta1: float) -> FusedKernel:
    """The kernel for one beta1. The compiled form reads beta1 and 1 - beta1
    from 0-d tensors, not from numbers in its code: inductor's on-disk cache
    does not key an FMA's constant, and a later beta1 would reuse the first
    one's kernel. The eager form multiplies by the numbers, as ever."""
    def eager(out: torch.Tensor, m: torch.Tensor, g: torch.Tensor, denominator: torch.Tensor,
              *factors: torch.Tensor) -> torch.Tensor:
        return torch.mul(m, beta1, out=out).add_(g, alpha=1 - beta1).div_(denominator)

    def fusable(out: torch.Tensor, m: torch.Tensor, g: torch.Tensor, denominator: torch.Tensor,
                beta1_factor: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        return out.copy_(fused_multiply_add(g, rest, m * beta1_factor) / denominator)
    eager.__name__ = fusable.__name__ = "preconditioned_momentum"
    return FusedKernel(eager, fusable)


def preconditioned_step_(p: Tensors, u: Tensors, *, lr: float, beta1: float, weight_decay: float, t: int) -> None:
    """AdamW's step ``t`` (decay, then the update) with the momentum already
    divided by its denominator, ``u`` = m / denominator: the step after the
    freeze, where what was averaged is u."""
    _decay_(p, lr, weight_decay)
    if isinstance(p, torch.Tensor):
        p.add_(u, alpha=-lr / (1 - beta1 ** t))
        return
    torch._foreach_add_(p, u, alpha=-lr / (1 - beta1 ** t))


def clip_coefficient(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor | None:
    """What scales ``grads`` to a global L2 norm of at most ``max_norm``, by
    torch.nn.utils.clip_grad_norm_'s formula (a 0-d tensor; None for 0: no clipping)."""
    if not max_norm:
        return None
    norm = torch.nn.utils.get_total_norm(grads, 2.0)  # what clip_grad_norm_ computes
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_to_norm(grads: list[torch.Tensor], max_norm: float, *, in_place: bool = False) -> list[torch.Tensor]:
    """``grads`` scaled to a global L2 norm of at most ``max_norm``
    (``clip_coefficient``; 0: as they are); new tensors unless ``in_place``."""
    coef = clip_coefficient(grads, max_norm)
    if coef is None:
        return grads
    return [g.mul_(coef) for g in grads] if in_place else [g * coef for g in grads]
