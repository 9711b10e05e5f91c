"""Train the byte-level GPT on the standard library's sources (examples/lm.py)
with data-parallel workers, and report test loss (nats and bits per byte),
bytes each worker sent per step (counted), and time per step.

Methods (``--method``):
  adamw            AdamW on the exact average of the gradients (the baseline)
  adamw-dsq        AdamW on DoubleSqueeze-averaged gradients (--compressor ...)
  compressed-adam  dsq.CompressedAdam: exact warm-up, then DoubleSqueeze on the momentum
  local-steps      dsq.LocalSteps around AdamW: inner steps alone, the pseudo-gradient through
                   DoubleSqueeze every --sync-every steps, an outer Nesterov step

In-process ranks (threads):
    python examples/train_lm.py --workers 4 --method compressed-adam --compressor sign
Real processes:
    torchrun --nproc_per_node 4 examples/train_lm.py --method compressed-adam
    horovodrun -np 4 -H localhost:4 python examples/train_lm.py --engine horovod --method compressed-adam
    deepspeed --num_gpus 4 examples/train_lm.py --engine deepspeed --zero-stage 2 --method compressed-adam
    torchrun --nproc_per_node 4 examples/train_lm.py --engine ddp --method compressed-adam
    torchrun --nproc_per_node 4 examples/train_lm.py --engine fsdp --mesh hsdp --method compressed-adam
(with FSDP2, fully_shard per block on a 1-D mesh or HSDP's 2 x n/2 one: adamw is FSDP's own exchange,
adamw-dsq dsq_plugins.fsdp.compress, compressed-adam dsq_plugins.fsdp.compressed_adam (HSDP);
with DeepSpeed, compressed-adam is a config written as for DeepSpeed 0.19.6's OneBitAdam, at any ZeRO
stage 0-3, and adamw is DeepSpeed's own path with a torch AdamW.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsq_plugins as dsq  # noqa: E402
from examples.common import progress, ring_allreduce_bytes  # noqa: E402
from examples.lm import GPT, GPTConfig, loss_of, test_loss, train_batch  # noqa: E402

METHODS = ("adamw", "adamw-dsq", "compressed-adam", "local-steps")
# the study's two models: 470,784 parameters (the default), and 1,563,656 (3 layers of width 200)
SIZES = {"small": GPTConfig(), "large": GPTConfig(width=200, layers=3)}


@dataclass
class LMResult:
    """What every rank returns (the same on every rank)."""

    method: str
    workers: int
    steps: int
    train_losses: list[float] = field(default_factory=list)
    test_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, test loss)
    bytes_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, bytes sent so far)
    test_loss: float = float("nan")
    bytes_per_step: float = 0.0
    bytes_per_step_after_freeze: float = 0.0
    fp32_allreduce_bytes_per_step: float = 0.0
    seconds_per_step: float = 0.0
    frozen_at: int = 0  # the step CompressedAdam's variance froze at (0: it did not)
    diverged_at: int = 0  # the step at which the run stopped on a non-finite momentum or gradient (0: it did not)
    #: two-level runs (``node_size``): bytes one host sent across its link per step after the freeze or warm-up
    #: (rank 0's cross-host bytes times the ranks of a host, whose shards differ by at most a few bytes)
    host_link_bytes_per_step_after_freeze: float = 0.0

    @property
    def bits_per_byte(self) -> float:
        return self.test_loss / math.log(2)

    def summary(self) -> str:
        ratio = self.fp32_allreduce_bytes_per_step / max(self.bytes_per_step, 1.0)
        after = self.fp32_allreduce_bytes_per_step / max(self.bytes_per_step_after_freeze, 1.0)
        return (f"{self.method}, {self.workers} workers, {self.steps} steps\n"
                f"  test loss                   {self.test_loss:.4f} nats/byte ({self.bits_per_byte:.3f} bits/byte)\n"
                f"  bytes / worker / step       {self.bytes_per_step:,.0f} (counted; {ratio:.1f}x less than an fp32 "
                f"ring allreduce), after the freeze {self.bytes_per_step_after_freeze:,.0f} ({after:.1f}x less)\n"
                f"  time / step                 {1000 * self.seconds_per_step:.1f} ms")


def make_optimizer(method: str, model: torch.nn.Module, comm: dsq.Communicator, *, lr: float, weight_decay: float,
                   freeze_step: int, compressor: str, compressor_params: dict | None, seed: int,
                   layerwise: bool = False, feedback: str = "both", betas: tuple[float, float] = (0.9, 0.999),
                   error_dtype: str = "fp32", server_compressor: str | None = None,
                   server_compressor_params: dict | None = None, node_size: int | None = None,
                   local: dict | None = None):
    """(optimizer, reducer or None): what steps the model, and what averages
    gradients in front of it (None: the optimizer exchanges itself).
    ``node_size``: hosts of that many ranks, the two-level exchange between them.
    ``local``: LocalSteps' own options (``sync_every``, ``outer_lr``, ``outer_momentum``, ``exact_steps``)."""
    named = list(model.named_parameters())
    hosts = {} if node_size is None else dict(hierarchy="node", node_size=node_size)
    if method == "compressed-adam":
        return dsq.CompressedAdam(named, comm=comm, lr=lr, betas=betas, weight_decay=weight_decay,
                                  freeze_step=freeze_step,
                                  compressor=compressor, compressor_params=compressor_params, seed=seed,
                                  server_compressor=server_compressor,
                                  server_compressor_params=server_compressor_params,
                                  layerwise=layerwise, error_feedback=feedback, error_dtype=error_dtype,
                                  **hosts), None
    opt = torch.optim.AdamW([p for _, p in named], lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)
    if method == "local-steps":
        return dsq.LocalSteps(model, opt, comm, compressor=compressor, compressor_params=compressor_params, seed=seed,
                              error_feedback=feedback, error_dtype=error_dtype, **hosts, **(local or {})), None
    if method == "adamw":
        return opt, dsq.DoubleSqueeze(comm, "none", error_feedback="none", seed=seed)
    if method == "adamw-dsq":
        return opt, dsq.DoubleSqueeze(comm, compressor, compressor_params=compressor_params, seed=seed,
                                      server_compressor=server_compressor,
                                      server_compressor_params=server_compressor_params,
                                      layerwise=layerwise, error_feedback=feedback, error_dtype=error_dtype,
                                      **hosts)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


