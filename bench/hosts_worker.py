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
stage 0, under torchrun).
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

SYSTEMS = ("ddp-allreduce", "ddp-powersgd4", "ddp-dsq-sign-flat", "ddp-dsq-sign", "ds-dsq-sign-flat", "ds-dsq-sign")
BATCH, CONTEXT = 8, 64


def link_bytes() -> int:
    """Bytes this host's end of the link sent and received so far."""
    base = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics"
    return sum(int(open(f"{base}/{side}_bytes").read()) for side in ("tx", "rx"))


def ddp_system(system: str, model: nn.Module, bucket_mb: float):
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
        state = dsq_ddp.HookState(compressor="sign", hierarchy="flat" if system.endswith("-flat") else "auto")
        ddp.register_comm_hook(state, dsq_ddp.hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad()
        loss_of(ddp, x, y).backward()
        opt.step()
    return step, (lambda: state.reducer) if state is not None else (lambda: None)


def deepspeed_system(system: str, model: nn.Module, bucket_mb: float):
    import deepspeed_ext as dx
    section = {"compressor": "sign", "hierarchy": "flat" if system.endswith("-flat") else "auto",
               "bucket_mb": bucket_mb}
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 0}, "doublesqueeze": section}
    engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x, y):
        engine.backward(loss_of(engine, x, y))
        engine.step()
    return step, lambda: engine.doublesqueeze


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True, help="rank 0 appends one JSON line here")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="our systems' buckets")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = GPT(SIZES["large"])
    build = deepspeed_system if args.system.startswith("ds-") else ddp_system
    step, reducer = build(args.system, model, args.bucket_mb)
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
        record = {"system": args.system, "size": dist.get_world_size(),
                  "params": sum(p.numel() for p in model.parameters()), "median_s": statistics.median(times),
                  "times_s": times, "link_bytes_per_step": crossed / args.steps,
                  "two_level": None if r is None else r.hosts.two_level,
                  "hosts": None if r is None else r.hosts.describe()}
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
