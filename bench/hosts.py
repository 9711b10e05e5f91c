"""Two hosts on one machine, joined by one slow link: bytes across the link
and time per step, for DDP's allreduce, torch's PowerSGD hook and
DoubleSqueeze flat and two-level.

    sudo .venv/bin/python -m bench.hosts                        # 2 hosts x 2 ranks, 100 Mbit/s
    .venv/bin/python -m bench.hosts --rate 1gbit --systems ddp-dsq-sign ddp-dsq-sign-flat
    python -m bench.hosts --report runs/hosts.json              # the table of a saved run

Each host is a network namespace with its ranks on its own loopback; a veth
pair joins the two, with link-local addresses only (169.254.77.1 and .2),
so nothing can leave these namespaces. Both ends of the veth are shaped with
``tc`` to the rate asked (netem with a small delay, or tbf where the kernel
has no netem); inside a host nothing is shaped. Ranks start as the launchers
start them: one ``torchrun --nnodes 2 --node_rank i`` per namespace, gloo
bound to the veth (``GLOO_SOCKET_IFNAME``), so ranks of one host still talk
over its loopback and only what goes between hosts crosses the link. The
link's own counters (``/sys/class/net/<veth>/statistics``) give the bytes.
Needs root; without it the benchmark says so and exits 0.
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

from bench.hosts_worker import SYSTEMS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ADDRESSES = ("169.254.77.1", "169.254.77.2")  # link-local: never routed beyond the link


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


@contextlib.contextmanager
def two_hosts(tag: str):
    """Namespaces ``<tag>a`` and ``<tag>b`` joined by veths ``<tag>a``/``<tag>b``; removed on the way out."""
    hosts = [f"{tag}a", f"{tag}b"]
    try:
        for ns in hosts:
            _run("ip", "netns", "add", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _run("ip", "link", "add", hosts[0], "type", "veth", "peer", "name", hosts[1])
        for ns, address in zip(hosts, ADDRESSES):
            _run("ip", "link", "set", ns, "netns", ns)
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/30", "dev", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", ns, "up")
        yield hosts
    finally:
        for ns in hosts:
            _run("ip", "netns", "del", ns, check=False)


def shape(hosts: list[str], rate: str, delay_ms: float) -> str:
    """Each end of the link sends at ``rate``; returns what was applied, in words."""
    applied = ""
    for ns in hosts:
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ns, "root", check=False)
        base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns, "root"]
        netem = _run(*base, "netem", "rate", rate, "delay", f"{delay_ms}ms", "limit", "100000", check=False)
        if netem.returncode == 0:
            applied = f"netem rate {rate} delay {delay_ms} ms, each way"
        else:
            _run(*base, "tbf", "rate", rate, "burst", "64kb", "latency", "400ms")
            applied = f"tbf rate {rate}, each way (this kernel has no netem)"
    return applied


def run_system(hosts: list[str], system: str, per_host: int, args, out: str) -> dict | None:
    procs = []
    for i, ns in enumerate(hosts):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               f"--node_rank={i}", f"--nproc_per_node={per_host}", f"--master_addr={ADDRESSES[0]}",
               "--master_port=29533", os.path.join(HERE, "hosts_worker.py"), "--system", system,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", out, "--bucket-mb",
               str(args.bucket_mb), "--verdict", args.verdict] + (["--zero3-regather"] if args.zero3_regather else [])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=ns)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=ROOT))
    t0, logs = time.time(), []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=args.timeout)[0])
    except subprocess.TimeoutExpired:
        print(f"  {system}: timed out after {args.timeout:.0f} s", flush=True)
        return None
    finally:
        for proc in procs:
            proc.kill()
    records = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    mine = [r for r in records if r["system"] == system]
    if any(proc.returncode for proc in procs) or not mine:
        print(f"  {system}: FAILED\n" + "\n".join(log[-2500:] for log in logs), flush=True)
        return None
    got = mine[-1]
    print(f"  {system}: {got['median_s'] * 1e3:.0f} ms/step, {got['link_bytes_per_step']:,.0f} B/step across "
          f"the link ({time.time() - t0:.0f} s with launch)", flush=True)
    return got


def table(results: dict[str, dict], link: str) -> str:
    base = results.get("ddp-allreduce")
    flat = results.get("ddp-dsq-sign-flat")
    lines = ["| system | hierarchy | ms/step | bytes across the link / step | × fewer than its peer (DDP's "
             "allreduce; FSDP's own exchange for the FSDP rows, ZeRO-2's and ZeRO-3's for theirs) |",
             "|---|---|---:|---:|---:|"]
    for system in SYSTEMS:
        got = results.get(system)
        if got is None:
            continue
        peer = results.get(f"{system[:4]}-own") if system[:4] in ("fsdp", "hsdp") else (
            results.get(f"{system[:8]}-adamw") if system.startswith(("ds-zero2-", "ds-zero3-")) else base)
        layout = got.get("layout") or ("—" if got["two_level"] is None else (
            f"two-level ({got['hosts']['hosts']}×{got['hosts']['per_host']})" if got["two_level"] else "flat"))
        fewer = f"{peer['link_bytes_per_step'] / got['link_bytes_per_step']:.1f}" if peer else "—"
        lines.append(f"| {system} | {layout} | {got['median_s'] * 1e3:.0f} | {got['link_bytes_per_step']:,.0f} | "
                     f"{fewer} |")
    two = results.get("ddp-dsq-sign")
    if two and flat:
        lines.append("")
        lines.append(f"two-level / flat bytes across the link (DDP hook): "
                     f"{two['link_bytes_per_step'] / flat['link_bytes_per_step']:.3f}")
    lines += ["", f"- link: {link}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="100mbit", help="tc rate of the link between the hosts, each way")
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay where netem exists")
    p.add_argument("--per-host", type=int, default=2, help="ranks per host")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--bucket-mb", type=float, default=4.0, help="our systems' bucket size (DDP's bucket_cap_mb)")
    p.add_argument("--verdict", default="auto", choices=["auto", "step", "collective"],
                   help="the DDP hook's verdict: 'step' runs a GPU's deferred protocol on the CPU")
    p.add_argument("--zero3-regather", action="store_true",
                   help="ZeRO-3 releases every parameter after use and gathers it again in backward (no reuse "
                        "distance, no persistent parameters), as with a model too large to keep them; hpZ's case")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per system")
    p.add_argument("--json", default="runs/hosts.json")
    p.add_argument("--report", metavar="JSON", help="print the table of a saved run; measures nothing")
    args = p.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        print(table(saved["results"], saved["link"]))
        return 0
    if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
        print("bench.hosts needs root and iproute2 (ip, tc) to build two network namespaces; skipped, nothing "
              "measured.")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still removes the namespaces
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dsq-hosts-") as tmp, two_hosts(f"dsqh{os.getpid() % 10000}") as hosts:
        link = shape(hosts, args.rate, args.delay_ms)
        print(f"2 hosts x {args.per_host} ranks; link: {link}", flush=True)
        for system in args.systems:
            got = run_system(hosts, system, args.per_host, args, os.path.join(tmp, "runs.jsonl"))
            if got is not None:
                results[system] = got
    print(table(results, link))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"link": link, "results": results, "per_host": args.per_host}, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
