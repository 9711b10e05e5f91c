"""The paper's convergence questions on real data (sklearn digits, the main
job's MLP and loop, in-process workers).

    python -m bench.convergence rq1          # compressors x error feedback vs uncompressed, 3 seeds
    python -m bench.convergence rq2          # n = 1, 2, 4, 8, 16 workers at a fixed per-worker batch
    python -m bench.convergence rq4          # biased/unbiased and mixed worker/server operators
    python -m bench.convergence layerwise    # layer-wise against whole-model compression
    python -m bench.convergence staleness    # staleness 0 against 1
    python -m bench.convergence stability    # learning-rate map with momentum 0.9
    python -m bench.convergence subbit       # below one bit per element (blocksign) against sign and top-k
    python -m bench.convergence errordtype   # error memories in fp32, bf16 and int8

Each prints a Markdown table and writes it, with a PNG, to --out.
"""
from __future__ import annotations

import os
import statistics
import sys
import textwrap

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsq_plugins as dsq  # noqa: E402
from bench.study import prepare, study_parser  # noqa: E402
from examples.train_digits import train  # noqa: E402


def run(workers: int, seed: int, **kw):
    """One training run's RunResult, or None when it diverged (the reducer
    stopped it with NonFiniteGradientError)."""
    try:
        return dsq.LocalGroup(workers).run(lambda comm: train(comm, seed=seed, **kw))[0]
    except dsq.NonFiniteGradientError:
        return None


def over_seeds(args, workers: int | None = None, **kw) -> list:
    """One run per seed at the study's steps and learning rate (None where it diverged)."""
    return [run(workers or args.workers, seed, steps=args.steps, lr=args.lr, **kw) for seed in range(args.seeds)]


def bytes_per_step(results) -> float:
    """Bytes per worker per step (the same for every seed), from any run that finished."""
    return next((r.bytes_per_step for r in results if r is not None), float("nan"))


def mean_curve(results) -> list[float]:
    return [statistics.mean(v) for v in zip(*(r.losses for r in results if r is not None))]


def smooth(values: list[float], width: int = 20) -> list[float]:
    return [sum(values[max(0, i - width + 1): i + 1]) / len(values[max(0, i - width + 1): i + 1])
            for i in range(len(values))]


def summarize(results) -> tuple[str, str]:
    diverged = sum(r is None for r in results)
    results = [r for r in results if r is not None]
    if not results:
        return "diverged", "—"
    if diverged:
        acc, loss = summarize(results)
        return f"{acc} ({diverged} of {diverged + len(results)} seeds diverged)", loss
    accs = [r.test_accuracy for r in results]
    losses = [sum(r.losses[-25:]) / 25 for r in results]
    spread = lambda v: f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else ""  # noqa: E731
    return (f"{100 * statistics.mean(accs):.1f}%" + (f" ± {100 * statistics.stdev(accs):.1f}" if len(accs) > 1 else ""),
            f"{statistics.mean(losses):.3f}{spread(losses)}")


