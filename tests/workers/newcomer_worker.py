"""What a new user hit, on real processes (test_newcomer.py):

    torchrun --nproc_per_node 2 tests/workers/newcomer_worker.py OUT_DIR
    deepspeed --num_gpus 2 tests/workers/newcomer_worker.py OUT_DIR --deepspeed

(gloo.) Each rank catches what it is told, saves it to OUT_DIR/rank{R}.pt,
and then ends as a user's script ends, through the interpreter's normal
exit (no ``os._exit``): the exit code itself is under test."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
import dsq_plugins.ddp as dsq_ddp  # noqa: E402
from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import deepspeed_worker_parser  # noqa: E402
from tests.workers.hvd_worker import batches, poisoned_batch  # noqa: E402


def caught(run):
    """(the error's type name, its message) of what ``run()`` raised, or None."""
    try:
        run()
    except dsq.DSQError as exc:
        return type(exc).__name__, str(exc)
    return None


def ddp_steps(rank, state, steps=3, poison_at=None):
    model = make_model(seed=1, hidden=64)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, dsq_ddp.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        x, y = poisoned_batch(rank, step) if step == poison_at and rank == 1 else batches(rank, step, 1)[0]
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()


def torchrun_main(out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {
        # ranks configured differently: rank 1 with top-k, or with top-k at another ratio
        "compressor": caught(lambda: ddp_steps(rank, dsq_ddp.HookState(compressor="sign" if rank == 0 else "topk"))),
        "ratio": caught(lambda: ddp_steps(rank, dsq_ddp.HookState(
            compressor="topk", compressor_params={"ratio": 0.01 if rank == 0 else 0.1}))),
        # last: a NaN on rank 1 with the hook's background thread, caught, and then the script ends
        "nan": caught(lambda: ddp_steps(rank, dsq_ddp.HookState(compressor="sign"), steps=4, poison_at=2)),
    }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def deepspeed_main(out_dir):
    import deepspeed

    import deepspeed_ext as dx
    rank = int(os.environ["RANK"])
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "doublesqeeze": {"compressor": "sign"}}
    model = make_model(seed=1, hidden=16)
    results = {"initialize": caught(lambda: dx.initialize(model=model, model_parameters=model.parameters(),
                                                          config=dict(config)))}
    with dx.installed():
        results["install"] = caught(lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                 config=dict(config)))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = deepspeed_worker_parser()
    parser.add_argument("--deepspeed", action="store_true", help="the DeepSpeed scenarios (deepspeed launcher)")
    args = parser.parse_args()
    (deepspeed_main if args.deepspeed else torchrun_main)(args.out_dir)
