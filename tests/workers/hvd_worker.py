"""Horovod scenarios, one horovodrun launch for all of them:

    horovodrun -np N -H localhost:N python tests/workers/hvd_worker.py OUT_DIR

Each rank saves a dict of results to OUT_DIR/rank{R}.pt. The training
recipes here are shared with the in-process simulations in test_horovod.py."""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.train_digits import load_digits_split, make_model  # noqa: E402
from tests.helpers.states import decoded  # noqa: E402

STEPS = 4
SCENARIOS = {
    # name: (path, doublesqueeze kwargs, optimizer kwargs, set_to_none)
    "stock-sign": ("stock", {"compressor": "sign"}, {}, True),
    "stock-topk-groups-bpps2": ("stock", {"compressor": "topk", "ratio": 0.2},
                                {"backward_passes_per_step": 2, "num_groups": 2}, False),
    "dropin-sign": ("dropin", {"compressor": "sign", "bucket_mb": 0.004}, {}, True),
    "dropin-qsgd-bpps2": ("dropin", {"compressor": "qsgd", "levels": 7, "bucket_mb": 0.004},
                          {"backward_passes_per_step": 2}, False),
    "dropin-topk-server-sign": ("dropin", {"compressor": "topk", "ratio": 0.1, "server_compressor": "sign"},
                                {}, True),
    # verdicts judged once per step (the default on a GPU), over Horovod's fused collectives
    "dropin-sign-deferred": ("dropin", {"compressor": "sign", "bucket_mb": 0.004, "verdict": "step"}, {}, True),
    # the same payloads on a torch.distributed group of their own instead of Horovod's collectives
    "dropin-sign-torch": ("dropin", {"compressor": "sign", "bucket_mb": 0.004}, {"transport": "torch"}, True),
    "dropin-topk-server-sign-torch-deferred": ("dropin", {"compressor": "topk", "ratio": 0.1,
                                                          "server_compressor": "sign", "verdict": "step"},
                                               {"transport": "torch"}, True),
}


def batches(rank, step, passes, batch=16):
    (x, y), _ = load_digits_split()
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return [(x[idx], y[idx]) for idx in (torch.randint(len(y), (batch,), generator=gen) for _ in range(passes))]


def poisoned_batch(rank, step, bad_rank=1):
    """One batch of ``batches``, with a NaN in it on ``bad_rank``."""
    x, y = batches(rank, step, 1)[0]
    if rank == bad_rank:
        x = x.clone()
        x[0, 0] = float("nan")
    return x, y


def new_model_and_sgd():
    model = make_model(seed=1, hidden=32)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def local_backward(model, rank, step, passes):
    for x, y in batches(rank, step, passes):
        F.cross_entropy(model(x), y).backward()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def horovod_training(hvd, hx, name):
    path, dsq_kw, opt_kw, set_to_none = SCENARIOS[name]
    model, sgd = new_model_and_sgd()
    compression = hx.Compression.doublesqueeze(**dsq_kw)
    wrap = hvd.DistributedOptimizer if path == "stock" else hx.DistributedOptimizer
    opt = wrap(sgd, named_parameters=model.named_parameters(), compression=compression, **opt_kw)
    passes = opt_kw.get("backward_passes_per_step", 1)
    for step in range(STEPS):
        model.zero_grad(set_to_none=set_to_none)  # Horovod 0.28.1's own zero_grad() takes no set_to_none
        local_backward(model, hvd.rank(), step, passes)
        opt.step()
    return params_of(model)


