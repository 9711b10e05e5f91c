"""CompressedAdam written plainly: n simulated workers, one flat parameter
vector, no communicator. Warm-up steps are AdamW on the exact mean
gradient; after ``freeze_step`` each worker's momentum
beta1·m + (1 - beta1)·g_i, divided by the frozen denominator (floored per
tensor: ``sizes`` are the tensors' lengths in the vector), goes through
Algorithm 1 (tests/reference.py) and the result is the step. Elementwise,
so the sharded optimizer must agree with it bit for bit."""
import math

import torch

from dsq_plugins.algorithm.reference import ReferenceDoubleSqueeze


class ReferenceCompressedAdam:
    def __init__(self, x, n, q, qs, *, lr, betas, eps, weight_decay, freeze_step, seed_of, sizes=None):
        self.x = x.clone()
        self.n, self.lr, self.betas, self.eps, self.wd = n, lr, betas, eps, weight_decay
        self.freeze_step = freeze_step
        self.sizes = list(sizes) if sizes is not None else [x.numel()]
        self.m = torch.zeros_like(x)
        self.v = torch.zeros_like(x)
        self.t = 0
        self.ds = ReferenceDoubleSqueeze(n, q, qs, "both", seed_of=seed_of)

    def step(self, grads):
        beta1, beta2 = self.betas
        self.t += 1
        t = self.t
        if t <= self.freeze_step:
            g = torch.stack(grads).mean(dim=0)
            self.x.mul_(1 - self.lr * self.wd)
            self.m.lerp_(g, 1 - beta1)
            self.v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (self.v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(self.eps)
        else:
            denom = self.frozen_denominator()
            local = [self.m.mul(beta1).add_(g, alpha=1 - beta1).div_(denom).masked_fill_(self.v == 0, 0)
                     for g in grads]
            u = self.ds(local).masked_fill_(self.v == 0, 0)  # never-reached coordinates stay still
            self.m = u * denom
            self.x.mul_(1 - self.lr * self.wd)
            return self.x.add_(u, alpha=-self.lr / (1 - beta1 ** t))
        self.x.addcdiv_(self.m, denom, value=-self.lr / (1 - beta1 ** t))
        return self.x

    def frozen_denominator(self):
        """sqrt(v / (1 - beta2^T)) + eps, at least a tenth of the mean of
        each tensor's denominators where v > 0."""
        beta2 = self.betas[1]
        denom = (self.v.sqrt() / math.sqrt(1 - beta2 ** self.freeze_step)).add_(self.eps)
        for d, v in zip(denom.split(self.sizes), self.v.split(self.sizes)):
            live = v > 0
            d.clamp_min_((d * live).sum() / live.sum().clamp_min(1) * 0.1)
        return denom
