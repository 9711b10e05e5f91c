"""The robust layer: one of four ranks sends its gradient with the sign
flipped, and a trimmed mean (each coordinate's largest and smallest value
dropped) bounds what it can do. The attack is injected inside the real
exchange (``faults=``).

    torchrun --standalone --nproc_per_node 4 examples/quickstart/robust_layer.py
"""
import torch
import torch.distributed as dist

from common import model, report, train_averaged

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

first, last = train_averaged(net, opt, reducer, rank, range(60))
report(first, last, list(net.parameters()))
