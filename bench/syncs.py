"""Host syncs per step on CUDA: how many times one DoubleSqueeze step
(``--buckets`` buckets, every compressor) makes the host wait for the GPU,
counted by torch's sync debug mode, which reports each synchronizing call
(``.item()``, ``.tolist()``, ``nonzero``, a copy to the host...). Each one
stalls the launch queue, so a step's kernels cannot run ahead of Python.

    python -m bench.syncs [--ranks 2] [--numel 1048576] [--buckets 1 4]
                          [--verdicts collective step] [--json FILE]

Runs LocalGroup ranks on the one GPU (the in-process transport moves no
headers through the device, so what is counted is the compressors' and the
reducer's own syncs), with each collective's verdict read on the host
(``verdict="collective"``) and with the step's verdict judged once at its
end (``"step"``, the default on a GPU), then prints each compressor's syncs
per step per rank and the call sites that made them. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import collections
import json
import threading
import traceback
import warnings

import torch

import dsq_plugins as dsq


def count_syncs(compressor: str, ranks: int, numel: int, steps: int = 3, verdict: str = "auto", buckets: int = 1
                ) -> tuple[float, collections.Counter]:
    """Mean syncs per rank per step after a warm-up step, and where they came from.

    The ranks are threads and the warnings filters are global, so warnings
    are recorded once, around the whole group, and counted only between the
    barriers that enclose the timed steps."""
    barrier = threading.Barrier(ranks)

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, compressor, verdict=verdict, layerwise=True)  # a bucket per tensor
        gen = torch.Generator(device="cuda").manual_seed(comm.rank)
        grads = [[(f"w{b}", torch.randn(numel // buckets, device="cuda", generator=gen)) for b in range(buckets)]
                 for _ in range(steps + 1)]
        r.reduce_many(grads[0])
        torch.cuda.synchronize()
        if barrier.wait() == 0:
            torch.cuda.set_sync_debug_mode("warn")
        barrier.wait()
        for g in grads[1:]:
            r.reduce_many(g)
        if barrier.wait() == 0:
            torch.cuda.set_sync_debug_mode("default")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dsq.LocalGroup(ranks, device="cuda").run(per_rank)
    mine = [w for w in seen if "synchroniz" in str(w.message)]
    sites = collections.Counter(f"{w.filename.split('dsq_plugins/')[-1]}:{w.lineno}" for w in mine)
    return len(mine) / (ranks * steps), sites


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--compressors", nargs="+", default=list(dsq.COMPRESSORS), choices=dsq.COMPRESSORS)
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 4])
    p.add_argument("--verdicts", nargs="+", default=["collective", "step"], choices=["collective", "step"])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.syncs needs a CUDA device")
    rows = {}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.ranks} ranks, "
          f"{args.numel} elements")
    for name in args.compressors:
        for verdict in args.verdicts:
            for buckets in args.buckets:
                try:
                    mean, sites = count_syncs(name, args.ranks, args.numel, verdict=verdict, buckets=buckets)
                except Exception:  # one compressor's failure should not hide the others' counts
                    traceback.print_exc()
                    continue
                rows[f"{name}/{verdict}/{buckets}"] = {"compressor": name, "verdict": verdict, "buckets": buckets,
                                                       "syncs_per_step": mean, "sites": dict(sites.most_common())}
                print(f"{name:10s} {verdict:10s} {buckets:2d} bucket(s) {mean:6.1f} syncs per rank per step   " +
                      ", ".join(f"{s} x{c}" for s, c in sites.most_common(6)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
