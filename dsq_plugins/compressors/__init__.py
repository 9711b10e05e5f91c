"""Compressors by name. ``get_compressor("sign")`` and friends; every module
documents its wire format at its top."""
from __future__ import annotations

import inspect
from typing import Any

from ..errors import ConfigError
from .base import Compressor, Packet, derive_seed
from .bf16 import BF16Compressor
from .blocksign import BlockSignCompressor
from .fp16 import FP16Compressor
from .lowrank import LowRankCompressor
from .none import NoCompression
from .qsgd import QSGDCompressor
from .randomk import RandomKCompressor
from .randomsign import RandomSignCompressor
from .sign import SignCompressor
from .terngrad import TernGradCompressor
from .topk import TopKCompressor

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (NoCompression, FP16Compressor, BF16Compressor, SignCompressor, TopKCompressor,
                RandomKCompressor, QSGDCompressor, TernGradCompressor, BlockSignCompressor, LowRankCompressor,
                RandomSignCompressor)
}


def compressor_params(name: str) -> list[str]:
    """The keyword parameters compressor ``name`` accepts."""
    return [p for p in inspect.signature(COMPRESSORS[name].__init__).parameters if p != "self"]


def get_compressor(name: str | Compressor, **params: Any) -> Compressor:
    """A compressor by name, e.g. ``get_compressor("topk", ratio=0.01)``.

    An instance passes through unchanged (parameters are then an error)."""
    if isinstance(name, Compressor):
        if params:
            raise ConfigError(f"parameters {sorted(params)} given with a ready compressor instance {name!r}")
        return name
    if name not in COMPRESSORS:
        raise ConfigError(f"unknown compressor {name!r}; available: {', '.join(COMPRESSORS)}")
    allowed = compressor_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ConfigError(f"compressor {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                          f"its parameters are: {', '.join(allowed)}")
    try:
        return COMPRESSORS[name](**params)
    except TypeError as exc:  # e.g. a string where a number belongs
        raise ConfigError(f"compressor {name!r}: {exc}") from None


__all__ = ["COMPRESSORS", "Compressor", "Packet", "derive_seed", "get_compressor", "compressor_params"]
