"""DoubleSqueeze for engines that can only allreduce dense tensors, such as
Horovod's ``compression=`` hook: there the engine averages whatever
``compress`` returns, so no compressed payload can travel.

The math is still Algorithm 1. ``compress`` is the worker pass (compensate
with the worker error, compress, remember the loss) and returns the
*decompressed* value c_i, which the engine averages; ``decompress`` is the
server pass, run identically on every rank on the identical average with a
replicated server error. Compression is per tensor, not per chunk.

What travels is the engine's dense allreduce of c_i, in ``wire_dtype``
(the input dtype by default; fp16 halves it). For byte savings use the
sharded ``DoubleSqueeze`` (the Horovod and DeepSpeed drop-ins do).

State is transactional: ``compress`` only stages the new worker error;
``decompress`` commits it, and the server error, only if the average is
finite. A NaN fed by any rank reaches every rank through the average, so every
rank raises ``NonFiniteGradientError`` and no rank's state changes.
"""
from __future__ import annotations

from typing import Any

import torch

from .compressors import Compressor, derive_seed
from .compressors.base import FLOAT_DTYPES, check_float_tensor
from .errors import ConfigError, NonFiniteGradientError
from .finite import all_finite
from .memory import ErrorMemory
from .reducer import resolve_compressors


class ReplicatedDoubleSqueeze:
    """Per-tensor DoubleSqueeze state and math around a dense average.

    Args: as ``DoubleSqueeze``, plus ``rank`` (seeds the worker-side randomness
    differently per rank) and ``wire_dtype`` (dtype handed to the engine)."""

    def __init__(self, compressor: str | Compressor = "sign", server_compressor: str | Compressor | None = None,
                 error_feedback: str = "both", *, compressor_params: dict[str, Any] | None = None,
                 server_compressor_params: dict[str, Any] | None = None, rank: int = 0,
                 wire_dtype: torch.dtype | None = None, seed: int = 0):
        if wire_dtype is not None and wire_dtype not in FLOAT_DTYPES:
            raise ConfigError(f"wire_dtype must be one of {FLOAT_DTYPES}, got {wire_dtype!r}")
        self.compressor, self.server_compressor = resolve_compressors(
            compressor, server_compressor, error_feedback, compressor_params, server_compressor_params)
        self.error_feedback = error_feedback
        self.rank = rank
        self.wire_dtype = wire_dtype
        self.seed = seed
        self.worker_error = ErrorMemory()
        self.server_error = ErrorMemory()
        self.steps: dict[str, int] = {}
        self._pending: dict[str, tuple[torch.Tensor | None, bool]] = {}

    def compress(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Worker pass for ``name``: the dense value to average, in
        ``wire_dtype`` (or the tensor's dtype). Stages the worker error."""
        check_float_tensor(tensor, f"compress({name!r})")
        flat = tensor.detach().reshape(-1).to(torch.float32)
        worker_ef = self.error_feedback in ("both", "worker")
        v = flat + self.worker_error.get(name, flat.numel(), flat.device) if worker_ef else flat
        finite = all_finite(v)
        if finite:
            step = self.steps.get(name, 0)
            q = self.compressor
            c = q.decompress(q.compress(v, seed=derive_seed(self.seed, name, step, "w", self.rank)))
            c = c.to(self.wire_dtype or tensor.dtype)
        else:  # let the NaN travel: every rank then sees it in the average
            c = v.to(self.wire_dtype or tensor.dtype)
        self._pending[name] = ((v - c.to(torch.float32)) if worker_ef and finite else None, finite)
        return c.reshape(tensor.shape)

    def decompress(self, name: str, averaged: torch.Tensor) -> torch.Tensor:
        """Server pass for ``name`` on the engine's average; fp32 result,
        identical on every rank. Commits this step's state."""
        werr, mine_finite = self._pending.pop(name, (None, True))
        u = averaged.detach().reshape(-1).to(torch.float32)
        if not all_finite(u):
            who = "this rank's gradient was not finite" if not mine_finite else "another rank's gradient was"
            raise NonFiniteGradientError(
                f"the averaged gradient {name!r} holds NaN or Inf ({who}); the step was not applied and "
                f"error-feedback state is unchanged", [] if mine_finite else [self.rank])
        step = self.steps.get(name, 0)
        if self.error_feedback == "both":
            u = u + self.server_error.get(name, u.numel(), u.device)
        qs = self.server_compressor
        r = qs.decompress(qs.compress(u, seed=derive_seed(self.seed, name, step, "s")))
        if werr is not None:
            self.worker_error.set(name, werr)
        if self.error_feedback == "both":
            self.server_error.set(name, u - r)
        self.steps[name] = step + 1
        return r.reshape(averaged.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"worker_error": self.worker_error.state_dict(), "server_error": self.server_error.state_dict(),
                "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"worker_error", "server_error", "steps"} - set(state)
        if missing:
            raise ValueError(f"ReplicatedDoubleSqueeze state_dict is missing {sorted(missing)}")
        self.worker_error.load_state_dict(state["worker_error"])
        self.server_error.load_state_dict(state["server_error"])
        self.steps = {str(k): int(v) for k, v in state["steps"].items()}
        self._pending.clear()
