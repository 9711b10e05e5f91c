"""Step time on a slow network: n ranks on one machine joined by a link the
benchmark builds and tears down itself.

    sudo .venv/bin/python -m bench.slowlink                    # 1 Gbit/s and 100 Mbit/s, every system
    .venv/bin/python -m bench.slowlink --rates 100mbit --systems horovod-none hvd-dsq-sign
    python -m bench.slowlink --report runs/slowlink.json      # table and plot of a saved run

The link: a fresh network namespace whose loopback is rate-limited with
``tc`` (``netem rate R delay D`` where the kernel has netem, otherwise a token
bucket ``tbf rate R`` with no added delay; the table says which was applied).
All ranks of a run sit in that namespace and talk over 127.0.0.1, so they
share the one shaped link, like workers behind a single slow uplink: a step
pushes every rank's bytes through it. ``unshaped`` is the same namespace
with no qdisc. Needs root (``ip netns``); without it the benchmark says so
and exits 0 having measured nothing.

Each system runs with its own launcher (horovodrun, deepspeed, torchrun) on
gloo; rank 0 reports the median of the timed steps after warm-up
(``bench/slowlink_worker.py``). Ratios are the baseline's median step time
divided by each system's, measured at the same rate in the same run: Horovod
``none``'s unless ``--baseline`` names another (``ddp-none``, DDP's own).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.slowlink_worker import SYSTEMS
from examples.common import ring_allreduce_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASELINE = "horovod-none"
MTU = 9000  # a jumbo-frame link: the loopback's 64 KiB frames would make a token bucket lumpy


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@contextlib.contextmanager
def namespace(name: str):
    """A network namespace with only a loopback, deleted on the way out whatever happens."""
    _ip("netns", "add", name)
    try:
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "mtu", str(MTU), "up")
        yield name
    finally:
        _ip("netns", "del", name, check=False)


def shape(ns: str, rate: str, delay_ms: float) -> str:
    """Rate-limit the namespace's loopback; returns what was applied, in words."""
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    if rate == "unshaped":
        return "no qdisc"
    base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root"]
    netem = subprocess.run(base + ["netem", "rate", rate, "delay", f"{delay_ms}ms", "limit", "100000"],
                           capture_output=True, text=True)
    if netem.returncode == 0:
        return f"netem rate {rate} delay {delay_ms} ms"
    subprocess.run(base + ["tbf", "rate", rate, "burst", "256kb", "latency", "200ms"], check=True,
                   capture_output=True, text=True)
    return f"tbf rate {rate}, no delay (this kernel has no netem)"


def launch_command(system: str, n: int, worker_args: list[str]) -> list[str]:
    py = sys.executable
    bindir = os.path.dirname(py)
    worker = os.path.join(HERE, "slowlink_worker.py")
    if system.startswith(("horovod", "hvd")):
        runner = shutil.which("horovodrun", path=bindir) or "horovodrun"
        return [runner, "-np", str(n), "-H", f"localhost:{n}", py, worker, *worker_args]
    if system.startswith(("deepspeed", "ds-")):
        runner = shutil.which("deepspeed", path=bindir) or "deepspeed"
        return [runner, "--num_gpus", str(n), "--master_addr", "127.0.0.1", worker, *worker_args]
    return [py, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
            "--master_port", "29511", worker, *worker_args]


