"""DeepSpeed scenarios, one launch for all of them:

    deepspeed --num_gpus 2 tests/workers/ds_worker.py OUT_DIR

(CPU accelerator, gloo.) Each rank saves its results to OUT_DIR/rank{R}.pt;
test_deepspeed.py compares them with in-process simulations."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import deepspeed_worker_parser, save_and_leave  # noqa: E402
from tests.workers.hvd_worker import batches, params_of  # noqa: E402  (shared recipe: digits batches)

STEPS = 4
SCENARIOS = {
    # name: (doublesqueeze section, extra DeepSpeed config)
    "sign": ({"compressor": "sign", "bucket_mb": 0.004}, {}),
    "sign-no-overlap": ({"compressor": "sign", "bucket_mb": 0.004, "overlap": False}, {}),
    "topk-gas2-clip": ({"compressor": "topk", "compressor_params": {"ratio": 0.2}},
                       {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05}),
    "qsgd-server-sign": ({"compressor": "qsgd", "compressor_params": {"levels": 7}, "server_compressor": "sign"}, {}),
    "qsgd-no-overlap": ({"compressor": "qsgd", "compressor_params": {"levels": 7}, "server_compressor": "sign",
                         "overlap": False}, {}),
    # verdicts judged once per step (the default on a GPU): the overlapped exchange, and reduce_many in the step
    "sign-deferred": ({"compressor": "sign", "bucket_mb": 0.004, "verdict": "step"}, {}),
    "sign-no-overlap-deferred": ({"compressor": "sign", "bucket_mb": 0.004, "overlap": False, "verdict": "step"}, {}),
}


def ds_config(section, extra, micro_batch=16):
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 0}, "steps_per_print": 10**9, "doublesqueeze": section}
    cfg.update(extra)
    return cfg


def new_engine(dx, section, extra):
    model = make_model(seed=1, hidden=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), optimizer=opt,
                               config=ds_config(section, extra))
    return engine, model


def train(engine, rank, steps, gas=1):
    for step in steps:
        for x, y in batches(rank, step, gas):
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()


def checkpoint_scenario(dx, rank, out_dir):
    section = {"compressor": "sign", "bucket_mb": 0.004}
    engine, model = new_engine(dx, section, {})
    train(engine, rank, range(6))
    straight = params_of(model)
    engine, model = new_engine(dx, section, {})
    train(engine, rank, range(3))
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
    engine, model = new_engine(dx, section, {})
    engine.load_checkpoint(os.path.join(out_dir, "ckpt"))
    train(engine, rank, range(3, 6))
    return straight, params_of(model)


def bytes_scenario(dx):
    layer = torch.nn.Linear(1024, 1024)
    engine, *_ = dx.initialize(model=layer, model_parameters=layer.parameters(),
                               optimizer=torch.optim.SGD(layer.parameters(), lr=0.01),
                               config=ds_config({"compressor": "sign"}, {}, micro_batch=8))
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(engine.global_rank))
    engine.backward(engine(x).square().mean())
    engine.step()
    n = engine.doublesqueeze_comm.size
    return engine.doublesqueeze_comm.bytes_sent, 2 * (n - 1) / n * 4 * sum(p.numel() for p in layer.parameters())


def bf16_scenario(dx, rank):
    model = make_model(seed=1, hidden=32)
    engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(),
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               config=ds_config({"compressor": "sign", "error_dtype": "fp32"},  # stays fp32 under bf16
                                                {"bf16": {"enabled": True}}))
    losses = []
    for step in range(40):
        x, y = batches(rank, step, 1)[0]
        loss = F.cross_entropy(engine(x.to(torch.bfloat16)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    memory = engine.doublesqueeze.worker_error.state_dict()
    return (sum(losses[:5]) / 5, sum(losses[-5:]) / 5, {v.dtype for v in memory.values()},
            params_of(model)[0].float())


def nan_scenario(dx, rank):
    engine, _ = new_engine(dx, {"compressor": "sign"}, {})
    for step in range(3):
        x, y = batches(rank, step, 1)[0]
        if step == 2 and rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        try:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
        except Exception as exc:  # noqa: BLE001 - the result under test
            return type(exc).__name__, str(exc), step
    return None


def backend_scenario(dx, rank):
    """Three calls of compressed_allreduce per compressor, with the caller's
    error buffers; inputs and outputs go back to the test for the reference."""
    out = {}
    for name in ("sign", "topk", "none"):
        backend = dx.DoubleSqueezeBackend(compressor=name)
        numel, padded = 1000, 1008  # padded to a multiple of 8 * size, as 1-bit Adam did
        worker_error = torch.zeros(padded)
        server_error = torch.zeros(padded // backend.size)
        calls = []
        for t in range(3):
            buf = torch.randn(numel, generator=torch.Generator().manual_seed(100 * t + rank))
            result = backend.compressed_allreduce(buf.clone(), worker_error, server_error, 0)
            calls.append((buf, result, worker_error.clone(), server_error.clone()))
        out[name] = calls
        out[name + ":bytes"] = backend.comm.bytes_sent
    return out


def atomic_scenario(dx, rank, mode):
    """Two good steps, then one whose last bucket fails on rank 1 (NaN with
    raise or skip; a payload one byte short): the reducer's state and (when
    skipped) the parameters stay as they were on every rank."""
    from dsq_plugins.comm import header
    from tests.workers.hvd_worker import reducer_state, same_state
    section = {"compressor": "sign", "bucket_mb": 0.0005, "on_nonfinite": "skip" if mode == "skip" else "raise"}
    engine, model = new_engine(dx, section, {})
    train(engine, rank, range(2))
    reducer, comm = engine.doublesqueeze, engine.doublesqueeze_comm
    before, params, skipped_before = reducer_state(reducer.state_dict()), params_of(model), engine.skipped_steps
    hook = None
    overlapped = engine.doublesqueeze_overlap  # its buckets run in reverse parameter order
    if rank == 1 and mode != "short":
        hook = overlapped.feed.bucket_params[-1][0].register_hook(lambda g: torch.full_like(g, float("nan")))
    original = comm.alltoall
    if rank == 1 and mode == "short":
        last = overlapped.buckets[-1]
        tag = header.make_tag(last.name, last.numel)
        comm.alltoall = lambda payloads, **kw: original(
            [payloads[0][:-1], *payloads[1:]] if kw.get("tag") == tag else payloads, **kw)
    try:
        train(engine, rank, [2])
        outcome = "skipped" if engine.skipped_steps > skipped_before else "applied"
    except Exception as exc:  # noqa: BLE001 - the result under test
        outcome = type(exc).__name__
    comm.alltoall = original
    if hook is not None:
        hook.remove()
    return (outcome, same_state(before, reducer_state(reducer.state_dict())),
            all(torch.equal(a, b) for a, b in zip(params, params_of(model))),
            len(overlapped.buckets))


def backend_atomic_scenario(dx, rank):
    """compressed_allreduce: a NaN on rank 1 (raise, then skip) leaves the
    caller's error buffers as they were."""
    out = {}
    for mode in ("raise", "skip"):
        backend = dx.DoubleSqueezeBackend(compressor="sign", on_nonfinite=mode)
        worker_error, server_error = torch.zeros(1008), torch.zeros(1008 // backend.size)
        buf = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
        backend.compressed_allreduce(buf, worker_error, server_error, 0)
        kept = worker_error.clone(), server_error.clone()
        bad = buf.clone()
        if rank == 1:
            bad[7] = float("nan")
        try:
            result = backend.compressed_allreduce(bad, worker_error, server_error, 0)
            outcome = "zeros" if bool((result == 0).all()) else "values"
        except Exception as exc:  # noqa: BLE001 - the result under test
            outcome = type(exc).__name__
        out[mode] = (outcome, torch.equal(kept[0], worker_error) and torch.equal(kept[1], server_error))
    return out


ONE_BIT = {"type": "OneBitAdam", "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.01,
                                            "freeze_step": 2, "cuda_aware": False, "comm_backend_name": "nccl"}}