SCHEDULES = ("constant", "cosine")


def lr_factor(schedule: str, step: int, steps: int, warmup: int = 20) -> float:
    """The learning rate at ``step`` as a fraction of the peak: 1 ("constant"),
    or a linear warm-up over ``warmup`` steps, then a cosine down to a tenth
    of the peak at the last step ("cosine", as language models are trained)."""
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < warmup:
        return (step + 1) / warmup
    progress_ = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_))


def train_lm(comm: dsq.Communicator, *, method: str = "compressed-adam", steps: int = 300, lr: float = 3e-3,
             weight_decay: float = 0.0, freeze_step: int = 40, compressor: str = "sign",
             compressor_params: dict | None = None, batch: int = 16, seed: int = 0, eval_every: int = 50,
             layerwise: bool = False, feedback: str = "both", betas: tuple[float, float] = (0.9, 0.999),
             gpt: GPTConfig = GPTConfig(), error_dtype: str = "fp32", server_compressor: str | None = None,
             server_compressor_params: dict | None = None, node_size: int | None = None,
             local: dict | None = None, schedule: str = "constant", show_progress: bool = False) -> LMResult:
    """Train on ``comm``'s ranks; returns the same LMResult on every rank.
    ``schedule``: the learning rate over the run ("constant", or "cosine": see ``lr_factor``)."""
    model = GPT(gpt, seed=seed)
    opt, reducer = make_optimizer(method, model, comm, lr=lr, weight_decay=weight_decay, freeze_step=freeze_step,
                                  compressor=compressor, compressor_params=compressor_params, seed=seed,
                                  layerwise=layerwise, feedback=feedback, betas=betas, error_dtype=error_dtype,
                                  server_compressor=server_compressor,
                                  server_compressor_params=server_compressor_params, node_size=node_size,
                                  local=local)
    named = list(model.named_parameters())
    numel = sum(p.numel() for _, p in named)
    result = LMResult(method, comm.size, steps, fp32_allreduce_bytes_per_step=ring_allreduce_bytes(numel, comm.size))
    bar = progress(steps, show_progress and comm.rank == 0, desc=method)
    comm.reset_counters()
    exchange = reducer if reducer is not None else getattr(opt, "reducer", None)
    cross = getattr(exchange, "cross_comm", None)  # the host link (two-level runs)
    crossed = lambda: cross.bytes_sent if cross is not None else 0  # noqa: E731
    sent_at_freeze, crossed_at_freeze, frozen_at, start = None, 0, None, time.perf_counter()
    for step in range(steps):
        inputs, targets = train_batch(seed, comm.rank, step, batch, gpt.context)
        loss = loss_of(model, inputs, targets)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if schedule != "constant":
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor(schedule, step, steps)
        try:
            if reducer is not None:
                averaged = reducer.reduce_many([(n, p.grad) for n, p in named])
                for (_, p), g in zip(named, averaged):
                    p.grad.copy_(g)
            opt.step()
        except dsq.NonFiniteGradientError:  # the same on every rank: the run diverged here
            result.diverged_at = step + 1
            break
        result.train_losses.append(loss.item())
        # CompressedAdam's variance froze at this step, or LocalSteps' exact warm-up ended
        if frozen_at is None and (getattr(opt, "frozen", False) or getattr(opt, "warmed_up", False)):
            frozen_at, sent_at_freeze, crossed_at_freeze = step + 1, comm.bytes_sent, crossed()
        if step + 1 == steps and hasattr(opt, "finish"):
            opt.finish()  # LocalSteps' overlapped sync in flight: the run ends on it
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            result.test_curve.append((step + 1, test_loss(model)))
            result.bytes_curve.append((step + 1, comm.bytes_sent))
        if bar is not None:
            bar.update()
            if step % 10 == 9:
                bar.set_postfix(loss=f"{sum(result.train_losses[-10:]) / 10:.3f}")
    if bar is not None:
        bar.close()
    result.seconds_per_step = (time.perf_counter() - start) / steps
    if result.diverged_at:
        result.test_loss = result.bytes_per_step = result.bytes_per_step_after_freeze = float("nan")
        return result
    result.test_loss = result.test_curve[-1][1]
    result.bytes_per_step = comm.bytes_sent / steps
    result.frozen_at = frozen_at or 0
    if frozen_at is not None and steps > frozen_at:
        result.bytes_per_step_after_freeze = (comm.bytes_sent - sent_at_freeze) / (steps - frozen_at)
        if cross is not None:
            crossed_after = (crossed() - crossed_at_freeze) / (steps - frozen_at)
            result.host_link_bytes_per_step_after_freeze = comm.size // cross.size * crossed_after
    else:
        result.bytes_per_step_after_freeze = result.bytes_per_step
    return result


