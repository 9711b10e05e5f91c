"""Horovod's optimizer contract, kept by the drop-in (one launch, 3 ranks):

    horovodrun -np 3 -H localhost:3 python tests/workers/hvd_contract_worker.py OUT_DIR

Each scenario is a pattern Horovod users rely on: resuming through
``hvd.broadcast_optimizer_state`` or ``hvd.broadcast_object``, process sets,
sparse embeddings, the synchronize/step warning, options the stock path
cannot honour, and a rank stuck in another collective. Each rank saves its
results to OUT_DIR/rank{R}.pt."""
import gc
import os
import sys
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.states import decoded  # noqa: E402
from tests.workers.hvd_worker import local_backward, new_model_and_sgd, params_of  # noqa: E402

SET = [0, 2]  # the process set of the process-set scenario; rank 1 is outside it


def compression(hx, name="sign", **kw):
    return hx.Compression.doublesqueeze(name, bucket_mb=0.004, **kw)


def train(model, opt, rank, steps):
    for step in steps:
        opt.zero_grad()
        local_backward(model, rank, step, 1)
        opt.step()


def resume_horovod_pattern(hvd, hx, out_dir):
    """Horovod's own resume: rank 0 loads a checkpoint, then broadcasts
    parameters and optimizer state. The fresh optimizers on the other ranks
    get their state made by the wrapped optimizer, not by an exchange that
    rank 0 would never join."""
    model, opt = build(hvd, hx)
    train(model, opt, hvd.rank(), range(2))
    path = os.path.join(out_dir, "horovod-pattern.pt")
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    hvd.barrier()
    model, opt = build(hvd, hx)
    if hvd.rank() == 0:
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    train(model, opt, hvd.rank(), range(2, 4))
    opt.close()
    return momentum, params_of(model)


def resume_per_rank(hvd, hx, out_dir):
    """Every rank saves and loads its own optimizer state (its error memory
    is its own): six steps straight equal three, a restart, three more."""
    model, opt = build(hvd, hx)
    train(model, opt, hvd.rank(), range(6))
    straight = params_of(model)
    opt.close()
    model, opt = build(hvd, hx)
    train(model, opt, hvd.rank(), range(3))
    path = os.path.join(out_dir, f"per-rank-{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    opt.close()
    model, opt = build(hvd, hx)
    ckpt = torch.load(path)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # harmless on top: the error state is not in what it sends
    train(model, opt, hvd.rank(), range(3, 6))
    opt.close()
    return all(torch.equal(a, b) for a, b in zip(straight, params_of(model)))


def resume_broadcast_object(hvd, hx):
    """``state = hvd.broadcast_object(opt.state_dict(), 0)`` then loading it
    on the other ranks: their own error state stays (with a warning)."""
    model, opt = build(hvd, hx)
    train(model, opt, hvd.rank(), range(2))
    own = {k: decoded(v) for k, v in opt.state_dict()["doublesqueeze"]["worker_error"].items()}
    state = hvd.broadcast_object(opt.state_dict(), root_rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if hvd.rank() > 0:
            opt.load_state_dict(state)
    kept = opt.state_dict()["doublesqueeze"]["worker_error"]
    train(model, opt, hvd.rank(), range(2, 3))
    opt.close()
    return (all(torch.equal(own[k], decoded(kept[k])) for k in own),
            [str(w.message) for w in caught if "error state is per rank" in str(w.message)])


def build(hvd, hx, **kw):
    model, sgd = new_model_and_sgd()
    return model, hx.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                          compression=compression(hx), **kw)


def process_set_scenario(hvd, hx, process_set, transport="horovod"):
    """Ranks 0 and 2 exchange among themselves; rank 1, outside the set,
    gets a pass-through optimizer that steps on its own gradients."""
    model, sgd = new_model_and_sgd()
    opt = hx.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression(hx),
                                  process_set=process_set, transport=transport)
    train(model, opt, hvd.rank(), range(3))
    local_model, local_sgd = new_model_and_sgd()
    train(local_model, local_sgd, hvd.rank(), range(3))  # what a rank alone would reach
    sent = opt.comm.bytes_sent if opt.comm is not None else 0
    opt.close()
    return params_of(model), params_of(local_model), sent


