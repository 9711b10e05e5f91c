"""``zero``: CompressedAdam at ZeRO-2 (the deepspeed launcher) against DeepSpeed's own AdamW;
``zero3``: AdamW at ZeRO-3 on compressed gradients, and a OneBitAdam config at ZeRO-3, against
DeepSpeed's own ZeRO-3."""
from __future__ import annotations

from ..runner import _run_deepspeed, launched

# (name, label, train_lm_deepspeed options): the DeepSpeed launcher, the optimizer state partitioned
ZERO_METHODS = [
    ("adamw", "ZeRO-2, DeepSpeed's own AdamW (its bytes: an fp32 allreduce's)", dict(method="adamw", stage=2)),
    ("control", "ZeRO-2, OneBitAdam config, exact averaging (control)", dict(method="compressed-adam", stage=2,
                                                                   compressor="none")),
    ("cadam-sign", "ZeRO-2, OneBitAdam config: CompressedAdam, sign", dict(method="compressed-adam", stage=2)),
    ("cadam-sign-int8mem",
     "ZeRO-2, OneBitAdam config, sign, int8 error memories", dict(method="compressed-adam", stage=2,
                                                                   error_dtype="int8")),
]


def zero(args) -> tuple[list[str], dict]:
    """CompressedAdam under ZeRO-2 (deepspeed_ext.zero_adam) against
    DeepSpeed's own ZeRO-2 AdamW and the exact control of the same algorithm."""
    return launched(args, ZERO_METHODS, "deepspeed", _run_deepspeed, args.methods)

# AdamW behind the section at ZeRO-3, as a stage-3 user has it; then a OneBitAdam config there
ZERO3_METHODS = [
    ("adamw", "ZeRO-3, DeepSpeed's own AdamW (its bytes: an fp32 allreduce's)", dict(method="adamw", stage=3)),
    ("adamw-exact", "ZeRO-3, AdamW, the section's exact gradient pass (control)", dict(method="adamw-dsq", stage=3,
                                                                                       compressor="none")),
    ("adamw-bf16", "ZeRO-3, AdamW, bf16 gradient pass (its bytes only)", dict(method="adamw-dsq", stage=3,
                                                                             compressor="bf16")),
    ("adamw-sign", "ZeRO-3, AdamW, sign gradient pass (its bytes only)", dict(method="adamw-dsq", stage=3,
                                                                             compressor="sign")),
    # the ranks as hosts of 2 (run with --workers 4): both passes compressed between them, exact inside
    ("adamw-bf16-hosts", "ZeRO-3, AdamW, bf16, 2 hosts x 2: both passes between hosts",
     dict(method="adamw-dsq", stage=3, compressor="bf16", node_size=2)),
    ("adamw-sign-hosts", "ZeRO-3, AdamW, sign, 2 hosts x 2: both passes between hosts",
     dict(method="adamw-dsq", stage=3, compressor="sign", node_size=2)),
    # a OneBitAdam config at stage 3 (deepspeed_ext.zero3_adam), the hosts as above, and its exact control
    ("onebit-control-hosts", "ZeRO-3, OneBitAdam config, exact averaging, 2 hosts x 2 (control)",
     dict(method="compressed-adam", stage=3, compressor="none", node_size=2)),
    ("onebit-sign-hosts", "ZeRO-3, OneBitAdam config, sign, int8 memories, 2 hosts x 2",
     dict(method="compressed-adam", stage=3, compressor="sign", error_dtype="int8", node_size=2)),
]


def zero3(args) -> tuple[list[str], dict]:
    """AdamW at ZeRO-3 with the section compressing its gradient pass
    (``deepspeed_ext.zero3``, ``hierarchy`` "flat" so that one host compresses
    as hosts would) against DeepSpeed's own stage 3."""
    return launched(args, ZERO3_METHODS, "deepspeed", _run_deepspeed, args.methods)
