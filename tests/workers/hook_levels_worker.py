"""The DDP hook in two levels (2 hosts of 2 ranks, forced with node_size) on
torch.distributed, with verdicts judged per collective and once per step,
inline and on its thread: the model each gives, and the host reads of the
last deferred step.

    torchrun --nproc_per_node 4 tests/workers/hook_levels_worker.py OUT_DIR
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins.ddp as dsq_ddp  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402


def train(rank: int, verdict: str, overlap: bool) -> tuple[torch.Tensor, int | None, bool]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)  # several buckets
    state = dsq_ddp.HookState(compressor="sign", hierarchy="node", node_size=2, verdict=verdict, overlap=overlap)
    ddp.register_comm_hook(state, dsq_ddp.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    verdict_of_last = state.reducer.last_step.verdict
    return (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            verdict_of_last and verdict_of_last.host_reads, state.reducer.two_level is not None)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {(v, o): train(rank, v, o) for v in ("collective", "step") for o in (False, True)}
    save_and_leave(results, sys.argv[1], rank)
