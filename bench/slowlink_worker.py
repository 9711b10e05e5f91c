"""One rank of the slow-link step-time benchmark (``bench/slowlink.py`` starts it).

Every system trains the same 12.0M-parameter model on the same synthetic
batch with plain SGD, so the only thing that differs between runs is how the
gradients are exchanged. Rank 0 times whole steps (zero_grad, forward,
backward, the exchange, the update) and writes a JSON line to ``--out``.

Systems: ``horovod-none``/``horovod-fp16`` (Horovod's own compressors),
``deepspeed`` (plain DeepSpeed, fp32 allreduce), ``ddp-powersgd2``/``-4`` and
``ddp-fp16`` (torch DDP communication hooks), ``ddp-dsq-<c>`` (this project's DDP hook,
c in sign, blocksign, lowrank1), ``hvd-dsq-<c>`` (this project's
drop-in Horovod optimizer; ``hvd-torch-dsq-<c>`` the same with
``transport="torch"``: payloads on a torch.distributed group) and ``ds-dsq-<c>`` (this project's DeepSpeed
section), for c in sign, topk, qsgd, blocksign (block 32: a quarter bit per element), lowrank1/4
and randomsign (a quarter of the signs). ``ddp-none`` is DDP's own fp32 allreduce, and
``local-<c>-h<H>`` is ``dsq.LocalSteps`` (no DDP) syncing every H steps with compressor c (``none``: the
exact control), timed over whole periods; ``-f4``: 4 fragments synced in turn, ``-ov<k>``: each sync
overlapped with the next k inner steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH = 8
# a system's suffix: (compressor, its parameters); blocksign16 is the block size that keeps digits within a
# point of sign (docs/results/convergence.md, "Below one bit per element"), at twice block 32's bytes
OURS = {"sign": ("sign", {}), "topk": ("topk", {"ratio": 0.01}), "qsgd": ("qsgd", {}),
        "blocksign": ("blocksign", {}), "blocksign16": ("blocksign", {"block": 16}),
        "lowrank1": ("lowrank", {"rank": 1, "factors": "fp32"}),  # fp32: the default when measured (bf16 since)
        "lowrank4": ("lowrank", {"rank": 4, "factors": "fp32"}),
        "randomsign": ("randomsign", {"ratio": 0.25})}  # a quarter of the signs: blocksign's bytes
# through this project's DDP hook (dsq_plugins.ddp), beside torch's own hooks
DDP_OURS = {"sign": ("sign", {}), "blocksign": ("blocksign", {}),
            "lowrank1": ("lowrank", {"rank": 1, "factors": "fp32"}),
            "lowrank4": ("lowrank", {"rank": 4, "factors": "fp32"})}
# dsq.LocalSteps (no DDP): a system's suffix: (compressor, its parameters, sync_every); "none" is the exact
# control (local steps with a plain fp32 average), sign LocalSteps' default
# ... and the 4th, where given, LocalSteps' other options: f4, 4 fragments synced in turn (Streaming DiLoCo),
# ov<k>, each sync beside the next k inner steps
LOCAL = {"none-h20": ("none", None, 20), "sign-h20": ("sign", None, 20), "sign-h50": ("sign", None, 50),
         "sign-h20-ov20": ("sign", None, 20, dict(overlap_steps=20)),
         "sign-h20-f4": ("sign", None, 20, dict(fragments=4)),
         "sign-h20-f4-ov5": ("sign", None, 20, dict(fragments=4, overlap_steps=5))}
SYSTEMS = (["horovod-none", "horovod-fp16", "deepspeed", "ddp-none", "ddp-powersgd2", "ddp-powersgd4", "ddp-fp16"]
           + [f"hvd-dsq-{c}" for c in OURS] + [f"hvd-torch-dsq-{c}" for c in OURS] + [f"ds-dsq-{c}" for c in OURS]
           + [f"ddp-dsq-{c}" for c in DDP_OURS] + [f"local-{c}" for c in LOCAL])


def make_model(seed: int = 0) -> nn.Module:
    """An MLP of 12.0M parameters in five weight matrices and their biases:
    big enough that the exchange, not the arithmetic, dominates a slow link,
    small enough for four ranks to step on two CPU cores."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 1536), nn.ReLU(), nn.Linear(1536, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(),
                         nn.Linear(1024, 1000))


def synthetic_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(BATCH, 1024, generator=g), torch.randint(0, 1000, (BATCH,), generator=g)


def timed_steps(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def bytes_per_step(comm, args) -> int | None:
    """What our communicator counted per step (warm-up included), or None for the engines' own paths."""
    return comm.bytes_sent // (args.warmup + args.steps) if comm is not None else None


def run_horovod(system: str, model: nn.Module, args) -> tuple[int, int, list[float], int | None]:
    import horovod.torch as hvd
    hvd.init()
    rank = hvd.rank()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    comm = None
    if system.startswith(("hvd-dsq-", "hvd-torch-dsq-")):
        import horovod_ext as hx
        name, params = OURS[system.split("dsq-", 1)[1]]
        opt = hx.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      compression=hx.Compression.doublesqueeze(name, **params),
                                      transport="torch" if system.startswith("hvd-torch-") else "horovod")
        comm = opt.comm
    else:
        compression = hvd.Compression.none if system == "horovod-none" else hvd.Compression.fp16
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    x, y = synthetic_batch(rank)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    times = timed_steps(step, args.warmup, args.steps)
    sent = bytes_per_step(comm, args)
    hvd.allreduce(torch.zeros(1), name="done")  # nobody leaves while another rank still times
    return rank, hvd.size(), times, sent


