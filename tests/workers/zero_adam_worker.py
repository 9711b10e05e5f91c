"""CompressedAdam (a OneBitAdam config) at ZeRO stages 1 and 2, one launch:

    deepspeed --num_gpus 2 tests/workers/zero_adam_worker.py OUT_DIR
    deepspeed --num_gpus 4 tests/workers/zero_adam_worker.py OUT_DIR --hosts   (2 hosts of 2 ranks)

(CPU accelerator, gloo.) Each rank saves its results to OUT_DIR/rank{R}.pt
for test_zero_adam.py."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import deepspeed_worker_parser, save_and_leave  # noqa: E402
from tests.helpers.states import memories, poisoned_step, what_raises  # noqa: E402
from tests.workers.hvd_worker import params_of, poisoned_batch  # noqa: E402
from tests.workers.zero_worker import train  # noqa: E402

FREEZE, STEPS, LR = 3, 10, 3e-3


def one_bit_config(stage, freeze=FREEZE, section=None, extra=None):
    cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": freeze, "weight_decay": 0.01}}}
    if section is not None:
        cfg["doublesqueeze"] = section
    cfg.update(extra or {})
    return cfg


def engine_for(dx, config):
    model = make_model(seed=1, hidden=32)
    engine, *_ = dx.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model


def warmup_scenario(dx, rank, stage):
    """Before the freeze: DeepSpeed's own ZeRO path with AdamW, bit for bit."""
    engine, model = engine_for(dx, one_bit_config(stage, freeze=100))
    train(engine, rank, range(5))
    reference = make_model(seed=1, hidden=32)
    adamw = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    plain, *_ = dx.initialize(model=reference, model_parameters=reference.parameters(), optimizer=adamw,
                              config={k: v for k, v in one_bit_config(stage).items() if k != "optimizer"})
    train(plain, rank, range(5))
    return params_of(model), params_of(reference)


def onebit_scenario(dx, rank, stage, section=None, extra=None, steps=STEPS, gas=1):
    engine, model = engine_for(dx, one_bit_config(stage, section=section, extra=extra))
    wired = engine.doublesqueeze_zero
    losses = train(engine, rank, range(FREEZE + 1), gas)  # the freeze, and the first compressed step
    sent = engine.doublesqueeze_comm.bytes_sent
    losses += train(engine, rank, range(FREEZE + 1, steps), gas)
    per_step = (engine.doublesqueeze_comm.bytes_sent - sent) / (steps - FREEZE - 1)
    numel = sum(p.numel() for p in model.parameters())
    never = torch.isinf(wired.denominators[0].float())  # digits' corner pixels: no gradient, ever
    m = wired.momentum_of(0, never.device)
    return {"never": int(never.sum()), "momentum_there": float(m[never].abs().sum()), "losses": losses,
            "params": params_of(model), "bytes_per_step": per_step,
            "fp32_allreduce": 2 * (2 - 1) / 2 * 4 * numel, "frozen": wired.frozen, "kind": type(wired).__name__,
            "state_bytes": wired.reducer.state.nbytes() + wired.momentum_nbytes(), "numel": numel,
            "denominator_bytes": sum(d.numel() * d.element_size() for d in wired.denominators),
            "position": wired.reducer.hosts.position(wired.comm.rank),
            "dtype": str(next(model.parameters()).dtype)}


def resume_scenario(dx, rank, stage, out_dir, section=None):
    """Eight steps straight, against five, a checkpoint, a fresh engine, three more."""
    engine, model = engine_for(dx, one_bit_config(stage, section=section))
    train(engine, rank, range(8))
    straight = params_of(model)
    engine, model = engine_for(dx, one_bit_config(stage, section=section))
    train(engine, rank, range(5))
    engine.save_checkpoint(os.path.join(out_dir, f"ckpt{stage}"), tag="five")
    engine, model = engine_for(dx, one_bit_config(stage, section=section))
    engine.load_checkpoint(os.path.join(out_dir, f"ckpt{stage}"), tag="five")
    frozen_after_load = engine.doublesqueeze_zero.frozen
    train(engine, rank, range(5, 8))
    return straight, params_of(model), frozen_after_load


