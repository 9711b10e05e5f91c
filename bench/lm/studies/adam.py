"""``adam``: AdamW exact, AdamW on DoubleSqueeze gradients, CompressedAdam, and DeepSpeed 0.19.6's own
OneBitAdam, in process."""
from __future__ import annotations

import sys

from examples.train_lm import LMResult

from ..runner import chosen, run_anchor, run_in_process
from ..tables import table

def _momentum(compressor: str, **params) -> dict:
    """train_lm's options for CompressedAdam with this momentum compressor."""
    return dict(method="compressed-adam", compressor=compressor, compressor_params=params)


# (name for --methods, label, train_lm options); the first row is the study's exact baseline
ADAM_METHODS = [
    ("adamw", "AdamW, exact average", dict(method="adamw")),
    ("adamw-dsq-sign", "AdamW on DoubleSqueeze gradients, sign", dict(method="adamw-dsq", compressor="sign")),
    ("adamw-dsq-topk1", "AdamW on DoubleSqueeze gradients, top-k 1%", dict(method="adamw-dsq", compressor="topk",
                                                        compressor_params={"ratio": 0.01})),
    ("cadam-sign", "CompressedAdam, sign (RMS scale, the default)", dict(method="compressed-adam", compressor="sign")),
    ("cadam-sign-freeze100",
     "CompressedAdam, sign, freeze at step 100", dict(method="compressed-adam", compressor="sign", freeze_step=100)),
    ("cadam-sign-meanscale", "CompressedAdam, sign, mean scale", dict(method="compressed-adam", compressor="sign",
                                              compressor_params={"scale": "mean"})),
    ("cadam-topk1",
     "CompressedAdam, top-k 1%", dict(method="compressed-adam", compressor="topk", compressor_params={"ratio": 0.01})),
    ("cadam-topk1-layerwise", "CompressedAdam, top-k 1%, layer-wise", dict(method="compressed-adam", compressor="topk",
                                                  compressor_params={"ratio": 0.01}, layerwise=True)),
    ("cadam-topk5",
     "CompressedAdam, top-k 5%", dict(method="compressed-adam", compressor="topk", compressor_params={"ratio": 0.05})),
    # the sub-bit operator (one byte per block of 32 elements)
    ("cadam-blocksign", "CompressedAdam, blocksign (block 32)", dict(method="compressed-adam", compressor="blocksign")),
    ("adamw-dsq-blocksign",
     "AdamW on DoubleSqueeze gradients, blocksign (block 32)", dict(method="adamw-dsq", compressor="blocksign")),
    # the control of the compressed rows: the same algorithm (variance frozen at the same step), exact averaging
    ("control", "Frozen-variance control: CompressedAdam with exact averaging", dict(method="compressed-adam",
                                                                          compressor="none")),
    # compact error memories (error_dtype)
    ("cadam-sign-bf16mem",
     "CompressedAdam, sign, bf16 error memories", dict(method="compressed-adam", compressor="sign",
                                                       error_dtype="bf16")),
    ("cadam-sign-int8mem",
     "CompressedAdam, sign, int8 error memories", dict(method="compressed-adam", compressor="sign",
                                                       error_dtype="int8")),
    ("cadam-sign-autofreeze",
     "CompressedAdam, sign, freeze_step='auto'", dict(method="compressed-adam", compressor="sign",
                                                       freeze_step="auto")),
    # low-rank momentum (power iteration per chunk, compressors/lowrank.py), below sign's bytes; fp32 factors,
    # the operator's default when these rows were measured (bf16 since)
    *[(f"cadam-lowrank{r}-own", f"CompressedAdam, lowrank rank {r}, own warm start",
       _momentum("lowrank", rank=r, warm_start="own", factors="fp32"))
      for r in (1, 4)],
    # below one bit and still dense over a few steps: the signs of a shared random fraction (randomsign)
    *[(f"cadam-randomsign{name}", f"CompressedAdam, randomsign {label} (RMS scale)",
       _momentum("randomsign", ratio=ratio, scale="rms"))
      for name, label, ratio in (("0.5", "1/2", 0.5), ("0.33", "1/3", 1 / 3), ("0.25", "1/4", 0.25),
                                 ("0.3", "0.3", 0.3))],
    # low-rank momentum with the default warm start (the Q the owner served, one for every sender)
    *[(f"cadam-lowrank{r}", f"CompressedAdam, lowrank rank {r}",
       _momentum("lowrank", rank=r, warm_start="served", factors="fp32"))
      for r in (1, 4)],
    # randomsign at about 100x fewer bytes after the freeze (the front target's edge)
    ("cadam-randomsign0.32",
     "CompressedAdam, randomsign 0.32 (RMS scale)", _momentum("randomsign", ratio=0.32, scale="rms")),
    # the same bytes split unevenly between the passes: workers 0.25, the owner 0.39, and the other way round
    *[(f"cadam-randomsign{w}w{s}s", f"CompressedAdam, randomsign {w} workers / {s} server (RMS scale)",
       dict(_momentum("randomsign", ratio=w, scale="rms"), server_compressor="randomsign",
            server_compressor_params={"ratio": s, "scale": "rms"}))
      for w, s in ((0.25, 0.39), (0.39, 0.25))],
    # the two-level exchange: the 4 workers as 2 hosts of 2 ranks, exact inside a host, sign between hosts
    ("cadam-sign-2hosts", "CompressedAdam, sign, two-level (2 hosts x 2 ranks)",
     dict(method="compressed-adam", compressor="sign", node_size=2)),
    ("adamw-dsq-sign-2hosts", "AdamW on DoubleSqueeze gradients, sign, two-level (2 hosts x 2 ranks)",
     dict(method="adamw-dsq", compressor="sign", node_size=2)),
]
ANCHOR = "DeepSpeed 0.19.6 OneBitAdam (its code; DoubleSqueezeBackend for its NCCL backend)"
ANCHOR_MASKED = "DeepSpeed 0.19.6 OneBitAdam with the exp_avg_mask its documentation asks for"


def adam(args) -> tuple[list[str], dict]:
    runs: dict[str, list[LMResult]] = {}
    for label, kw in chosen(ADAM_METHODS, args.methods):
        runs[label] = [run_in_process(args.workers, seed, args, **kw) for seed in range(args.seeds)]
        print(f"{label}: {[round(r.test_loss, 4) for r in runs[label]]}, frozen at "
              f"{[r.frozen_at for r in runs[label]]}", file=sys.stderr)
    if not args.no_anchor:
        for label, mask in ((ANCHOR, False), (ANCHOR_MASKED, True)):
            runs[label] = [run_anchor(args.workers, seed, args, mask)
                           for seed in range(args.anchor_seeds if args.anchor_seeds is not None else args.seeds)]
            print(f"{label}: {[round(r.test_loss, 4) for r in runs[label]]}", file=sys.stderr)
    return table(runs, ADAM_METHODS[0][1]), runs
