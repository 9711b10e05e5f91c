"""DeepSpeed configs written for DeepSpeed <= 0.19.6's 1-bit optimizers.

``"optimizer": {"type": "OneBitAdam", "params": {...}}`` runs as
``dsq_plugins.CompressedAdam`` over the engine's data-parallel group: the
same design (exact warm-up, then the momentum compressed with error feedback
on both passes, against a frozen variance), any compressor. The
``"doublesqueeze"`` section, if present, chooses the compressor; without it,
sign with RMS scales, as 1-bit Adam had.

The optimizer does all of the communication itself (the exact average during
warm-up costs what DeepSpeed's allreduce costs), so the engine's own gradient
allreduce is switched off from the start. Gradient clipping moves into the
optimizer for the same reason (``max_grad_norm``): the engine would clip each
rank's local gradient before the warm-up average. ``ZeroOneAdam`` and ``OneBitLamb``
are not built: a ``ConfigError`` says what to use instead.
"""
from __future__ import annotations

from typing import Any

import torch

from dsq_plugins import CompressedAdam, ReducerConfig, TorchDistributedComm
from dsq_plugins.errors import ConfigError

ONE_BIT_ADAM = "onebitadam"
NOT_BUILT = {
    "zerooneadam": "0/1 Adam (ZeroOneAdam) is not built here: use \"OneBitAdam\" (dsq_plugins.CompressedAdam), "
                   "the same compressed momentum without 0/1 Adam's adaptive variance freezing and local steps",
    "onebitlamb": "1-bit LAMB (OneBitLamb) is not built here: use \"OneBitAdam\" (dsq_plugins.CompressedAdam), "
                  "or LAMB with the doublesqueeze section compressing its gradients",
}
# OneBitAdam's parameters in DeepSpeed 0.19.6, and what becomes of each here
PARAMS = {
    "lr": "learning rate", "betas": "Adam's betas", "eps": "Adam's eps", "weight_decay": "decoupled weight decay",
    "freeze_step": "exact steps before the variance is frozen, or \"auto\" (dsq_plugins.optim.FreezePolicy)",
    "max_freeze_step": "with freeze_step \"auto\": freeze here at the latest",
    "freeze_window": "with freeze_step \"auto\": steps between looks at the variance",
    "freeze_threshold": "with freeze_step \"auto\": the relative change below which it has settled",
    "cuda_aware": "accepted and unused: the exchange uses the engine's torch.distributed group on whatever device "
                  "the tensors are on, so CUDA-aware MPI is not needed",
    "comm_backend_name": "accepted and unused: every backend name runs the same exchange over the engine's "
                         "data-parallel group (no cupy, no MPI)",
    "bias_correction": "accepted: CompressedAdam always corrects the bias, as AdamW does",
}
# keys of the doublesqueeze section that choose CompressedAdam's momentum exchange
SECTION_KEYS = {"enabled", "compressor", "compressor_params", "server_compressor", "server_compressor_params",
                "bucket_mb", "layerwise", "seed", "on_nonfinite", "error_feedback", "error_dtype", "hierarchy",
                "node_size"}


def one_bit_section(full: dict[str, Any]) -> dict[str, Any] | None:
    """The optimizer section if it asks for a 1-bit optimizer (validated), else None."""
    section = full.get("optimizer")
    if not isinstance(section, dict):
        return None
    kind = str(section.get("type", "")).lower()
    if kind in NOT_BUILT:
        raise ConfigError(f"optimizer.type {section['type']!r}: {NOT_BUILT[kind]}")
    if kind != ONE_BIT_ADAM:
        return None
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"optimizer.params must be an object, got {params!r}")
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise ConfigError(f"optimizer.params: unknown key(s) {', '.join(map(repr, unknown))} for OneBitAdam; "
                          f"valid keys: {', '.join(PARAMS)}")
    if params.get("bias_correction", True) is not True:
        raise ConfigError("optimizer.params.bias_correction: CompressedAdam always corrects the bias; leave it true")
    return section


