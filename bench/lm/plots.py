"""A study's figures: loss by step and by bytes, and the loss-per-byte fronts."""
from __future__ import annotations

import re
import statistics
import textwrap

from examples.train_lm import LMResult

from .tables import ratio


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
        ax.scatter([ratio(results[0])], [loss], marker=marker, s=40)
        ax.annotate(label.replace(" (in process)", ""), (ratio(results[0]), loss), fontsize=6,
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
        lines.setdefault(label.replace(h.group(0), ""), []).append((ratio(results[0]), loss, f"H={h.group(1)}"))
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
