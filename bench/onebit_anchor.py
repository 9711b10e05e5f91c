"""The anchor of the Adam study: DeepSpeed 0.19.6's own ``OnebitAdam``
(removed from DeepSpeed in 0.19.7), on the LM workload with the same data,
seeds and steps as ``bench.lm``'s in-process runs.

DeepSpeed 0.19.6 is never a dependency of the project: ``ensure_installed()``
puts it in ``~/.cache/dsq-plugins/deepspeed-0.19.6`` (``pip install --no-deps
--target``, from the PyPI sdist), and only this worker puts that folder on
``sys.path``. Its optimizer runs unmodified; its NCCL backend module imports
cupy, so ``deepspeed_ext.DoubleSqueezeBackend`` stands in for it (the same
interface and the same 1-bit arithmetic, checked in tests/test_deepspeed.py).
The driver does what DeepSpeed's engine did around it: average gradients
exactly until the optimizer freezes, then leave them local. OnebitAdam's
first ``step()`` only sets up its buffers, so it gets one extra call on zero
gradients before training, and the same number of real updates as the rest.
``--mask`` gives it the momentum mask its documentation asks for where some
coordinates never see a gradient (as here: bytes absent from the warm-up);
without it a momentum that turns NaN is reported as a divergence.

    python -m bench.onebit_anchor --install        # once
    torchrun --nproc_per_node 4 bench/onebit_anchor.py --steps 600 --freeze-step 100 --json OUT
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from dataclasses import asdict

HOME = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsq-plugins",
                    "deepspeed-0.19.6")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_installed() -> str:
    """DeepSpeed 0.19.6 in the cache folder (installs it the first time)."""
    if not os.path.isdir(os.path.join(HOME, "deepspeed")):
        os.makedirs(HOME, exist_ok=True)
        env = dict(os.environ, DS_BUILD_OPS="0")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-binary", "deepspeed", "--target", HOME, "deepspeed==0.19.6"], check=True, env=env)
    return HOME


def run(args) -> None:
    sys.path.insert(0, HOME)  # DeepSpeed 0.19.6, for this process only
    sys.path.insert(1, ROOT)
    import deepspeed
    import torch
    assert deepspeed.__version__.startswith("0.19.6"), deepspeed.__version__
    deepspeed.init_distributed(dist_backend="gloo")
    import deepspeed.runtime.comm as ds_comm
    import torch.distributed as dist

    from deepspeed_ext import DoubleSqueezeBackend
    stand_in = types.ModuleType("deepspeed.runtime.comm.nccl")
    stand_in.NcclBackend = lambda mpu=None: DoubleSqueezeBackend(mpu=mpu, compressor="sign")
    sys.modules["deepspeed.runtime.comm.nccl"] = ds_comm.nccl = stand_in
    from deepspeed.runtime.fp16.onebit.adam import OnebitAdam

    import dsq_plugins as dsq
    from examples.common import ring_allreduce_bytes
    from examples.lm import GPT, loss_of, test_loss, train_batch
    from examples.train_lm import LMResult
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    model = GPT(seed=args.seed)
    engine = types.SimpleNamespace(mpu=None, local_rank=rank, enable_backward_allreduce=True)
    # one group per parameter, so that each can carry its own exp_avg_mask (applied group-wide by OnebitAdam)
    opt = OnebitAdam([{"params": [p]} for p in model.parameters()], deepspeed=engine, lr=args.lr,
                     freeze_step=args.freeze_step, comm_backend_name="nccl")
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    for p in params:  # OnebitAdam's set-up call
        p.grad = torch.zeros_like(p)
    opt.step()
    backend = opt.comm_backend_handle
    backend.comm.reset_counters()
    result = LMResult("deepspeed-0.19.6-onebitadam" + ("-masked" if args.mask else ""), size, args.steps,
                      fp32_allreduce_bytes_per_step=ring_allreduce_bytes(numel, size))
    exact_bytes, start, masked = 0.0, time.perf_counter(), False
    for step in range(args.steps):
        if args.mask and opt.adam_freeze_key and not masked:
            # the momentum mask DeepSpeed's 1-bit Adam asks users for: coordinates that never had a gradient
            for group in opt.param_groups:
                group["exp_avg_mask"] = (opt.state[group["params"][0]]["exp_avg_sq"] != 0).to(torch.float32)
            masked = True
        inputs, targets = train_batch(args.seed, rank, step, args.batch, model.cfg.context)
        loss = loss_of(model, inputs, targets)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if engine.enable_backward_allreduce:  # the engine's allreduce, until the optimizer freezes
            for p in params:
                dist.all_reduce(p.grad)
                p.grad.div_(size)
            exact_bytes += ring_allreduce_bytes(numel, size)
        try:
            opt.step()
        except dsq.NonFiniteGradientError:
            result.diverged_at = step + 1  # the momentum became NaN/Inf: DoubleSqueezeBackend refuses it
            break
        result.train_losses.append(loss.item())
        sent = exact_bytes + backend.comm.bytes_sent
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            result.test_curve.append((step + 1, test_loss(model)))
            result.bytes_curve.append((step + 1, sent))
    steps_run = len(result.train_losses) or 1
    result.seconds_per_step = (time.perf_counter() - start) / steps_run
    result.test_loss = result.test_curve[-1][1] if result.test_curve and not result.diverged_at else float("nan")
    result.bytes_per_step = sent / args.steps
    result.bytes_per_step_after_freeze = backend.comm.bytes_sent / max(1, args.steps - args.freeze_step)
    if rank == 0:
        print(result.summary())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(asdict(result), f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--install", action="store_true", help="install DeepSpeed 0.19.6 into the cache and exit")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--freeze-step", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--json", default=None)
    p.add_argument("--mask", action="store_true", help="give OnebitAdam the exp_avg_mask its documentation asks for "
                                                      "(coordinates without any gradient at the freeze)")
    args = p.parse_args(argv)
    if args.install:
        print(ensure_installed())
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
