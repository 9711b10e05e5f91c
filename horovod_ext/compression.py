"""Compression objects for Horovod's ``compression=`` argument.

``Compression.none``, ``.fp16`` and ``.bf16`` cast the gradient for the
allreduce, as Horovod's own do (bf16 is new). ``Compression.doublesqueeze(...)``
works in two places:

* in the stock ``hvd.DistributedOptimizer`` / ``hvd.allreduce``: Horovod
  allreduces what ``compress`` returns, so the object carries the DoubleSqueeze
  math (``dsq_plugins.replicated.ReplicatedDoubleSqueeze``): worker compensation in
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

from dsq_plugins import ReducerConfig
from dsq_plugins.compressors.base import FLOAT_DTYPES
from dsq_plugins.errors import ConfigError
from dsq_plugins.replicated import ReplicatedDoubleSqueeze, check_replicable

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
        compressor, server_compressor, error_feedback: as
            ``dsq_plugins.DoubleSqueeze``.
        wire_dtype: stock path only, the dtype handed to Horovod's allreduce.
        config: a ready ``dsq_plugins.ReducerConfig`` instead of options.
        **options: any other ``DoubleSqueeze`` option by its name
            (``aggregator``, ``compressor_params``, ``server_compressor_params``,
            ``bucket_mb``, ``layerwise``, ``on_nonfinite``, ``strict_payloads``,
            ``seed``, ``aggregator_params``, ``worker_momentum``, ``faults``),
            and, as shorthand, the compressor's own parameters
            (``doublesqueeze("topk", ratio=0.01)``).
    """

    def __init__(self, compressor: Any = "sign", server_compressor: Any = None, error_feedback: str = "both", *,
                 wire_dtype: torch.dtype | None = None, config: ReducerConfig | None = None, **options: Any):
        if config is None:
            config = config_from_options(compressor, server_compressor, error_feedback, options)
        elif options:
            raise ConfigError(f"options {sorted(options)} were given with a ready config: put them in the config")
        if config.aggregator != "mean":
            _load_robust_rules()
        self.config = config
        self.wire_dtype = wire_dtype
        if wire_dtype is not None and wire_dtype not in FLOAT_DTYPES:
            raise ConfigError(f"wire_dtype must be one of {FLOAT_DTYPES}, got {wire_dtype!r}")
        self._replicated: ReplicatedDoubleSqueeze | None = None  # the stock path's state, made at first use

    def __repr__(self) -> str:
        defaults = ReducerConfig().reducer_kwargs()
        kw = {k: v for k, v in self.config.reducer_kwargs().items() if v != defaults.get(k)}
        return f"Compression.doublesqueeze({', '.join(f'{k}={v!r}' for k, v in kw.items())})"

    # -- Horovod Compressor API (stock path) ------------------------------
    def compress(self, tensor: torch.Tensor):
        if tensor.is_sparse or not tensor.dtype.is_floating_point:
            return tensor, None  # Horovod's sparse path and integer tensors pass through untouched
        name = _tensor_name()
        return self._stock().compress(name, tensor), (name, tensor.dtype)

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:
            return tensor
        name, dtype = ctx
        return self._stock().decompress(name, tensor).to(dtype)

    def state_dict(self) -> dict[str, Any]:
        """Stock-path error state of this rank (save it with the checkpoint)."""
        return self._stock().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._stock().load_state_dict(state)

    def _stock(self) -> ReplicatedDoubleSqueeze:
        """The stock path's replicated reducer. Options a dense allreduce
        cannot honour (``on_nonfinite="skip"``, robust aggregators, faults)
        are refused here, the first time this object serves the stock path."""
        if self._replicated is None:
            check_replicable(self.config)
            if self.config.faults is not None:
                raise ConfigError("faults are injected into the compressed exchange: use them with "
                                  "horovod_ext.DistributedOptimizer, not hvd.DistributedOptimizer")
            import horovod.torch as hvd
            self._replicated = ReplicatedDoubleSqueeze(config=self.config, wire_dtype=self.wire_dtype,
                                                       rank=hvd.rank())
        return self._replicated


_CONFIG_KEYS = set(ReducerConfig().reducer_kwargs())


def config_from_options(compressor: Any, server_compressor: Any, error_feedback: str,
                        options: dict[str, Any]) -> ReducerConfig:
    """A ``ReducerConfig`` from Horovod-style options: reducer options by
    name, the rest as the compressor's parameters."""
    options = dict(options)
    reducer = {k: options.pop(k) for k in list(options) if k in _CONFIG_KEYS}
    if options:
        if reducer.get("compressor_params") is not None:
            raise ConfigError(f"give the compressor's parameters as compressor_params or as keywords "
                              f"({sorted(options)}), not both")
        reducer["compressor_params"] = options
    if reducer.get("aggregator", "mean") != "mean":
        _load_robust_rules()
    return ReducerConfig(compressor=compressor, server_compressor=server_compressor, error_feedback=error_feedback,
                         **reducer)


def _load_robust_rules() -> None:
    """Register the robust aggregators, if the robust package is installed."""
    try:
        import robust  # noqa: F401
    except ImportError:
        pass


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
    def doublesqueeze(compressor: Any = "sign", server_compressor: Any = None,
                      error_feedback: str = "both", **options: Any) -> DoubleSqueezeCompression:
        """DoubleSqueeze with ``compressor`` on workers and ``server_compressor``
        (default: the same) on the server, e.g. ``doublesqueeze("topk", ratio=0.01)``;
        ``options`` as ``DoubleSqueezeCompression``."""
        return DoubleSqueezeCompression(compressor, server_compressor, error_feedback, **options)

    @staticmethod
    def plain(compressor: Any, **options: Any) -> DoubleSqueezeCompression:
        """A core compressor on both passes with no error feedback (plain
        QSGD, top-k or signSGD: the paper's baselines)."""
        return DoubleSqueezeCompression(compressor, None, "none", **options)
