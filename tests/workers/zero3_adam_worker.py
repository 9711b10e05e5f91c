"""CompressedAdam (a OneBitAdam config) at ZeRO stage 3, one launch:

    deepspeed --num_gpus 2 tests/workers/zero3_adam_worker.py OUT_DIR
    deepspeed --num_gpus 4 tests/workers/zero3_adam_worker.py OUT_DIR --hosts   (2 hosts of 2 ranks)

(CPU accelerator, gloo.) Each rank saves its results to OUT_DIR/rank{R}.pt
for test_zero3_adam.py."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import deepspeed_worker_parser, save_and_leave  # noqa: E402
from tests.helpers.states import memories, poisoned_step, what_raises  # noqa: E402
from tests.workers.hvd_worker import poisoned_batch  # noqa: E402
from tests.workers.zero3_worker import gathered  # noqa: E402
from tests.workers.zero_adam_worker import FREEZE, LR, STEPS  # noqa: E402
from tests.workers.zero_adam_worker import engine_for as model_engine  # noqa: E402
from tests.workers.zero_adam_worker import one_bit_config as one_bit_config_at  # noqa: E402
from tests.workers.zero_worker import train  # noqa: E402

#: the two-level exchange: 4 ranks as 2 hosts of 2 (hpZ over each, the parameter pass's replica)
TWO_HOSTS = {"compressor": "sign", "hierarchy": "node", "node_size": 2}


def one_bit_config(freeze=FREEZE, section=None, extra=None):
    """zero_adam_worker's config at stage 3: small buckets, nothing kept whole, no clipping (see the test)."""
    zero = {"stage": 3, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0}
    return one_bit_config_at(3, freeze, section, {"gradient_clipping": 0.0, "zero_optimization": zero,
                                                  **(extra or {})})


def engine_for(dx, config):
    return model_engine(dx, config)[0]


def warmup_scenario(dx, rank):
    """Before the freeze: DeepSpeed's own stage 3 with AdamW, bit for bit."""
    engine = engine_for(dx, one_bit_config(freeze=100))
    train(engine, rank, range(4))
    reference = make_model(seed=1, hidden=32)
    adamw = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    plain, *_ = dx.initialize(model=reference, model_parameters=reference.parameters(), optimizer=adamw,
                              config={k: v for k, v in one_bit_config().items() if k != "optimizer"})
    train(plain, rank, range(4))
    return gathered(engine), gathered(plain)


def onebit_scenario(dx, rank, section=None, extra=None, steps=STEPS):
    engine = engine_for(dx, one_bit_config(section=section, extra=extra))
    wired = engine.doublesqueeze_zero
    losses = train(engine, rank, range(FREEZE + 1))  # the freeze, and the first compressed step
    sent = engine.doublesqueeze_comm.bytes_sent
    losses += train(engine, rank, range(FREEZE + 1, steps))
    per_step = (engine.doublesqueeze_comm.bytes_sent - sent) / (steps - FREEZE - 1)
    model = gathered(engine)
    kept = wired.momentum()
    never = torch.cat([torch.isinf(d).reshape(-1) for _, d in kept])
    m = torch.cat([m.reshape(-1) for m, _ in kept])
    return {"kind": type(wired).__name__, "frozen": wired.frozen, "losses": losses, "params": model,
            "bytes_per_step": per_step, "numel": model.numel(), "state_bytes": wired.state_nbytes(),
            "never": int(never.sum()), "momentum_there": float(m[never].abs().sum()),
            "position": wired.reducer.hosts.position(wired.comm.rank),
            "parameter_pass": wired.parameter_pass is not None}


def resume_scenario(dx, rank, out_dir, section=None):
    """Eight steps straight; five, a checkpoint and three more in the same
    engine; and a fresh engine that loads it and takes those three. Across
    hosts a save or a load restarts the parameter pass's replicas from the
    exact weights (``zero3_params``), so there the resumed run is the one
    that saved, not the one that never did."""
    engine = engine_for(dx, one_bit_config(section=section))
    train(engine, rank, range(8))
    straight = gathered(engine)
    engine = engine_for(dx, one_bit_config(section=section))
    train(engine, rank, range(5))
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"), tag="five")
    saved = gathered(engine)
    rebuilt = None
    if rank == 0:  # DeepSpeed's own zero_to_fp32 reads the checkpoint the section wrote
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out_dir, "ckpt"), tag="five")
        rebuilt = torch.cat([state[name].reshape(-1) for name, _ in make_model(seed=1, hidden=32).named_parameters()])
    train(engine, rank, range(5, 8))
    continued = gathered(engine)
    engine = engine_for(dx, one_bit_config(section=section))
    engine.load_checkpoint(os.path.join(out_dir, "ckpt"), tag="five")
    frozen_after_load = engine.doublesqueeze_zero.frozen
    train(engine, rank, range(5, 8))
    return {"straight": straight, "continued": continued, "resumed": gathered(engine), "frozen": frozen_after_load,
            "saved": saved, "zero_to_fp32": rebuilt}


def nan_scenario(dx, rank, section=None):
    """A NaN on rank 1 after the freeze: NonFiniteGradientError from every
    rank's backward; the model, the momentum and the memories as they were."""
    engine = engine_for(dx, one_bit_config(section=section))
    train(engine, rank, range(FREEZE + 1))
    wired = engine.doublesqueeze_zero

    def snapshot():
        return ([t.detach().clone() for t in engine.optimizer.fp32_partitioned_groups_flat],
                {**{f"m{i}": m for i, (m, _) in enumerate(wired.momentum())}, **memories(wired.reducer)},
                wired.applied_steps)
    return poisoned_step(engine, poisoned_batch(rank, FREEZE + 1), snapshot)


def install_scenario(dx, rank):
    """HF Trainer's and Accelerate's way: a plain deepspeed.initialize under install()."""
    import deepspeed
    with dx.installed():
        model = make_model(seed=1, hidden=32)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=one_bit_config())
        train(engine, rank, range(FREEZE + 2))
    wired = getattr(engine, "doublesqueeze_zero", None)
    return type(wired).__name__, wired.frozen, gathered(engine)


def hosts_main(dx, rank, out_dir):
    results = {"hosts": onebit_scenario(dx, rank, section=TWO_HOSTS),
               "flat": onebit_scenario(dx, rank, section={"compressor": "sign", "hierarchy": "flat"}),
               "hosts-resume": resume_scenario(dx, rank, out_dir, section=TWO_HOSTS),
               "hosts-nan": nan_scenario(dx, rank, section=TWO_HOSTS)}
    engine = engine_for(dx, one_bit_config(section={"compressor": "sign", "hierarchy": "flat"}))
    # the two-level checkpoint resume_scenario wrote, loaded flat
    results["other-layout"] = what_raises(lambda: engine.load_checkpoint(os.path.join(out_dir, "ckpt"), tag="five"))
    save_and_leave(results, out_dir, rank)


def main(out_dir, hosts=False):
    import deepspeed_ext as dx
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    if hosts:
        return hosts_main(dx, rank, out_dir)
    results = {"warmup": warmup_scenario(dx, rank), "onebit": onebit_scenario(dx, rank),
               "bf16": onebit_scenario(dx, rank, extra={"bf16": {"enabled": True}}),
               "resume": resume_scenario(dx, rank, out_dir), "nan": nan_scenario(dx, rank),
               "install": install_scenario(dx, rank)}
    save_and_leave(results, out_dir, rank)


if __name__ == "__main__":
    args = deepspeed_worker_parser(hosts=True).parse_args()
    main(args.out_dir, args.hosts)
