"""``ddp``: the DDP paths (torchrun) against DDP's own allreduce and torch's PowerSGD hook."""
from __future__ import annotations

from ..runner import _run_ddp, launched

def _hook_lowrank(name: str, rank: int, factors: str, warm_start: str, iterations: int | None = None,
                  error_dtype: str | None = None) -> tuple:
    """A DDP_METHODS row: the DoubleSqueeze hook with lowrank in front of AdamW, labelled from its options
    (error memories in fp32, train_lm_ddp's default, unless ``error_dtype`` says otherwise)."""
    how = "served bases" if warm_start == "basis" else f"{warm_start} warm start"
    more = f", {iterations} iterations" if iterations else ""
    options = dict(method="adamw", hook="dsq", compressor="lowrank", rank=rank, factors=factors, warm_start=warm_start)
    if iterations:
        options["iterations"] = iterations
    if error_dtype:
        options["error_dtype"] = error_dtype
        more += f", {error_dtype} error memories"
    return (name, f"DDP + the DoubleSqueeze hook, lowrank rank {rank}, {factors} factors, {how}{more}, + AdamW",
            options)


# (name, label, train_lm_ddp options): PyTorch DDP under torchrun
DDP_METHODS = [
    ("adamw", "DDP's allreduce + AdamW (exact)", dict(method="adamw", hook="allreduce")),
    ("cadam-sign", "DDP + dsq_ddp.compressed_adam, sign", dict(method="compressed-adam")),
    ("hook-sign", "DDP + the DoubleSqueeze hook, sign, + AdamW", dict(method="adamw", hook="dsq")),
    # torch's own one-line compression for DDP, exact for the same first steps
    ("powersgd1", "DDP + torch's PowerSGD hook, rank 1, + AdamW", dict(method="adamw", hook="powersgd1")),
    ("powersgd2", "DDP + torch's PowerSGD hook, rank 2, + AdamW", dict(method="adamw", hook="powersgd2")),
    ("powersgd4", "DDP + torch's PowerSGD hook, rank 4, + AdamW", dict(method="adamw", hook="powersgd4")),
    # the control of compressed_adam: the same algorithm (variance frozen at the same step), exact averaging
    ("control",
     "DDP + dsq_ddp.compressed_adam, exact averaging (control)", dict(method="compressed-adam", compressor="none")),
    # the library's low-rank operator through its hook, against PowerSGD at the same rank (fp32 factors where a
    # row does not say: the operator's default when they were measured, bf16 since)
    ("hook-lowrank1-own", "DDP + the DoubleSqueeze hook, lowrank rank 1, own warm start, + AdamW", dict(
        method="adamw", hook="dsq", compressor="lowrank", rank=1, factors="fp32", warm_start="own")),
    # with bf16 factors: half the bytes of the row above
    ("hook-lowrank1-bf16-own",
     "DDP + the DoubleSqueeze hook, lowrank rank 1, bf16 factors, own warm start, + AdamW", dict(
        method="adamw", hook="dsq", compressor="lowrank", rank=1, factors="bf16", warm_start="own")),
    ("hook-lowrank2-bf16-own",
     "DDP + the DoubleSqueeze hook, lowrank rank 2, bf16 factors, own warm start, + AdamW", dict(
        method="adamw", hook="dsq", compressor="lowrank", rank=2, factors="bf16", warm_start="own")),
    # every sender starts from the Q the owner served (one Q for all, as PowerSGD's)
    ("hook-lowrank1", "DDP + the DoubleSqueeze hook, lowrank rank 1, served warm start, + AdamW", dict(
        method="adamw", hook="dsq", compressor="lowrank", rank=1, factors="fp32", warm_start="served")),
    _hook_lowrank("hook-lowrank1-bf16", 1, "bf16", "served"),
    _hook_lowrank("hook-lowrank1-fp16", 1, "fp16", "served"),
    _hook_lowrank("hook-lowrank4-bf16", 4, "bf16", "served"),
    # HookState's own default memories (int8), as the README's line for PowerSGD users leaves them
    *[_hook_lowrank(f"hook-lowrank{r}-bf16-int8", r, "bf16", "served", error_dtype="int8") for r in (1, 4)],
    # two power iterations per step (each sender's and the owner's): the same bytes, a closer approximation
    *[_hook_lowrank(f"hook-lowrank{r}-bf16-it2", r, "bf16", "served", iterations=2) for r in (1, 4)],
    # every rank projects onto the bases the owner served (warm_start="basis"): the mean is served exactly
    *[_hook_lowrank(f"hook-lowrank{r}-basis-{f}", r, f, "basis") for r in (1, 4) for f in ("fp32", "bf16")],
]


def ddp(args) -> tuple[list[str], dict]:
    """The DDP paths (dsq_plugins.ddp) against DDP's own allreduce."""
    return launched(args, DDP_METHODS, "ddp", _run_ddp, args.methods)
