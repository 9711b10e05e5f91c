"""``DoubleSqueezeBackend``: the interface of DeepSpeed <= 0.19.6's
``NcclBackend`` (removed in 0.19.7 with 1-bit Adam, 0/1 Adam and 1-bit LAMB),
for any compressor, on any torch.distributed backend, without cupy or MPI.

``compressed_allreduce(buffer_m, worker_error, server_error, local_rank)``
returns the average of ``buffer_m`` over the data-parallel group, compressed
on both passes. As with the old backend, the caller owns the error buffers:
``worker_error`` has the padded size of the buffer (a multiple of the group
size, at least ``buffer_m.numel()``), ``server_error`` is
``worker_error.numel() // size``; both are updated in place.

``compressor="sign"`` (the default) uses RMS scales, one per worker buffer and
one per server chunk, zero counted as positive: what DeepSpeed's 1-bit
backend computed.
"""
from __future__ import annotations

from typing import Any

import torch

from dsq_plugins import DoubleSqueeze, ReducerConfig, TorchDistributedComm
from dsq_plugins.errors import ConfigError

_ONE_BIT = {"scale": "rms", "scope": "tensor"}


def backend_config(compressor: Any = "sign", server_compressor: Any = None,
                   compressor_params: dict[str, Any] | None = None,
                   server_compressor_params: dict[str, Any] | None = None, **options: Any) -> ReducerConfig:
    """The backend's ``ReducerConfig``: the arguments as given, except that
    sign without parameters means DeepSpeed's 1-bit scales, and the error
    memories are the caller's own fp32 buffers (``error_dtype`` "fp32")."""
    options.setdefault("error_dtype", "fp32")
    if compressor_params is None and compressor == "sign":
        compressor_params = dict(_ONE_BIT)
    if server_compressor_params is None and (server_compressor or compressor) == "sign":
        server_compressor, server_compressor_params = "sign", {"scale": "rms"}
    return ReducerConfig(compressor=compressor, server_compressor=server_compressor,
                         compressor_params=compressor_params, server_compressor_params=server_compressor_params,
                         **options)


class DoubleSqueezeBackend:
    """Args: ``mpu`` (its data-parallel group is used; the world without
    one), ``compressor`` and ``server_compressor`` names, their parameters,
    the reducer's other options by name (``ReducerConfig``), or ``config=``."""

    def __init__(self, mpu: Any = None, compressor: Any = "sign", server_compressor: Any = None,
                 compressor_params: dict[str, Any] | None = None,
                 server_compressor_params: dict[str, Any] | None = None, *, config: ReducerConfig | None = None,
                 **reducer_options: Any):
        if config is None:
            config = backend_config(compressor, server_compressor, compressor_params, server_compressor_params,
                                    **reducer_options)
        elif reducer_options:
            raise ConfigError(f"options {sorted(reducer_options)} were given with a ready config: put them in it")
        if config.error_dtype != "fp32":
            raise ConfigError("error_dtype must be 'fp32' here: the caller's own worker_error and server_error "
                              "buffers are the error memories")
        if config.error_feedback != "both":
            raise ConfigError("error_feedback must be 'both' here: the caller's worker_error and server_error "
                              "buffers are the two error memories")
        group = mpu.get_data_parallel_group() if mpu is not None else None
        self.comm = TorchDistributedComm(group)
        # the caller's buffers are the flat exchange's error memories (the whole vector, this rank's chunk)
        self.reducer = DoubleSqueeze(self.comm, config=config.flat_only(
            "the caller's buffers are the flat exchange's error memories: leave hierarchy at 'flat' or 'auto'"))
        self.size = self.comm.size
        self.rank = self.comm.rank

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                             local_rank: int | None = None) -> torch.Tensor:
        """The averaged ``buffer_m`` (same shape and dtype); the two error
        buffers are updated in place, and only if the exchange succeeded
        (a skipped step returns zeros and leaves them as they were).
        ``local_rank`` is accepted for compatibility: tensors stay on the
        device they are on."""
        numel, padded = buffer_m.numel(), worker_error.numel()
        if padded < numel or padded % self.size:
            raise ConfigError(f"worker_error must hold at least buffer_m.numel() = {numel} elements and a multiple "
                              f"of the group size {self.size}; it holds {padded}")
        if server_error.numel() != padded // self.size:
            raise ConfigError(f"server_error must hold worker_error.numel() // size = {padded // self.size} "
                              f"elements; it holds {server_error.numel()}")
        flat = buffer_m.detach().reshape(-1).to(torch.float32)
        if padded > numel:
            flat = torch.cat([flat, flat.new_zeros(padded - numel)])
        name = f"buffer{padded}"
        self.reducer.worker_error.set(name, worker_error.reshape(-1))
        self.reducer.server_error.set(name, server_error.reshape(-1))
        with self.reducer.step() as step:
            averaged = self.reducer.reduce(name, flat)
        if step.applied:
            device = flat.device
            worker_error.copy_(self.reducer.worker_error.get(name, padded, device).reshape(worker_error.shape))
            server_error.copy_(self.reducer.server_error.get(name, server_error.numel(), device)
                               .reshape(server_error.shape))
        return averaged[:numel].reshape(buffer_m.shape).to(buffer_m.dtype)
