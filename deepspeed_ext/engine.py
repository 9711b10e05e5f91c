"""``deepspeed_ext.initialize``: ``deepspeed.initialize`` plus a
``"doublesqueeze"`` section in the JSON config.

The section is read and validated (``dsq_plugins.config.ReducerConfig``),
removed, and the rest goes to DeepSpeed unchanged. If it is enabled, the
engine's own gradient allreduce at the accumulation boundary (its
``buffered_allreduce_fallback``, what ZeRO stage 0 uses) is replaced by the
DoubleSqueeze reducer over buckets of the gradients, on the engine's
data-parallel group. Everything after it is DeepSpeed's: gradient clipping
sees the averaged gradient, the optimizer steps, the scheduler runs. At ZeRO
stages 1 and 2 the two passes become ZeRO's gradient reduce-scatter and
parameter all-gather instead (``deepspeed_ext.zero``); at stage 3 each
gradient bucket's reduce-scatter is the worker pass (``deepspeed_ext.zero3``).

A config whose optimizer is ``OneBitAdam`` (written for DeepSpeed <= 0.19.6)
runs ``dsq_plugins.CompressedAdam`` instead (``deepspeed_ext.onebit``).

Checkpoints: ``engine.save_checkpoint`` also writes
``<dir>/<tag>/doublesqueeze_rank<r>.pt`` (error memory is per rank: each rank
owns one chunk of the server error) and ``engine.load_checkpoint`` reads it.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from typing import Any

import torch

from dsq_plugins import CompressedAdam, DoubleSqueeze, TorchDistributedComm
from dsq_plugins.config import ReducerConfig, near_miss
from dsq_plugins.errors import ConfigError, StateError
from dsq_plugins.optim import FreezePolicy, warn_if_adam
from dsq_plugins.state.reshard import reshard

from . import onebit, overlap, patches, zero, zero3
from .zero3_adam import Zero3CompressedAdam
from .zero_adam import ZeroCompressedAdam

SECTION = "doublesqueeze"


def load_config(config: Any = None, args: Any = None, config_params: Any = None) -> dict[str, Any]:
    """The DeepSpeed config as a dict, from wherever DeepSpeed would take it."""
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    if source is None:
        raise ConfigError("no DeepSpeed config: pass config= (a path or a dict) or args.deepspeed_config")
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"DeepSpeed config {source}: not valid JSON: {exc}") from None
    raise ConfigError(f"DeepSpeed config must be a path or a dict, got {type(source).__name__}")


def check_section_name(full: dict[str, Any]) -> None:
    """A ``ConfigError`` for a top-level key that is nearly ``"doublesqueeze"``
    (the same but for case, or two edits away): DeepSpeed ignores unknown
    top-level keys, so a misspelt section would train uncompressed, silently."""
    for key in full:
        if isinstance(key, str) and near_miss(key, SECTION):
            raise ConfigError(f"DeepSpeed config key {key!r} looks like a misspelt {SECTION!r} section; DeepSpeed "
                              f"ignores unknown top-level keys, so it would train without compression. Spell it "
                              f"{SECTION!r}")


def _load_robust_rules() -> None:
    """Register the robust aggregators, if the robust package is installed."""
    try:
        import robust  # noqa: F401
    except ImportError:
        pass


def split_config(full: dict[str, Any]) -> tuple[dict[str, Any], ReducerConfig | None]:
    """(what DeepSpeed gets, the validated section or None if absent/disabled)."""
    rest = dict(full)
    section = rest.pop(SECTION, None)
    if section is None:
        return rest, None
    _load_robust_rules()
    cfg = ReducerConfig.from_dict(section)
    if not cfg.enabled:
        return rest, None
    zero_section = rest.get("zero_optimization") or {}
    if zero_section.get("stage", 0) == 3:
        zero3.refuse(cfg, zero_section)
        rest["zero_optimization"] = zero3.with_replica_partition(cfg, zero_section)
    elif zero_section.get("stage", 0) != 0:
        zero.refuse(cfg, zero_section)
    return rest, cfg


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None, config_params: Any = None):
    """Same signature and return value as ``deepspeed.initialize``:
    ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    import deepspeed
    full = load_config(config, args, config_params)
    check_section_name(full)
    one_bit = onebit.one_bit_section(full)
    if one_bit is not None:
        if optimizer is not None:
            raise ConfigError("the config names a OneBitAdam optimizer and optimizer= was given too; give one")
        options = onebit.compressed_adam_options(one_bit, full.get(SECTION))
        ds_config = onebit.deepspeed_config(full, options)
        optimizer, cfg = onebit.build(model, options, ds_config, mpu), None
    else:
        ds_config, cfg = split_config(full)
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args = copy.copy(args)  # DeepSpeed refuses a config both in args and in config=
        args.deepspeed_config = None
    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                  mesh_param=mesh_param)
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    result = deepspeed.initialize(**kwargs)
    if one_bit is not None:
        attach_one_bit(result[0], optimizer, options, full, mpu)
    elif cfg is not None:
        attach(result[0], cfg, mpu)
    return result


