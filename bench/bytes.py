"""Bytes on the wire: what each worker sends per step, counted by the
communicator, for every compressor and n = 2, 4, 8, 16 in-process ranks,
against an fp32 ring allreduce of the same tensor (2(n-1)/n * 4 bytes per
element). Shows that per-worker bytes do not grow with n, and what serving
each chunk on several ranks (owners=3, owners="all") costs.

    python -m bench.bytes [--numel 4194304] [--workers 2,4,8,16] [--out runs/bench-bytes]

LocalGroup counts the fused protocol (headers inside the messages); over
torch.distributed the second pass is padded to the longest chunk result,
which adds at most a few bytes per chunk.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import dsq_plugins as dsq
from examples.common import ring_allreduce_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=4 * 2**20)
    p.add_argument("--workers", default="2,4,8,16")
    p.add_argument("--out", default="runs/bench-bytes")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    workers = [int(w) for w in args.workers.split(",")]
    table: dict[str, dict[int, int]] = {}
    rows = [(name, name, {}) for name in dsq.COMPRESSORS]
    rows += [(f"sign, owners={o}", "sign", {"owners": o}) for o in (3, "all")]  # no trusted rank costs bytes
    for label, name, options in rows:
        for n in workers:
            if options.get("owners", 1) != "all" and options.get("owners", 1) > n:
                continue

            def per_rank(comm, name=name, options=options):
                reducer = dsq.DoubleSqueeze(comm, name, **options)
                reducer.reduce("g", torch.randn(args.numel, generator=torch.Generator().manual_seed(comm.rank)))
                return comm.bytes_sent
            table.setdefault(label, {})[n] = max(dsq.LocalGroup(n).run(per_rank))
            print(f"{label:16s} n={n:2d} {table[label][n]:>12,} bytes", file=sys.stderr)
    ring = {n: ring_allreduce_bytes(args.numel, n) for n in workers}
    lines = [f"{args.numel:,} fp32 elements per worker; bytes each worker sends per step "
             f"(and the fp32 ring allreduce's divided by it)", "",
             "| compressor | " + " | ".join(f"n={n}" for n in workers) + " |", "|---|" + "---|" * len(workers),
             "| fp32 ring allreduce | " + " | ".join(f"{ring[n]:,.0f}" for n in workers) + " |"]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[n]:,} ({ring[n] / row[n]:.1f}x)" if n in row else "—"
                                                 for n in workers) + " |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(workers, [ring[n] for n in workers], "k--", label="fp32 ring allreduce")
    for name, row in table.items():
        ax.plot([n for n in workers if n in row], [row[n] for n in workers if n in row], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("bytes sent per worker per step")
    ax.set_title(f"DoubleSqueeze, {args.numel:,} elements")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bytes.png"), dpi=120)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
