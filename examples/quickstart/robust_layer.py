"""The robust layer: one of four ranks sends its gradient with the sign
flipped, and a trimmed mean (each coordinate's largest and smallest value
dropped) bounds what it can do. The attack is injected inside the real
exchange (``faults=``).

    torchrun --standalone --nproc_per_node 4 examples/quickstart/robust_layer.py
"""
import torch
import torch.distributed as dist

from common import loss_of, model, report

dist.init_process_group("gloo")
rank = dist.get_rank()
net = model()
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

# [robust]
import dsq_plugins as dsq
import robust  # noqa: F401  (registers the robust rules by name)

reducer = dsq.DoubleSqueeze(dsq.TorchDistributedComm(), "sign", aggregator="trimmed_mean",
                            aggregator_params={"f": 1}, faults="attack=signflip;ranks=3")
# [/robust]

losses = []
for step in range(60):
    opt.zero_grad()
    loss = loss_of(net, rank, step)
    loss.backward()
    named = [(name, p.grad) for name, p in net.named_parameters()]
    for (_, p), average in zip(net.named_parameters(), reducer.reduce_many(named)):
        p.grad = average
    opt.step()
    losses.append(loss.item())
report(sum(losses[:5]) / 5, sum(losses[-5:]) / 5, list(net.parameters()))