def train_lm_deepspeed(*, method: str = "compressed-adam", stage: int = 2, steps: int = 300, lr: float = 3e-3,
                       weight_decay: float = 0.0, freeze_step: int | str = 40, compressor: str = "sign",
                       compressor_params: dict | None = None, batch: int = 16, seed: int = 0, eval_every: int = 50,
                       betas: tuple[float, float] = (0.9, 0.999), error_dtype: str = "fp32",
                       gpt: GPTConfig = GPTConfig(), show_progress: bool = False, node_size: int | None = None,
                       **_: object) -> LMResult:
    """The same training under the deepspeed launcher: ``adamw`` is
    DeepSpeed's own path (its bytes are an fp32 allreduce's, not counted
    here), ``compressed-adam`` a OneBitAdam config (at ZeRO 1-3 the optimizer
    state stays partitioned: ``deepspeed_ext.zero_adam``, ``zero3_adam``). ``node_size``:
    the ranks as hosts of this many (two levels; at stage 3 both passes
    compressed between them), where "flat" stands for hosts otherwise."""
    import torch.distributed as dist

    import deepspeed_ext as dx
    model = GPT(gpt, seed=seed)
    numel = sum(p.numel() for p in model.parameters())  # (before ZeRO-3 partitions them)
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0}
    section = {"compressor": compressor, "compressor_params": compressor_params, "error_dtype": error_dtype}
    hosts = {} if node_size is None else {"hierarchy": "node", "node_size": node_size}
    if method == "compressed-adam":
        config["optimizer"] = {"type": "OneBitAdam", "params": {"lr": lr, "betas": list(betas), "eps": 1e-8,
                                                                "weight_decay": weight_decay,
                                                                "freeze_step": freeze_step}}
        config["doublesqueeze"] = {**section, **hosts}
        engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), config=config)
    elif method in ("adamw", "adamw-dsq"):
        if method == "adamw-dsq":  # AdamW on compressed gradients, as one host standing for several ("flat")
            config["doublesqueeze"] = {**section, **(hosts or {"hierarchy": "flat"})}
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
        engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), optimizer=opt, config=config)
    else:
        raise ValueError(f"with --engine deepspeed, method must be adamw, adamw-dsq or compressed-adam: {method!r}")
    rank, size = dist.get_rank(), dist.get_world_size()
    result = LMResult(method, size, steps, fp32_allreduce_bytes_per_step=ring_allreduce_bytes(numel, size))
    comm = getattr(engine, "doublesqueeze_comm", None)
    sent = (lambda: comm.bytes_sent) if comm is not None else (lambda: 0.0)  # noqa: E731
    wired = getattr(engine, "doublesqueeze_zero", None) or getattr(engine, "compressed_adam", None)
    bar = progress(steps, show_progress and rank == 0, desc=f"{method}, ZeRO-{stage}")
    sent_at_freeze, frozen_at, start = None, None, time.perf_counter()
    for step in range(steps):
        inputs, targets = train_batch(seed, rank, step, batch, gpt.context)
        loss = loss_of(engine, inputs, targets)
        engine.backward(loss)
        engine.step()
        result.train_losses.append(loss.item())
        if frozen_at is None and getattr(wired, "frozen", False):
            frozen_at, sent_at_freeze = step + 1, sent()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            result.test_curve.append((step + 1, test_loss(model)))
            result.bytes_curve.append((step + 1, sent() if comm is not None else
                                       (step + 1) * result.fp32_allreduce_bytes_per_step))
        if bar is not None:
            bar.update()
    result.seconds_per_step = (time.perf_counter() - start) / steps
    result.test_loss = result.test_curve[-1][1]
    result.bytes_per_step = sent() / steps if comm is not None else result.fp32_allreduce_bytes_per_step
    result.frozen_at = frozen_at or 0
    if frozen_at is not None and steps > frozen_at:
        result.bytes_per_step_after_freeze = (sent() - sent_at_freeze) / (steps - frozen_at)
    else:
        result.bytes_per_step_after_freeze = result.bytes_per_step
    return result


