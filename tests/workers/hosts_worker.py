"""Two hosts as the launchers start them: two torchrun processes,
``--nnodes 2 --node_rank i``, each with its ranks (here on one machine's
loopback; ``bench.hosts`` puts them in network namespaces joined by a link).

    torchrun --nnodes 2 --node_rank I --nproc_per_node 2 --master_addr A --master_port P \\
        tests/workers/hosts_worker.py OUT_DIR

The DDP hook with the default hierarchy ("auto") and with "flat", and
LocalSteps with its defaults (one DiLoCo worker per host). Each rank saves
its results to OUT_DIR/rank{R}.pt for test_hosts.py."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
import dsq_plugins.ddp as dsq_ddp  # noqa: E402
from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.workers.ddp_worker import train  # noqa: E402
from tests.workers.hvd_worker import batches, params_of  # noqa: E402

STEPS = 8


def scenario(rank, **options):
    state = dsq_ddp.HookState(compressor="sign", **options)
    model = make_model(seed=1, hidden=1024)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    ddp.register_comm_hook(state, dsq_ddp.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = train(ddp, opt, rank, range(STEPS))
    reducer = state.reducer
    cross = reducer.cross_comm.bytes_sent if reducer.cross_comm is not None else None
    return {"losses": losses, "params": params_of(model), "two_level": reducer.hosts.two_level,
            "hosts": reducer.hosts.describe(), "cross_bytes": cross, "bytes": reducer.comm.bytes_sent,
            "worker_error": reducer.worker_error.numel(), "numel": sum(p.numel() for p in model.parameters())}


def local_steps(rank, sync_every=3):
    """LocalSteps with comm=None on two launched hosts: each rank's weights
    after every step, and the bytes its host link carried by then."""
    model = make_model(seed=1, hidden=64)
    opt = dsq.LocalSteps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=sync_every, exact_steps=0)
    params, cross = [], []
    for step in range(2 * sync_every):
        for x, y in batches(rank, step, 1):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        params.append(params_of(model))
        cross.append(opt.reducer.cross_comm.bytes_sent)
    return {"params": params, "cross_bytes": cross, "two_level": opt.reducer.hosts.two_level,
            "inside_host": opt.host_exact is not None, "syncs": opt.syncs}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"auto": scenario(rank), "flat": scenario(rank, hierarchy="flat"), "local": local_steps(rank)}
    save_and_leave(results, sys.argv[1], rank)


if __name__ == "__main__":
    main()
