"""The Horovod drop-in with the two-level exchange (hosts forced as groups
of 2 ranks: horovodrun's -H localhost:4 is one host), on both transports:
Horovod's own (host groups as dynamic process sets) and torch's.

    HOROVOD_DYNAMIC_PROCESS_SETS=1 horovodrun -np 4 -H localhost:4 python tests/workers/hvd_hosts_worker.py OUT_DIR

Each rank saves its results to OUT_DIR/rank{R}.pt for test_hosts.py."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.workers.hvd_worker import local_backward, new_model_and_sgd, params_of  # noqa: E402

STEPS = 6


def training(hvd, hx, transport, compressor="sign", **options):
    model, sgd = new_model_and_sgd()
    opt = hx.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), transport=transport,
                                  compression=hx.Compression.doublesqueeze(compressor, **options))
    for step in range(STEPS):
        opt.zero_grad()
        local_backward(model, hvd.rank(), step, 1)
        opt.step()
    hosts = opt.reducer.hosts.describe() if opt.reducer.hosts.two_level else None
    cross = opt.reducer.cross_comm.bytes_sent if opt.reducer.cross_comm is not None else None
    opt.close()
    return {"params": params_of(model), "hosts": hosts, "cross_bytes": cross}


def main(out_dir):
    import horovod.torch as hvd

    import horovod_ext as hx
    hvd.init()
    # the flat run first: run after the host groups' process sets were added, it took 66 s for 6 steps on
    # 2 oversubscribed cores, and 15-25 s first (Horovod's background loop coordinates every set each cycle)
    results = {"flat-exact": training(hvd, hx, "horovod", compressor="none", error_feedback="none")}
    results.update({transport: training(hvd, hx, transport, hierarchy="node", node_size=2)
                    for transport in ("horovod", "torch")})
    results["exact"] = training(hvd, hx, "horovod", compressor="none", error_feedback="none", hierarchy="node",
                                node_size=2)
    torch.save(results, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))
    hvd.barrier() if hasattr(hvd, "barrier") else None


if __name__ == "__main__":
    main(sys.argv[1])