class Bag(nn.Module):
    """A sparse embedding in front of a linear layer."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.out = nn.Linear(8, 10)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, idx):
        return self.out(self.emb(idx).mean(1))


def sparse_scenario(hvd, hx, stock):
    """nn.Embedding(sparse=True) trains through the drop-in without
    sparse_as_dense (dense exchange, sparse gradients handed back, one
    warning); with compressor none it matches Horovod's own sparse path."""
    model = Bag()
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    if stock:
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    else:
        opt = hx.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                      compression=hx.Compression.doublesqueeze("none", error_feedback="none"))
    gen = torch.Generator().manual_seed(hvd.rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            idx = torch.randint(50, (16, 4), generator=gen)
            y = torch.randint(10, (16,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(idx), y).backward()
            opt.step()
    grad_sparse = model.emb.weight.grad.is_sparse
    if not stock:
        opt.close()
    return params_of(model), grad_sparse, sum("sparse gradient" in str(w.message) for w in caught)


def synchronize_warning_scenario(hvd, hx):
    """synchronize(); clip; step() warns once (Horovod's words); inside
    skip_synchronize() it does not; the gradient is not exchanged twice."""
    model, opt = build(hvd, hx)
    out = []
    for use_context in (False, True):
        opt.zero_grad()
        local_backward(model, hvd.rank(), 0, 1)
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        steps_before = dict(opt.reducer.steps)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if use_context:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        out.append(([str(w.message) for w in caught], opt.reducer.steps == steps_before))
    opt.close()
    return out, sorted(opt._parameter_names.values()) == sorted(n for n, _ in model.named_parameters())


def stock_refuses_skip_scenario(hvd, hx):
    """The stock optimizer cannot skip a step: on_nonfinite='skip' is refused
    by name the first time the object serves it, on every rank."""
    model, sgd = new_model_and_sgd()
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                   compression=hx.Compression.doublesqueeze("sign", on_nonfinite="skip"))
    try:
        local_backward(model, hvd.rank(), 0, 1)
        opt.step()
    except Exception as exc:  # noqa: BLE001 - the result under test
        return type(exc).__name__, str(exc)
    return None


def close_scenario(hvd, hx):
    """close() stops the exchange thread; a dropped optimizer is collected
    and its thread stops with it."""
    model, opt = build(hvd, hx)
    train(model, opt, hvd.rank(), range(1))
    thread = opt._exchange._thread
    opt.close()
    closed_stops = not thread.is_alive()
    model, opt = build(hvd, hx)
    train(model, opt, hvd.rank(), range(1))
    thread, ref = opt._exchange._thread, weakref.ref(opt)
    del opt
    gc.collect()
    thread.join(timeout=10)
    return closed_stops, ref() is None, not thread.is_alive()


def stuck_scenario(hvd, hx, transport="horovod"):
    """Rank 0 steps while ranks 1 and 2 wait in a broadcast before their
    backward pass: rank 0's step times out naming the Horovod collective it
    waits in, instead of hanging. Then each rank joins what the others
    started, so the run can finish. Only rank 0 waits briefly: the others'
    step runs behind its timeout and must not race a short one on a loaded
    machine, and every rank meets at a barrier before closing, so rank 0's
    exchange thread has finished that step before anything shuts down."""
    model, opt = build(hvd, hx, exchange_timeout=3.0 if hvd.rank() == 0 else 120.0, transport=transport)
    opt.zero_grad()
    flag = torch.zeros(1)
    result = None
    if hvd.rank() == 0:
        local_backward(model, hvd.rank(), 0, 1)
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001 - the result under test
            result = (type(exc).__name__, str(exc))
        hvd.broadcast(flag, root_rank=0, name="stuck.flag")
    else:
        hvd.broadcast(flag, root_rank=0, name="stuck.flag")
        local_backward(model, hvd.rank(), 0, 1)
        opt.step()  # completes the exchange rank 0 started
    hvd.barrier()
    opt.close()
    return result


def main(out_dir):
    import horovod.torch as hvd

    import horovod_ext as hx
    torch.set_num_threads(1)
    process_set = hvd.ProcessSet(SET)
    hvd.init(process_sets=[process_set])
    results = {
        "resume-horovod": resume_horovod_pattern(hvd, hx, out_dir),
        "resume-per-rank": resume_per_rank(hvd, hx, out_dir),
        "resume-broadcast-object": resume_broadcast_object(hvd, hx),
        "process-set": process_set_scenario(hvd, hx, process_set),
        "sparse-dropin": sparse_scenario(hvd, hx, stock=False),
        "sparse-stock": sparse_scenario(hvd, hx, stock=True),
        "synchronize-warning": synchronize_warning_scenario(hvd, hx),
        "stock-skip": stock_refuses_skip_scenario(hvd, hx),
        "close": close_scenario(hvd, hx),
        "stuck": stuck_scenario(hvd, hx),
        # last, as in tests/workers/hvd_worker.py: no torch.distributed group exists while Horovod's scenarios run
        "process-set-torch": process_set_scenario(hvd, hx, process_set, transport="torch"),
        "stuck-torch": stuck_scenario(hvd, hx, transport="torch"),
    }
    torch.save(results, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
