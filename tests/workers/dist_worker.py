"""One per-rank function, run unchanged on LocalGroup and under torchrun.

    torchrun --standalone --nproc_per_node N tests/workers/dist_worker.py OUT_DIR
writes each rank's results to OUT_DIR/rank{R}.pt. DSQ_TEST_DEVICE=cuda puts
every gradient and parameter on the GPU, and DSQ_TEST_BACKEND names the
process group's backend (gloo unless told: nccl takes one rank per GPU);
DSQ_TEST_VERDICT sets every reducer's ``verdict`` ("auto" unless told)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.helpers.states import decoded  # noqa: E402

DEVICE = torch.device(os.environ.get("DSQ_TEST_DEVICE", "cpu"))
VERDICT = os.environ.get("DSQ_TEST_VERDICT", "auto")
CASES = [("sign", {}), ("topk", {"ratio": 0.1}), ("qsgd", {"levels": 7}), ("randomk", {"ratio": 0.2}),
         ("terngrad", {}), ("fp16", {})]


def nan_rank(comm) -> int:
    """The rank whose gradient gets a NaN: rank 1, or rank 0 when it is alone."""
    return min(1, comm.size - 1)


def grad(rank, step, numel=101):
    return torch.randn(numel, generator=torch.Generator().manual_seed(31 * step + rank)).to(DEVICE)


def per_rank(comm):
    results = {}
    for name, params in CASES:
        comm.reset_counters()
        r = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict=VERDICT)
        results[name] = [r.reduce("g", grad(comm.rank, t)) for t in range(3)]
        results[name + ":bytes"] = (comm.bytes_sent, comm.bytes_received)
    r = dsq.DoubleSqueeze(comm, "sign", bucket_mb=64 * 4 / 2**20, verdict=VERDICT)
    named = [(f"p{i}", grad(comm.rank, i, 10 * i + 5).reshape(-1, 5)) for i in range(6)]
    results["bucketed"] = r.reduce_many(named)
    # a NaN on rank 1 (rank 0 when alone): the same clear error on every rank
    g = grad(comm.rank, 9)
    if comm.rank == nan_rank(comm):
        g[3] = float("nan")
    try:
        r.reduce("nan", g)
    except dsq.NonFiniteGradientError as exc:
        results["nan"] = ("NonFiniteGradientError", exc.ranks)
    results["atomic"] = atomic_steps(comm)
    results["adam"] = compressed_adam(comm)
    # a NaN scale in the last rank's payloads (decoded with every sender's, as rows): PayloadError naming it
    r_bad = dsq.DoubleSqueeze(comm, "sign", verdict=VERDICT)
    if comm.rank == comm.size - 1:
        encode = r_bad.worker.q.compress_chunks
        nan_scale = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)
        r_bad.worker.q.compress_chunks = lambda *a, **k: [p.index_copy_(0, torch.arange(4, device=p.device),
                                                                          nan_scale.to(p.device))
                                                          for p in encode(*a, **k)]
    try:
        r_bad.reduce("badscale", grad(comm.rank, 11))
    except dsq.PayloadError as exc:
        results["badscale"] = ("PayloadError", exc.rank)
    # a payload one byte short from the last rank: PayloadError naming it everywhere
    if comm.rank == comm.size - 1:
        original = comm.alltoall
        comm.alltoall = lambda payloads, **kw: original([payloads[0][:-1], *payloads[1:]], **kw)
    try:
        r.reduce("short", grad(comm.rank, 10))
    except dsq.PayloadError as exc:
        results["short"] = ("PayloadError", exc.rank)
    return results


def compressed_adam(comm):
    """CompressedAdam across its freeze, and the same run resumed from each
    rank's saved state halfway: (parameters at every step, resumed equal?)."""
    import tempfile

    from tests.test_adam import HYPER, grads_for, init_params, run_optimizer
    history, opt = run_optimizer(comm, 6, 3, device=DEVICE)
    _, half = run_optimizer(comm, 4, 3, device=DEVICE)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"rank{comm.rank}.pt")
        torch.save(half.state_dict(), path)
        params = init_params(DEVICE)
        with torch.no_grad():  # the parameters as they were saved
            for (_, p), saved in zip(params, half.param_groups[0]["params"]):
                p.copy_(saved)
        fresh = dsq.CompressedAdam(params, comm=comm, freeze_step=3, **HYPER)
        fresh.load_state_dict(torch.load(path))
    for t in range(4, 6):
        for (_, p), g in zip(params, grads_for(comm.rank, t, DEVICE)):
            p.grad = g.clone()
        fresh.step()
    resumed = torch.cat([p.detach().reshape(-1) for _, p in params])
    return history, torch.equal(resumed, history[-1])


def atomic_steps(comm):
    """A step of four buckets whose last bucket fails on one rank (NaN with
    raise and with skip, a payload one byte short): each leaves every
    memory and step counter as it was."""
    from dsq_plugins.comm import header
    out = {}
    named = lambda step, nan: [(f"t{i}", grad(comm.rank, step, 30 + i).clone()) for i in range(4)]  # noqa: E731
    for mode in ("raise", "skip", "short"):
        r = dsq.DoubleSqueeze(comm, "sign", bucket_mb=33 * 4 / 2**20, worker_momentum=0.5,
                              on_nonfinite="skip" if mode == "skip" else "raise", verdict=VERDICT)
        r.reduce_many(named(0, False))
        before = r.state_dict()
        tensors = named(1, False)
        last = r.layout([(n, tuple(t.shape)) for n, t in tensors])[-1]
        original = comm.alltoall
        if comm.rank == nan_rank(comm) and mode != "short":
            tensors[-1][1][5] = float("nan")
        if comm.rank == comm.size - 1 and mode == "short":
            tag = header.make_tag(last.name, last.numel)
            comm.alltoall = lambda payloads, **kw: original(
                [payloads[0][:-1], *payloads[1:]] if kw.get("tag") == tag else payloads, **kw)
        try:
            r.reduce_many(tensors)
            outcome = r.last_step.outcome
        except dsq.DSQError as exc:
            outcome = type(exc).__name__
        comm.alltoall = original
        after = r.state_dict()
        unchanged = after["steps"] == before["steps"] and all(
            torch.equal(decoded(after[kind][k]), decoded(before[kind][k]))
            for kind in ("worker_error", "server_error", "momentum") for k in before[kind])
        out[mode] = (outcome, unchanged, len(r.layout([(n, tuple(t.shape)) for n, t in tensors])))
    return out


if __name__ == "__main__":
    import torch.distributed as dist
    torch.set_num_threads(1)
    backend = os.environ.get("DSQ_TEST_BACKEND", "gloo")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend)
    out = per_rank(dsq.TorchDistributedComm())
    save_and_leave(out, sys.argv[1], dist.get_rank())