def compressed_adam_options(section: dict[str, Any], dsq_section: dict[str, Any] | None) -> dict[str, Any]:
    """CompressedAdam's keyword options from the two sections."""
    params = section.get("params", {})
    options = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay", "freeze_step", "max_freeze_step",
                                      "freeze_window", "freeze_threshold") if k in params}
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    if dsq_section:
        unused = sorted(set(dsq_section) - SECTION_KEYS)
        if unused:
            raise ConfigError(f"doublesqueeze: with a OneBitAdam optimizer the section chooses the momentum's "
                              f"compression; {', '.join(map(repr, unused))} do not apply (valid: "
                              f"{', '.join(sorted(SECTION_KEYS))})")
        cfg = ReducerConfig.from_dict(dsq_section)  # the same checks and messages as everywhere else
        if cfg.error_feedback != "both":
            raise ConfigError("doublesqueeze.error_feedback: the compressed momentum uses error feedback on both "
                              "passes; leave it 'both'")
        options.update(compressor=cfg.compressor, compressor_params=cfg.compressor_params,
                       server_compressor=cfg.server_compressor,
                       server_compressor_params=cfg.server_compressor_params, bucket_mb=cfg.bucket_mb,
                       layerwise=cfg.layerwise, seed=cfg.seed, on_nonfinite=cfg.on_nonfinite,
                       error_dtype=cfg.error_dtype, hierarchy=cfg.hierarchy, node_size=cfg.node_size)
    CompressedAdam.momentum_config(**options)  # every bad value refused here, before any process group exists
    return options


def build(model, options: dict[str, Any], full: dict[str, Any], mpu: Any = None) -> torch.optim.Optimizer:
    """The client optimizer for a OneBitAdam config: at ZeRO stage 0,
    CompressedAdam over the data-parallel group (torch.distributed is
    initialised first, as deepspeed.initialize would); at stages 1 to 3, a
    plain AdamW for DeepSpeed to partition, which ``deepspeed_ext.zero_adam``
    (stage 3: ``zero3_adam``) then drives (``engine.attach_one_bit``)."""
    import deepspeed
    zero = full.get("zero_optimization") or {}
    if zero.get("stage", 0):
        refuse_at_zero(options, full)
        if model is None:
            raise ConfigError("optimizer.type OneBitAdam needs model=")
        hyper = {k: options[k] for k in ("lr", "betas", "eps", "weight_decay") if k in options}
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **hyper)
    for key in ("fp16", "bf16"):
        if (full.get(key) or {}).get("enabled"):
            raise ConfigError(f"optimizer.type OneBitAdam with {key} at ZeRO stage 0: DeepSpeed's {key} optimizer "
                              f"wraps the client optimizer around flattened master weights; run it in fp32, or at "
                              f"ZeRO stage 1 or 2")
    if model is None:
        raise ConfigError("optimizer.type OneBitAdam needs model= (CompressedAdam names the parameters)")
    deepspeed.init_distributed()
    group = mpu.get_data_parallel_group() if mpu is not None else None
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return CompressedAdam(named, comm=TorchDistributedComm(group), max_grad_norm=gradient_clipping(full), **options)


def refuse_at_zero(options: dict[str, Any], full: dict[str, Any]) -> None:
    """A ``ConfigError`` naming what the ZeRO mapping of CompressedAdam
    cannot serve at the config's stage (before DeepSpeed builds anything)."""
    from . import zero as zero_mapping
    from . import zero3
    from .zero3_adam import refuse_settings
    zero, momentum = full.get("zero_optimization") or {}, CompressedAdam.momentum_config(**options)
    if zero.get("stage") != 3:
        zero_mapping.refuse(momentum, zero)
        return
    zero3.refuse(momentum, zero)
    refuse_settings(bool((full.get("fp16") or {}).get("enabled")), full.get("gradient_accumulation_steps", 1))


def deepspeed_config(full: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """What DeepSpeed gets for a OneBitAdam config: no optimizer section and
    no ``doublesqueeze`` section, and at stage 3 across hosts hpZ over each
    host (``zero3.with_replica_partition``: the parameter pass's replica)."""
    from . import zero3
    rest = {k: v for k, v in full.items() if k not in ("optimizer", zero3.SECTION)}
    zero = rest.get("zero_optimization") or {}
    if zero.get("stage") == 3:
        rest["zero_optimization"] = zero3.with_replica_partition(CompressedAdam.momentum_config(**options), zero)
    return rest


def gradient_clipping(full: dict[str, Any]) -> float:
    """The config's gradient_clipping (DeepSpeed's default is 1.0), which
    CompressedAdam applies in place of the engine (see attach)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    return float(full.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))
