"""Horovod adapters for dsq_plugins::

    import horovod_ext as hx
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hx.Compression.doublesqueeze("sign"))     # stock optimizer
    opt = hx.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=hx.Compression.doublesqueeze("topk", ratio=0.01))  # compressed bytes

The first keeps Horovod's own optimizer and hands it the compression; the
second is this package's drop-in, whose payloads travel as compressed bytes.
"""
from .comm import HorovodComm
from .compression import Compression, DoubleSqueezeCompression
from .optimizer import DistributedOptimizer

__all__ = ["Compression", "DistributedOptimizer", "DoubleSqueezeCompression", "HorovodComm"]
