"""A torch.distributed that disagrees with Horovod, under transport="torch"
(2 ranks): rank 1 has a one-rank default group of its own, rank 0 none.

    horovodrun -np 2 -H localhost:2 python tests/workers/hvd_transport_worker.py OUT_DIR

Every rank must get the same ConfigError, none may hang in the group's
creation. Each rank saves (error type, message) to OUT_DIR/rank{R}.pt."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(out_dir):
    import horovod.torch as hvd

    import horovod_ext as hx
    hvd.init()
    if hvd.rank() == 1:
        store = os.path.join(out_dir, "rank1-store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    model = torch.nn.Linear(3, 2)
    result = None
    try:
        hx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                compression=hx.Compression.doublesqueeze("sign"), transport="torch")
    except Exception as exc:  # noqa: BLE001 - the result under test
        result = (type(exc).__name__, str(exc))
    torch.save(result, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