def run_deepspeed(system: str, model: nn.Module, args) -> tuple[int, int, list[float], int | None]:
    import deepspeed
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if system.startswith("ds-dsq-"):
        import deepspeed_ext as dx
        name, params = OURS[system.removeprefix("ds-dsq-")]
        config["doublesqueeze"] = {"compressor": name, "compressor_params": params}
        engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), optimizer=opt, config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=opt,
                                          config=config)
    rank = engine.global_rank
    x, y = synthetic_batch(rank)

    def step():
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()

    times = timed_steps(step, args.warmup, args.steps)
    sent = bytes_per_step(getattr(engine, "doublesqueeze_comm", None), args)
    torch.distributed.barrier()
    return rank, engine.world_size, times, sent


def run_ddp(system: str, model: nn.Module, args) -> tuple[int, int, list[float], int | None]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # torch's hooks get one bucket (the model is 48 MB): PowerSGD issues its
    # second allreduce from the first one's completion callback, and on gloo
    # callbacks of several buckets can run in different orders on different
    # ranks, which mismatches the collectives (NCCL runs would not need this).
    # Ours gets 4 MB buckets, which it averages during backward: at DDP's
    # default (25 MB) this model's three buckets took 562 ms per step at
    # 100 Mbit/s against 309 ms (docs/results/slow-links.md, the DDP hook overlapped).
    ours = system.startswith("ddp-dsq-")
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4 if ours else 64)
    if system == "ddp-none":
        pass  # DDP's own fp32 allreduce
    elif system == "ddp-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif ours:
        import dsq_plugins.ddp as dsq_ddp
        name, params = DDP_OURS[system[len("ddp-dsq-"):]]
        ddp.register_comm_hook(dsq_ddp.HookState(compressor=name, compressor_params=params), dsq_ddp.hook)
    else:
        # compress from the second step on (PowerSGD's default waits 1000 steps
        # of plain allreduce first); error feedback and warm start as default.
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(system[-1]),
                                       start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = synthetic_batch(rank)

    def step():
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    # three warm-up steps: past PowerSGD's start (start_powerSGD_iter=2) and DDP's bucket rebuild after its
    # first step (with one warm-up step our sign hook's median was 9.0 s at 100 Mbit/s, 1.4 s with three; the
    # cause is not pinned down). DDP's own allreduce takes what is asked (4 minutes a step at 10 Mbit/s)
    times = timed_steps(step, args.warmup if system == "ddp-none" else max(args.warmup, 3), args.steps)
    dist.barrier()
    size = dist.get_world_size()
    dist.destroy_process_group()
    return rank, size, times, None


def run_local(system: str, model: nn.Module, args) -> tuple[int, int, list[float], int | None]:
    """dsq.LocalSteps under torchrun: inner steps move nothing, a sync every H. A step's time is a whole
    period's (H inner steps and their sync) over H, so the sync is paid in every timed figure; --warmup and
    --steps count periods."""
    import torch.distributed as dist

    import dsq_plugins as dsq
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    compressor, params, every, *options = LOCAL[system[len("local-"):]]
    opt = dsq.LocalSteps(model, torch.optim.SGD(model.parameters(), lr=1e-3), sync_every=every, exact_steps=0,
                         compressor=compressor, compressor_params=params, **(options[0] if options else {}))
    x, y = synthetic_batch(rank)

    def period():
        for _ in range(every):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    times = [t / every for t in timed_steps(period, args.warmup, args.steps)]
    opt.finish()  # an overlapped sync still in flight (each timed period waited for the one before it)
    sent = opt.comm.bytes_sent // ((args.warmup + args.steps) * every)
    dist.barrier()
    size = dist.get_world_size()
    dist.destroy_process_group()
    return rank, size, times, sent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True, help="rank 0 appends one JSON line here")
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = make_model()
    if args.system.startswith(("horovod", "hvd")):
        rank, size, times, sent = run_horovod(args.system, model, args)
    elif args.system.startswith(("deepspeed", "ds-")):
        rank, size, times, sent = run_deepspeed(args.system, model, args)
    elif args.system.startswith("local-"):
        rank, size, times, sent = run_local(args.system, model, args)
    else:
        rank, size, times, sent = run_ddp(args.system, model, args)
    if rank == 0:
        record = {"system": args.system, "size": size, "params": sum(p.numel() for p in model.parameters()),
                  "median_s": statistics.median(times), "times_s": times, "bytes_sent": sent}
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
