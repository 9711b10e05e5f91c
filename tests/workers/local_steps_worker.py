"""dsq.LocalSteps under torchrun, with no DDP and comm=None (the default group):

    torchrun --nproc_per_node 2 tests/workers/local_steps_worker.py OUT_DIR

Each rank saves its results to OUT_DIR/rank{R}.pt for test_local_steps.py.
With DSQ_KILL_RANK=r DSQ_KILL_AFTER=k, rank r SIGKILLs itself after its
step k (between two syncs); a survivor saves what its next sync raised, how
long that took, and whether its weights are still the last good sync's,
to OUT_DIR/failed-rank{R}.pt. With DSQ_OVERLAP=k the syncs run beside the
next k inner steps (overlap_steps) on a group of their own, while the
training thread all-reduces its loss on the default group every step."""
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.workers.hvd_worker import batches, params_of  # noqa: E402

SYNC_EVERY = 3


def main(out_dir):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    kill_after = int(os.environ["DSQ_KILL_AFTER"]) if int(os.environ.get("DSQ_KILL_RANK", -1)) == rank else None
    model = make_model(seed=1, hidden=32)
    overlap = int(os.environ.get("DSQ_OVERLAP", 0))
    opt = dsq.LocalSteps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=SYNC_EVERY,
                         overlap_steps=overlap, exact_steps=0)
    sent = []
    for step in range(6):
        for x, y in batches(rank, step, 1):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if overlap and "DSQ_KILL_RANK" not in os.environ:  # the training thread's own collective, beside the sync
                dist.all_reduce(loss.detach())
            noting_a_failure(opt.step, opt, out_dir, rank, step + 1)
        sent.append(opt.comm.bytes_sent)
        if kill_after == step + 1:
            os.kill(os.getpid(), signal.SIGKILL)
    noting_a_failure(opt.finish, opt, out_dir, rank, 6)  # an overlapped sync in flight: the run ends on it
    save_and_leave({"params": params_of(model), "sent": sent, "syncs": opt.syncs,
                    "own_group": opt.comm.group is not None}, out_dir, rank)


def noting_a_failure(call, opt, out_dir, rank, step):
    """``call()``; if it raises the library's error, save what it was, how long it took and whether the
    weights are the last good sync's, then raise it."""
    began = time.monotonic()
    try:
        call()
    except dsq.DSQError as exc:
        torch.save({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - began,
                    "step": step, "syncs": opt.syncs,
                    "at_anchor": all(torch.equal(p.detach().float(), opt.anchor[n]) for n, p in opt.named)},
                   os.path.join(out_dir, f"failed-rank{rank}.pt"))
        raise


if __name__ == "__main__":
    main(sys.argv[1])
