"""Plain torch.distributed: average gradients with DoubleSqueeze after backward().

    torchrun --standalone --nproc_per_node 2 examples/quickstart/plain_torch.py
"""
import torch
import torch.distributed as dist

from common import loss_of, model, report

dist.init_process_group("gloo")
rank = dist.get_rank()
net = model()
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

# [reducer]
import dsq_plugins as dsq

reducer = dsq.DoubleSqueeze(dsq.TorchDistributedComm(), "sign")
# [/reducer]

losses = []
for step in range(60):
    opt.zero_grad()
    loss = loss_of(net, rank, step)
    loss.backward()
    # [average]
    named = [(name, p.grad) for name, p in net.named_parameters()]
    for (_, p), average in zip(net.named_parameters(), reducer.reduce_many(named)):
        p.grad = average
    # [/average]
    opt.step()
    losses.append(loss.item())
report(sum(losses[:5]) / 5, sum(losses[-5:]) / 5, list(net.parameters()))