def attach_one_bit(engine, optimizer: torch.optim.Optimizer, options: dict[str, Any], full: dict[str, Any],
                   mpu: Any = None) -> None:
    """Wire a OneBitAdam config's optimizer (``onebit.build``) into its
    engine: CompressedAdam at stage 0, the ZeRO mapping at stages 1 to 3."""
    if isinstance(optimizer, CompressedAdam):
        attach_compressed_adam(engine, optimizer)
        return
    comm = TorchDistributedComm(mpu.get_data_parallel_group() if mpu is not None else None)
    freeze = FreezePolicy.from_options(options)
    mapping = Zero3CompressedAdam if engine.zero_optimization_stage() == 3 else ZeroCompressedAdam
    wired = engine.doublesqueeze_zero = mapping(
        engine, CompressedAdam.momentum_config(**options), comm, freeze=freeze,
        max_grad_norm=onebit.gradient_clipping(full))
    engine.doublesqueeze, engine.doublesqueeze_comm = wired.reducer, comm
    _wrap_checkpointing(engine, wired.state_dict, wired.load_state_dict, comm.rank)


def attach_compressed_adam(engine, optimizer: CompressedAdam) -> None:
    """The engine steps a CompressedAdam that averages for itself: its own
    gradient allreduce goes, and checkpoints carry each rank's error memories."""
    engine.enable_backward_allreduce = False
    engine._config.gradient_clipping = 0.0  # CompressedAdam clips (max_grad_norm), after its exact average
    engine.compressed_adam = optimizer
    engine.doublesqueeze_comm = optimizer.comm
    optimizer.other_rank_state = "reshard"  # rank 0's optimizer file, then each rank's own below
    _wrap_checkpointing(engine, optimizer.compressed_state_dict, optimizer.load_compressed_state_dict,
                        optimizer.comm.rank)


def attach(engine, cfg: ReducerConfig, mpu: Any = None) -> DoubleSqueeze:
    """Wire a DoubleSqueeze reducer into an initialized engine; returns it
    (also at ``engine.doublesqueeze``). ZeRO stages 1 and 2: ``deepspeed_ext.zero``."""
    stage = engine.zero_optimization_stage()
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{SECTION}: the engine runs ZeRO stage {stage}; compressed averaging supports "
                          f"stages 0 to 3")
    if getattr(engine, "has_moe_layers", False):
        raise ConfigError(f"{SECTION}: MoE expert gradients are reduced over expert groups; not supported")
    if getattr(engine, "pipeline_parallelism", False):
        raise ConfigError(f"{SECTION}: pipeline parallelism is not supported")
    group = mpu.get_data_parallel_group() if mpu is not None else None
    comm = TorchDistributedComm(group)
    if stage == 0:
        reducer = DoubleSqueeze(comm, config=cfg)
        overlapped = overlap.OverlappedAllreduce(engine, reducer) if cfg.overlap and overlap.supported(engine) else None
        engine.doublesqueeze_overlap = overlapped
        patches.on(engine, "buffered_allreduce_fallback", _compressed_allreduce(engine, reducer, overlapped))
        state_dict, load_state_dict = reducer.state_dict, reducer.load_state_dict
    else:
        mapping = zero3.Zero3Compression if stage == 3 else zero.ZeroCompression
        wired = engine.doublesqueeze_zero = mapping(engine, cfg, comm)
        reducer, state_dict, load_state_dict = wired.reducer, wired.state_dict, wired.load_state_dict
    warn_if_adam(getattr(engine, "basic_optimizer", None) or engine.optimizer, cfg, "the doublesqueeze section")
    engine.doublesqueeze = reducer
    engine.doublesqueeze_comm = comm
    _wrap_checkpointing(engine, state_dict, load_state_dict, comm.rank, comm.size)
    return reducer


