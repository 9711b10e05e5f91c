"""The command line of ``python -m bench.lm``: a study by name, its table,
raw results and plots written to --out."""
from __future__ import annotations

import json
import os
from dataclasses import asdict

from bench.study import prepare, study_parser
from examples.train_lm import SIZES

from . import __doc__ as usage
from .plots import plot, plot_front, plot_local_front
from .runner import RUNS_MADE_AT
from .studies import adam, ddp, front, fsdp, local, rq2, zero

STUDIES = {"adam": adam.adam, "zero": zero.zero, "zero3": zero.zero3, "ddp": ddp.ddp, "fsdp": fsdp.fsdp, "rq2": rq2.rq2,
           "front": front.front, "local": local.local}


def parameters(size: str) -> int:
    from examples.lm import GPT
    return sum(p.numel() for p in GPT(SIZES[size], seed=0).parameters())


def main(argv=None) -> int:
    p = study_parser(usage, STUDIES, steps=600, lr=3e-3, out="runs/bench-lm")
    p.add_argument("--freeze-step", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--schedule", default="constant", choices=["constant", "cosine"],
                   help="the learning rate over the run, in-process studies (examples/train_lm.py lr_factor)")
    p.add_argument("--size", default="small", choices=list(SIZES), help="the model (examples/train_lm.py --size)")
    p.add_argument("--target", type=float, default=2.3, help="rq2: the test loss whose first reaching is counted")
    p.add_argument("--no-anchor", action="store_true", help="adam: skip DeepSpeed 0.19.6's OneBitAdam")
    p.add_argument("--methods", type=lambda v: v.split(","), default=None,
                   help="run only these rows of the study's methods, by name (comma-separated; its first row, its "
                        "exact baseline, is always run)")
    p.add_argument("--anchor-seeds", type=int, default=None,
                   help="adam: seeds for DeepSpeed's OneBitAdam (default: --seeds; each is 4 processes)")
    p.prog = "python -m bench.lm"
    args = p.parse_args(argv)
    prepare(args)
    lines, runs = STUDIES[args.study](args)
    header = (f"{args.study}: byte-level GPT ({parameters(args.size):,} parameters) on the standard library's sources, "
              f"{args.workers if args.study != 'rq2' else 'n'} workers, batch {args.batch} x 64 bytes per worker, "
              f"{args.steps} steps, lr {args.lr}, freeze step {args.freeze_step} (CompressedAdam), "
              f"{args.seeds} seeds (mean ± std)")
    if args.study == "adam" and not args.no_anchor and args.anchor_seeds not in (None, args.seeds):
        header += f"; DeepSpeed's OneBitAdam {args.anchor_seeds} seed(s)"
    text = header + "\n\n" + "\n".join(lines) + f"\n\nRuns made at: {', '.join(sorted(RUNS_MADE_AT)) or 'none'}"
    print(text)
    with open(os.path.join(args.out, f"{args.study}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, f"{args.study}.json"), "w") as f:
        json.dump({k: [asdict(r) for r in v] for k, v in runs.items()}, f)
    (plot_front if args.study == "front" else plot)(runs, os.path.join(args.out, f"{args.study}.png"), header)
    if args.study == "local":
        plot_local_front(runs, os.path.join(args.out, "local-front.png"), header)
    return 0
