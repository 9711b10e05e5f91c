"""The Adam studies on the LM workload (examples/lm.py: a byte-level GPT on
the standard library's sources), in-process workers unless said otherwise.

    python -m bench.lm adam     # AdamW exact / on DoubleSqueeze gradients / CompressedAdam / DeepSpeed 0.19.6
    python -m bench.lm zero     # CompressedAdam at ZeRO-2 (deepspeed launcher) vs DeepSpeed's own AdamW
    python -m bench.lm ddp      # the DDP paths (torchrun) vs DDP's own allreduce
    python -m bench.lm fsdp     # FSDP2 / HSDP (torchrun): dsq_plugins.fsdp vs FSDP's own exchange
    python -m bench.lm rq2      # 1, 2, 4, 8, 16 workers at a fixed per-worker batch
    python -m bench.lm front    # every method of adam and ddp: test loss against bytes per step

``adam`` also runs DeepSpeed 0.19.6's own OneBitAdam (bench/onebit_anchor.py,
4 processes under torchrun) unless ``--no-anchor``; the first run installs
0.19.6 into ~/.cache/dsq-plugins (a benchmark tool, never a dependency).
Each study prints a Markdown table and writes it, the raw results (JSON) and
plots to --out.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import asdict

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsq_plugins as dsq  # noqa: E402
from bench.study import prepare, study_parser  # noqa: E402
from examples.train_lm import SIZES, LMResult, train_lm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def mean_sd(values: list[float], fmt: str = "{:.4f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"


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
                   error_dtype: str = "fp32") -> LMResult:
    launcher = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(workers)]
    options = ["--engine", "deepspeed", "--zero-stage", str(stage), "--method", method, "--compressor", compressor,
               "--error-dtype", error_dtype]
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


def table(runs: dict[str, list[LMResult]], baseline: str) -> list[str]:
    """The study's Markdown table, each row against ``baseline``'s mean."""
    exact = statistics.mean(r.test_loss for r in runs[baseline])
    lines = ["| method | test loss (nats/byte) | vs exact AdamW | bits/byte | bytes / worker / step, all steps "
             "| after the freeze | fp32 allreduce ÷ bytes after the freeze |", "|---|---|---|---|---|---|---|"]
    for label, results in runs.items():
        diverged = [r.diverged_at for r in results if r.diverged_at]
        if diverged:
            lines.append(f"| {label} | diverged in {len(diverged)} of {len(results)} seeds (at steps "
                         f"{', '.join(map(str, diverged))}) | | | | | |")
            continue
        losses = [r.test_loss for r in results]
        r0 = results[0]
        gap = 100 * (statistics.mean(losses) / exact - 1)
        lines.append(f"| {label} | {mean_sd(losses)} | {gap:+.1f}% | {statistics.mean(losses) / 0.6931:.3f} "
                     f"| {r0.bytes_per_step:,.0f} | {r0.bytes_per_step_after_freeze:,.0f} "
                     f"| {r0.fp32_allreduce_bytes_per_step / r0.bytes_per_step_after_freeze:.1f}× |")
    return lines


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


def plot(runs: dict[str, list[LMResult]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, results in runs.items():
        results = [r for r in results if not r.diverged_at]
        if not results:
            continue
        steps = [s for s, _ in results[0].test_curve]
        loss = [statistics.mean(r.test_curve[i][1] for r in results) for i in range(len(steps))]
        sent = [b / 2**20 for _, b in results[0].bytes_curve]
        by_step.plot(steps, loss, marker=".", label=label, linewidth=1.2)
        by_bytes.plot(sent, loss, marker=".", label=label, linewidth=1.2)
    by_step.set_xlabel("step")
    by_bytes.set_xlabel("MiB sent per worker (cumulative)")
    by_bytes.set_xscale("log")
    for ax in (by_step, by_bytes):
        ax.set_ylabel("test loss (nats/byte)")
        ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def front(args) -> tuple[list[str], dict]:
    """Test loss against bytes per step after the freeze, every method of the
    adam and ddp studies (their cached runs; any missing one is run): the
    loss-per-byte front, and where torch's PowerSGD sits on it."""
    runs = {f"{label} (in process)": [run_in_process(args.workers, seed, args, **kw) for seed in range(args.seeds)]
            for label, kw in chosen(ADAM_METHODS, args.methods)}
    runs.update(launched(args, DDP_METHODS, "ddp", _run_ddp)[1])  # every DDP row (--methods picks adam's)
    order = sorted(runs, key=lambda k: (math.isnan(_ratio(runs[k][0])), _ratio(runs[k][0])))  # diverged last
    baseline = next(k for k in runs if k.startswith("AdamW, exact"))
    return table({k: runs[k] for k in order}, baseline), runs