def _compressed_allreduce(engine, reducer: DoubleSqueeze, overlapped: "overlap.OverlappedAllreduce | None"):
    """Replaces ``engine.buffered_allreduce_fallback``: average the gradients
    DeepSpeed would have allreduced, in place, as one ``reducer.step()``.
    With ``overlapped`` most buckets were sent during backward; this waits
    for them (``deepspeed_ext.overlap``).

    A skipped step (``on_nonfinite="skip"``) skips the optimizer step on every
    rank: fp16 and bf16 engines get inf gradients, which their own overflow
    check skips; other engines' optimizer step is not called that time, and
    DeepSpeed counts it as skipped (``engine.skipped_steps``)."""
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad and p.numel() > 0]
    skip = _SkipNextStep(engine) if not (engine.fp16_enabled() or engine.bfloat16_enabled()) else None

    def skip_step(grads) -> None:
        if skip is not None:
            skip.arm()
        else:
            for g in grads:
                g.fill_(float("inf"))

    def allreduce(grads=None, elements_per_buffer=None):
        if grads is None and overlapped is not None:
            _, skipped = overlapped.finish()  # the exchange averaged the gradients in place
            if skipped:
                skip_step([p.grad for p in overlapped.params])
            return
        if grads is None:
            if hasattr(engine.optimizer, "get_grads_for_reduction"):  # bf16 optimizer: its fp32 accumulators
                grads, _ = engine.optimizer.get_grads_for_reduction()
            else:
                grads, _ = engine._get_gradients_for_reduction()
        grads = list(grads)
        for g in grads:
            if getattr(g, "is_sparse", False) or not isinstance(g, torch.Tensor):
                raise ConfigError(f"{SECTION}: sparse gradients are not supported; use dense embeddings")
        labels = names if len(names) == len(grads) else [f"grad.{i}" for i in range(len(grads))]
        with reducer.step() as step:  # reverse order: the same buckets as the overlapped exchange
            reducer.reduce_many(list(zip(labels, grads))[::-1], in_place=True)
        if step.skipped:
            skip_step(grads)
    return allreduce


class _SkipNextStep:
    """Makes the engine's next optimizer step a no-op that DeepSpeed counts
    as skipped (its ``optimizer.overflow`` signal: no scheduler step either)."""

    def __init__(self, engine):
        self.engine = engine
        self.armed = False
        optimizer = engine.optimizer

        def step(*args, **kwargs):
            if self.armed:
                self.armed = False
                optimizer.overflow = True
                return None
            optimizer.overflow = False
            return inner.previous(*args, **kwargs)
        optimizer.overflow = False
        inner = patches.on(optimizer, "step", step)

    def arm(self) -> None:
        self.armed = True


def _wrap_checkpointing(engine, state_dict, load_state_dict, rank: int, size: int | None = None) -> None:
    """``engine.save_checkpoint`` also writes, and ``load_checkpoint`` reads,
    this rank's own error memories: a file per rank, since DeepSpeed writes
    the replicated state from one rank only. ``size``: the world size; a
    checkpoint written at another one is resharded as it is read (every
    rank reads every rank's file, ``dsq_plugins.reshard``), where the state
    allows it (ZeRO's replica partitions do not: a ``StateError``)."""

    def state_file(directory: str, tag: Any, r: int = rank) -> str:
        return os.path.join(directory, str(tag), f"doublesqueeze_rank{r}.pt")

    def read_state(directory: str, tag: Any) -> Any:
        """This rank's state: its own file, or at another world size every file resharded (rank 0's says the size)."""
        first = torch.load(state_file(directory, tag, 0))
        saved_size = first.get("size", first.get("reducer", {}).get("size")) if isinstance(first, dict) else None
        if size is None or saved_size in (None, size):
            own = state_file(directory, tag)
            return (torch.load(own) if os.path.exists(own) else None) if rank else first
        every = [first] + [torch.load(state_file(directory, tag, r)) for r in range(1, saved_size)]
        if any("reducer" in s for s in every):  # a ZeRO file: the reducer's state and the replica partitions
            raise StateError(f"{state_file(directory, tag)} was saved at {saved_size} ranks; this run has {size}: "
                             f"a ZeRO checkpoint's state is laid out by partition (stages 1-2: the replica "
                             f"partitions; stage 3: the worker errors) and cannot be resharded here (load it at "
                             f"{saved_size} ranks, or reshard it offline after converting to stage 0)")
        warnings.warn(f"DoubleSqueeze state saved at {saved_size} ranks, resharded for {size} (dsq_plugins.reshard)")
        return reshard(every, size)[rank]

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        tag = tag if tag is not None else f"global_step{engine.global_steps}"
        result = save.previous(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest, **kwargs)
        path = state_file(save_dir, tag)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state_dict(), path)
        return result

    def load_checkpoint(load_dir, tag=None, **kwargs):
        result = load.previous(load_dir, tag=tag, **kwargs)
        if result[0] is None:
            return result
        if tag is None:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        path = state_file(load_dir, tag)
        state = read_state(load_dir, tag) if os.path.exists(state_file(load_dir, tag, 0)) else None
        if state is not None:
            load_state_dict(state)
        else:
            warnings.warn(f"{path} not found: DoubleSqueeze error memory starts from zero "
                          f"(a checkpoint saved without compression?)")
        return result

    save = patches.on(engine, "save_checkpoint", save_checkpoint)
    load = patches.on(engine, "load_checkpoint", load_checkpoint)


