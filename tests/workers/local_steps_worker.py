"""dsq.LocalSteps under torchrun, with no DDP and comm=None (the default group):

    torchrun --nproc_per_node 2 tests/workers/local_steps_worker.py OUT_DIR

Each rank saves its results to OUT_DIR/rank{R}.pt for test_local_steps.py."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.workers.hvd_worker import batches, params_of  # noqa: E402


def main(out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model(seed=1, hidden=32)
    opt = dsq.LocalSteps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=3)
    sent = []
    for step in range(6):
        for x, y in batches(rank, step, 1):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        sent.append(opt.comm.bytes_sent)
    save_and_leave({"params": params_of(model), "sent": sent, "syncs": opt.syncs}, out_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1])