def train_lm_ddp(*, method: str = "adamw", hook: str = "allreduce", steps: int = 300,
                 lr: float = 3e-3, weight_decay: float = 0.0, freeze_step: int = 40, compressor: str = "sign",
                 compressor_params: dict | None = None, batch: int = 16, seed: int = 0, eval_every: int = 50,
                 betas: tuple[float, float] = (0.9, 0.999), error_dtype: str = "fp32",
                 gpt: GPTConfig = GPTConfig(), show_progress: bool = False, **_: object) -> LMResult:
    """The same training with PyTorch DDP (torchrun): ``adamw`` behind DDP's
    allreduce (``hook="allreduce"``) or this library's hook (``"dsq"``, exact
    for its first ``freeze_step`` steps), torch's PowerSGD hook at rank r
    (``hook="powersgd<r>"``, plain allreduce for its first ``freeze_step``
    steps, then error feedback and warm start as torch defaults them), or
    ``compressed-adam`` (``dsq_plugins.ddp.compressed_adam``)."""
    import torch.distributed as dist
    model = GPT(gpt, seed=seed)
    # PowerSGD issues its second allreduce from the first one's completion
    # callback; on gloo those callbacks of several buckets run in different
    # orders on different ranks, so it gets one bucket (as bench.slowlink)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=64 if hook.startswith("powersgd") else None)
    rank, size = dist.get_rank(), dist.get_world_size()
    numel = sum(p.numel() for p in model.parameters())
    fp32 = ring_allreduce_bytes(numel, size)
    result = LMResult(method if method == "compressed-adam" else f"{method}/{hook}", size, steps,
                      fp32_allreduce_bytes_per_step=fp32)
    opt, sent = ddp_optimizer(ddp, method, hook, fp32, size, lr=lr, betas=betas, weight_decay=weight_decay,
                              freeze_step=freeze_step, compressor=compressor, compressor_params=compressor_params,
                              seed=seed, error_dtype=error_dtype)
    return _run_steps(result, ddp, opt, sent, steps=steps, freeze_step=freeze_step, batch=batch, seed=seed,
                      eval_every=eval_every, gpt=gpt, rank=rank, show_progress=show_progress,
                      frozen=method == "compressed-adam" or hook == "dsq", set_to_none=False, evaluate=model)