# -- install(): the section honoured by every deepspeed.initialize -------------------------------------------------


def install() -> None:
    """From now on every DeepSpeed engine honours the config's
    ``"doublesqueeze"`` section and OneBitAdam optimizer exactly as
    ``dx.initialize`` does, however it is made: ``deepspeed.initialize``
    from user code, HF Trainer, Accelerate's DeepSpeed plugin, Lightning's
    DeepSpeedStrategy. Idempotent; ``uninstall()`` (or ``with installed():``)
    undoes it. A bad section is a ``ConfigError`` when the engine is built."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    if is_installed():
        return
    original = DeepSpeedEngine.__init__

    def __init__(self, args=None, model=None, optimizer=None, model_parameters=None, *rest, **kwargs):
        config = kwargs.get("config")
        if config is None and getattr(args, "deepspeed_config", None) is not None:
            config = args.deepspeed_config
        full = load_config(config) if config is not None else {}
        check_section_name(full)
        one_bit = onebit.one_bit_section(full)
        cfg = options = None
        mpu = kwargs.get("mpu")
        if one_bit is not None and optimizer is None:
            options = onebit.compressed_adam_options(one_bit, full.get(SECTION))
            optimizer = onebit.build(model, options, full, mpu)
            if isinstance(config, dict) and not isinstance(optimizer, CompressedAdam):
                deepspeeds = onebit.deepspeed_config(full, options)
                if deepspeeds.get("zero_optimization") != full.get("zero_optimization"):
                    _set_up_for_the_section(kwargs, deepspeeds)  # stage 3 across hosts: hpZ over each host
                else:
                    kwargs["config"] = deepspeeds
        elif SECTION in full:
            deepspeeds, cfg = split_config(full)  # validated here, before DeepSpeed builds anything
            zero = deepspeeds.get("zero_optimization")
            if isinstance(config, dict) and zero is not None and zero != full.get("zero_optimization"):
                _set_up_for_the_section(kwargs, {**full, "zero_optimization": zero})
        original(self, args, model, optimizer, model_parameters, *rest, **kwargs)
        if options is not None:
            attach_one_bit(self, optimizer, options, full, mpu)
        elif cfg is not None and getattr(self, "doublesqueeze", None) is None:
            attach(self, cfg, mpu)

    __init__.__wrapped__ = original
    patches.everywhere(DeepSpeedEngine, "__init__", __init__)


def _set_up_for_the_section(kwargs: dict[str, Any], config: dict[str, Any]) -> None:
    """An engine's keyword arguments given the config the section sets up
    (at stage 3 across hosts: hpZ over each host), and the parsed config
    ``deepspeed.initialize`` made from the user's, made again from it."""
    kwargs["config"] = config
    if kwargs.get("config_class") is not None:
        from deepspeed.runtime.config import DeepSpeedConfig
        mesh = {"mesh_device": kwargs["mesh_device"]} if kwargs.get("mesh_device") is not None else {}
        kwargs["config_class"] = DeepSpeedConfig(config, kwargs.get("mpu"), **mesh)


def is_installed() -> bool:
    from deepspeed.runtime.engine import DeepSpeedEngine
    return patches.original(DeepSpeedEngine, "__init__") is not DeepSpeedEngine.__init__


def uninstall() -> None:
    """Undo ``install()``: every process-wide change deepspeed_ext made to
    DeepSpeed is put back (``patches``); engines already built keep their
    own wiring."""
    patches.restore_everywhere()


@contextlib.contextmanager
def installed():
    """``install()`` for the duration of a ``with`` block."""
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
