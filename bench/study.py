"""What every study command shares: its command line and where it writes."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import torch


def study_parser(doc: str, studies: dict[str, Callable], *, steps: int, lr: float, out: str,
                 workers: int = 4, seeds: int = 3) -> argparse.ArgumentParser:
    """The options every study takes, with this benchmark's defaults; add its own to the result."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("study", choices=list(studies))
    p.add_argument("--workers", type=int, default=workers)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--seeds", type=int, default=seeds)
    p.add_argument("--out", default=out)
    return p


def prepare(args: argparse.Namespace) -> None:
    """One thread per in-process rank (the ranks are the parallelism) and the output folder."""
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)


def publish(out: str, name: str, text: str, results: Any) -> None:
    """Print a study's table and keep it, with its runs, as ``out/name.md`` and ``out/name.json``."""
    print(text)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