def plot(curves: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, losses in curves.items():
        ax.plot(smooth(losses), label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (moving average of 20)")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rq1(args) -> tuple[list[str], dict[str, list[float]]]:
    rows, curves = [], {}
    methods = [("none", "none", None)] + [(c, ef, {"ratio": 0.01} if c == "topk" else None)
                                          for c in ("qsgd", "topk", "sign") for ef in ("none", "worker", "both")]
    for compressor, ef, params in methods:
        results = over_seeds(args, compressor=compressor, error_feedback=ef, compressor_params=params)
        acc, loss = summarize(results)
        label = "uncompressed" if compressor == "none" else f"{compressor}, error feedback {ef}"
        rows.append(f"| {label} | {acc} | {loss} | {bytes_per_step(results):,.0f} |")
        curves[label] = mean_curve(results)
        print(rows[-1], file=sys.stderr)
    head = ["| method | test accuracy | final train loss | bytes / worker / step |", "|---|---|---|---|"]
    return head + rows, curves


def rq2(args):
    rows, curves = [], {}
    for n in (1, 2, 4, 8, 16):
        results = over_seeds(args, workers=n, compressor="sign")
        acc, loss = summarize(results)
        rows.append(f"| {n} | {acc} | {loss} |")
        curves[f"n={n}"] = mean_curve(results)
        print(rows[-1], file=sys.stderr)
    head = ["| workers (sign, error feedback both) | test accuracy | final train loss |", "|---|---|---|"]
    return head + rows, curves


def layerwise(args):
    rows, curves = [], {}
    for compressor, params in (("sign", None), ("topk", {"ratio": 0.01})):
        for mode in (False, True):
            results = over_seeds(args, compressor=compressor, compressor_params=params, layerwise=mode)
            acc, loss = summarize(results)
            label = f"{compressor}, {'layer-wise' if mode else 'whole model'}"
            rows.append(f"| {label} | {acc} | {loss} |")
            curves[label] = mean_curve(results)
            print(rows[-1], file=sys.stderr)
    return ["| compression | test accuracy | final train loss |", "|---|---|---|"] + rows, curves


def stability(args):
    lrs = (0.005, 0.01, 0.02, 0.05, 0.1)
    variants = (("uncompressed", dict(compressor="none", error_feedback="none")),
                ("sign, worker-only error feedback", dict(compressor="sign", error_feedback="worker")),
                ("sign, DoubleSqueeze (both)", dict(compressor="sign", error_feedback="both")),
                ("sign, DoubleSqueeze, 100 warm-up steps", dict(compressor="sign", error_feedback="both",
                                                                warmup_steps=100)),
                ("sign workers, QSGD 8-bit server, both", dict(compressor="sign", error_feedback="both",
                                                                server_compressor="qsgd")),
                ("sign, DoubleSqueeze, RMS scale", dict(compressor="sign", error_feedback="both",
                                                        compressor_params={"scale": "rms"})))
    rows, curves = [], {}
    for label, kw in variants:
        cells = []
        for lr in lrs:
            r = run(args.workers, 0, steps=args.steps, lr=lr, momentum=0.9, **kw)
            tail = sum(r.losses[-25:]) / 25 if r is not None else float("nan")
            cells.append(f"{100 * r.test_accuracy:.0f}% / {tail:.2f}" if tail == tail else "diverged")
            if lr == 0.05 and r is not None:
                curves[label] = r.losses
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
        print(rows[-1], file=sys.stderr)
    head = ["| momentum 0.9: test accuracy / final loss | " + " | ".join(f"lr {lr}" for lr in lrs) + " |",
            "|---|" + "---|" * len(lrs)]
    return head + rows, curves


# (label, worker operator, its parameters, server operator, its parameters)
RQ4_PAIRS = [
    ("sign / sign", "sign", None, "sign", None),
    ("top-k 1% / top-k 1%", "topk", {"ratio": 0.01}, "topk", {"ratio": 0.01}),
    ("QSGD 8-bit / QSGD 8-bit", "qsgd", None, "qsgd", None),
    ("QSGD 4-bit / QSGD 4-bit", "qsgd", {"levels": 7}, "qsgd", {"levels": 7}),
    ("TernGrad / TernGrad", "terngrad", None, "terngrad", None),
    ("random-k 10% unbiased / same", "randomk", {"ratio": 0.1}, "randomk", {"ratio": 0.1}),
    ("random-k 10% scaled (unbiased=False) / same", "randomk", {"ratio": 0.1, "unbiased": False},
     "randomk", {"ratio": 0.1, "unbiased": False}),
    ("sign / top-k 1%", "sign", None, "topk", {"ratio": 0.01}),
    ("top-k 1% / sign", "topk", {"ratio": 0.01}, "sign", None),
    ("sign / QSGD 4-bit", "sign", None, "qsgd", {"levels": 7}),
    ("QSGD 4-bit / sign", "qsgd", {"levels": 7}, "sign", None),
    ("TernGrad / sign", "terngrad", None, "sign", None),
    ("sign / TernGrad", "sign", None, "terngrad", None),
    ("sign / none (exact server pass)", "sign", None, "none", None),
]


def rq4(args):
    """Biased and unbiased operators on both passes, and server operators
    other than the worker's, each with DoubleSqueeze's error feedback on both
    sides and with none."""
    rows, curves = [], {}
    for label, wq, wparams, sq, sparams in RQ4_PAIRS:
        cells = []
        for ef in ("both", "none"):
            results = over_seeds(args, compressor=wq, compressor_params=wparams, server_compressor=sq,
                                 server_compressor_params=sparams, error_feedback=ef)
            acc, loss = summarize(results)
            cells += [acc, loss]
            if ef == "both":
                curves[label] = mean_curve(results)
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {bytes_per_step(results):,.0f} |")
        print(rows[-1], file=sys.stderr)
    head = ["| worker / server operator | accuracy, error feedback both | final loss, both "
            "| accuracy, no error feedback | final loss, none | bytes / worker / step |",
            "|---|---|---|---|---|---|"]
    return head + rows, curves


def staleness(args):
    """Staleness 0 against 1 (the paper's asynchronous variant: each step
    applies the previous step's average)."""
    rows, curves = [], {}
    for label, compressor, params in (("uncompressed", "none", None), ("sign", "sign", None),
                                      ("top-k 1%", "topk", {"ratio": 0.01})):
        cells = []
        for stale in (0, 1):
            results = over_seeds(args, compressor=compressor, compressor_params=params, staleness=stale)
            acc, loss = summarize(results)
            cells += [acc, loss]
            curves[f"{label}, staleness {stale}"] = mean_curve(results)
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
        print(rows[-1], file=sys.stderr)
    head = ["| compressor (error feedback both) | accuracy, staleness 0 | final loss, 0 "
            "| accuracy, staleness 1 | final loss, 1 |", "|---|---|---|---|---|"]
    return head + rows, curves


def subbit(args):
    """Operators below one bit per element against sign and top-k, all
    with error feedback on both passes: what fewer bytes cost in accuracy."""
    rows, curves = [], {}
    variants = [("sign", "sign", None), ("top-k 1%", "topk", {"ratio": 0.01})] + [
        (f"blocksign, block {b}", "blocksign", {"block": b}) for b in (16, 32, 64)]
    for label, compressor, params in variants:
        results = over_seeds(args, compressor=compressor, compressor_params=params)
        acc, loss = summarize(results)
        rows.append(f"| {label} | {acc} | {loss} | {bytes_per_step(results):,.0f} |")
        curves[label] = mean_curve(results)
        print(rows[-1], file=sys.stderr)
    head = ["| compressor (error feedback both) | test accuracy | final train loss | bytes / worker / step |",
            "|---|---|---|---|"]
    return head + rows, curves


def errordtype(args):
    """The error memories stored as fp32, bf16 and int8 (``error_dtype``),
    for sign and top-k 1% with error feedback on both passes: what storing
    the compensation in fewer bytes costs in accuracy."""
    rows, curves = [], {}
    for label, compressor, params in (("sign", "sign", None), ("top-k 1%", "topk", {"ratio": 0.01})):
        for dtype in ("fp32", "bf16", "int8"):
            results = over_seeds(args, compressor=compressor, compressor_params=params, error_dtype=dtype)
            acc, loss = summarize(results)
            rows.append(f"| {label} | {dtype} | {acc} | {loss} |")
            curves[f"{label}, {dtype}"] = mean_curve(results)
            print(rows[-1], file=sys.stderr)
    head = ["| compressor (error feedback both) | error_dtype | test accuracy | final train loss |",
            "|---|---|---|---|"]
    return head + rows, curves


STUDIES = {"rq1": rq1, "rq2": rq2, "rq4": rq4, "layerwise": layerwise, "staleness": staleness,
           "stability": stability, "subbit": subbit, "errordtype": errordtype}


def main(argv=None) -> int:
    p = study_parser(__doc__, STUDIES, steps=300, lr=0.05, out="runs/bench-convergence")
    args = p.parse_args(argv)
    prepare(args)
    lines, curves = STUDIES[args.study](args)
    header = (f"{args.study}: sklearn digits, MLP 64-64-10, {args.workers} workers (rq2: varies), batch 32 per worker, "
              f"{args.steps} steps, SGD lr {args.lr}, {args.seeds} seeds (mean ± std)")
    text = header + "\n\n" + "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, f"{args.study}.md"), "w") as f:
        f.write(text + "\n")
    plot(curves, os.path.join(args.out, f"{args.study}.png"), header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
