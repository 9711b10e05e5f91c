"""Compression objects for Horovod's ``compression=`` argument.

``Compression.none``, ``.fp16`` and ``.bf16`` cast the gradient for the
allreduce, as Horovod's own do (bf16 is new). ``Compression.doublesqueeze(...)``
works in two places:

* in the stock ``hvd.DistributedOptimizer`` / ``hvd.allreduce``: Horovod
  allreduces what ``compress`` returns, so the object carries the DoubleSqueeze
  math (``dsq_plugins.ReplicatedDoubleSqueeze``): worker compensation in
  ``compress``, the server squeeze in ``decompress``, identical on every rank.
  The bytes are Horovod's dense allreduce (``wire_dtype=torch.float16`` halves
  them); the gain on this path is convergence, not bandwidth.
* in ``horovod_ext.DistributedOptimizer``: packed payloads move through
  ``hvd.alltoall`` / ``hvd.allgather`` with the sharded reducer: 1-bit sign
  moves ~1/32 of an fp32 allreduce.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from dsq_plugins import ReplicatedDoubleSqueeze
from dsq_plugins.errors import ConfigError

# functions of Horovod whose local ``name`` names the tensor being compressed
_NAMED_CALLERS = {"allreduce", "allreduce_async", "allreduce_async_", "allreduce_"}


class _CastCompressor:
    """Horovod Compressor API: cast floats to ``dtype`` for the allreduce."""

    dtype: torch.dtype

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx is not None else tensor


class NoneCompressor(_CastCompressor):
    """Horovod's default: the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None


class FP16Compressor(_CastCompressor):
    """Floats allreduced as float16."""

    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floats allreduced as bfloat16."""

    dtype = torch.bfloat16


class DoubleSqueezeCompression:
    """A DoubleSqueeze configuration usable as Horovod ``compression=``.

    Args:
        compressor / server_compressor / error_feedback / aggregator: as
            ``dsq_plugins.DoubleSqueeze``.
        server_params: parameters of a server compressor of another kind.
        wire_dtype: stock path only, dtype handed to Horovod's allreduce.
        bucket_mb, layerwise, on_nonfinite, seed, aggregator_params,
            worker_momentum: as ``DoubleSqueeze`` (bucketing applies to the
            drop-in optimizer).
        faults: a fault-injection spec (``robust.faults``), drop-in only;
            the ``DSQ_FAULTS`` environment variable works too.
        **params: the compressor's parameters (``ratio=0.01`` for top-k).
    """

    def __init__(self, compressor: str = "sign", server_compressor: str | None = None,
                 error_feedback: str = "both", *, aggregator: str = "mean", server_params: dict | None = None,
                 wire_dtype: torch.dtype | None = None, bucket_mb: float = 25.0, layerwise: bool = False,
                 on_nonfinite: str = "raise", seed: int = 0, aggregator_params: dict | None = None,
                 worker_momentum: float = 0.0, faults: Any = None, **params: Any):
        self.reducer_kwargs = dict(compressor=compressor, server_compressor=server_compressor,
                                   error_feedback=error_feedback, aggregator=aggregator, compressor_params=params,
                                   server_compressor_params=server_params, bucket_mb=bucket_mb,
                                   layerwise=layerwise, on_nonfinite=on_nonfinite, seed=seed,
                                   aggregator_params=aggregator_params, worker_momentum=worker_momentum)
        self.faults = faults
        # validate now, on every rank, rather than at the first backward pass
        self._replicated = ReplicatedDoubleSqueeze(compressor, server_compressor, error_feedback,
                                                   compressor_params=params, server_compressor_params=server_params,
                                                   wire_dtype=wire_dtype, seed=seed)
        if aggregator != "mean":
            try:
                import robust  # noqa: F401  (registers the robust rules)
            except ImportError:
                pass
            from dsq_plugins import get_aggregator
            get_aggregator(aggregator, **(aggregator_params or {}))
        if faults is not None:
            from robust.faults import FaultSpec
            FaultSpec.parse(faults)
        self.aggregator = aggregator
        self._rank_known = False

    def __repr__(self) -> str:
        kw = {k: v for k, v in self.reducer_kwargs.items() if v not in (None, {}, "mean", False)}
        return f"Compression.doublesqueeze({', '.join(f'{k}={v!r}' for k, v in kw.items())})"

    # -- Horovod Compressor API (stock path) ------------------------------
    def compress(self, tensor: torch.Tensor):
        if tensor.is_sparse or not tensor.dtype.is_floating_point:
            return tensor, None  # Horovod's sparse path and integer tensors pass through untouched
        if self.aggregator != "mean":
            raise ConfigError(f"aggregator {self.aggregator!r} needs the contributions one by one; Horovod's "
                              f"allreduce only sums them: use horovod_ext.DistributedOptimizer")
        if not self._rank_known:
            import horovod.torch as hvd
            self._replicated.rank = hvd.rank()
            self._rank_known = True
        name = _tensor_name()
        return self._replicated.compress(name, tensor), (name, tensor.dtype)

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:
            return tensor
        name, dtype = ctx
        return self._replicated.decompress(name, tensor).to(dtype)

    def state_dict(self) -> dict[str, Any]:
        """Stock-path error state of this rank (save it with the checkpoint)."""
        return self._replicated.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._replicated.load_state_dict(state)


def _tensor_name() -> str:
    """The name Horovod gives the tensor being compressed, read from the
    caller: the optimizer's ``_parameter_names[p]`` or ``hvd.allreduce``'s
    ``name``. Keying error memory by that name (not by tensor identity) keeps
    it right with ``zero_grad(set_to_none=True)``, accumulation and groups."""
    frame = sys._getframe(2)
    param = None
    for _ in range(4):
        if frame is None:
            break
        local = frame.f_locals
        if param is None and isinstance(local.get("p"), torch.Tensor):
            param = local["p"]
        names = getattr(local.get("self"), "_parameter_names", None)
        if isinstance(names, dict) and param is not None and param in names:
            return names[param]
        if frame.f_code.co_name in _NAMED_CALLERS and isinstance(local.get("name"), str):
            return local["name"]
        frame = frame.f_back
    raise ConfigError("DoubleSqueeze compression cannot tell which tensor it is compressing: pass name=... to "
                      "hvd.allreduce, or use it through hvd.DistributedOptimizer / horovod_ext.DistributedOptimizer")


class Compression:
    """Horovod-style namespace of compression objects."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def doublesqueeze(compressor: str = "sign", server_compressor: str | None = None,
                      error_feedback: str = "both", **params: Any) -> DoubleSqueezeCompression:
        """DoubleSqueeze with ``compressor`` on workers and ``server_compressor``
        (default: the same) on the server, e.g. ``doublesqueeze("topk", ratio=0.01)``."""
        return DoubleSqueezeCompression(compressor, server_compressor, error_feedback, **params)

    @staticmethod
    def plain(compressor: str, **params: Any) -> DoubleSqueezeCompression:
        """A core compressor on both passes with no error feedback (plain
        QSGD, top-k or signSGD: the paper's baselines)."""
        return DoubleSqueezeCompression(compressor, None, "none", **params)
