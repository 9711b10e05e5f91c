"""One rank of the two-host benchmark (``bench/hosts.py`` starts it, one
torchrun per host: ``--nnodes 2 --node_rank i``).

Every system trains the large byte-level GPT (examples/lm.py, 1.56M
parameters) with AdamW on the same batches; only the gradient exchange
differs. Rank 0 times whole steps and reads its host's side of the link
(the veth named by ``GLOO_SOCKET_IFNAME``) before and after the timed steps:
what crossed it, both ways, is every byte between the hosts.

Systems: ``ddp-allreduce`` (DDP's own fp32 allreduce), ``ddp-powersgd4``
(torch's PowerSGD hook, rank 4), ``ddp-dsq-sign-flat`` and ``ddp-dsq-sign``
(this project's DDP hook, hierarchy "flat" and the default "auto"), and
``ds-dsq-sign-flat`` / ``ds-dsq-sign`` (the DeepSpeed section at ZeRO
stage 0, under torchrun). At ZeRO-2: ``ds-zero2-adamw`` (DeepSpeed's own
reduce-scatter and all-gather) and ``ds-zero2-cadam-sign-flat`` /
``ds-zero2-cadam-sign`` (CompressedAdam, a OneBitAdam config, frozen before
the timed steps: the ZeRO-1/2 mapping, flat or "auto"). At ZeRO-3: ``ds-zero3-adamw``
(DeepSpeed's own), ``ds-zero3-hpz`` (DeepSpeed's hpZ: a secondary copy of the weights sharded inside each
host, ``zero_hpz_partition_size`` = the ranks per host), ``ds-zero3-zeropp`` (ZeRO++: hpZ with qwZ's int8
weights and qgZ's int4 gradients), ``ds-zero3-dsq-sign-flat`` / ``ds-zero3-dsq-sign`` (the section:
flat, the gradient pass; "auto", both passes between the hosts) and ``ds-zero3-onebit-sign`` (a OneBitAdam
config at stage 3, frozen before the timed steps: ``deepspeed_ext.zero3_adam``).
``--zero3-regather`` has ZeRO-3 release every parameter after use and gather it again in backward, as
a model too large to keep them does (hpZ saves nothing otherwise on a model this small).
FSDP2, every block and the model ``fully_shard``-ed:
``fsdp-own`` / ``fsdp-dsq-sign`` on a 1-D mesh of every rank (FSDP's
reduce-scatter, or ``dsq_plugins.fsdp.compress``: two-level across the
hosts by default), and HSDP with the shard dimension inside a host and the
replicate dimension across: ``hsdp-own`` (FSDP's replicate all-reduce),
``hsdp-dsq-sign`` (``compress``) and ``hsdp-cadam-sign``
(``compressed_adam``, frozen before the timed steps). Local steps:
``local-sign-h20`` (``dsq.LocalSteps`` with its defaults, a sync every 20
steps: one DiLoCo worker per host, exact inside it, sign between hosts) and
``local-sign-h20-alone`` (every rank alone, the same two-level sync); their
warm-up and timed steps are whole periods of 20, and their time per step is
a period's (its inner steps and its sync) over 20.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.lm import GPT, loss_of, train_batch  # noqa: E402
from examples.train_lm import SIZES  # noqa: E402

SYSTEMS = ("ddp-allreduce", "ddp-powersgd4", "ddp-dsq-sign-flat", "ddp-dsq-sign", "ds-dsq-sign-flat", "ds-dsq-sign",
           "ds-zero2-adamw", "ds-zero2-cadam-sign-flat", "ds-zero2-cadam-sign",
           "ds-zero3-adamw", "ds-zero3-hpz", "ds-zero3-zeropp", "ds-zero3-dsq-sign-flat", "ds-zero3-dsq-sign",
           "ds-zero3-onebit-sign", "fsdp-own", "fsdp-dsq-sign", "hsdp-own", "hsdp-dsq-sign", "hsdp-cadam-sign",
           "local-sign-h20", "local-sign-h20-alone")
LOCAL_H = 20  # the local-steps systems' sync_every
BATCH, CONTEXT = 8, 64


def link_bytes() -> int:
    """Bytes this host's end of the link sent and received so far."""
    base = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics"
    return sum(int(open(f"{base}/{side}_bytes").read()) for side in ("tx", "rx"))


