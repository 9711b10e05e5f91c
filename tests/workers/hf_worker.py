"""HF Trainer with DeepSpeed on CPU ranks, switched on by the config it is
handed plus one line, ``deepspeed_ext.install()``:

    deepspeed --num_gpus 2 tests/workers/hf_worker.py OUT_DIR [--zero-stage 2|3] [--one-bit-adam]
        [--verdict step]

or one torchrun per simulated host (``run_hosts``): across hosts the
section's ``hierarchy`` stays "auto", which is then two levels.

A tiny GPT-2 built from a config (nothing downloaded) trains on the
standard library's bytes (examples/lm.py). Each rank saves what the test
checks to OUT_DIR/rank{R}.pt: the reducer the engine got, the bytes it
sent, the parameters, and the losses."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deepspeed_ext  # noqa: E402
from examples.lm import load_text  # noqa: E402
from tests.helpers.launchers import deepspeed_worker_parser, save_and_leave  # noqa: E402

deepspeed_ext.install()  # the one line a Trainer script adds

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 10**9,
    "zero_optimization": {"stage": 0},
    "doublesqueeze": {"compressor": "sign", "bucket_mb": 1},
}


class Windows(torch.utils.data.Dataset):
    """Fixed windows of 33 bytes: input_ids and labels for a causal LM."""

    def __init__(self, count: int = 64):
        text = load_text("train")
        starts = torch.randint(len(text) - 33, (count,), generator=torch.Generator().manual_seed(0))
        self.windows = [text[s: s + 33] for s in starts.tolist()]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


# a config written for DeepSpeed <= 0.19.6's 1-bit Adam, with HF's "auto" values
ONE_BIT_ADAM = {"type": "OneBitAdam", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                                 "freeze_step": 2}}


def main(out_dir: str, zero_stage: int = 0, one_bit_adam: bool = False, verdict: str | None = None) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    config = {**DS_CONFIG, "zero_optimization": {"stage": zero_stage}}
    across_hosts = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) < int(os.environ.get("WORLD_SIZE", 0))
    if zero_stage == 3:  # HF Trainer's save gathers the partitioned weights into one file
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        if not across_hosts:  # on one host "auto" would reduce exactly
            config["doublesqueeze"] = {**config["doublesqueeze"], "hierarchy": "flat"}
    if verdict:
        config["doublesqueeze"] = {**config["doublesqueeze"], "verdict": verdict}
    if one_bit_adam:
        config["optimizer"] = ONE_BIT_ADAM
    args = TrainingArguments(output_dir=os.path.join(out_dir, "trainer"), deepspeed=config, use_cpu=True,
                             per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                             seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Windows())
    trainer.train()
    engine = trainer.model_wrapped
    reducer = getattr(engine, "doublesqueeze", None)
    saved = None
    if zero_stage == 3:
        trainer.save_model(os.path.join(out_dir, "saved"))
        if torch.distributed.get_rank() == 0:
            from safetensors.torch import load_file
            state = load_file(os.path.join(out_dir, "saved", "model.safetensors"))
            saved = [state[name].float() if name in state else None for name, _ in model.named_parameters()]
    # stage 3 keeps only this rank's partition of each parameter; across hosts the forward computes with the
    # replicas, which a save puts back to the exact weights (gathered after it, as the save gathered them)
    with gathered(model, zero_stage):
        params = [p.detach().float().clone() for p in model.parameters()]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    numel = sum(p.numel() for p in params)
    zero = getattr(engine, "doublesqueeze_zero", None)
    last = getattr(zero, "last_backward", None) or (reducer.last_step if reducer else None)  # (the backward's)
    verdict = last.verdict if last else None
    save_and_leave({"reducer": type(reducer).__name__, "zero": type(zero).__name__,
                    "bytes": engine.doublesqueeze_comm.bytes_sent if reducer else 0,
                    "two_level": bool(reducer and reducer.hosts.two_level), "reads": verdict and verdict.host_reads,
                    "state_bytes": reducer.state.nbytes() if reducer else 0, "numel": numel,
                    "fp32_allreduce": 2 * (size - 1) / size * 4 * numel * 4, "params": params, "losses": losses,
                    "steps": reducer.steps if reducer else {}, "frozen": getattr(zero, "frozen", None),
                    "parameter_pass": getattr(zero, "parameter_pass", None) is not None,
                    "saved": saved},
                   out_dir, rank)


def gathered(model, zero_stage: int):
    import contextlib

    import deepspeed
    return deepspeed.zero.GatheredParameters(list(model.parameters())) if zero_stage == 3 \
        else contextlib.nullcontext()


if __name__ == "__main__":
    parser = deepspeed_worker_parser()
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--one-bit-adam", action="store_true")
    parser.add_argument("--verdict", default=None)
    cli = parser.parse_args()
    main(cli.out_dir, cli.zero_stage, cli.one_bit_adam, cli.verdict)