def one_bit_engine(dx, section=None):
    model = make_model(seed=1, hidden=32)
    cfg = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10**9, "optimizer": ONE_BIT}
    if section is not None:
        cfg["doublesqueeze"] = section
    engine, optimizer, *_ = dx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, optimizer, model


def one_bit_adam_scenario(dx, rank, out_dir):
    """A config written for DeepSpeed 0.19.6's OneBitAdam: five steps across
    its freeze (sign, and top-k from the doublesqueeze section), bytes
    before and after the freeze, and a checkpoint resumed exactly."""
    out = {}
    for label, section in (("sign", None), ("topk", {"compressor": "topk", "compressor_params": {"ratio": 0.2}})):
        engine, optimizer, model = one_bit_engine(dx, section)
        sent = []
        for step in range(5):
            before = engine.doublesqueeze_comm.bytes_sent
            train(engine, rank, [step])
            sent.append(engine.doublesqueeze_comm.bytes_sent - before)
        out[label] = (type(optimizer).__name__, params_of(model), sent, engine.enable_backward_allreduce)
    engine, _, model = one_bit_engine(dx)
    train(engine, rank, range(3))
    engine.save_checkpoint(os.path.join(out_dir, "onebit"))
    train(engine, rank, range(3, 5))
    straight = params_of(model)
    engine, _, model = one_bit_engine(dx)
    engine.load_checkpoint(os.path.join(out_dir, "onebit"))
    train(engine, rank, range(3, 5))
    out["resume"] = all(torch.equal(a, b) for a, b in zip(straight, params_of(model)))
    return out


