"""ZeRO stage 3 with the section, for real:

    deepspeed --num_gpus 2 tests/workers/zero3_worker.py OUT_DIR

(CPU accelerator, gloo.) Scenarios: DeepSpeed's own stage 3; the section
with the exact operator (no compression, no error feedback), which must
give DeepSpeed's own; sign; and sign saved after 3 steps and resumed in a
fresh engine, which must continue bit for bit. Every rank is on one host
here, so sign compresses with ``hierarchy: "flat"``; left at "auto" it is
exact. Each rank saves its results
to OUT_DIR/rank{R}.pt. With DSQ_LOSE_PEER (one torchrun per host) rank 1
is killed instead, and rank 0 saves what it raised (``lost_peer``)."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.launchers import deepspeed_worker_parser, save_and_leave  # noqa: E402

STEPS = 6
#: a model of odd sizes, so that last partitions are padded; two buckets of gradients
SECTIONS = {"deepspeed": None,
            "exact": {"compressor": "none", "error_feedback": "none"},
            "sign-on-one-host": {"compressor": "sign"},  # "auto" on one host: exact, said once
            "sign": {"compressor": "sign", "hierarchy": "flat"},
            # verdicts judged once per backward ("auto" on a GPU): its buckets planned after the first
            "sign-step": {"compressor": "sign", "hierarchy": "flat", "verdict": "step"}}


def make_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))


def ds_config(section):
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    if section is not None:
        cfg["doublesqueeze"] = section
    return cfg


def batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    device = "cuda" if os.environ.get("DSQ_TEST_BACKEND") == "nccl" else "cpu"
    return torch.randn(8, 13, generator=gen).to(device), torch.randint(0, 5, (8,), generator=gen).to(device)


def new_engine(section):
    import deepspeed_ext as dx
    model = make_model()
    engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), config=ds_config(section))
    return engine


def train(engine, rank, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = batch(rank, step)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def gathered(engine):
    """The whole model, gathered from its partitions (the same on every rank)."""
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().reshape(-1).clone() for p in params])


def same(a, b):
    """Whether two reducer states hold the same values (tensors compared exactly)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def nan_on_one_rank(rank, section="sign"):
    """The last rank's batch holds a NaN at the third step: (the error each rank's backward raised,
    whether the reducer's state is what it was before that backward)."""
    engine = new_engine(SECTIONS[section])
    train(engine, rank, 2)
    before = engine.doublesqueeze.state_dict()
    x, y = batch(rank, 2)
    if rank == torch.distributed.get_world_size() - 1:
        x[0, 0] = float("nan")
    try:
        engine.backward(F.cross_entropy(engine(x), y))
        raised = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        raised = (type(exc).__name__, str(exc))
    return raised, same(before, engine.doublesqueeze.state_dict())


def lost_peer(rank, out_dir, where):
    """Rank 1 is SIGKILLed at its third step (``where``: before its forward,
    or before its backward): what rank 0 raised, after how long, and
    whether its reducer's state is what it was before that step."""
    import signal
    import time
    engine = new_engine(SECTIONS["sign"])
    train(engine, rank, 2)
    before = engine.doublesqueeze.state_dict()
    x, y = batch(rank, 2)
    if rank == 1 and where == "forward":
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        loss = F.cross_entropy(engine(x), y)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        engine.backward(loss)
        engine.step()
        raised = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        raised = (type(exc).__name__, str(exc))
    torch.save({"raised": raised, "seconds": time.monotonic() - start,
                "unchanged": same(before, engine.doublesqueeze.state_dict())}, os.path.join(out_dir, "lost-rank0.pt"))
    os._exit(1)  # the group is broken: no barrier to wait at


def main():
    args = deepspeed_worker_parser().parse_args()
    import deepspeed
    deepspeed.init_distributed(os.environ.get("DSQ_TEST_BACKEND", "gloo"))  # nccl: test_cuda_paths
    rank = torch.distributed.get_rank()
    if os.environ.get("DSQ_LOSE_PEER"):
        lost_peer(rank, args.out_dir, os.environ["DSQ_LOSE_PEER"])
    out = {}
    for name, section in SECTIONS.items():
        engine = new_engine(section)
        losses = train(engine, rank, STEPS)
        out[name] = {"losses": losses, "params": gathered(engine)}
        if section is not None:
            out[name]["bytes"] = engine.doublesqueeze_comm.bytes_sent
            out[name]["memories"] = sorted(engine.doublesqueeze.state_dict()["worker_error"])
            verdict = engine.doublesqueeze.last_step.verdict
            out[name]["reads"] = verdict and verdict.host_reads
    # save after 3 steps, go on 3; a fresh engine resumed from the file must give the same 3
    ckpt = os.path.join(args.out_dir, "ckpt")
    engine = new_engine(SECTIONS["sign"])
    train(engine, rank, 3)
    engine.save_checkpoint(ckpt, tag="three")
    saved_params = gathered(engine)
    continued = train(engine, rank, 3, first=3)
    resumed_engine = new_engine(SECTIONS["sign"])
    resumed_engine.load_checkpoint(ckpt, tag="three")
    resumed = train(resumed_engine, rank, 3, first=3)
    out["resume"] = {"continued": (continued, gathered(engine)), "resumed": (resumed, gathered(resumed_engine))}
    torch.distributed.barrier()  # every rank's files are written
    if rank == 0:  # DeepSpeed's own consolidation of a checkpoint written with the section
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="three")
        out["zero_to_fp32"] = torch.cat([state[name].reshape(-1) for name, _ in make_model().named_parameters()])
    out["saved_at_three"] = saved_params
    out["nan"] = nan_on_one_rank(rank)
    out["nan-step"] = nan_on_one_rank(rank, "sign-step")
    save_and_leave(out, args.out_dir, rank)


if __name__ == "__main__":
    main()
