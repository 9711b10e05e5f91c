"""DoubleSqueeze for engines that can only allreduce dense tensors, such as
Horovod's ``compression=`` hook: there the engine averages whatever
``compress`` returns, so no compressed payload can travel.

The math is still Algorithm 1 (``dsq_plugins.algorithm.arithmetic``). ``compress`` is the
worker pass (compensate with the worker error, compress, keep the loss) and
returns the *decompressed* value c_i, which the engine averages;
``decompress`` is the server pass, run identically on every rank on the
identical average with a replicated server error. Compression is per tensor,
not per chunk.

What travels is the engine's dense allreduce of c_i, in ``wire_dtype``
(the input dtype by default; fp16 halves it). For byte savings use the
sharded ``DoubleSqueeze`` (the Horovod and DeepSpeed drop-ins do).

State changes by whole steps, as in the sharded reducer: a step is the set
of tensors compressed since the last one closed; their worker and server
errors and step counters are written when the last of them has been
decompressed, and only if none failed. A NaN fed by any rank reaches every
rank through the average, so every rank raises ``NonFiniteGradientError``
and no tensor of that step changes any rank's state. Skipping a step is not
possible here (the engine's optimizer steps whatever we return), so
``on_nonfinite="skip"`` is refused.
"""
from __future__ import annotations

from typing import Any

import torch

from .algorithm import SERVER, WORKER, Seeds, shared_draw
from .algorithm import arithmetic as passes
from .compressors import Compressor
from .compressors.base import FLOAT_DTYPES, check_float_tensor
from .compressors.decoded import Decoded
from .compressors.finite import all_finite
from .config import ReducerConfig
from .errors import ConfigError, NonFiniteGradientError
from .state import ReducerState, StagedUpdate

__all__ = ["check_replicable", "ReplicatedDoubleSqueeze"]


