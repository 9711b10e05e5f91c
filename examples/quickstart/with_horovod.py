"""Horovod with DoubleSqueeze: the drop-in optimizer (compressed bytes on the
wire), or Horovod's own optimizer handed a ``compression=``.

    horovodrun -np 2 -H localhost:2 python examples/quickstart/with_horovod.py           # the drop-in
    horovodrun -np 2 -H localhost:2 python examples/quickstart/with_horovod.py --stock   # hvd.DistributedOptimizer
"""
import argparse

import horovod.torch as hvd
import torch

from common import model, report, train

parser = argparse.ArgumentParser()
parser.add_argument("--stock", action="store_true")
args = parser.parse_args()
hvd.init()
rank = hvd.rank()
net = model()
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

# [optimizer]
import horovod_ext as hx

if args.stock:  # Horovod's own optimizer: its dense allreduce carries the decoded values
    opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                   compression=hx.Compression.doublesqueeze("sign"))
else:           # the drop-in: the compressed payloads themselves travel
    opt = hx.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                  compression=hx.Compression.doublesqueeze("sign"))
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
# [/optimizer]

first, last = train(net, opt, rank, steps=60)
report(first, last, list(net.parameters()), rank=rank,
       gather=lambda flat: list(hvd.allgather(flat.unsqueeze(0), name="quickstart.check")))
