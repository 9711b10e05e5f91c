"""FSDP2 / HSDP with DoubleSqueeze between the replicas: exact inside a
host, compressed between hosts. Here 4 ranks stand for 2 hosts of 2
(``node_size=2``), on a (replicate, shard) mesh as HSDP has.

    torchrun --standalone --nproc_per_node 4 examples/quickstart/with_fsdp.py
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import model, report, train

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
net = model()
for layer in net:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(net, mesh=mesh)

# [compress]
import dsq_plugins.fsdp as dsq_fsdp

compression = dsq_fsdp.compress(net, compressor="sign", node_size=2)  # after fully_shard
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
# [/compress]

first, last = train(net, opt, rank, steps=60)
params = [p.full_tensor() for p in net.parameters()]  # the whole weights, gathered from the shards
report(first, last, params)
