"""DoubleSqueeze where PyTorch shards the model (FSDP2 and HSDP), after
``fully_shard``:

    import dsq_plugins.fsdp as dsq_fsdp
    fully_shard(block) for each block; fully_shard(model)
    compression = dsq_fsdp.compress(model, compressor="sign")     # the gradient path, any optimizer
    # or, for transformers (Adam): the momentum compressed across the replicas
    opt = dsq_fsdp.compressed_adam(model, lr=1e-3, freeze_step="auto")

On HSDP's (replicate, shard) mesh, FSDP's reduce-scatter stays exact inside
the shard group (a host) and the replicate dimension (between hosts) is
DoubleSqueeze: the two-level exchange, with FSDP's parameter all-gather as
its third step. On a 1-D mesh the reduce-scatter itself is DoubleSqueeze's
worker pass. Gradient accumulation without sync exchanges nothing; a failure
is the same error on every rank, raised from ``backward()``, writes no state,
and the next step goes on as usual.
"""
from __future__ import annotations

from typing import Any

import torch

from ._adam import ShardedCompressedAdam, compressed_adam
from ._compression import FSDPCompression
from ._seams import TESTED_TORCH

__all__ = ["FSDPCompression", "ShardedCompressedAdam", "TESTED_TORCH", "compress", "compressed_adam"]


def compress(model: torch.nn.Module, compressor: Any = "sign", *, exact_steps: int = 0,
             **options: Any) -> FSDPCompression:
    """Wire DoubleSqueeze into every ``fully_shard`` module of ``model``
    (call once, after ``fully_shard``); the first ``exact_steps`` backwards
    average exactly (as the DDP hook's). ``options``: any reducer option by
    name (``compressor_params``, ``server_compressor``, ``error_dtype``,
    ``hierarchy``, ``seed`` ...; ``ReducerConfig``). Returns the
    ``FSDPCompression``, whose ``state_dict()`` goes into checkpoints."""
    return FSDPCompression(model, compressor, exact_steps=exact_steps, **options)