def train_lm_fsdp(*, method: str = "adamw", mesh: str = "hsdp", steps: int = 300, lr: float = 3e-3,
                  weight_decay: float = 0.0, freeze_step: int = 40, compressor: str = "sign",
                  compressor_params: dict | None = None, batch: int = 16, seed: int = 0, eval_every: int = 50,
                  betas: tuple[float, float] = (0.9, 0.999), error_dtype: str = "int8",
                  gpt: GPTConfig = GPTConfig(), show_progress: bool = False, **_: object) -> LMResult:
    """The same training with FSDP2 (torchrun): every block and the model
    ``fully_shard``-ed on a 1-D mesh or on HSDP's (2, n/2) mesh (2 replicas).
    ``adamw``: FSDP's own exchange; ``adamw-dsq``: ``dsq_plugins.fsdp.compress``
    (exact for its first ``freeze_step`` steps, as the DDP hook's rows);
    ``compressed-adam``: ``dsq_plugins.fsdp.compressed_adam``. Bytes are the
    gradient exchange's per rank (FSDP's parameter all-gathers, the same in
    every method, are not counted; under HSDP, neither is the exact
    reduce-scatter inside the shard group: the bytes are what crosses the
    replicate dimension, the hosts' link)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dsq_plugins.fsdp as dsq_fsdp
    rank, size = dist.get_rank(), dist.get_world_size()
    shape = (size,) if mesh == "1d" else (2, size // 2)
    device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("shard",) if mesh == "1d" else ("replicate", "shard"))
    model = GPT(gpt, seed=seed)
    numel = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    # FSDP's own gradient exchange per rank: the reduce-scatter (1-D), or HSDP's ring allreduce of the shard
    exact = 4 * numel * (size - 1) / size if mesh == "1d" else ring_allreduce_bytes(numel // shape[1], shape[0])
    label = {"adamw": "adamw/fsdp", "adamw-dsq": "adamw/fsdp-dsq", "compressed-adam": "compressed-adam/fsdp"}
    result = LMResult(f"{label[method]}-{mesh}", size, steps, fp32_allreduce_bytes_per_step=exact)
    options = dict(compressor=compressor, compressor_params=compressor_params, seed=seed, error_dtype=error_dtype)
    if method == "compressed-adam":
        opt = dsq_fsdp.compressed_adam(model, lr=lr, betas=betas, weight_decay=weight_decay, freeze_step=freeze_step,
                                       **options)
        sent = lambda step: opt.comm.bytes_sent  # noqa: E731
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)
        sent = lambda step: step * exact  # noqa: E731
        if method == "adamw-dsq":
            compression = dsq_fsdp.compress(model, exact_steps=freeze_step, **options)
            sent = lambda step: compression.bytes_sent  # noqa: E731
    return _run_steps(result, model, opt, sent, steps=steps, freeze_step=freeze_step, batch=batch, seed=seed,
                      eval_every=eval_every, gpt=gpt, rank=rank, show_progress=show_progress,
                      frozen=method != "adamw")


def _run_steps(result: LMResult, model: torch.nn.Module, opt, sent, *, steps: int, freeze_step: int | str, batch: int,
               seed: int, eval_every: int, gpt: GPTConfig, rank: int, show_progress: bool, frozen: bool,
               set_to_none: bool = True, evaluate: torch.nn.Module | None = None) -> LMResult:
    """The training loop under a launcher: this rank's batches, test loss of
    ``evaluate`` (default: ``model``) every ``eval_every`` steps (every rank
    evaluates: a sharded model's forward is collective), bytes from ``sent(step)``.
    ``freeze_step="auto"``: the step the optimizer says it froze at."""
    bar = progress(steps, show_progress and rank == 0, desc=result.method)
    sent_at_freeze, start = 0.0, time.perf_counter()
    auto = freeze_step == "auto"
    freeze_step = steps if auto else freeze_step
    for step in range(steps):
        inputs, targets = train_batch(seed, rank, step, batch, gpt.context)
        loss = loss_of(model, inputs, targets)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        result.train_losses.append(loss.item())
        if auto and getattr(opt, "freeze_step", None) == step + 1:
            freeze_step = step + 1
        if step + 1 == freeze_step:
            sent_at_freeze = sent(step + 1)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            with torch.no_grad():
                result.test_curve.append((step + 1, test_loss(model if evaluate is None else evaluate)))
            result.bytes_curve.append((step + 1, sent(step + 1)))
        if bar is not None:
            bar.update()
    result.seconds_per_step = (time.perf_counter() - start) / steps
    result.test_loss = result.test_curve[-1][1]
    result.bytes_per_step = sent(steps) / steps
    result.frozen_at = freeze_step if frozen else 0
    result.bytes_per_step_after_freeze = ((sent(steps) - sent_at_freeze) / (steps - freeze_step)
                                          if steps > freeze_step else result.bytes_per_step)
    return result


def ddp_optimizer(ddp: torch.nn.Module, method: str, hook: str, fp32_bytes: float, size: int, *, lr: float,
                  betas: tuple[float, float], weight_decay: float, freeze_step: int, compressor: str,
                  compressor_params: dict | None, seed: int, error_dtype: str):
    """The optimizer of ``train_lm_ddp`` with its exchange wired into ``ddp``,
    and the function of the step that says the bytes each worker has sent."""
    import dsq_plugins.ddp as dsq_ddp
    if method == "compressed-adam":
        opt = dsq_ddp.compressed_adam(ddp, lr=lr, betas=betas, weight_decay=weight_decay, freeze_step=freeze_step,
                                      compressor=compressor, compressor_params=compressor_params, seed=seed,
                                      error_dtype=error_dtype)
        return opt, lambda step: opt.comm.bytes_sent
    opt = torch.optim.AdamW(ddp.module.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)
    if hook == "dsq":
        state = dsq_ddp.HookState(compressor=compressor, compressor_params=compressor_params, seed=seed,
                                  exact_steps=freeze_step, error_dtype=error_dtype)
        ddp.register_comm_hook(state, dsq_ddp.hook)
        return opt, lambda step: state.bytes_sent
    if hook.startswith("powersgd"):
        return opt, powersgd(ddp, int(hook[len("powersgd"):]), freeze_step, fp32_bytes, size)
    return opt, lambda step: step * fp32_bytes


def powersgd(ddp: torch.nn.Module, rank: int, start: int, fp32_bytes: float, size: int):
    """Register torch's PowerSGD hook at ``rank`` on ``ddp``; the function of
    the step that says the bytes each worker has sent: a ring allreduce of
    every gradient until ``start``, then of the elements PowerSGD's own state
    counts (its P and Q factors, and the tensors it leaves uncompressed)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=start)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return lambda step: fp32_bytes * min(step, start) + ring_allreduce_bytes(state.total_numel_after_compression,
                                                                                size)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="compressed-adam", choices=METHODS)
    p.add_argument("--compressor", default="sign", choices=list(dsq.COMPRESSORS))
    p.add_argument("--ratio", type=float, default=None, help="top-k / random-k fraction kept")
    p.add_argument("--scale", default=None, choices=["mean", "rms"], help="sign's scale")
    p.add_argument("--layerwise", action="store_true", help="each tensor its own bucket (and scale)")
    p.add_argument("--feedback", default="both", choices=["both", "ef21", "worker", "none"],
                   help="error feedback of the exchange (the momentum's, for compressed-adam)")
    p.add_argument("--engine", default=None, choices=["torch", "horovod", "deepspeed", "ddp", "fsdp"],
                   help="under a launcher: torch.distributed (torchrun), Horovod (horovodrun), DeepSpeed, or "
                        "PyTorch DDP or FSDP2 (torchrun)")
    p.add_argument("--mesh", default="hsdp", choices=["1d", "hsdp"],
                   help="--engine fsdp: a 1-D mesh of every rank, or HSDP's (2 replicas, n/2 shards)")
    p.add_argument("--ddp-hook", default="allreduce",
                   choices=["allreduce", "dsq", "powersgd1", "powersgd2", "powersgd4"],
                   help="--engine ddp with --method adamw: DDP's allreduce, this library's hook, or torch's "
                        "PowerSGD hook at rank 1, 2 or 4")
    p.add_argument("--rank", type=int, default=None, help="the lowrank compressor's rank")
    p.add_argument("--iterations", type=int, default=None, help="the lowrank compressor's power iterations")
    p.add_argument("--factors", default=None, choices=["fp32", "bf16", "fp16"],
                   help="the lowrank compressor's factor dtype")
    p.add_argument("--warm-start", default=None, choices=["basis", "served", "own"],
                   help="the lowrank compressor's warm start: the bases the owner served (every rank projects onto "
                        "them), the Q the owner served (one for all), or its own")
    p.add_argument("--zero-stage", type=int, default=0, help="--engine deepspeed: the ZeRO stage")
    p.add_argument("--error-dtype", default="fp32", choices=["fp32", "bf16", "int8"])
    p.add_argument("--node-size", type=int, default=None,
                   help="--engine deepspeed, --method adamw-dsq or compressed-adam: the ranks as hosts of this many "
                        "(two levels)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--schedule", default="constant", choices=SCHEDULES,
                   help="the learning rate over the run (in-process and torchrun runs of train_lm)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--freeze-step", type=lambda v: v if v == "auto" else int(v), default=40)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4, help="in-process ranks when not under a launcher")
    p.add_argument("--json", default=None, help="write the result (rank 0) to this file")
    p.add_argument("--size", default="small", choices=list(SIZES),
                   help="the model: small (470,784 parameters) or large (1,563,656)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    params = {k: v for k, v in (("ratio", args.ratio), ("scale", args.scale), ("rank", args.rank),
                                ("factors", args.factors), ("warm_start", args.warm_start),
                                ("iterations", args.iterations))
              if v is not None} or None
    kw = dict(method=args.method, steps=args.steps, lr=args.lr, weight_decay=args.weight_decay,
              freeze_step=args.freeze_step, compressor=args.compressor, compressor_params=params, batch=args.batch,
              seed=args.seed, layerwise=args.layerwise, feedback=args.feedback, betas=(0.9, args.beta2),
              error_dtype=args.error_dtype, eval_every=args.eval_every, gpt=SIZES[args.size], show_progress=True)
    torch.set_num_threads(1)
    engine = args.engine or ("horovod" if "HOROVOD_RANK" in os.environ else "torch" if "RANK" in os.environ else None)
    if args.schedule != "constant" and engine in ("ddp", "fsdp", "deepspeed"):
        raise SystemExit(f"--schedule {args.schedule}: only the in-process, torchrun and horovod runs take a schedule")
    finish = None
    if engine in ("ddp", "fsdp"):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if engine == "fsdp":
            result = train_lm_fsdp(mesh=args.mesh, **kw)
        else:
            result = train_lm_ddp(hook=args.ddp_hook, **kw)
        comm = dsq.TorchDistributedComm()

        def finish():
            dist.barrier()
            dist.destroy_process_group()
    elif engine == "deepspeed":
        import torch.distributed as dist
        result = train_lm_deepspeed(stage=args.zero_stage, node_size=args.node_size, **kw)
        comm = dsq.TorchDistributedComm()

        def finish():
            dist.barrier()
    elif engine == "horovod":
        import horovod.torch as hvd

        import horovod_ext as hx
        hvd.init()
        comm = hx.HorovodComm()
        result = train_lm(comm, schedule=args.schedule, **kw)
    elif engine == "torch":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        comm = dsq.TorchDistributedComm()
        result = train_lm(comm, schedule=args.schedule, **kw)

        def finish():
            dist.barrier()  # nobody tears gloo down while a peer's last sends are in flight
            dist.destroy_process_group()
    else:
        comm = None
        result = dsq.LocalGroup(args.workers).run(lambda c: train_lm(c, schedule=args.schedule, **kw))[0]
    if comm is None or comm.rank == 0:
        print(result.summary())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(asdict(result), f)
    if finish is not None:
        finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
