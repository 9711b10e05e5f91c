"""``fsdp``: dsq_plugins.fsdp (torchrun) against FSDP2's own exchange, with the exact control."""
from __future__ import annotations

from ..runner import _run_fsdp, launched

# (name, label, train_lm_fsdp options): FSDP2 under torchrun, every block and the model fully_shard-ed; HSDP is
# (2 replicas, n/2 shards). Bytes: the gradient exchange per rank (HSDP: what crosses the replicate dimension)
FSDP_METHODS = [
    ("adamw", "FSDP2 (1-D mesh) + AdamW, FSDP's own reduce-scatter (exact)", dict(method="adamw", mesh="1d")),
    ("hsdp-adamw", "HSDP + AdamW, FSDP's own exchange (exact)", dict(method="adamw", mesh="hsdp")),
    ("fsdp-sign", "FSDP2 (1-D mesh) + dsq_fsdp.compress, sign, + AdamW", dict(method="adamw-dsq", mesh="1d")),
    ("hsdp-sign", "HSDP + dsq_fsdp.compress, sign, + AdamW", dict(method="adamw-dsq", mesh="hsdp")),
    ("hsdp-cadam-sign", "HSDP + dsq_fsdp.compressed_adam, sign", dict(method="compressed-adam", mesh="hsdp")),
    ("hsdp-cadam-sign-fp32mem", "HSDP + dsq_fsdp.compressed_adam, sign, fp32 error memories",
     dict(method="compressed-adam", mesh="hsdp", error_dtype="fp32")),
    ("hsdp-cadam-sign-autofreeze", "HSDP + dsq_fsdp.compressed_adam, sign, freeze_step='auto'",
     dict(method="compressed-adam", mesh="hsdp", freeze="auto")),
    # the control of compressed_adam: the same algorithm (variance frozen at the same step), exact averaging
    ("hsdp-control", "HSDP + dsq_fsdp.compressed_adam, exact averaging (control)",
     dict(method="compressed-adam", mesh="hsdp", compressor="none")),
]


def fsdp(args) -> tuple[list[str], dict]:
    """dsq_plugins.fsdp against FSDP2's own exchange, with the exact control."""
    return launched(args, FSDP_METHODS, "fsdp", _run_fsdp, args.methods)
