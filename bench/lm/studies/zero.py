"""``zero``: CompressedAdam at ZeRO-2 (the deepspeed launcher) against DeepSpeed's own AdamW."""
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