def install_scenario(dx, rank):
    """After install(), a plain deepspeed.initialize honours the section (the
    same training as dx.initialize, bit for bit) and a OneBitAdam config;
    after uninstall() it is plain DeepSpeed again."""
    import deepspeed
    section, extra = SCENARIOS["sign"]
    out = {}
    with dx.installed():
        model = make_model(seed=1, hidden=32)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          config=ds_config(section, extra))
        train(engine, rank, range(STEPS))
        out["plain"] = (type(getattr(engine, "doublesqueeze", None)).__name__, params_of(model))
        model = make_model(seed=1, hidden=32)
        cfg = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10**9, "optimizer": ONE_BIT}
        engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        train(engine, rank, range(5))
        out["one-bit"] = (type(optimizer).__name__, params_of(model))
    model = make_model(seed=1, hidden=32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=ds_config(section, {}))
    out["uninstalled"] = getattr(engine, "doublesqueeze", None) is None
    return out


def main(out_dir):
    import deepspeed_ext as dx
    torch.set_num_threads(1)
    results = {}
    for name, (section, extra) in SCENARIOS.items():
        engine, model = new_engine(dx, section, extra)
        train(engine, engine.global_rank, range(STEPS), extra.get("gradient_accumulation_steps", 1))
        results[name] = params_of(model)
        overlapped = engine.doublesqueeze_overlap
        results[name + ":overlap"] = (None if overlapped is None else
                                      (overlapped.sent_during_backward, len(overlapped.buckets)))
    rank = engine.global_rank
    results["checkpoint"] = checkpoint_scenario(dx, rank, out_dir)
    results["bytes"] = bytes_scenario(dx)
    results["bf16"] = bf16_scenario(dx, rank)
    results["nan"] = nan_scenario(dx, rank)
    results["backend"] = backend_scenario(dx, rank)
    for mode in ("raise", "skip", "short"):
        results[f"atomic-{mode}"] = atomic_scenario(dx, rank, mode)
    results["backend-atomic"] = backend_atomic_scenario(dx, rank)
    results["one-bit-adam"] = one_bit_adam_scenario(dx, rank, out_dir)
    results["install"] = install_scenario(dx, rank)
    save_and_leave(results, out_dir, rank)


if __name__ == "__main__":
    main(deepspeed_worker_parser().parse_args().out_dir)
