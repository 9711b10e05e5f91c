"""FSDP2 / HSDP with DoubleSqueeze on 4 gloo ranks (torchrun): one run per
scenario, each rank writing what the tests check to OUT_DIR/rank{R}.pt."""
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dsq_plugins as dsq
import dsq_plugins.fsdp as dsq_fsdp

STEPS = 6


def build_plain():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 5))


def build(mesh, mp=None):
    model = build_plain()
    kw = {} if mp is None else {"mp_policy": mp}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, (x[:, :5] * 2 + 0.1 * torch.randn(8, 5, generator=g))


def locals_of(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def train(model, opt, steps=STEPS, start=0, nan_at=None):
    rank, losses = dist.get_rank(), []
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        if step == nan_at and rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(x).float(), y)  # a bf16 model: the loss in fp32 (torch 2.11 needs it)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def meshes():
    n = dist.get_world_size()
    return {"1d": init_device_mesh("cpu", (n,)),
            "hsdp": init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))}


def gradient_path(mesh, compressor, **options):
    model = build(mesh)
    comp = None if compressor is None else dsq_fsdp.compress(model, compressor, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = train(model, opt)
    out = {"losses": losses, "locals": locals_of(model)}
    if comp is not None:
        verdict = comp.reducer.last_step.verdict
        out.update(bytes=comp.bytes_sent, backwards=comp.steps.applied, reads=verdict and verdict.host_reads,
                   worker_error=comp.reducer.worker_error.numel(), server_error=comp.reducer.server_error.numel(),
                   padded=sum(dsq_fsdp_padded(u) for u in comp.units))
    return out


def dsq_fsdp_padded(unit):
    """The padded numel FSDP reduce-scatters for a unit (each parameter's dim 0 padded to the shard size)."""
    world = unit.group.mesh_info.shard_mesh_size
    return sum(-(-p.shape[0] // world) * world * (p.numel() // p.shape[0]) for p in unit.parameters())


def failures(mesh, **options):
    """A NaN on rank 1 in step 3: the same error everywhere, state as it was."""
    model = build(mesh)
    comp = dsq_fsdp.compress(model, "sign", **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, steps=2)
    before = copy.deepcopy(comp.local_state_dict())
    try:
        train(model, opt, steps=1, start=2, nan_at=2)
        error = None
    except dsq.NonFiniteGradientError as exc:
        error = str(exc)
    after = comp.local_state_dict()
    same, backwards = _same_state(before["reducer"], after["reducer"]), comp.steps.applied
    try:  # FSDP after an exception in its backward: does the next step go through?
        recovered = train(model, opt, steps=1, start=3)
    except Exception as exc:  # noqa: BLE001 - recorded for the test to read
        recovered = f"{type(exc).__name__}: {exc}"
    return {"error": error, "state_unchanged": same, "backwards": backwards, "recovered": recovered,
            "backwards_after": comp.steps.applied}


def _same_state(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def accumulation(mesh):
    """Two micro-batches without sync, then one with: the first exchange nothing."""
    model = build(mesh)
    comp = dsq_fsdp.compress(model, "sign")
    rank = dist.get_rank()
    model.set_requires_gradient_sync(False)
    for step in range(2):
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
    quiet = (comp.bytes_sent, comp.steps.applied)
    memories = comp.reducer.worker_error.numel()
    model.set_requires_gradient_sync(True)
    x, y = batch(2, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {"quiet_bytes": quiet[0], "quiet_backwards": quiet[1], "quiet_memories": memories,
            "bytes": comp.bytes_sent, "backwards": comp.steps.applied}


def resume(mesh, checkpoint):
    """Two steps, a checkpoint (the model's sharded state dict and the compression, through
    torch.distributed.checkpoint; the optimizer in memory), two more; then back to the checkpoint and the
    same two again: the same weights bit for bit."""
    import torch.distributed.checkpoint as dcp
    model = build(mesh)
    comp = dsq_fsdp.compress(model, "sign")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, opt, steps=2)
    opt_state = copy.deepcopy(opt.state_dict())
    dcp.save({"model": model.state_dict(), "dsq": comp}, checkpoint_id=checkpoint)
    train(model, opt, steps=2, start=2)
    first = locals_of(model)
    restored = {"model": model.state_dict(), "dsq": comp}
    dcp.load(restored, checkpoint_id=checkpoint)
    model.load_state_dict(restored["model"])
    opt.load_state_dict(opt_state)
    train(model, opt, steps=2, start=2)
    refused = {}
    for what, call in [("another rank's file", lambda: comp.load_state_dict({"rank9": b""})),
                       ("another rank's state", lambda: comp.load_local_state_dict(
                           dict(comp.local_state_dict(), rank=(dist.get_rank() + 1) % dist.get_world_size())))]:
        try:
            call()
            refused[what] = None
        except dsq.StateError as exc:
            refused[what] = str(exc)
    return {"first": first, "again": locals_of(model), "refused": refused}


def adam(mesh, compressed, freeze_step=3, **options):
    """AdamW (FSDP's own exchange), or compressed_adam frozen at ``freeze_step``."""
    model = build(mesh)
    if compressed:
        opt = dsq_fsdp.compressed_adam(model, lr=3e-3, freeze_step=freeze_step, compressor="sign", **options)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = train(model, opt, steps=2 * STEPS)
    out = {"losses": losses, "locals": locals_of(model)}
    if compressed:
        out.update(bytes=opt.compressed.comm.bytes_sent, frozen=opt.frozen, freeze_step=opt.freeze_step,
                   state_numel=sum(t.numel() for s in opt.state.values() for t in s.values()
                                   if isinstance(t, torch.Tensor) and t.dim()),
                   memories=opt.compressed.worker_error.numel() + opt.compressed.server_error.numel(),
                   memory_bytes=opt.compressed.worker_error.nbytes() + opt.compressed.server_error.nbytes(),
                   model_numel=sum(p.numel() for p in model.parameters()))
    return out


def frozen_adam(mesh):
    """compressed_adam with its middle layer frozen after it was built (its variance watched by the
    auto freeze, so that the frozen shards' slots stay apart): that layer's shards before and after."""
    model = build(mesh)
    opt = dsq_fsdp.compressed_adam(model, lr=3e-3, weight_decay=0.1, freeze_step="auto", freeze_window=2,
                                   freeze_threshold=0.5, compressor="sign")
    model[2].requires_grad_(False)
    before = locals_of(model)
    losses = train(model, opt, steps=2 * STEPS)
    return {"before": before, "after": locals_of(model), "losses": losses, "frozen": opt.frozen}


def flat_adam():
    """CompressedAdam over the world on the whole model: what HSDP with one shard per replica must equal."""
    torch.manual_seed(0)
    model = build_plain()
    opt = dsq.CompressedAdam(model.named_parameters(), comm=dsq.TorchDistributedComm(), lr=3e-3, freeze_step=3,
                             compressor="sign")
    train(model, opt, steps=2 * STEPS)
    return [p.detach().clone() for p in model.parameters()]


def bad_input(mesh):
    errors = {}
    plain = torch.nn.Linear(4, 4)
    for what, call in [("before fully_shard", lambda: dsq_fsdp.compress(plain)),
                       ("twice", lambda: dsq_fsdp.compress(model)),
                       ("adam on a 1-D mesh", lambda: dsq_fsdp.compressed_adam(build(mesh["1d"]))),
                       ("bad key", lambda: dsq_fsdp.compress(build(mesh["1d"]), "sign", bucket_size=3))]:
        if what == "twice":
            model = build(mesh["1d"])
            dsq_fsdp.compress(model)
        try:
            call()
            errors[what] = None
        except dsq.ConfigError as exc:
            errors[what] = str(exc)
    model = build(mesh["hsdp"])
    dsq_fsdp.compress(model)
    model.set_requires_all_reduce(False)
    x, y = batch(0, dist.get_rank())
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        errors["set_requires_all_reduce"] = None
    except dsq.ConfigError as exc:
        errors["set_requires_all_reduce"] = str(exc)
    return errors


def main(out_dir):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = meshes()
    out = {}
    for kind in ("1d", "hsdp"):
        out[f"native-{kind}"] = gradient_path(mesh[kind], None)
        out[f"exact-{kind}"] = gradient_path(mesh[kind], "none", error_feedback="none")
        out[f"sign-{kind}"] = gradient_path(mesh[kind], "sign")
        out[f"warm-{kind}"] = gradient_path(mesh[kind], "sign", exact_steps=2)
        out[f"failure-{kind}"] = failures(mesh[kind])
        out[f"sign-step-{kind}"] = gradient_path(mesh[kind], "sign", verdict="step")
        out[f"failure-step-{kind}"] = failures(mesh[kind], verdict="step")
    out["accumulation-hsdp"] = accumulation(mesh["hsdp"])
    out["accumulation-1d"] = accumulation(mesh["1d"])
    out["resume-hsdp"] = resume(mesh["hsdp"], os.path.join(out_dir, "checkpoint"))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    model = build(mesh["hsdp"], bf16)
    comp = dsq_fsdp.compress(model, "sign")
    out["bf16-hsdp"] = {"losses": train(model, torch.optim.SGD(model.parameters(), lr=0.05)),
                        "backwards": comp.steps.applied, "locals": locals_of(model)}
    out["adamw-hsdp"] = adam(mesh["hsdp"], False)
    out["warmup-hsdp"] = adam(mesh["hsdp"], True, freeze_step=2 * STEPS + 1)
    out["cadam-hsdp"] = adam(mesh["hsdp"], True)
    out["cadam-auto-hsdp"] = adam(mesh["hsdp"], True, freeze_step="auto", freeze_window=2, freeze_threshold=0.5)
    one_shard = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    out["cadam-one-shard"] = adam(one_shard, True)
    out["cadam-flat"] = flat_adam()
    out["cadam-frozen-layer"] = frozen_adam(mesh["hsdp"])
    out["bad"] = bad_input(mesh)
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
