"""A rank killed mid-step, and the job restarted smaller from its last
checkpoint (test_elastic.py runs both under torchrun):

    DSQ_KILL_AT=5 DSQ_KILL_RANK=2 torchrun --nproc-per-node 3 tests/workers/elastic_worker.py OUT CKPT
    torchrun --nproc-per-node 2 tests/workers/elastic_worker.py OUT CKPT

Plain torch.distributed training (gloo) of a quadratic with DoubleSqueeze,
a checkpoint after every step (CKPT/step<s>/rank<r>.pt, each rank its own).
Rank DSQ_KILL_RANK SIGKILLs itself inside step DSQ_KILL_AT, after the
step's first bucket went through. The survivors' step must fail with a
clear error and write nothing; they record it (OUT/failed-rank<r>.pt) and
exit. A restarted job reads every rank's file of the last complete
checkpoint, reshards it for its own size and trains on (OUT/rank<r>.pt).
"""
import glob
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.helpers.states import decoded  # noqa: E402

SHAPES = {"w": 200, "b": 100}
STEPS, LR = 12, 0.2
TWO_BUCKETS = 150 * 4 / 2**20


def gradients(params, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [(name, p - 1.0 + 0.3 * torch.randn(p.numel(), generator=gen)) for name, p in params.items()]


def last_checkpoint(ckpt):
    """(step, every rank's file) of the newest step all of whose ranks saved it."""
    for folder in sorted(glob.glob(os.path.join(ckpt, "step*")), key=lambda f: -int(f.rsplit("step", 1)[1])):
        files = sorted(glob.glob(os.path.join(folder, "rank*.pt")))
        saved = [torch.load(f) for f in files]
        if saved and len(saved) == saved[0]["size"]:
            return saved[0]["step"], sorted(saved, key=lambda s: s["rank"])
    return 0, None


def save(ckpt, step, rank, size, params, reducer):
    folder = os.path.join(ckpt, f"step{step}")
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".rank{rank}.tmp")
    torch.save({"step": step, "rank": rank, "size": size, "params": params, "reducer": reducer.state_dict()}, tmp)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.pt"))


def die_inside(comm):
    """SIGKILL this worker at the second all-to-all of the step."""
    calls = {"n": 0}
    original = comm._alltoallv

    def alltoallv(send, recv_lens):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(send, recv_lens)
    return alltoallv


def main(out_dir, ckpt):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    kill_at = int(os.environ["DSQ_KILL_AT"]) if int(os.environ.get("DSQ_KILL_RANK", -1)) == rank else None
    comm = dsq.TorchDistributedComm()
    reducer = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.1}, bucket_mb=TWO_BUCKETS)
    params = {name: torch.zeros(n) for name, n in SHAPES.items()}
    start, saved = last_checkpoint(ckpt)
    resharded_from = None
    if saved is not None:
        params = saved[0]["params"]
        states = [s["reducer"] for s in saved]
        resharded_from = len(states) if len(states) != size else None
        reducer.load_state_dict(dsq.reshard(states, size)[rank] if resharded_from else states[rank])
    loaded = reducer.state_dict()
    for step in range(start, STEPS):
        if kill_at == step:
            comm._alltoallv = die_inside(comm)
        before, began = reducer.state_dict(), time.monotonic()
        try:
            averaged = reducer.reduce_many(gradients(params, rank, step))
        except dsq.DSQError as exc:
            after = reducer.state_dict()
            unchanged = before["steps"] == after["steps"] and all(
                torch.equal(decoded(before[kind][k]), decoded(after[kind][k]))
                for kind in ("worker_error", "server_error") for k in before[kind])
            failure = {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - began,
                       "unchanged": unchanged, "step": step, "size": size}
            torch.save(failure, os.path.join(out_dir, f"failed-rank{rank}.pt"))
            raise
        params = {name: p - LR * g for (name, p), g in zip(params.items(), averaged)}
        save(ckpt, step + 1, rank, size, params, reducer)
    save_and_leave({"size": size, "resumed_at": start, "resharded_from": resharded_from,
                    "loaded": loaded, "params": params, "steps": dict(reducer.steps)}, out_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
