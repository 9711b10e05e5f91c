"""Algorithm 1 of the DoubleSqueeze paper written plainly: n workers and one
central server, no sharding, no communicator. Compression is per chunk, with
the same chunks the sharded reducer uses, so the two must agree bit for bit.
"""
import torch

from ..layout import chunk_bounds

__all__ = ["ReferenceDoubleSqueeze"]


class ReferenceDoubleSqueeze:
    def __init__(self, n, q, qs, error_feedback="both", seed_of=None, error_decay=1.0):
        self.n, self.q, self.qs = n, q, qs
        self.ef, self.decay = error_feedback, error_decay
        self.worker_err = None
        self.server_err = None
        self.step = 0
        # seed_of(step, side, sender, chunk): the seeds the reducer under test derives
        self.seed_of = seed_of or (lambda *a: None)

    def __call__(self, grads):
        n = self.n
        numel = grads[0].numel()
        bounds = chunk_bounds(numel, n)
        if self.worker_err is None:
            self.worker_err = [torch.zeros(numel) for _ in range(n)]  # with ef21: each worker's state h_i
            self.server_err = torch.zeros(numel)
        sent = []  # sent[i][k]: what worker i's chunk k decodes to
        for i, g in enumerate(grads):
            if self.ef == "ef21":  # EF21: compress g - h_i, and h_i moves by what was sent
                v = g.reshape(-1).float() - self.worker_err[i]
            else:
                v = g.reshape(-1).float() + (self.decay * self.worker_err[i] if self.ef in ("both", "worker") else 0)
            chunks = [self.q.decompress(self.q.compress(v[a:b], seed=self.seed_of(self.step, "w", i, k)))
                      for k, (a, b) in enumerate(bounds)]
            if self.ef == "ef21":
                chunks = [h + c for h, c in zip(self.worker_err[i].split([b - a for a, b in bounds]), chunks)]
                self.worker_err[i] = torch.cat(chunks)  # the owner's replica of h_i, and h_i itself
            sent.append(chunks)
            if self.ef in ("both", "worker"):
                self.worker_err[i] = v - torch.cat(chunks)
        out = []
        for k, (a, b) in enumerate(bounds):
            # the mean summed from zero in worker order (torch.mean reorders its sum from 8 rows on)
            u = sum((sent[i][k] for i in range(n)), torch.zeros(b - a)) / n
            if self.ef in ("both", "ef21"):
                u = u + self.decay * self.server_err[a:b]
            r = self.qs.decompress(self.qs.compress(u, seed=self.seed_of(self.step, "s", k, k)))
            if self.ef in ("both", "ef21"):
                self.server_err[a:b] = u - r
            out.append(r)
        self.step += 1
        return torch.cat(out)