def run_one(ns: str, system: str, n: int, warmup: int, steps: int, out: str, timeout: float) -> dict | None:
    args = ["--system", system, "--warmup", str(warmup), "--steps", str(steps), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    t0 = time.time()
    proc = subprocess.run(["ip", "netns", "exec", ns, *launch_command(system, n, args)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=timeout)
    records = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    mine = [r for r in records if r["system"] == system]
    if proc.returncode != 0 or not mine:
        print(f"  {system}: FAILED (exit {proc.returncode})\n{(proc.stdout + proc.stderr)[-3000:]}", flush=True)
        return None
    print(f"  {system}: median {mine[-1]['median_s'] * 1e3:.0f} ms/step  ({time.time() - t0:.0f} s with launch)",
          flush=True)
    return mine[-1]


def table(results: dict[str, dict[str, dict]], links: dict[str, str], baseline: str = BASELINE) -> str:
    rates = list(results)
    head = "| system | " + " | ".join(f"{r}: ms/step | ×{baseline}" for r in rates) + " | bytes / worker / step |"
    rule = "|---|" + "---:|---:|" * len(rates) + "---:|"
    lines = [head, rule]
    systems = [s for s in SYSTEMS if any(s in results[r] for r in rates)]
    for s in systems:
        cells = []
        for r in rates:
            got, base = results[r].get(s), results[r].get(baseline)
            if got is None:
                cells += ["—", "—"]
                continue
            ratio = f"{base['median_s'] / got['median_s']:.2f}" if base else "—"
            cells += [f"{got['median_s'] * 1e3:.0f}", ratio]
        counted = next((results[r][s]["bytes_sent"] for r in rates if s in results[r]), None)
        cells.append(f"{counted:,} (counted)" if counted else "—")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    some = next((got for per_rate in results.values() for got in per_rate.values()), None)
    if some is not None:
        n, params = some["size"], some["params"]
        lines.append("| fp32 ring allreduce, for scale | " + " | ".join(["", ""] * len(rates))
                     + f" | {ring_allreduce_bytes(params, n):,.0f} (2(n−1)/n·4·params) |")
    lines.append("")
    lines += [f"- {r}: {links[r]}" for r in rates]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = list(results)
    systems = [s for s in SYSTEMS if any(s in results[r] for r in rates)]
    n = next(got["size"] for per_rate in results.values() for got in per_rate.values())
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 0.35 * len(systems) + 1.5), squeeze=False)
    for ax, r in zip(axes[0], rates):
        vals = [results[r][s]["median_s"] if s in results[r] else 0.0 for s in systems]
        ours = ("hvd-dsq", "hvd-torch-dsq", "ds-dsq", "ddp-dsq", "local-")
        colors = ["tab:orange" if s.startswith(ours) else "tab:gray" for s in systems]
        ax.barh(systems, vals, color=colors)
        ax.invert_yaxis()
        for y, v in enumerate(vals):
            if v:
                ax.text(v, y, f" {v:.2f}", va="center", fontsize=7)
        ax.set_xlim(0, 1.15 * max(vals))
        ax.set_title(f"{r}: median step time (s), n = {n}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"],
                   help="tc rates, or 'unshaped' for the bare namespace loopback")
    p.add_argument("--delay-ms", type=float, default=2.0, help="one-way delay where netem exists")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("-n", type=int, default=4, help="ranks")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per system and rate")
    p.add_argument("--baseline", default=BASELINE, choices=list(SYSTEMS),
                   help="the system every other's step time is a ratio against (ddp-none: DDP's own allreduce)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the baseline (minutes per run at 100mbit) when repeating runs to compare systems "
                        "with each other; the ratio column is then empty")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--json", default="runs/slowlink.json")
    p.add_argument("--plot", default="docs/bench-slowlink.png")
    p.add_argument("--report", metavar="JSON", help="print the table and plot of a saved run; measures nothing")
    args = p.parse_args(argv)

    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        print(table(saved["results"], saved["links"], saved.get("baseline", BASELINE)))
        plot(saved["results"], args.plot)
        return 0

    if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
        print("bench.slowlink needs root and iproute2 (ip, tc) to build a rate-limited network namespace; "
              "skipped, nothing measured.")
        return 0
    # a SIGTERM (a killed job, a CI timeout) must still tear the namespace down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.baseline not in args.systems and not args.no_baseline:
        args.systems.insert(0, args.baseline)  # ratios need it
    results: dict[str, dict[str, dict]] = {}
    links: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="dsq-slowlink-") as tmp, namespace(f"dsqbench{os.getpid()}") as ns:
        for rate in args.rates:
            links[rate] = shape(ns, rate, args.delay_ms)
            print(f"{rate}: {links[rate]}", flush=True)
            results[rate] = {}
            for system in args.systems:
                out = os.path.join(tmp, f"{rate}.jsonl")
                try:
                    got = run_one(ns, system, args.n, args.warmup, args.steps, out, args.timeout)
                except subprocess.TimeoutExpired:
                    print(f"  {system}: timed out after {args.timeout:.0f} s", flush=True)
                    got = None
                if got is not None:
                    results[rate][system] = got
    print()
    print(f"n = {args.n} ranks, {next(iter(next(iter(results.values())).values()), {}).get('params', '?')} "
          f"parameters, median of {args.steps} steps after {args.warmup} warm-up steps; "
          f"ratio = {args.baseline} step time / system step time at the same rate")
    print(table(results, links, args.baseline))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"links": links, "results": results, "n": args.n, "baseline": args.baseline}, f, indent=1)
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
