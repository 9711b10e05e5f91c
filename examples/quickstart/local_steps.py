"""Local steps for slow links: each rank steps alone, and every H steps the
ranks average where they went, compressed both ways.

    torchrun --standalone --nproc_per_node 2 examples/quickstart/local_steps.py
"""
import torch
import torch.distributed as dist

from common import model, report, train

dist.init_process_group("gloo")
rank = dist.get_rank()
net = model()

# [local-steps]
import dsq_plugins as dsq

opt = dsq.LocalSteps(net, torch.optim.AdamW(net.parameters(), lr=3e-3), sync_every=10)
# [/local-steps]

# 80 steps end on a sync (one every 10 steps after the 20 exact ones), so the ranks agree at the end
first, last = train(net, opt, rank, steps=80)
report(first, last, list(net.parameters()))