def ddp_system(system: str, model: nn.Module, bucket_mb: float, verdict: str = "auto"):
    """The DDP model, its optimizer, and the reducer (ours) to report on."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import dsq_plugins.ddp as dsq_ddp
    # ours in 4 MB buckets, averaged during backward; torch's paths in one bucket: PowerSGD issues its second
    # allreduce from the first one's callback, and on gloo several buckets' callbacks can run in different
    # orders on different ranks, which mismatches the collectives (bench/slowlink_worker.py says the same)
    ours = system.startswith("ddp-dsq-")
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb if ours else 64)
    state = None
    if system == "ddp-powersgd4":
        ddp.register_comm_hook(powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                      start_powerSGD_iter=2), powersgd.powerSGD_hook)
    elif system.startswith("ddp-dsq-"):
        state = dsq_ddp.HookState(compressor="sign", hierarchy="flat" if system.endswith("-flat") else "auto",
                                  verdict=verdict)
        ddp.register_comm_hook(state, dsq_ddp.hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad()
        loss_of(ddp, x, y).backward()
        opt.step()
    return step, (lambda: state.reducer) if state is not None else (lambda: None)


def deepspeed_system(system: str, model: nn.Module, bucket_mb: float, regather: bool = False):
    import deepspeed_ext as dx
    section = {"compressor": "sign", "hierarchy": "flat" if system.endswith("-flat") else "auto",
               "bucket_mb": bucket_mb}
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 0}, "doublesqueeze": section}
    if system.startswith("ds-zero3-"):  # gradient buckets of about bucket_mb, as the section's own
        config["zero_optimization"] = {"stage": 3, "reduce_bucket_size": int(bucket_mb * 2**20 / 4)}
        if regather:  # as with a model too large to keep: every parameter released after use, gathered again
            config["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_max_live_parameters=0,
                                               stage3_param_persistence_threshold=0)
        del section["bucket_mb"]
        if system in ("ds-zero3-adamw", "ds-zero3-hpz", "ds-zero3-zeropp"):  # DeepSpeed's own passes
            del config["doublesqueeze"]
        if system in ("ds-zero3-hpz", "ds-zero3-zeropp"):
            config["zero_optimization"]["zero_hpz_partition_size"] = int(os.environ["LOCAL_WORLD_SIZE"])
        if system == "ds-zero3-zeropp":
            config["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True)
        if system == "ds-zero3-onebit-sign":  # frozen before the timed steps: the momentum's two passes
            config["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}
    if system.startswith("ds-zero2-"):
        config["zero_optimization"]["stage"] = 2
        if system == "ds-zero2-adamw":
            del config["doublesqueeze"]
        else:  # the OneBitAdam section: the momentum's compression, no bucket size
            del section["bucket_mb"]
            config["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}
    engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x, y):
        engine.backward(loss_of(engine, x, y))
        engine.step()
    wired = getattr(engine, "doublesqueeze_zero", None)
    return step, lambda: wired.reducer if wired is not None else getattr(engine, "doublesqueeze", None)


def fsdp_system(system: str, model: nn.Module, bucket_mb: float):
    """FSDP2 on a 1-D mesh or HSDP (replicate across the hosts, shard inside), with FSDP's own exchange or ours."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dsq_plugins.fsdp as dsq_fsdp
    size, per_host = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (size,)) if system.startswith("fsdp-") else init_device_mesh(
        "cpu", (size // per_host, per_host), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    reducer = None
    if system == "hsdp-cadam-sign":
        opt = dsq_fsdp.compressed_adam(model, lr=1e-3, freeze_step=2, compressor="sign", bucket_mb=bucket_mb)
        reducer = opt.compressed
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if system.endswith("-dsq-sign"):
            reducer = dsq_fsdp.compress(model, "sign", bucket_mb=bucket_mb).reducer

    def step(x, y):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return step, lambda: reducer


def local_system(system: str, model: nn.Module, bucket_mb: float):
    """LocalSteps around AdamW: one worker per host (its defaults on several hosts), or every rank alone."""
    import dsq_plugins as dsq
    opt = dsq.LocalSteps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=LOCAL_H,
                         inside_host="alone" if system.endswith("-alone") else None, bucket_mb=bucket_mb,
                         exact_steps=0)  # (step times after the warm-up)

    def step(x, y):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return step, lambda: opt.reducer


def layout(system: str, reducer) -> str:
    """How the system's exchange is laid out over the hosts, in words."""
    if system.startswith("hsdp-"):
        return "HSDP: exact inside a host, " + ("FSDP's allreduce" if reducer is None else "DoubleSqueeze") + \
            " across"
    if system in ("ds-zero3-hpz", "ds-zero3-zeropp"):
        return "hpZ: weights re-sharded inside each host" + (", int8 weights, int4 gradients" if
                                                              system.endswith("zeropp") else "")
    if reducer is None:
        return "—"
    hosts = reducer.hosts.describe()
    words = f"two-level ({hosts['hosts']}×{hosts['per_host']})" if reducer.hosts.two_level else "flat"
    if system.startswith("local-"):
        words += ", every rank alone" if system.endswith("-alone") else ", one worker per host"
    return words


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True, help="rank 0 appends one JSON line here")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="our systems' buckets")
    p.add_argument("--verdict", default="auto", help="the DDP hook's")
    p.add_argument("--zero3-regather", action="store_true", help="ZeRO-3 keeps no gathered parameter")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = GPT(SIZES["large"])
    build = deepspeed_system if args.system.startswith("ds-") else (
        fsdp_system if args.system.startswith(("fsdp-", "hsdp-")) else (
            local_system if args.system.startswith("local-") else ddp_system))
    local = args.system.startswith("local-")
    if local:  # whole periods: every timed period holds its sync
        args.warmup, args.steps = (-(-n // LOCAL_H) * LOCAL_H for n in (args.warmup, args.steps))
    options = {"verdict": args.verdict} if build is ddp_system else (
        {"regather": args.zero3_regather} if build is deepspeed_system else {})
    step, reducer = build(args.system, model, args.bucket_mb, **options)
    batches = [train_batch(0, rank, t, BATCH, CONTEXT) for t in range(args.warmup + args.steps)]
    for x, y in batches[:args.warmup]:
        step(x, y)
    dist.barrier()
    before, times = link_bytes(), []
    for x, y in batches[args.warmup:]:
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    dist.barrier()  # both hosts done: every byte of the timed steps has crossed
    crossed = link_bytes() - before
    r = reducer()
    if rank == 0:
        per_step = sum(times) / len(times) if local else statistics.median(times)  # a period's over H for local
        record = {"system": args.system, "size": dist.get_world_size(), "verdict": args.verdict,
                  "zero3_regather": args.zero3_regather,
                  "params": sum(p.numel() for p in model.parameters()), "median_s": per_step,
                  "times_s": times, "link_bytes_per_step": crossed / args.steps,
                  "two_level": None if r is None else r.hosts.two_level,
                  "hosts": None if r is None else r.hosts.describe(), "layout": layout(args.system, r)}
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
