"""DeepSpeed with DoubleSqueeze: a "doublesqueeze" section in the config,
with deepspeed_ext.initialize (or deepspeed_ext.install() once, before HF
Trainer, Accelerate or a plain deepspeed.initialize).

    deepspeed --num_gpus 2 examples/quickstart/with_deepspeed.py            # deepspeed_ext.initialize
    deepspeed --num_gpus 2 examples/quickstart/with_deepspeed.py --install  # install(), then deepspeed.initialize
    deepspeed --num_gpus 2 examples/quickstart/with_deepspeed.py --onebit   # an old OneBitAdam config, ZeRO-2
"""
import argparse

import torch.distributed as dist

from common import loss_of, model, report

parser = argparse.ArgumentParser()
parser.add_argument("--install", action="store_true")
parser.add_argument("--onebit", action="store_true")
parser.add_argument("--local_rank", type=int, default=-1)  # what the deepspeed launcher appends
args = parser.parse_args()
net = model()

# [config]
config = {
    "train_micro_batch_size_per_gpu": 32,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    "doublesqueeze": {"compressor": "sign"},
}
# [/config]
# [onebit]
onebit_config = {  # DeepSpeed's own 1-bit Adam config, served by CompressedAdam on ZeRO's partitions
    "train_micro_batch_size_per_gpu": 32,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": 20}},
}
# [/onebit]
if args.onebit:
    config = onebit_config

# [initialize]
import deepspeed_ext as dx

if args.install:  # HF Trainer, Accelerate or your own deepspeed.initialize honour the section from here on
    import deepspeed
    dx.install()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
else:
    engine, *_ = dx.initialize(model=net, model_parameters=net.parameters(), config=config)
# [/initialize]

rank = dist.get_rank()
losses = []
for step in range(60):
    loss = loss_of(engine, rank, step)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
report(sum(losses[:5]) / 5, sum(losses[-5:]) / 5, list(net.parameters()))
