"""PyTorch DDP with DoubleSqueeze, as the DDP guide shows it.

    torchrun --standalone --nproc_per_node 2 examples/quickstart/with_ddp.py          # the hook, any optimizer
    torchrun --standalone --nproc_per_node 2 examples/quickstart/with_ddp.py --adam   # compressed_adam for AdamW
"""
import argparse

import torch
import torch.distributed as dist

from common import model, report, train

parser = argparse.ArgumentParser()
parser.add_argument("--adam", action="store_true")
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()

# [hook]
import dsq_plugins.ddp as dsq_ddp

ddp_model = torch.nn.parallel.DistributedDataParallel(model())
if args.adam:  # AdamW users: compress Adam's momentum, not the gradients
    opt = dsq_ddp.compressed_adam(ddp_model, lr=3e-3, freeze_step=20)
else:          # any other optimizer: a communication hook, as torch's PowerSGD hook is
    ddp_model.register_comm_hook(dsq_ddp.HookState(compressor="sign"), dsq_ddp.hook)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
# [/hook]

first, last = train(ddp_model, opt, rank, steps=60)
report(first, last, list(ddp_model.parameters()))