class ReplicatedDoubleSqueeze:
    """Per-tensor DoubleSqueeze state and math around a dense average.

    Args: as ``DoubleSqueeze`` (or ``config=``), plus ``rank`` (seeds the
    worker-side randomness differently per rank) and ``wire_dtype`` (dtype
    handed to the engine)."""

    def __init__(self, compressor: str | Compressor = "sign", server_compressor: str | Compressor | None = None,
                 error_feedback: str = "both", *, rank: int = 0, wire_dtype: torch.dtype | None = None,
                 config: ReducerConfig | None = None, **options: Any):
        if wire_dtype is not None and wire_dtype not in FLOAT_DTYPES:
            raise ConfigError(f"wire_dtype must be one of {FLOAT_DTYPES}, got {wire_dtype!r}")
        config = ReducerConfig.build(config, dict(compressor=compressor, server_compressor=server_compressor,
                                                  error_feedback=error_feedback), options)
        check_replicable(config)
        self.config = config
        self.compressor, self.server_compressor = config.build_compressors(warn=True, stacklevel=2)
        self.error_feedback = config.error_feedback
        self.rank = rank
        self.wire_dtype = wire_dtype
        self.seeds = Seeds(config.seed, shared_draw(self.compressor, self.server_compressor))
        self.state = ReducerState({"rank": rank}, ("worker_error", "server_error"), owner="ReplicatedDoubleSqueeze",
                                  error_dtype=config.error_dtype)
        self._new_step()

    worker_error = property(lambda self: self.state["worker_error"])
    server_error = property(lambda self: self.state["server_error"])
    steps = property(lambda self: self.state.steps)

    def compress(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Worker pass for ``name``: the dense value to average, in
        ``wire_dtype`` (or the tensor's dtype). Stages the worker error."""
        check_float_tensor(tensor, f"compress({name!r})")
        if self._failed or name in self._compressed:
            self._new_step()  # the previous step failed, or this tensor starts the next one
        flat = tensor.detach().reshape(-1).to(torch.float32)
        worker_ef = self.error_feedback in ("both", "worker")
        c = passes.compensate(flat, worker_error=self.worker_error.get(name, flat.numel(), flat.device)
                              if worker_ef else None, decay=self.config.error_decay)
        update = StagedUpdate(name)
        if c.finite:
            step = self.steps.get(name, 0)
            payloads = passes.compress_chunks(self.compressor, c.v, [(0, flat.numel())],
                                              lambda _: self.seeds.whole(name, step, WORKER, self.rank))
            decoded = self.compressor.decompress_flat(payloads[0], flat.numel(),
                                                      self.seeds.whole(name, step, WORKER, self.rank))
            wire = decoded.to(self.wire_dtype or tensor.dtype)
            if worker_ef:  # the residual keeps what the cast to the wire dtype lost too
                sent = Decoded(wire.to(torch.float32), flat.numel())
                update.worker_error = passes.worker_residual_(c, self.compressor, payloads, [(0, flat.numel())],
                                                              None, decoded={0: sent})
        else:  # let the NaN travel: every rank then sees it in the average
            wire = c.v.to(self.wire_dtype or tensor.dtype)
        self._compressed[name] = (update, c.finite)
        return wire.reshape(tensor.shape)

    def decompress(self, name: str, averaged: torch.Tensor) -> torch.Tensor:
        """Server pass for ``name`` on the engine's average; fp32 result,
        identical on every rank. Closes the step once every tensor of it is in."""
        update, mine_finite = self._compressed.get(name, (StagedUpdate(name), True))
        u = averaged.detach().reshape(-1).to(torch.float32)
        if not all_finite(u):
            self._failed = True
            who = "this rank's gradient was not finite" if not mine_finite else "another rank's gradient was"
            raise NonFiniteGradientError(
                f"the averaged gradient {name!r} holds NaN or Inf ({who}); the step was not applied and "
                f"error-feedback state is unchanged", [] if mine_finite else [self.rank])
        step = self.steps.get(name, 0)
        server_error = self.server_error.get(name, u.numel(), u.device) if self.error_feedback == "both" else None
        qs = self.server_compressor
        memory = self.server_error if server_error is not None else None  # u - Q'(u) in Q'(u)'s pass where it can
        squeezed = passes.server_squeeze(qs, u, server_error, self.seeds.whole(name, step, SERVER),
                                         decay=self.config.error_decay, memory=memory)
        served = qs.decode(squeezed.payload, u.numel(), self.seeds.whole(name, step, SERVER))
        if server_error is not None:
            update.server_errors[name] = passes.server_residual(squeezed, served, memory)
        served = served.dense()
        self._decompressed[name] = update
        if name not in self._compressed:
            self._compressed[name] = (update, True)
        if self._decompressed.keys() == self._compressed.keys():
            self._commit()
        return served.reshape(averaged.shape)

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a ``StateError`` if it is another rank's."""
        self.state.load_state_dict(state)
        self._new_step()

    # -- steps --------------------------------------------------------------
    def _new_step(self) -> None:
        """Drop whatever an unfinished or failed step staged."""
        self._compressed: dict[str, tuple[StagedUpdate, bool]] = {}
        self._decompressed: dict[str, StagedUpdate] = {}
        self._failed = False

    def _commit(self) -> None:
        for update in self._decompressed.values():
            self.state.write(update)
        self._new_step()


def check_replicable(config: ReducerConfig) -> None:
    """The options a dense allreduce cannot honour, refused by name."""
    if config.on_nonfinite == "skip":
        raise ConfigError("on_nonfinite='skip' cannot skip a step through a dense allreduce (the engine's "
                          "optimizer steps whatever the average is): use horovod_ext.DistributedOptimizer, "
                          "or on_nonfinite='raise'")
    if config.error_feedback == "ef21":
        raise ConfigError("error_feedback='ef21' needs each sender's state replicated at the owners; a dense "
                          "allreduce has no owners: use horovod_ext.DistributedOptimizer")
    if config.aggregator != "mean":
        raise ConfigError(f"aggregator {config.aggregator!r} needs the contributions one by one; a dense "
                          f"allreduce only sums them: use horovod_ext.DistributedOptimizer")
    config.flat_only("it needs groups of ranks; a dense allreduce is the engine's own (Horovod's "
                     "HOROVOD_HIERARCHICAL_ALLREDUCE is its two-level scheme): use horovod_ext.DistributedOptimizer")