def _ratio(r: LMResult) -> float:
    return r.fp32_allreduce_bytes_per_step / r.bytes_per_step_after_freeze


def plot_front(runs: dict[str, list[LMResult]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 6))
    for label, results in runs.items():
        if any(r.diverged_at for r in results):
            continue
        loss = statistics.mean(r.test_loss for r in results)
        marker = "s" if "PowerSGD" in label else "o"
        ax.scatter([_ratio(results[0])], [loss], marker=marker, s=40)
        ax.annotate(label.replace(" (in process)", ""), (_ratio(results[0]), loss), fontsize=6,
                    xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("fp32 allreduce bytes ÷ bytes per step after the freeze (log)")
    ax.set_ylabel("test loss (nats/byte)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_local_front(runs: dict[str, list[LMResult]], path: str, title: str) -> None:
    """The local-steps front: test loss (mean over seeds) against how many
    times fewer bytes than DDP a step sends after the warm-up, one line per
    method across its H (rows whose labels differ only in H), with AdamW's
    exact loss as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines: dict[str, list[tuple[float, float, str]]] = {}
    fig, ax = plt.subplots(figsize=(10, 6))
    for label, results in runs.items():
        if any(r.diverged_at for r in results):
            continue
        loss = statistics.mean(r.test_loss for r in results)
        h = re.search(r"H=(\d+), ", label)
        if h is None:
            ax.axhline(loss, linestyle="--", color="grey", linewidth=1)
            ax.text(0.01, loss, label, transform=ax.get_yaxis_transform(), fontsize=7, va="bottom")
            continue
        lines.setdefault(label.replace(h.group(0), ""), []).append((_ratio(results[0]), loss, f"H={h.group(1)}"))
    for family, points in lines.items():
        points.sort()
        ax.plot([x for x, _, _ in points], [y for _, y, _ in points], marker="o", label=family, linewidth=1.2)
        for x, y, h in points:
            ax.annotate(h, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("DDP's fp32 allreduce bytes ÷ bytes per step after the warm-up (log)")
    ax.set_ylabel("test loss (nats/byte)")
    ax.set_title("\n".join(textwrap.wrap(title, 140)), fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _local(h: int, compressor: str = "none", outer: dict | None = None, error_dtype: str | None = None,
           error_decay: float = 1.0, **params) -> dict:
    """train_lm's options for LocalSteps around AdamW, syncing every ``h`` steps after 40 exact ones,
    with the outer step ``outer`` and, compressed, the memories' ``error_decay`` (both always written out,
    so that a change of LocalSteps' defaults never reuses a cached run of the old ones)."""
    exact = compressor == "none"
    kw = dict(method="local-steps", compressor=compressor, compressor_params=params or None,
              feedback="none" if exact else "both", local=dict(sync_every=h, exact_steps=40, **(outer or DILOCO)))
    if not exact:
        kw["local"]["error_decay"] = error_decay
    if error_dtype is not None:
        kw["error_dtype"] = error_dtype
    return kw


def _defaults(h: int, outer: dict) -> dict:
    """``_local`` with LocalSteps' default compressor and memories before block scales (sign with one RMS scale
    per chunk, int8) and ``outer``."""
    return _local(h, "sign", outer=outer, error_dtype="int8", scale="rms")


def _blocks(h: int, outer: dict, block: int = 128, decay: float = 1.0) -> dict:
    """``_defaults`` with a scale per block of ``block`` elements (128: LocalSteps' compressor since block
    scales) and the memories decayed by ``decay``."""
    return _local(h, "sign", outer=outer, error_dtype="int8", error_decay=decay, scale="rms", block=block)


def _two_hosts(kw: dict, inside_host: str) -> dict:
    """``kw`` (a ``_local`` row) on 2 hosts of 2 ranks, the host's ranks averaging exactly every step or alone."""
    return dict(kw, node_size=2, local=dict(kw["local"], inside_host=inside_host))


# outer steps: DiLoCo's Nesterov SGD; the average itself; twice and three times it; Nesterov, momentum 0.5;
# LocalSteps' default
DILOCO = dict(outer_lr=0.7, outer_momentum=0.9)
PLAIN = dict(outer_lr=1.0, outer_momentum=0.0)
DOUBLE = dict(outer_lr=2.0, outer_momentum=0.0)
TRIPLE = dict(outer_lr=3.0, outer_momentum=0.0)
HALF = dict(outer_lr=1.0, outer_momentum=0.5)
O78 = dict(outer_lr=0.7, outer_momentum=0.8)  # LocalSteps' default outer step: Nesterov lr 0.7, momentum 0.8


DEFAULT_BLOCK_MARK = {128: " (LocalSteps' compressor)"}  # the block rows' label mark for LocalSteps' block
DEFAULTS_MARK = " (LocalSteps' defaults)"  # the label mark of the rows that run LocalSteps' defaults


# (name, label, train_lm options): local steps; each H has its exact control (the same local steps, exact
# averaging of the pseudo-gradient), which separates the cost of the local steps from that of the compression
LOCAL_METHODS = [
    ("adamw", "AdamW, exact average every step", dict(method="adamw")),
    # the exact baseline at other learning rates (its best is the bar)
    *[(f"adamw-lr{lr:g}", f"AdamW, exact average every step, lr {lr:g}", dict(method="adamw", lr=lr))
      for lr in (1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3)],
    *[(f"exact-h{h}", f"local steps H={h}, exact averaging, DiLoCo's outer Nesterov (lr 0.7, momentum 0.9; control)",
       _local(h)) for h in (10, 20, 50)],
    *[(f"sign-h{h}", f"local steps H={h}, sign, DiLoCo's outer Nesterov", _local(h, "sign")) for h in (10, 20, 50)],
    *[(f"topk1-h{h}", f"local steps H={h}, top-k 1%, DiLoCo's outer Nesterov", _local(h, "topk", ratio=0.01))
      for h in (10, 20, 50)],
    *[(f"randomsign0.25-h{h}", f"local steps H={h}, randomsign 1/4, DiLoCo's outer Nesterov",
       _local(h, "randomsign", ratio=0.25)) for h in (10, 20, 50)],
    # error feedback in place of the outer momentum (SparseLoCo's finding): the plain average as the outer step
    ("exact-h20-plain", "local steps H=20, exact averaging, the average as the outer step (control)",
     _local(20, outer=PLAIN)),
    ("sign-h20-plain", "local steps H=20, sign, the average as the outer step", _local(20, "sign", outer=PLAIN)),
    ("exact-h10-plain", "local steps H=10, exact averaging, the average as the outer step (control)",
     _local(10, outer=PLAIN)),
    ("sign-h10-plain", "local steps H=10, sign, the average as the outer step", _local(10, "sign", outer=PLAIN)),
    ("sign-h20-plain-layerwise", "local steps H=20, sign, a scale per tensor (layerwise), the average",
     _local(20, "sign", outer=dict(PLAIN, layerwise=True))),
    ("sign-h20-plain-int8", "local steps H=20, sign, the average, int8 error memories",
     _local(20, "sign", outer=PLAIN, error_dtype="int8")),
    ("sign-h20-rms", "local steps H=20, sign with the RMS scale, the average", _local(20, "sign", outer=PLAIN,
                                                                                       scale="rms")),
    # a longer outer step: sign's mean-scaled average is shorter than the exact one
    ("exact-h20-olr2", "local steps H=20, exact averaging, twice the average (control)", _local(20, outer=DOUBLE)),
    ("sign-h20-olr2", "local steps H=20, sign, twice the average", _local(20, "sign", outer=DOUBLE)),
    ("sign-h20-olr3", "local steps H=20, sign, three times the average",
     _local(20, "sign", outer=TRIPLE)),
    # the exact control of every row with this outer step, at each H
    *[(f"exact-h{h}-m05", f"local steps H={h}, exact averaging, outer Nesterov lr 1 momentum 0.5 (control)",
       _local(h, outer=HALF)) for h in (10, 20, 50, 100)],
    *[(f"sign-h{h}-m05", f"local steps H={h}, sign, outer Nesterov lr 1 momentum 0.5", _local(h, "sign", outer=HALF))
      for h in (10, 20, 50)],
    ("sign-h20-m05-rms", "local steps H=20, sign with the RMS scale, outer Nesterov lr 1 momentum 0.5",
     _local(20, "sign", outer=HALF, scale="rms")),
    # LocalSteps' defaults before block scales (sign with one RMS scale per chunk, outer Nesterov lr 1 momentum 0.5,
    # int8 error memories): the defaults-* rows
    *[(f"defaults-h{h}", f"local steps H={h}, LocalSteps' old defaults (sign, one RMS scale per chunk; outer "
       "Nesterov lr 1, momentum 0.5; int8 error memories)", _defaults(h, HALF))
      for h in (10, 20, 50, 100)],
    ("randomsign0.5-h20-m05", "local steps H=20, randomsign 1/2, outer Nesterov lr 1 momentum 0.5",
     _local(20, "randomsign", outer=HALF, ratio=0.5)),
    # the grid of issue 45 with LocalSteps' default outer step and memories (sign is the defaults-h rows above,
    # the controls the exact-h rows): top-k 1% and randomsign 1/4 (H=100 reaches past 10,000x fewer bytes than DDP)
    *[(f"defaults-topk1-h{h}", f"local steps H={h}, top-k 1%, LocalSteps' default outer step and memories",
       _local(h, "topk", outer=HALF, error_dtype="int8", ratio=0.01)) for h in (10, 20, 50)],
    *[(f"defaults-randomsign0.25-h{h}", f"local steps H={h}, randomsign 1/4 (RMS scale), LocalSteps' default "
       "outer step and memories", _local(h, "randomsign", outer=HALF, error_dtype="int8", ratio=0.25, scale="rms"))
      for h in (10, 20, 50, 100)],
    # the sync overlapped with the next k inner steps (overlap_steps=k; k = H: a whole round late), and its control
    *[(f"defaults-h20-ov{k}", f"local steps H=20, LocalSteps' old defaults, the sync beside the next {k} inner steps",
       _defaults(20, dict(HALF, overlap_steps=k))) for k in (1, 5, 20)],
    *[(f"exact-h20-m05-ov{k}", f"local steps H=20, exact averaging, outer Nesterov lr 1 momentum 0.5, the sync "
       f"beside the next {k} inner steps (control)", _local(20, outer=dict(HALF, overlap_steps=k))) for k in (5, 20)],
    # Streaming DiLoCo's fragments: 4 groups of parameters synced in turn, every 5 steps one of them, each sync
    # blocking or beside the next 5 inner steps (so that a round's bytes hide behind all its steps)
    *[(f"defaults-h20-f4{ov}", f"local steps H=20, LocalSteps' old defaults, 4 fragments in turn"
       f"{', each sync beside the next 5 inner steps' if ov else ''}",
       _defaults(20, dict(HALF, fragments=4, overlap_steps=5 if ov else 0))) for ov in ("", "-ov5")],
    *[(f"exact-h20-m05-f4{ov}", f"local steps H=20, exact averaging, outer Nesterov lr 1 momentum 0.5, 4 fragments "
       f"in turn{', each sync beside the next 5 inner steps' if ov else ''} (control)",
       _local(20, outer=dict(HALF, fragments=4, overlap_steps=5 if ov else 0))) for ov in ("", "-ov5")],
    # more fragments, each less late: 10 in turn, one every 2 steps, each beside the next 2
    ("defaults-h20-f10-ov2", "local steps H=20, LocalSteps' old defaults, 10 fragments in turn, each sync beside the "
     "next 2 inner steps", _defaults(20, dict(HALF, fragments=10, overlap_steps=2))),
    ("exact-h20-m05-f10-ov2", "local steps H=20, exact averaging, outer Nesterov lr 1 momentum 0.5, 10 fragments in "
     "turn, each sync beside the next 2 inner steps (control)",
     _local(20, outer=dict(HALF, fragments=10, overlap_steps=2))),
    # a late outer step without the outer momentum, which would carry the staleness on
    *[(f"sign-h20-plain-ov{k}", f"local steps H=20, sign (RMS scale), the average as the outer step, int8 memories, "
       f"the sync beside the next {k} inner steps", _defaults(20, dict(PLAIN, overlap_steps=k))) for k in (0, 20)],
    ("exact-h20-plain-ov20", "local steps H=20, exact averaging, the average as the outer step, the sync beside the "
     "next 20 inner steps (control)", _local(20, outer=dict(PLAIN, overlap_steps=20))),
    # the outer step and the inner lr at H=20, seed 0: a grid of the exact control, and sign at its best point
    *[(f"exact-h20-o{lr:g}-{mu:g}", f"local steps H=20, exact averaging, outer Nesterov lr {lr:g} momentum {mu:g} "
       "(control)", _local(20, outer=dict(outer_lr=lr, outer_momentum=mu)))
      for lr, mu in ((1.0, 0.3), (1.0, 0.7), (1.4, 0.5), (0.5, 0.85), (0.6, 0.8), (0.7, 0.8), (0.8, 0.8), (0.7, 0.85),
                     (0.4, 0.9))],
    *[(f"defaults-h20-o{lr:g}-{mu:g}", f"local steps H=20, LocalSteps' old defaults but the outer Nesterov lr {lr:g} "
       f"momentum {mu:g}", _defaults(20, dict(outer_lr=lr, outer_momentum=mu)))
      for lr, mu in ((0.7, 0.8), (0.85, 0.65))],
    ("sign-mean-h20-o0.7-0.8", "local steps H=20, sign with the mean scale, int8 memories, outer Nesterov lr 0.7 "
     "momentum 0.8", _local(20, "sign", outer=O78, error_dtype="int8",
                            scale="mean")),
    *[(f"exact-h20-{tag}-lr{lr:g}", f"local steps H=20, exact averaging, outer Nesterov lr {outer['outer_lr']:g} "
       f"momentum {outer['outer_momentum']:g}, inner lr {lr:g} (control)", dict(_local(20, outer=outer), lr=lr))
      for tag, outer, lrs in (("m05", HALF, (7e-4, 1.5e-3, 2e-3)),
                              ("o0.7-0.8", O78, (7e-4,)))
      for lr in lrs],
    # the 4 workers as 2 hosts of 2 ranks: one DiLoCo worker per host (exact inside it, every step), or every rank
    # alone with the two-level sync
    ("exact-h20-m05-2hosts", "local steps H=20, 2 hosts x 2 ranks, exact inside a host every step, exact averaging "
     "between hosts, outer Nesterov lr 1 momentum 0.5 (control)", _two_hosts(_local(20, outer=HALF), "exact")),
    ("defaults-h20-2hosts", "local steps H=20, 2 hosts x 2 ranks, LocalSteps' old defaults (exact inside a host every "
     "step, sign with one RMS scale per chunk between hosts)", _two_hosts(_defaults(20, HALF), "exact")),
    ("defaults-h20-2hosts-alone", "local steps H=20, 2 hosts x 2 ranks, every rank alone, the two-level sync (sign "
     "between hosts)", _two_hosts(_defaults(20, HALF), "alone")),
    # sign with a scale per block (bfloat16) instead of one per chunk: LocalSteps' compressor at block 128, and with
    # the outer step (lr 1, momentum 0.5) and full memories, its defaults before decayed memories
    *[(f"block{b}-h{h}", f"local steps H={h}, sign with an RMS scale per block of {b}"
       f"{DEFAULT_BLOCK_MARK.get(b, '')}, outer Nesterov lr 1 momentum 0.5, int8 memories",
       _blocks(h, HALF, b)) for h in (10, 20, 50, 100) for b in (32, 64, 128, 256) if h < 100 or b == 128],
    *[(f"block128-h20-o{lr:g}-{mu:g}", f"local steps H=20, LocalSteps' defaults before decay but the outer "
       f"Nesterov lr {lr:g} momentum {mu:g}", _blocks(20, dict(outer_lr=lr, outer_momentum=mu)))
      for lr, mu in ((1.0, 0.6), (1.2, 0.4), (0.85, 0.65), (0.7, 0.8))],
    ("block128-h20-heavyball", "local steps H=20, LocalSteps' defaults before decay but heavy-ball momentum (lr 1, "
     "momentum 0.5, not Nesterov)", _blocks(20, dict(outer_lr=1.0, outer_momentum=0.5, nesterov=False))),
    ("exact-h20-heavyball", "local steps H=20, exact averaging, heavy-ball momentum (lr 1, momentum 0.5; control)",
     _local(20, outer=dict(outer_lr=1.0, outer_momentum=0.5, nesterov=False))),
    ("block128-h20-2hosts", "local steps H=20, 2 hosts x 2 ranks, LocalSteps' defaults before decay (exact inside a "
     "host every step, sign with a scale per block of 128 between hosts)", _two_hosts(_blocks(20, HALF), "exact")),
    # decayed error memories (error_decay): the inner steps correct part of what a sync did not send themselves
    *[(f"block128-h{h}-o{lr:g}-{mu:g}-d{d:g}", f"local steps H={h}, sign with an RMS scale per block of 128, int8 "
       f"memories decayed by {d:g} at each sync, outer Nesterov lr {lr:g} momentum {mu:g}"
       f"{DEFAULTS_MARK if (lr, mu, d) == (0.7, 0.8, 0.5) else ''}",
       _blocks(h, dict(outer_lr=lr, outer_momentum=mu), decay=d))
      for h, lr, mu, ds in ((20, 1.0, 0.5, (0.5,)), (20, 0.7, 0.8, (0.0, 0.25, 0.5, 0.75)), (40, 0.7, 0.8, (0.5,)))
      for d in ds],
    # H = 40 (past 1,000x fewer bytes with sign): the exact control at three outer steps
    *[(f"exact-h40-o{lr:g}-{mu:g}", f"local steps H=40, exact averaging, outer Nesterov lr {lr:g} momentum {mu:g} "
       "(control)", _local(40, outer=dict(outer_lr=lr, outer_momentum=mu)))
      for lr, mu in ((0.7, 0.8), (1.0, 0.5), (0.6, 0.85))],
    # 2 hosts of 2 ranks, one DiLoCo worker per host, at H = 25 (past 1,000x fewer bytes per host link with sign):
    # the defaults and their exact control
    ("exact-h25-o0.7-0.8-2hosts", "local steps H=25, 2 hosts x 2 ranks, exact inside a host every step, exact "
     "averaging between hosts, outer Nesterov lr 0.7 momentum 0.8 (control)",
     _two_hosts(_local(25, outer=O78), "exact")),
    *[(f"block128-h25-o0.7-0.8-d{d:g}-2hosts", f"local steps H=25, 2 hosts x 2 ranks"
       f"{DEFAULTS_MARK if d == 0.5 else f', memories decayed by {d:g}'} (exact inside a host every step, sign with a "
       "scale per block of 128 between hosts)", _two_hosts(_blocks(25, O78, decay=d), "exact"))
      for d in (0.5, 0.25, 0.75)],
    # top-k 1% (996x at H = 20) with SparseLoCo's error feedback: memories decayed only a little, the average as
    # the outer step (error feedback in place of the outer momentum), or the defaults' outer step
    *[(f"topk1-h20-{tag}-d{d:g}", f"local steps H=20, top-k 1%, int8 memories decayed by {d:g} at each sync, "
       f"{what}", _local(20, "topk", outer=outer, error_dtype="int8", error_decay=d, ratio=0.01))
      for tag, what, outer, d in (("plain", "the average as the outer step", PLAIN, 0.95),
                                  ("o0.7-0.8", "outer Nesterov lr 0.7 momentum 0.8", O78, 0.9))],
]


def local(args) -> tuple[list[str], dict]:
    runs: dict[str, list[LMResult]] = {}
    for label, kw in chosen(LOCAL_METHODS, args.methods):
        runs[label] = [run_in_process(args.workers, seed, args, **kw) for seed in range(args.seeds)]
        print(f"{label}: {[round(r.test_loss, 4) for r in runs[label]]}", file=sys.stderr)
    lines = table(runs, LOCAL_METHODS[0][1])
    for label, results in runs.items():
        crossed = results[0].host_link_bytes_per_step_after_freeze
        if crossed:
            lines.append(f"- {label}: {crossed:,.0f} bytes per host across its link per step after the warm-up "
                         f"(DDP's fp32 ring allreduce per worker ÷ that: "
                         f"{results[0].fp32_allreduce_bytes_per_step / crossed:,.0f}×)")
    return lines, runs


STUDIES = {"adam": adam, "zero": zero, "ddp": ddp, "fsdp": fsdp, "rq2": rq2, "front": front, "local": local}


def parameters(size: str) -> int:
    from examples.lm import GPT
    return sum(p.numel() for p in GPT(SIZES[size], seed=0).parameters())


def main(argv=None) -> int:
    p = study_parser(__doc__, STUDIES, steps=600, lr=3e-3, out="runs/bench-lm")
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


if __name__ == "__main__":
    sys.exit(main())
