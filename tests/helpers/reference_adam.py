"""CompressedAdam written plainly: n simulated workers, one flat parameter
vector, no communicator. Warm-up steps are AdamW on the exact mean
gradient; after ``freeze_step`` each worker's momentum
beta1·m + (1 - beta1)·g_i goes through Algorithm 1 (tests/reference.py) and
the result is applied against the frozen variance. Elementwise, so the
sharded optimizer must agree with it bit for bit."""
import math

import torch

from dsq_plugins.algorithm.reference import ReferenceDoubleSqueeze


class ReferenceCompressedAdam:
    def __init__(self, x, n, q, qs, *, lr, betas, eps, weight_decay, freeze_step, seed_of):
        self.x = x.clone()
        self.n, self.lr, self.betas, self.eps, self.wd = n, lr, betas, eps, weight_decay
        self.freeze_step = freeze_step
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
            local = [self.m.mul(beta1).add_(g, alpha=1 - beta1) for g in grads]
            self.m = self.ds(local).masked_fill_(self.v == 0, 0)  # never-reached coordinates stay still
            self.x.mul_(1 - self.lr * self.wd)
            denom = (self.v.sqrt() / math.sqrt(1 - beta2 ** self.freeze_step)).add_(self.eps)
        self.x.addcdiv_(self.m, denom, value=-self.lr / (1 - beta1 ** t))
        return self.x
