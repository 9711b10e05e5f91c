"""The configuration schema of a DoubleSqueeze reducer, as a JSON-style dict
(the ``"doublesqueeze"`` section of a DeepSpeed config, for one).

Every problem is a ``ConfigError`` that names the key, says what it must be,
and lists the valid keys or values: unknown keys, wrong types, unknown
compressors or compressor parameters, and combinations that cannot work.
Compressors and aggregators are built here, once, so a bad section fails at
start-up on every rank rather than at the first backward pass."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .aggregation import get_aggregator
from .compressors import get_compressor
from .errors import ConfigError
from .reducer import ERROR_FEEDBACK_MODES, ON_NONFINITE

_SCHEMA: dict[str, tuple[tuple[type, ...], str]] = {
    "enabled": ((bool,), "true or false"),
    "compressor": ((str,), "a compressor name"),
    "compressor_params": ((dict,), "an object of compressor parameters"),
    "server_compressor": ((str, type(None)), "a compressor name or null"),
    "server_compressor_params": ((dict, type(None)), "an object of compressor parameters or null"),
    "error_feedback": ((str,), f"one of {', '.join(ERROR_FEEDBACK_MODES)}"),
    "aggregator": ((str,), "an aggregator name"),
    "aggregator_params": ((dict,), "an object of aggregator parameters"),
    "worker_momentum": ((int, float), "a number in [0, 1)"),
    "bucket_mb": ((int, float), "a positive number"),
    "layerwise": ((bool,), "true or false"),
    "on_nonfinite": ((str,), f"one of {', '.join(ON_NONFINITE)}"),
    "strict_payloads": ((bool, type(None)), "true, false or null"),
    "seed": ((int,), "an integer"),
    # validated by robust.faults.FaultSpec where the engine adapter wires it in
    "faults": ((dict, str, type(None)), "a fault spec object or string, or null"),
}
VALID_KEYS = tuple(_SCHEMA)


@dataclass
class ReducerConfig:
    """A validated reducer configuration; ``reducer_kwargs()`` feeds ``DoubleSqueeze``."""

    enabled: bool = True
    compressor: str = "sign"
    compressor_params: dict[str, Any] = field(default_factory=dict)
    server_compressor: str | None = None
    server_compressor_params: dict[str, Any] | None = None
    error_feedback: str = "both"
    aggregator: str = "mean"
    bucket_mb: float = 25.0
    layerwise: bool = False
    on_nonfinite: str = "raise"
    strict_payloads: bool | None = None
    aggregator_params: dict[str, Any] = field(default_factory=dict)
    worker_momentum: float = 0.0
    seed: int = 0
    faults: dict[str, Any] | str | None = None

    @classmethod
    def from_dict(cls, section: Any, where: str = "doublesqueeze") -> "ReducerConfig":
        """Validate a section; ``where`` prefixes every error message."""
        if not isinstance(section, dict):
            raise ConfigError(f"{where} must be an object, got {type(section).__name__}")
        unknown = sorted(set(section) - set(_SCHEMA))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"valid keys: {', '.join(VALID_KEYS)}")
        for key, value in section.items():
            types, what = _SCHEMA[key]
            if isinstance(value, bool) and bool not in types:
                raise ConfigError(f"{where}.{key} must be {what}, got {value!r}")
            if not isinstance(value, types):
                raise ConfigError(f"{where}.{key} must be {what}, got {value!r}")
        cfg = cls(**section)
        cfg._check(where)
        return cfg

    def _check(self, where: str) -> None:
        if self.error_feedback not in ERROR_FEEDBACK_MODES:
            raise ConfigError(f"{where}.error_feedback must be one of {', '.join(ERROR_FEEDBACK_MODES)}, "
                              f"got {self.error_feedback!r}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"{where}.on_nonfinite must be one of {', '.join(ON_NONFINITE)}, "
                              f"got {self.on_nonfinite!r}")
        if not 0 <= self.worker_momentum < 1:
            raise ConfigError(f"{where}.worker_momentum must be a number in [0, 1), got {self.worker_momentum!r}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"{where}.bucket_mb must be a positive number, got {self.bucket_mb!r}")
        if self.server_compressor_params is not None and self.server_compressor is None:
            raise ConfigError(f"{where}.server_compressor_params needs server_compressor: name the server's "
                              f"compressor (it may be the same as compressor)")
        try:
            get_compressor(self.compressor, **self.compressor_params)
            if self.server_compressor is not None or self.server_compressor_params is not None:
                get_compressor(self.server_compressor or self.compressor, **(self.server_compressor_params or {}))
            get_aggregator(self.aggregator, **self.aggregator_params)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def reducer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DoubleSqueeze`` (``faults`` is the adapters' to wire)."""
        return dict(compressor=self.compressor, server_compressor=self.server_compressor,
                    error_feedback=self.error_feedback, aggregator=self.aggregator,
                    compressor_params=self.compressor_params, server_compressor_params=self.server_compressor_params,
                    bucket_mb=float(self.bucket_mb), layerwise=self.layerwise, on_nonfinite=self.on_nonfinite,
                    strict_payloads=self.strict_payloads, aggregator_params=self.aggregator_params,
                    worker_momentum=float(self.worker_momentum), seed=self.seed)
