"""ZeRO stage 3 with the section across two simulated hosts, both passes
compressed between them (``deepspeed_ext.zero3_params``):

    one torchrun per host (tests.helpers.launchers.run_hosts) ... OUT_DIR

(CPU accelerator, gloo.) Scenarios: DeepSpeed's own stage 3; sign with
"auto" (two levels, so hpZ's secondary partition is the replica the
parameter pass keeps), with every parameter released after use and with
DeepSpeed's default persistence (this small model is then kept whole);
and sign saved after 3 steps and resumed in a fresh engine. Each rank
saves its results to OUT_DIR/rank{R}.pt."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.workers.zero3_worker import batch, gathered, make_model, train  # noqa: E402

STEPS = 6
SIGN = {"compressor": "sign"}
#: (section, persistence threshold): 0 releases every parameter after use; None is DeepSpeed's default
SCENARIOS = {"deepspeed": (None, 0), "sign": (SIGN, 0), "sign-persistent": (SIGN, None),
             # buckets of 1 KB: the parameter pass moves each group in several pieces (zero3_params.Piece)
             "sign-pieces": ({**SIGN, "bucket_mb": 0.001}, 0)}


def new_engine(section, persistence):
    import deepspeed_ext as dx
    zero = {"stage": 3, "reduce_bucket_size": 300}
    if persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    if section is not None:
        config["doublesqueeze"] = section
    model = make_model()
    engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def forward_weights(engine, rank):
    """The model as a forward computes with it (gathered from hpZ's secondary
    partitions where they are; ``gathered`` reads the primary ones, the
    exact weights), flat, in the module's parameter order."""
    seen = {}

    def keep(module, inputs):
        for p in module.parameters(recurse=False):
            seen[id(p)] = p.detach().reshape(-1).clone()
    hooks = [m.register_forward_pre_hook(keep) for m in engine.module.modules()]
    with torch.no_grad():
        engine(batch(rank, 0)[0])
    for hook in hooks:
        hook.remove()
    return torch.cat([seen[id(p)] for p in engine.module.parameters()])


def replica_check(engine, model):
    """(whether this rank's own replica copy is exactly its partition of
    ``model``, the weights every rank's forward computes with, whether
    gathered for each use or kept whole, whether every parameter kept its
    secondary partition, the largest |master - replica| here, padding left
    out: uninitialised memory, it may hold anything, a NaN too)."""
    opt, rank = engine.optimizer, torch.distributed.get_rank()
    passes = engine.doublesqueeze_zero.parameter_pass
    starts, at = {}, 0
    for p in engine.module.parameters():  # where each parameter lies in the gathered model
        starts[id(p)], at = at, at + p.ds_numel
    matches, gap = True, 0.0
    for i, group in enumerate(opt.fp16_groups):
        layout, replica, master = passes.layouts[i], passes.replicas[i], opt.fp32_partitioned_groups_flat[i]
        for param, part, offset in zip(group, layout.partitions, layout.offsets()):
            mine = model[starts[id(param)]:starts[id(param)] + param.ds_numel][rank * part:(rank + 1) * part]
            real = slice(offset, offset + mine.numel())  # DeepSpeed leaves a last partition's padding unwritten
            matches &= torch.equal(mine, replica[real])
            if mine.numel():
                gap = max(gap, float((master[real].float() - replica[real].float()).abs().max()))
    kept = all(p.ds_secondary_tensor is not None for group in opt.fp16_groups for p in group)
    return matches, kept, gap


def nan_in_a_master(rank, verdict):
    """After 2 steps the last rank's fp32 master holds a NaN as the parameter
    pass runs: (what each rank raised, whether its replica copy and its
    secondary partitions are what they were)."""
    engine = new_engine({**SIGN, "verdict": verdict}, 0)
    train(engine, rank, 2)
    opt, passes = engine.optimizer, engine.doublesqueeze_zero.parameter_pass
    before = [r.clone() for r in passes.replicas] + [p.ds_secondary_tensor.clone() for g in opt.fp16_groups for p in g]
    if rank == torch.distributed.get_world_size() - 1:
        with torch.no_grad():
            opt.fp32_partitioned_groups_flat[0][0] = float("nan")
    try:
        passes.move_replicas()
        raised = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        raised = (type(exc).__name__, str(exc))
    after = [r for r in passes.replicas] + [p.ds_secondary_tensor for g in opt.fp16_groups for p in g]
    return raised, all(torch.equal(a, b) for a, b in zip(before, after))


def main():
    import deepspeed
    out_dir = sys.argv[1]
    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    out = {}
    for name, (section, persistence) in SCENARIOS.items():
        engine = new_engine(section, persistence)
        losses = train(engine, rank, STEPS)
        model = forward_weights(engine, rank)
        out[name] = {"losses": losses, "params": model, "masters": gathered(engine)}
        if section is not None:
            zero = engine.doublesqueeze_zero
            out[name]["pass"] = zero.parameter_pass is not None
            out[name]["pieces"] = (len(zero.parameter_pass.pieces), len(zero.parameter_pass.layouts))
            out[name]["hpz"] = engine.optimizer.zero_hpz_partition_size
            out[name]["check"] = replica_check(engine, model) if zero.parameter_pass is not None else None
            out[name]["steps"] = dict(engine.doublesqueeze.steps)
    # save after 3 steps, go on 3; a fresh engine resumed from the file must give the same 3
    ckpt = os.path.join(out_dir, "ckpt")
    engine = new_engine(SIGN, 0)
    train(engine, rank, 3)
    engine.save_checkpoint(ckpt, tag="three")
    continued = train(engine, rank, 3, first=3)
    resumed_engine = new_engine(SIGN, 0)
    resumed_engine.load_checkpoint(ckpt, tag="three")
    resumed = train(resumed_engine, rank, 3, first=3)
    out["resume"] = {"continued": (continued, gathered(engine)), "resumed": (resumed, gathered(resumed_engine))}
    out["nan"] = {verdict: nan_in_a_master(rank, verdict) for verdict in ("collective", "step")}
    save_and_leave(out, out_dir, rank)


if __name__ == "__main__":
    main()
