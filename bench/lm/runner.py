"""How a study's runs are made and kept: in process (``LocalGroup``), under a
launcher (torchrun, deepspeed) through examples/train_lm.py, or DeepSpeed
0.19.6's own OneBitAdam; each cached in --out/cache by everything that
determines it, with the code it ran recorded beside it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict

import dsq_plugins as dsq
from examples.train_lm import SIZES, LMResult, train_lm

from .tables import table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: the code each run this invocation reported was made at (a cached run keeps its own; older caches did not record it)
RUNS_MADE_AT: set[str] = set()


def code_version() -> str:
    """This checkout's commit, "+changes" where the code a run executes differs from it. A cache key
    leaves the code out (a rerun of every study at every commit costs hours), so the tables say instead
    which code their runs came from."""
    def git(*command):
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--", "dsq_plugins", "examples", "bench") else "")


def cached(args, key: dict, run) -> LMResult:
    """``run()``'s result, kept in --out/cache by everything that determines
    it, so that a study interrupted or extended reruns only what is missing.
    The code it ran is recorded beside it (``RUNS_MADE_AT``)."""
    import hashlib
    settings = dict(dict(steps=args.steps, lr=args.lr, freeze_step=args.freeze_step, batch=args.batch,
                         eval_every=args.eval_every), **key)  # the run's own settings win over the study's
    if args.size != "small":  # (the small model's runs keep the keys they were cached under)
        settings["size"] = args.size
    if settings.get("local", {}).get("error_decay") == 1.0:  # (as do runs from before error_decay: undecayed)
        settings["local"] = {k: v for k, v in settings["local"].items() if k != "error_decay"}
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = os.path.join(args.out, "cache", f"{digest}.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        RUNS_MADE_AT.add(saved.get("code", "not recorded"))
        return LMResult(**saved["result"])
    code = code_version()
    result = run()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"settings": settings, "result": asdict(result), "code": code}, f)
    RUNS_MADE_AT.add(code)
    return result


def run_in_process(workers: int, seed: int, args, **kw) -> LMResult:
    """One in-process run; ``kw`` (train_lm's options) may override the study's freeze step."""
    options = dict(steps=args.steps, lr=args.lr, freeze_step=args.freeze_step, batch=args.batch, seed=seed,
                   eval_every=args.eval_every)
    if getattr(args, "schedule", "constant") != "constant":  # (constant runs keep the keys they were cached under)
        options["schedule"] = args.schedule
    options.update(kw)
    return cached(args, dict(kind="in-process", workers=workers, **options),
                  lambda: dsq.LocalGroup(workers).run(lambda comm: train_lm(comm, gpt=SIZES[args.size],
                                                                             **options))[0])


def run_anchor(workers: int, seed: int, args, mask: bool = False) -> LMResult:
    return cached(args, dict(kind="anchor", workers=workers, seed=seed, mask=mask),
                  lambda: _run_anchor(workers, seed, args, mask))


def _run_anchor(workers: int, seed: int, args, mask: bool) -> LMResult:
    from bench.onebit_anchor import ensure_installed
    ensure_installed()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "anchor.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
               os.path.join(ROOT, "bench", "onebit_anchor.py"), "--steps", str(args.steps), "--freeze-step",
               str(args.freeze_step), "--lr", str(args.lr), "--batch", str(args.batch), "--seed", str(seed),
               "--eval-every", str(args.eval_every), "--json", out] + (["--mask"] if mask else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"the DeepSpeed 0.19.6 anchor failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            data = json.load(f)
    return LMResult(**{k: v for k, v in data.items()})


def chosen(methods: list, names: list[str] | None) -> list[tuple[str, dict]]:
    """(label, options) of the rows named (all when None), the study's exact
    baseline, its first row, always first; an unknown name is an error listing the names."""
    known = [name for name, _, _ in methods]
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise SystemExit(f"--methods: no row named {', '.join(unknown)}; this study's rows: {', '.join(known)}")
    return [(label, kw) for i, (name, label, kw) in enumerate(methods) if i == 0 or names is None or name in names]


def launched(args, methods: list, kind: str, run, names: list[str] | None = None) -> tuple[list[str], dict]:
    """A study whose runs go through a launcher, each row against the first;
    ``names``: only these rows (the first always)."""
    runs: dict[str, list[LMResult]] = {}
    methods = chosen(methods, names)
    for label, kw in methods:
        runs[label] = [cached(args, dict(kind=kind, workers=args.workers, seed=seed, **kw),
                              lambda seed=seed, kw=kw: run(args.workers, seed, args, **kw))
                       for seed in range(args.seeds)]
        print(f"{label}: {[round(r.test_loss, 4) for r in runs[label]]}", file=sys.stderr)
    return table(runs, methods[0][0]), runs


def _run_ddp(workers: int, seed: int, args, *, method: str, hook: str = "allreduce",
             compressor: str = "sign", rank: int | None = None, factors: str | None = None,
             warm_start: str | None = None, iterations: int | None = None, error_dtype: str | None = None) -> LMResult:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}"]
    return _run_launched(launcher, ["--engine", "ddp", "--method", method, "--ddp-hook", hook,
                                    "--compressor", compressor, *(["--rank", str(rank)] if rank else []),
                                    *(["--factors", factors] if factors else []),
                                    *(["--warm-start", warm_start] if warm_start else []),
                                    *(["--iterations", str(iterations)] if iterations else []),
                                    *(["--error-dtype", error_dtype] if error_dtype else [])], seed, args)


def _run_fsdp(workers: int, seed: int, args, *, method: str, mesh: str, compressor: str = "sign",
              error_dtype: str = "int8", freeze: str | None = None) -> LMResult:
    """``freeze``: the row's own freeze step (``"auto"``) in place of the study's."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}"]
    return _run_launched(launcher, ["--engine", "fsdp", "--mesh", mesh, "--method", method, "--compressor", compressor,
                                    "--error-dtype", error_dtype], seed, args,
                         overrides=["--freeze-step", freeze] if freeze else [])


def _run_deepspeed(workers: int, seed: int, args, *, method: str, stage: int, compressor: str = "sign",
                   error_dtype: str = "fp32", node_size: int | None = None) -> LMResult:
    launcher = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(workers)]
    options = ["--engine", "deepspeed", "--zero-stage", str(stage), "--method", method, "--compressor", compressor,
               "--error-dtype", error_dtype] + ([] if node_size is None else ["--node-size", str(node_size)])
    return _run_launched(launcher, options, seed, args)


def _run_launched(launcher: list[str], options: list[str], seed: int, args, overrides: list[str] = ()) -> LMResult:
    """examples/train_lm.py under ``launcher`` with the study's settings (``overrides``: the row's own,
    after them); rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "lm.json")
        cmd = launcher + [os.path.join(ROOT, "examples", "train_lm.py"), *options, "--steps", str(args.steps),
                          "--freeze-step", str(args.freeze_step), "--lr", str(args.lr), "--batch", str(args.batch),
                          "--seed", str(seed), "--eval-every", str(args.eval_every), "--size", args.size,
                          "--json", out, *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(launcher[:2])} run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(out) as f:
            return LMResult(**json.load(f))
