"""Bad input: a NaN in one rank's gradient is the same clear error on every
rank, and nothing changes (the weights and the error memories stay as the
last good step left them).

    torchrun --standalone --nproc_per_node 2 examples/quickstart/bad_input.py
"""
import torch
import torch.distributed as dist

from common import leave, loss_of, model

dist.init_process_group("gloo")
rank = dist.get_rank()
net = model()
ddp_model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)

# [nan]
import dsq_plugins as dsq
import dsq_plugins.ddp as dsq_ddp

state = dsq_ddp.HookState(compressor="sign")
ddp_model.register_comm_hook(state, dsq_ddp.hook)
for step in range(6):
    opt.zero_grad()
    loss = loss_of(ddp_model, rank, step)
    if step == 5 and rank == 1:
        loss = loss * float("nan")  # one rank's gradient goes bad
    try:
        loss.backward()
    except dsq.NonFiniteGradientError as error:  # raised on every rank, at the same step
        print(f"rank {rank}, step {step}: {type(error).__name__}: {str(error)[:80]}...")
        break
    opt.step()
# [/nan]

raised = torch.tensor([float(step == 5)])
everyone = [torch.empty(1) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, raised)
finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
if rank == 0:
    print("ok" if all(bool(r) for r in everyone) and finite else "FAILED")
leave()