def checkpoint_scenario(hvd, hx, out_dir, path):
    """Six steps straight against three, a checkpoint through a real file,
    fresh objects, three more."""
    def build():
        model, sgd = new_model_and_sgd()
        comp = hx.Compression.doublesqueeze("sign", bucket_mb=0.004)
        wrap = hvd.DistributedOptimizer if path == "stock" else hx.DistributedOptimizer
        return model, wrap(sgd, named_parameters=model.named_parameters(), compression=comp), comp

    def run(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            local_backward(model, hvd.rank(), step, 1)
            opt.step()

    model, opt, _ = build()
    run(model, opt, range(6))
    straight = params_of(model)
    model, opt, comp = build()
    run(model, opt, range(3))
    file = os.path.join(out_dir, f"ckpt-{path}-{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "comp": comp.state_dict()}, file)
    model, opt, comp = build()
    ckpt = torch.load(file)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    if path == "stock":
        comp.load_state_dict(ckpt["comp"])  # the stock optimizer cannot carry it: the compression object does
    run(model, opt, range(3, 6))
    return straight, params_of(model)


def bytes_scenario(hvd, hx):
    layer = torch.nn.Linear(1024, 1024)
    opt = hx.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.01),
                                  named_parameters=layer.named_parameters(),
                                  compression=hx.Compression.doublesqueeze("sign"))
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(hvd.rank()))
    opt.zero_grad()
    layer(x).square().mean().backward()
    opt.step()
    numel = sum(p.numel() for p in layer.parameters())
    n = hvd.size()
    return opt.comm.bytes_sent, 2 * (n - 1) / n * 4 * numel


def staleness_scenario(hvd, hx, staleness, steps=150):
    (x, y), (xt, yt) = load_digits_split()
    model = make_model(seed=0, hidden=64)
    opt = hx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                  named_parameters=model.named_parameters(),
                                  compression=hx.Compression.doublesqueeze("sign"), staleness=staleness)
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        idx = torch.randint(len(y), (32,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    if staleness:
        opt.flush()
    with torch.no_grad():
        return float((model(xt).argmax(1) == yt).float().mean())


def nan_scenario(hvd, hx, path, **opt_kw):
    """Rank 1 feeds a NaN at step 2: every rank must raise a clear error, fast."""
    model, sgd = new_model_and_sgd()
    comp = hx.Compression.doublesqueeze("sign")
    wrap = hvd.DistributedOptimizer if path == "stock" else hx.DistributedOptimizer
    opt = wrap(sgd, named_parameters=model.named_parameters(), compression=comp, **opt_kw)
    for step in range(4):
        opt.zero_grad()
        x, y = batches(hvd.rank(), step, 1)[0]
        if step == 2 and hvd.rank() == 1:
            x = x.clone()
            x[0, 0] = float("nan")  # a poisoned input: NaN gradients reach the backward hooks
        F.cross_entropy(model(x), y).backward()
        start = time.monotonic()
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001 - the result under test
            return type(exc).__name__, str(exc), time.monotonic() - start, step
    return None


def broadcast_scenario(hvd, hx):
    """hvd.broadcast_optimizer_state must not overwrite per-rank error state."""
    model, sgd = new_model_and_sgd()
    opt = hx.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                  compression=hx.Compression.doublesqueeze("sign"))
    for step in range(2):
        opt.zero_grad()
        local_backward(model, hvd.rank(), step, 1)
        opt.step()
    before = opt.state_dict()["doublesqueeze"]["worker_error"]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = opt.state_dict()["doublesqueeze"]["worker_error"]
    same = all(torch.equal(decoded(before[k]), decoded(after[k])) for k in before)
    return same, {k: decoded(v) for k, v in after.items()}


def reducer_state(state):
    """The parts of a reducer's (or stock object's) state a step may write, copied."""
    return {kind: {k: decoded(v) for k, v in state.get(kind, {}).items()}
            for kind in ("worker_error", "server_error", "momentum")} | {"steps": dict(state["steps"])}


def same_state(a, b):
    return a["steps"] == b["steps"] and all(
        a[kind].keys() == b[kind].keys() and all(torch.equal(a[kind][k], b[kind][k]) for k in a[kind])
        for kind in ("worker_error", "server_error", "momentum"))


def poison_first_layer(model):
    """Rank 1's first-layer weight gradient becomes NaN: in the drop-in that
    bucket is exchanged last (buckets go in reverse parameter order)."""
    return model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))


