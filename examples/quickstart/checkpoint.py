"""Checkpoints: each rank's error memories ride beside the model and the
optimizer, and a run resumed from a checkpoint continues bit for bit (a
reducer's state changes only by whole steps). (The DDP hook's resume is close
but not bit for bit: a new DDP's first iteration buckets the gradients anew.)

    torchrun --standalone --nproc_per_node 2 examples/quickstart/checkpoint.py
"""
import os
import tempfile

import torch
import torch.distributed as dist

from common import leave, model, train_averaged

import dsq_plugins as dsq

dist.init_process_group("gloo")
rank = dist.get_rank()


def build():
    net = model()
    return net, dsq.DoubleSqueeze(dsq.TorchDistributedComm(), "sign"), torch.optim.SGD(net.parameters(), lr=0.1,
                                                                                        momentum=0.9)


net, reducer, opt = build()  # 20 steps straight
train_averaged(net, opt, reducer, rank, range(20))
straight = [p.detach().clone() for p in net.parameters()]

net, reducer, opt = build()  # 10 steps, a checkpoint, and 10 more from it in a new run
train_averaged(net, opt, reducer, rank, range(10))
folder = os.path.join(tempfile.gettempdir(), f"dsq-quickstart-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
os.makedirs(folder, exist_ok=True)
path = os.path.join(folder, f"rank{rank}.pt")
# [save]
torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
            "compression": reducer.state_dict()}, path)  # each rank its own file: the memories are its own
# [/save]
net, reducer, opt = build()
# [load]
checkpoint = torch.load(path)
net.load_state_dict(checkpoint["model"])
opt.load_state_dict(checkpoint["optimizer"])
reducer.load_state_dict(checkpoint["compression"])
# [/load]
train_averaged(net, opt, reducer, rank, range(10, 20))
resumed = list(net.parameters())

same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
everyone = [torch.empty(1) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, torch.tensor([float(same)]))
if rank == 0:
    print(f"resumed run equals the straight one, bit for bit: {all(bool(s) for s in everyone)}")
    print("ok" if all(bool(s) for s in everyone) else "FAILED")
leave()