def auto_scenario(dx, rank):
    """freeze_step "auto" (a loose threshold, so that it settles within the run): every rank freezes alike."""
    cfg = one_bit_config(2)
    cfg["optimizer"]["params"].update(freeze_step="auto", freeze_window=2, freeze_threshold=0.5)
    engine, model = engine_for(dx, cfg)
    losses = train(engine, rank, range(STEPS))
    return engine.doublesqueeze_zero.freeze_step, engine.doublesqueeze_zero.frozen, losses, params_of(model)


def nan_scenario(dx, rank, skip, section=None):
    """A NaN on rank 1 after the freeze: NonFiniteGradientError on every rank,
    or (on_nonfinite="skip") a step skipped everywhere; either way the model,
    the momentum and the error memories are as they were."""
    section = {**(section or {"compressor": "sign"}), "on_nonfinite": "skip"} if skip else section
    engine, model = engine_for(dx, one_bit_config(2, section=section))
    train(engine, rank, range(FREEZE + 1))
    wired = engine.doublesqueeze_zero

    def snapshot():
        return (params_of(model), {"m": wired.momentum_of(0, torch.device("cpu")), **memories(wired.reducer)},
                wired.applied_steps)
    error, unchanged = poisoned_step(engine, poisoned_batch(rank, FREEZE + 1), snapshot)
    return error, unchanged, engine.skipped_steps


def install_scenario(dx, rank):
    import deepspeed
    with dx.installed():
        model = make_model(seed=1, hidden=32)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=one_bit_config(2))
        train(engine, rank, range(FREEZE + 2))
    return type(getattr(engine, "doublesqueeze_zero", None)).__name__, engine.doublesqueeze_zero.frozen, \
        params_of(model)


#: the two-level exchange: 4 ranks as 2 hosts of 2
TWO_HOSTS = {"compressor": "sign", "hierarchy": "node", "node_size": 2}


def hosts_main(dx, rank, out_dir):
    """Two levels against flat at 4 ranks, and the two-level contract (a resume, a NaN)."""
    results = {"hosts1": onebit_scenario(dx, rank, 1, section=TWO_HOSTS),
               "hosts2": onebit_scenario(dx, rank, 2, section=TWO_HOSTS),
               "flat2": onebit_scenario(dx, rank, 2, section={"compressor": "sign", "hierarchy": "flat"}),
               "hosts-resume": resume_scenario(dx, rank, 2, out_dir, section=TWO_HOSTS),
               "hosts-nan": nan_scenario(dx, rank, skip=False, section=TWO_HOSTS),
               "one-host": onebit_scenario(dx, rank, 2, section={**TWO_HOSTS, "node_size": 4})}
    engine, _ = engine_for(dx, one_bit_config(2, section={"compressor": "sign", "hierarchy": "flat"}))
    # the two-level checkpoint resume_scenario wrote, loaded flat
    results["other-layout"] = what_raises(lambda: engine.load_checkpoint(os.path.join(out_dir, "ckpt2"), tag="five"))
    save_and_leave(results, out_dir, rank)


def main(out_dir, hosts=False):
    import deepspeed_ext as dx
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    if hosts:
        return hosts_main(dx, rank, out_dir)
    results = {}
    for stage in (1, 2):
        results[f"warmup{stage}"] = warmup_scenario(dx, rank, stage)
        results[f"onebit{stage}"] = onebit_scenario(dx, rank, stage)
    # int8 memories are the default: these two keep fp32 ones
    results["fp32"] = onebit_scenario(dx, rank, 2, section={"compressor": "sign", "error_dtype": "fp32"})
    results["gas-clip"] = onebit_scenario(dx, rank, 2, extra={"gradient_accumulation_steps": 2,
                                                              "gradient_clipping": 0.05}, gas=2)
    results["bf16"] = onebit_scenario(dx, rank, 2, extra={"bf16": {"enabled": True}})
    results["resume"] = resume_scenario(dx, rank, 2, out_dir)
    results["resume-fp32"] = resume_scenario(dx, rank, 1, out_dir, section={"compressor": "sign",
                                                                            "error_dtype": "fp32"})
    results["install"] = install_scenario(dx, rank)
    results["auto"] = auto_scenario(dx, rank)
    results["nan"] = nan_scenario(dx, rank, skip=False)
    results["nan-skip"] = nan_scenario(dx, rank, skip=True)
    save_and_leave(results, out_dir, rank)


if __name__ == "__main__":
    args = deepspeed_worker_parser(hosts=True).parse_args()
    main(args.out_dir, args.hosts)