def atomic_scenario(hvd, hx, path, mode):
    """Two good steps, then a step whose last bucket fails on one rank (NaN
    with raise or skip; a payload one byte short): error state, step
    counters and (when skipped) parameters stay as they were everywhere."""
    from dsq_plugins.comm import header
    model, sgd = new_model_and_sgd()
    comp = hx.Compression.doublesqueeze("sign", bucket_mb=0.0005, on_nonfinite="skip" if mode == "skip" else "raise")
    wrap = hvd.DistributedOptimizer if path == "stock" else hx.DistributedOptimizer
    opt = wrap(sgd, named_parameters=model.named_parameters(), compression=comp)
    state = (lambda: comp.state_dict()) if path == "stock" else (lambda: opt.reducer.state_dict())
    for step in range(2):
        opt.zero_grad()
        local_backward(model, hvd.rank(), step, 1)
        opt.step()
    before, params = reducer_state(state()), params_of(model)
    hook = poison_first_layer(model) if hvd.rank() == 1 and mode != "short" else None
    if path == "dropin" and mode == "short" and hvd.rank() == 1:
        last = opt._buckets[-1]
        tag, original = header.make_tag(last.name, last.numel), opt.comm.alltoall
        opt.comm.alltoall = lambda payloads, **kw: original(
            [payloads[0][:-1], *payloads[1:]] if kw.get("tag") == tag else payloads, **kw)
    opt.zero_grad()
    local_backward(model, hvd.rank(), 2, 1)
    try:
        opt.step()
        outcome = "skipped" if getattr(opt, "step_skipped", False) else "applied"
    except Exception as exc:  # noqa: BLE001 - the result under test
        outcome = type(exc).__name__
    if hook is not None:
        hook.remove()
    buckets = len(opt._buckets) if path == "dropin" else None
    result = (outcome, same_state(before, reducer_state(state())),
              all(torch.equal(a, b) for a, b in zip(params, params_of(model))), buckets)
    if path == "dropin":
        opt.close()
    return result


def compressed_adam_scenario(hvd, hx):
    """CompressedAdam over HorovodComm across its freeze, resumed halfway
    from each rank's saved state (tests/workers/dist_worker.py runs the same)."""
    from tests.workers.dist_worker import compressed_adam
    return compressed_adam(hx.HorovodComm())


def main(out_dir):
    import horovod.torch as hvd

    import horovod_ext as hx
    torch.set_num_threads(1)
    hvd.init()
    # Horovod's transport first, torch's last: Horovod's timed NaN scenarios then run before any
    # torch.distributed group exists. A slowdown once a group existed was suspected; a later check (2 and
    # 4 ranks, steps timed before and after making the group) found none beyond 4 ranks' bimodal step times
    # on 2 cores, with or without a group, so this order is a precaution, not a fix
    on_torch = [name for name, (_, _, opt_kw, _) in SCENARIOS.items() if opt_kw.get("transport") == "torch"]
    results = {name: horovod_training(hvd, hx, name) for name in SCENARIOS if name not in on_torch}
    for path in ("stock", "dropin"):
        results[f"checkpoint-{path}"] = checkpoint_scenario(hvd, hx, out_dir, path)
        results[f"nan-{path}"] = nan_scenario(hvd, hx, path)
    results["bytes"] = bytes_scenario(hvd, hx)
    for mode in ("raise", "skip", "short"):
        results[f"atomic-dropin-{mode}"] = atomic_scenario(hvd, hx, "dropin", mode)
    results["atomic-stock-raise"] = atomic_scenario(hvd, hx, "stock", "raise")
    results["compressed-adam"] = compressed_adam_scenario(hvd, hx)
    results["broadcast"] = broadcast_scenario(hvd, hx)
    if hvd.size() == 2:
        results["staleness"] = (staleness_scenario(hvd, hx, 0), staleness_scenario(hvd, hx, 1))
    results.update({name: horovod_training(hvd, hx, name) for name in on_torch})
    results["nan-dropin-torch"] = nan_scenario(hvd, hx, "dropin", transport="torch")
    torch.save(results, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
