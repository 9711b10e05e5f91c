"""Plain torch.distributed: average gradients with DoubleSqueeze after backward().

    torchrun --standalone --nproc_per_node 2 examples/quickstart/plain_torch.py
"""
import torch
import torch.distributed as dist

from common import model, report, train_averaged

dist.init_process_group("gloo")
rank = dist.get_rank()
net = model()
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

# [reducer]
import dsq_plugins as dsq

reducer = dsq.DoubleSqueeze(dsq.TorchDistributedComm(), "sign")
# [/reducer]

first, last = train_averaged(net, opt, reducer, rank, range(60))  # backward, average, step
report(first, last, list(net.parameters()))
