"""Host syncs per step on CUDA: how many times one DoubleSqueeze step
(``--buckets`` buckets of four tensors each, averaged in place as the
engines do, every compressor) makes the host wait for the GPU,
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
per step per rank and the call sites that made them.

Without a GPU (or with ``--device cpu``) it counts host reads instead: the
calls in Python that bring a tensor's values to the host (``bool``,
``item``, ``tolist``), each of which is a sync on a GPU. That count leaves
out syncs inside torch's own ops, and includes CPU-only algorithms' reads
(top-k's sampled threshold on a CPU), so the GPU's count is the one to
quote; the CPU's shows what the reducer itself reads, per bucket or per step.
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


def count_syncs(compressor: str, ranks: int, numel: int, steps: int = 3, verdict: str = "auto", buckets: int = 1,
                device: str = "cuda") -> tuple[float, collections.Counter]:
    """Mean syncs (host reads on a CPU) per rank per step after a warm-up
    step, and where they came from.

    The ranks are threads and the warnings filters (and the CPU's counting
    methods) are global, so they are set once, around the whole group, and
    count only between the barriers that enclose the timed steps."""
    barrier = threading.Barrier(ranks)
    counting = _SyncDebug() if device == "cuda" else HostReads()

    def per_rank(comm):
        # four tensors per bucket, averaged in place as the engines do: chunks are written into the tensors
        per_tensor = numel // (4 * buckets)
        r = dsq.DoubleSqueeze(comm, compressor, verdict=verdict, bucket_mb=4 * per_tensor * 4 / 2**20)
        gen = torch.Generator(device=device).manual_seed(comm.rank)
        grads = [[(f"w{i}", torch.randn(per_tensor, device=device, generator=gen)) for i in range(4 * buckets)]
                 for _ in range(steps + 1)]
        assert len(r.layout([(n, tuple(t.shape)) for n, t in grads[0]])) == buckets
        r.reduce_many(grads[0], in_place=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if barrier.wait() == 0:
            counting.start()
        barrier.wait()
        for g in grads[1:]:
            r.reduce_many(g, in_place=True)
        if barrier.wait() == 0:
            counting.stop()

    with counting:
        dsq.LocalGroup(ranks, device=device).run(per_rank)
    return sum(counting.sites.values()) / (ranks * steps), counting.sites


def _site(filename: str, lineno: int) -> str:
    return f"{filename.split('dsq_plugins/')[-1]}:{lineno}"


class _SyncDebug:
    """CUDA syncs, as torch's sync debug mode warns of them."""

    def __enter__(self):
        self._recording = warnings.catch_warnings(record=True)
        self._seen = self._recording.__enter__()
        warnings.simplefilter("always")
        self.sites: collections.Counter = collections.Counter()
        return self

    def start(self) -> None:
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def __exit__(self, *exc):
        self._recording.__exit__(*exc)
        self.sites.update(_site(w.filename, w.lineno) for w in self._seen if "synchroniz" in str(w.message))


class HostReads:
    """Reads of a tensor's values from Python (``bool``, ``item``, ``tolist``), by the library line that made them."""

    METHODS = ("__bool__", "item", "tolist")

    def __enter__(self):
        self.sites = collections.Counter()
        self._on = False
        self._originals = {m: getattr(torch.Tensor, m) for m in self.METHODS}
        for method, original in self._originals.items():
            def counted(tensor, *args, _original=original, **kwargs):
                if self._on:
                    frame = next((f for f in traceback.extract_stack()[::-1] if "dsq_plugins" in f.filename), None)
                    self.sites[_site(frame.filename, frame.lineno) if frame else "elsewhere"] += 1
                return _original(tensor, *args, **kwargs)
            setattr(torch.Tensor, method, counted)
        return self

    def start(self) -> None:
        self._on = True

    def stop(self) -> None:
        self._on = False

    def __exit__(self, *exc):
        for method, original in self._originals.items():
            setattr(torch.Tensor, method, original)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--compressors", nargs="+", default=list(dsq.COMPRESSORS), choices=dsq.COMPRESSORS)
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 4])
    p.add_argument("--verdicts", nargs="+", default=["collective", "step"], choices=["collective", "step"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.syncs --device cuda needs a CUDA device")
    rows = {}
    what = "syncs" if args.device == "cuda" else "host reads"
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (host reads from Python, not syncs)"
    print(f"device: {where}, torch {torch.__version__}, {args.ranks} ranks, {args.numel} elements")
    for name in args.compressors:
        for verdict in args.verdicts:
            for buckets in args.buckets:
                try:
                    mean, sites = count_syncs(name, args.ranks, args.numel, verdict=verdict, buckets=buckets,
                                              device=args.device)
                except Exception:  # one compressor's failure should not hide the others' counts
                    traceback.print_exc()
                    continue
                rows[f"{name}/{verdict}/{buckets}"] = {"compressor": name, "verdict": verdict, "buckets": buckets,
                                                       "device": args.device, "per_rank_step": mean,
                                                       "counted": what, "sites": dict(sites.most_common())}
                print(f"{name:10s} {verdict:10s} {buckets:2d} bucket(s) {mean:6.1f} {what} per rank per step   " +
                      ", ".join(f"{s} x{c}" for s, c in sites.most_common(6)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
