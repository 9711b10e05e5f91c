"""One run of ``bench.rare`` under a launcher (see bench/rare.py):

    torchrun --nproc_per_node 4 bench/rare_worker.py OUT.json hsdp WORKLOAD METHOD SEED
    deepspeed --num_gpus 2 bench/rare_worker.py OUT.json zero2 WORKLOAD METHOD SEED

Rank 0 writes the result to OUT.json."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.rare import METHODS, WORKLOADS, batches, build, dataset, train  # noqa: E402


def hsdp(workload: str, method: str, seed: int) -> dict:
    """fully_shard on a (2 replicas, 2 shards) mesh; the data-parallel workers are all 4 ranks, at half the
    in-process batch each, so the global batch is the in-process one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dsq_plugins.fsdp as dsq_fsdp
    data_name, model_name, lr, freeze, steps, batch = WORKLOADS[workload]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build(model_name, seed)
    for layer in model:
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if METHODS[method] is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    else:
        opt = dsq_fsdp.compressed_adam(model, lr=lr, freeze_step=freeze, compressor=METHODS[method])
    return train(model, opt, dataset(data_name), dist.get_rank(), seed, steps, batch // 2)


def zero2(workload: str, method: str, seed: int) -> dict:
    """A OneBitAdam config (or AdamW) at ZeRO stage 2 through deepspeed_ext.initialize."""
    import deepspeed_ext as dx
    data_name, model_name, lr, freeze, steps, batch = WORKLOADS[workload]
    if METHODS[method] is None:
        optimizer = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}
    else:
        optimizer = {"type": "OneBitAdam", "params": {"lr": lr, "freeze_step": freeze, "weight_decay": 0.0}}
    config = {"train_micro_batch_size_per_gpu": batch, "steps_per_print": 10**9, "zero_optimization": {"stage": 2},
              "optimizer": optimizer}
    if METHODS[method] not in (None, "sign"):
        config["doublesqueeze"] = {"compressor": METHODS[method]}
    model = build(model_name, seed)
    engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), config=config)
    xtr, ytr, xte, yte = dataset(data_name)
    rank, largest = dist.get_rank(), 0.0
    for _, idx in zip(range(steps), batches(xtr, rank, seed, batch)):
        loss = torch.nn.functional.cross_entropy(engine(xtr[idx]), ytr[idx])
        engine.backward(loss)
        engine.step()
        largest = max(largest, max(float(p.abs().max()) for p in model.parameters()))
    with torch.no_grad():
        accuracy = float((model(xte).argmax(1) == yte).float().mean())
    wired = getattr(engine, "doublesqueeze_zero", None)
    return {"accuracy": accuracy, "largest_weight": largest, "failure": None,
            "frozen_at": None if wired is None else wired.freeze_step}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, frontend, workload, method, seed = args[0], args[1], args[2], args[3], int(args[4])
    torch.set_num_threads(1)
    result = (hsdp if frontend == "hsdp" else zero2)(workload, method, seed)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
