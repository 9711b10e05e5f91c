"""Fault injection on real processes:

    DSQ_FAULTS="attack=garbage;ranks=1" torchrun --standalone --nproc_per_node 3 \\
        tests/workers/robust_worker.py OUT_DIR AGGREGATOR

Each rank trains a few steps on digits with the fault injected by the spec
in the environment, and saves what happened to OUT_DIR/rank{R}.pt."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
from examples.train_digits import load_digits_split, make_model  # noqa: E402
from robust.election import ElectionSampler, deterministic_code, election_gradient  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.workers.hvd_worker import batches  # noqa: E402


def faulty_training(comm, aggregator, steps=4, owners=1):
    model = make_model(seed=1, hidden=32)
    named = list(model.named_parameters())
    reducer = dsq.DoubleSqueeze(comm, "sign", aggregator=aggregator, owners=owners)  # faults: DSQ_FAULTS
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(steps):
            x, y = batches(comm.rank, step, 1)[0]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            for (_, p), g in zip(named, reducer.reduce_many([(n, p.grad) for n, p in named])):
                p.grad.copy_(g)
            opt.step()
    except dsq.DSQError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None)}
    return {"steps": steps, "rejected": dict(reducer.rejected),
            "params": [p.detach().clone() for p in model.parameters()]}


def election_training(comm, steps=30):
    """Election-coded signSGD: each worker votes over its partitions."""
    n = comm.size
    code = deterministic_code(n, 1)
    (x, y), (xt, yt) = load_digits_split()
    model = make_model(seed=2, hidden=32)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    sampler = ElectionSampler(code, comm.rank, len(y), partition_size=16, seed=0)
    reducer = dsq.DoubleSqueeze(comm, "sign", error_feedback="none", aggregator="majority")
    for step in range(steps):
        losses = [lambda idx=idx: torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                  for idx in sampler.batches(step)]
        votes = election_gradient(params, losses)
        with torch.no_grad():
            for p, g in zip(params, reducer.reduce_many(list(zip(names, votes)))):
                p -= 0.05 * g
    with torch.no_grad():
        return float((model(xt).argmax(1) == yt).float().mean())


if __name__ == "__main__":
    import torch.distributed as dist

    import robust  # noqa: F401  (registers the robust aggregators)
    torch.set_num_threads(1)
    out_dir, aggregator = sys.argv[1], sys.argv[2]
    owners = sys.argv[3] if len(sys.argv) > 3 else "1"
    dist.init_process_group("gloo")
    comm = dsq.TorchDistributedComm()
    result = faulty_training(comm, aggregator, owners=owners if owners == "all" else int(owners))
    if aggregator == "majority":
        os.environ.pop("DSQ_FAULTS", None)
        result["election_accuracy"] = election_training(dsq.TorchDistributedComm())
    save_and_leave(result, out_dir, comm.rank)
