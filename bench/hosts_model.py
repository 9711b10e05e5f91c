"""Bytes a host sends across its link per step, as a function of hosts N
and ranks per host L, for a model of M bytes (fp32 gradients):

* ring allreduce (NCCL's or gloo's ring over all P = N·L ranks, a host's ranks
  consecutive): the ring leaves each host once, carrying 2·(P−1)/P·M;
* flat DoubleSqueeze (every rank a worker and a chunk's server): the worker
  pass sends each rank's compressed chunks to the (N−1)·L ranks of other
  hosts, L·(N−1)/N·M_c per host; the server pass the same with a direct
  all-gather, or (P−1)/P·M_c with a ring all-gather (gloo's);
* two-level DoubleSqueeze: both passes among hosts on a host's shards,
  2·(N−1)/N·M_c per host, whatever L;
* ZeRO++ qgZ: 4-bit gradients across hosts in one reduce-scatter (ZeRO needs
  no all-gather of gradients), (N−1)/N·M/8 per host, with no error feedback.

M_c is M/32 for 1-bit sign (its scales aside).

    python -m bench.hosts_model                          # table for N in 2, 16 and L in 1..8
    python -m bench.hosts_model --check runs/hosts.json  # against the two-host measurement
    python -m bench.hosts_model --plot docs/bench-hosts-model.png
"""
from __future__ import annotations

import argparse
import json
import sys

METHODS = ("ring allreduce", "flat DoubleSqueeze (direct all-gather)", "flat DoubleSqueeze (ring all-gather)",
           "two-level DoubleSqueeze", "ZeRO++ qgZ (4-bit, reduce-scatter only)")


def host_link_bytes(method: str, hosts: int, per_host: int, model_bytes: float, ratio: float = 32.0) -> float:
    """Bytes one host sends across its link per step (one direction)."""
    n, local = hosts, per_host
    p, compressed = n * local, model_bytes / ratio
    if method == "ring allreduce":
        return 2 * (p - 1) / p * model_bytes
    worker_pass = local * (n - 1) / n * compressed
    if method == "flat DoubleSqueeze (direct all-gather)":
        return 2 * worker_pass
    if method == "flat DoubleSqueeze (ring all-gather)":
        return worker_pass + (p - 1) / p * compressed
    if method == "two-level DoubleSqueeze":
        return 2 * (n - 1) / n * compressed
    if method == "ZeRO++ qgZ (4-bit, reduce-scatter only)":
        return (n - 1) / n * model_bytes / 8
    raise ValueError(f"unknown method {method!r}; one of {METHODS}")


def table(hosts: list[int], per_host: list[int]) -> str:
    lines = ["| method | " + " | ".join(f"N={n}, L={L}" for n in hosts for L in per_host) + " |",
             "|---|" + "---:|" * (len(hosts) * len(per_host))]
    for method in METHODS:
        cells = [f"{host_link_bytes(method, n, L, 1.0):.4f}" for n in hosts for L in per_host]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n(bytes per host per step across its link, per byte of fp32 gradients; sign: M/32)"


def check(path: str) -> str:
    """The model against a ``bench.hosts`` run (both directions of the link, N = 2)."""
    with open(path) as f:
        saved = json.load(f)
    runs, per_host = saved["results"], saved["per_host"]
    rows = [("ddp-allreduce", "ring allreduce"), ("ddp-dsq-sign-flat", "flat DoubleSqueeze (ring all-gather)"),
            ("ddp-dsq-sign", "two-level DoubleSqueeze")]
    lines = ["| system | model: both ways / step | measured | measured ÷ model |", "|---|---:|---:|---:|"]
    for system, method in rows:
        if system not in runs:
            continue
        predicted = 2 * host_link_bytes(method, 2, per_host, 4 * runs[system]["params"])
        measured = runs[system]["link_bytes_per_step"]
        lines.append(f"| {system} ({method}) | {predicted:,.0f} | {measured:,.0f} | {measured / predicted:.3f} |")
    return "\n".join(lines)


def plot(path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    per_host = [1, 2, 4, 8, 16]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, n in zip(axes, (2, 16)):
        for method in METHODS:
            ax.plot(per_host, [host_link_bytes(method, n, L, 1.0) for L in per_host], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks per host L")
        ax.set_title(f"{n} hosts: bytes across a host's link per step (× M)")
    axes[0].set_ylabel("bytes per byte of fp32 gradients")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", metavar="JSON", help="compare with a bench.hosts run")
    p.add_argument("--plot", metavar="PNG", help="write the plot here")
    args = p.parse_args(argv)
    print(table([2, 16], [1, 2, 8]))
    if args.check:
        print()
        print(check(args.check))
    if args.plot:
        plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
