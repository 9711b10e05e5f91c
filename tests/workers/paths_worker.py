"""The round's user paths on one device and backend, for test_cuda_paths.py:
the DDP hook's two-level exchange (sign), the DDP hook with lowrank (rank 1,
bf16 factors, served warm start), the DDP hook handing its verdict to a fused
AdamW on the device, the DDP hook with a sparse gradient, the DDP hook with deferred verdicts
(sign) inline in backward and on its thread, LocalSteps' defaults, LocalSteps exact
inside a host and overlapped with the next inner steps, and FSDP2 (sign) on
a 1-D mesh and on an HSDP mesh (on nccl: FSDP2 on GPUs over gloo is not a
configuration torch supports; a run of 4 gloo ranks on one GPU crashed).

    DSQ_TEST_DEVICE=cuda DSQ_TEST_BACKEND=nccl torchrun --nproc_per_node 1 tests/workers/paths_worker.py OUT_DIR

Each scenario runs alone: what one raises is saved as its result (its type
and message), so a device run reports every path, not the first failure.
Each rank saves {scenario: {"losses", "params"} or {"error"}} to
OUT_DIR/rank{R}.pt."""
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
import dsq_plugins.ddp as dsq_ddp  # noqa: E402
import dsq_plugins.fsdp as dsq_fsdp  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402

DEVICE = torch.device(os.environ.get("DSQ_TEST_DEVICE", "cpu"))
STEPS = 6


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 5)).to(DEVICE)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    y = torch.randint(0, 5, (8,), generator=g)
    return x.to(DEVICE), y.to(DEVICE)


def train(model, opt) -> list:
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def finish(model, losses, **more) -> dict:
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu() for p in model.parameters()]
    return {"losses": losses, "params": params, **more}


def ddp_hook(**options) -> dict:
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = dsq_ddp.HookState(**options)
    ddp.register_comm_hook(state, dsq_ddp.hook)
    losses = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
    return finish(model, losses, bytes=state.reducer.comm.bytes_sent, two_level=state.reducer.hosts.two_level)


class SparseBag(torch.nn.Module):
    """Token ids -> 5 classes through an embedding bag with sparse gradients, then ``net()``'s layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.EmbeddingBag(40, 16, sparse=True)
        self.rest = net()

    def forward(self, tokens):
        return self.rest(self.emb(tokens))


def ddp_hook_sparse() -> dict:
    """The hook with a sparse gradient in its own bucket (averaged exactly, published from the side stream)."""
    model = SparseBag().to(DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = dsq_ddp.HookState(compressor="sign", hierarchy="flat", verdict="step")
    ddp.register_comm_hook(state, dsq_ddp.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        tokens = (x.abs() * 10).long().remainder(40)[:, :4]
        opt.zero_grad()
        loss = F.cross_entropy(ddp(tokens), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return finish(model, losses, bytes=state.reducer.comm.bytes_sent)


def ddp_hook_late() -> dict:
    """The hook handing its verdict to AdamW(fused=True) on the device (``HookState(optimizer=...)``). On
    CUDA over nccl, once DDP's layout is stable, nothing in an iteration's backward() and step() may wait
    for the device: torch's sync debug mode turns any such wait into an error."""
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
    state = dsq_ddp.HookState(compressor="sign", hierarchy="flat", verdict="step", optimizer=opt)
    ddp.register_comm_hook(state, dsq_ddp.hook)
    strict = DEVICE.type == "cuda" and dist.get_backend() == "nccl"  # (gloo copies CUDA tensors through the host)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        if strict and step >= 3:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default") if strict else None
        losses.append(loss.item())
    state.settle()
    return finish(model, losses, bytes=state.reducer.comm.bytes_sent, strict=strict)


def local_steps(**options) -> dict:
    model = net()
    opt = dsq.LocalSteps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=2, exact_steps=0, **options)
    losses = train(model, opt)
    opt.finish()  # an overlapped sync still in flight is applied; without overlap there is none
    return finish(model, losses, syncs=opt.syncs, bytes=opt.comm.bytes_sent)


def fsdp(shape) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh(DEVICE.type, shape, mesh_dim_names=names)
    model = net()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comp = dsq_fsdp.compress(model, "sign")
    losses = train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return finish(model, losses, bytes=comp.bytes_sent)


def main(out_dir: str) -> None:
    backend = os.environ.get("DSQ_TEST_BACKEND", "gloo")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend)
    n = dist.get_world_size()
    hosts = 2 if n % 2 == 0 else 1
    scenarios = {
        "two-level": lambda: ddp_hook(compressor="sign", hierarchy="node", node_size=n // hosts),
        "lowrank": lambda: ddp_hook(compressor="lowrank", compressor_params={"rank": 1, "factors": "bf16",
                                                                            "warm_start": "served"}),
        # the hook as a GPU runs it (verdicts deferred to the step's end), inline in backward and on its thread
        "hook-inline": lambda: ddp_hook(compressor="sign", hierarchy="flat", verdict="step", overlap=False),
        "hook-thread": lambda: ddp_hook(compressor="sign", hierarchy="flat", verdict="step", overlap=True),
        "hook-late": ddp_hook_late,
        "hook-sparse": ddp_hook_sparse,
        # (the hook's work on backward's own stream, where the others run on its side stream)
        "hook-one-stream": lambda: ddp_hook(compressor="sign", hierarchy="flat", verdict="step", side_stream=False),
        "local-steps": local_steps,
        # deferred verdicts, what "auto" picks on CUDA, on the CPU too: in two levels they count a few header
        # bytes more than the collective protocol, and the bytes are compared
        "local-steps-hosts-overlapped": lambda: local_steps(hierarchy="node", node_size=n // hosts, overlap_steps=2,
                                                            verdict="step"),
        "fsdp": lambda: fsdp((n,)),
        "hsdp": lambda: fsdp((hosts, n // hosts)),
    }
    if DEVICE.type == "cuda" and backend == "gloo":  # FSDP2 on GPUs is an nccl configuration
        del scenarios["fsdp"], scenarios["hsdp"]
    results = {}
    for name, run in scenarios.items():
        try:
            results[name] = run()
        except Exception as exc:  # noqa: BLE001 -- every path's outcome is the result
            results[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"}
        dist.barrier()
    save_and_leave(results, out_dir, dist.get_rank())


if __name__ == "__main__":
    main(sys.argv[1])
