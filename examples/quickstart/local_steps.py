"""Local steps for slow links: each rank steps alone, and every H steps the
ranks average where they went, compressed both ways.

    torchrun --standalone --nproc_per_node 2 examples/quickstart/local_steps.py
"""
import torch
import torch.distributed as dist

from common import loss_of, model, report

dist.init_process_group("gloo")
rank = dist.get_rank()
net = model()

# [local-steps]
import dsq_plugins as dsq

opt = dsq.LocalSteps(net, torch.optim.AdamW(net.parameters(), lr=3e-3), sync_every=10)
# [/local-steps]

losses = []
for step in range(80):  # ends on a sync (every 10 steps after the 20 exact ones), so the ranks agree
    opt.zero_grad()
    loss = loss_of(net, rank, step)
    loss.backward()
    opt.step()
    losses.append(loss.item())
report(sum(losses[:5]) / 5, sum(losses[-5:]) / 5, list(net.parameters()))
