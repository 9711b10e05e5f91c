"""``rq2``: 1, 2, 4, 8 and 16 workers at a fixed per-worker batch."""
from __future__ import annotations

import sys

from examples.train_lm import LMResult

from ..runner import run_in_process
from ..tables import mean_sd

def rq2(args) -> tuple[list[str], dict]:
    runs: dict[str, list[LMResult]] = {}
    for n in (1, 2, 4, 8, 16):
        for label, kw in (("AdamW, exact", dict(method="adamw")), ("CompressedAdam, sign", dict(
                method="compressed-adam", compressor="sign"))):
            key = f"{label}, n={n}"
            runs[key] = [run_in_process(n, seed, args, **kw) for seed in range(args.seeds)]
            print(f"{key}: {[round(r.test_loss, 4) for r in runs[key]]}", file=sys.stderr)
    lines = [f"| workers | AdamW exact: test loss | steps to {args.target} | CompressedAdam sign: test loss "
             f"| steps to {args.target} |", "|---|---|---|---|---|"]
    for n in (1, 2, 4, 8, 16):
        cells = []
        for label in ("AdamW, exact", "CompressedAdam, sign"):
            results = runs[f"{label}, n={n}"]
            reach = [next((s for s, loss in r.test_curve if loss <= args.target), None) for r in results]
            cells += [mean_sd([r.test_loss for r in results]),
                      "not reached" if None in reach else mean_sd([float(s) for s in reach], "{:.0f}")]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines, runs
