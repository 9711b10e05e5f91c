"""The real launchers the engine tests run their workers under: torchrun,
horovodrun and deepspeed, each with several processes on gloo. A worker
writes OUT_DIR/rank{R}.pt; ``launch`` returns those results in rank order,
or fails the test with the launcher's output (a timeout fails it too, so a
hang costs minutes, not the suite)."""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import torch

from tests.conftest import require

WORKERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers")


def venv_tool(name: str) -> str:
    """A console script of this interpreter's environment (horovodrun, deepspeed), else the name on PATH."""
    return shutil.which(name, path=os.path.dirname(sys.executable)) or name


def free_port() -> int:
    """A port no process listens on now: for a launcher whose default is a fixed one (deepspeed's 29500),
    which two tests running at once (``make test`` runs two pytest workers) would both take."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command(launcher: str, n: int, worker: str, *args: str) -> list[str]:
    """The command line that runs ``worker`` (a file of tests/workers/, or an absolute path) on ``n`` processes."""
    script = worker if os.path.isabs(worker) else os.path.join(WORKERS, worker)
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", script, *args]
    if launcher == "horovodrun":
        require("horovod.torch")
        return [venv_tool("horovodrun"), "-np", str(n), "-H", f"localhost:{n}", sys.executable, script, *args]
    if launcher == "deepspeed":
        require("deepspeed")
        return [venv_tool("deepspeed"), "--num_gpus", str(n), "--master_port", str(free_port()), script, *args]
    raise ValueError(f"unknown launcher {launcher!r}")


def launcher_env(launcher: str) -> dict[str, str]:
    """The environment every test launch runs in: one thread per process (the
    ranks share 2 cores), and for Horovod a gloo timeout of 120 s, not its
    30 s default, which a rank of test_hosts' launch that was only slow
    exceeded on a loaded CI machine. The elastic test, which detects killed
    ranks, builds its own command and keeps the default."""
    env = {"OMP_NUM_THREADS": "1"}
    if launcher == "horovodrun":
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = "120"
    return env


def launch(launcher: str, n: int, worker: str, *args: str, out_dir: str | None = None, timeout: float = 600,
           env: dict[str, str] | None = None) -> list:
    """Run the worker (its first argument is the output folder) and load
    every rank's results."""
    out_dir = out_dir or tempfile.mkdtemp(prefix=f"dsq-{launcher}{n}-")
    os.makedirs(out_dir, exist_ok=True)
    proc = subprocess.run(command(launcher, n, worker, str(out_dir), *args), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **launcher_env(launcher), **(env or {})})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + each_ranks_last_lines(proc.stderr, n)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(n)]


def each_ranks_last_lines(output: str, n: int, last: int = 12) -> str:
    """Each rank's last lines of a horovodrun's prefixed output (``[r]<stderr>:``): the rank that failed
    first is often cut off the tail of the whole, behind the others' shutdown tracebacks."""
    parts = []
    for r in range(n):
        mine = [line for line in output.splitlines() if line.startswith(f"[{r}]<")]
        if mine:
            parts.append(f"\n--- rank {r}'s last lines ---\n" + "\n".join(mine[-last:]))
    return "".join(parts)


def run_hosts(worker: str, out_dir: str, *args: str, hosts: int = 2, per_host: int = 2, timeout: float = 600,
              env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """Run ``tests/workers/<worker>`` as the launchers run a job of several
    hosts: one torchrun per host (``--nnodes --node_rank``, static
    rendezvous), meeting on this machine's loopback. Each host's agent sees
    only its own ranks, so a rank that dies ends its host's agent and not the
    others' ranks, as on a real cluster. Returns each host's (exit status,
    output)."""
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts}", f"--node_rank={i}",
         f"--nproc_per_node={per_host}", "--master_addr=127.0.0.1", f"--master_port={port}",
         os.path.join(WORKERS, worker), out_dir, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **launcher_env("torchrun"), **(env or {})}) for i in range(hosts)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


def launch_hosts(worker: str, *args: str, hosts: int = 2, per_host: int = 2, timeout: float = 600,
                 env: dict[str, str] | None = None) -> list:
    """``run_hosts`` for a job that must succeed: results in rank order."""
    out_dir = tempfile.mkdtemp(prefix=f"dsq-hosts{hosts}x{per_host}-")
    ran = run_hosts(worker, out_dir, *args, hosts=hosts, per_host=per_host, timeout=timeout, env=env)
    assert all(code == 0 for code, _ in ran), "\n".join(out[-3000:] for _, out in ran)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(hosts * per_host)]


def deepspeed_worker_parser(hosts: bool = False) -> argparse.ArgumentParser:
    """A worker's command line under the deepspeed launcher: OUT_DIR, and
    the --local_rank the launcher appends; ``hosts``: a ``--hosts`` flag
    too, for a worker whose two-level scenarios run on 4 processes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--local_rank", type=int, default=-1)
    if hosts:
        parser.add_argument("--hosts", action="store_true", help="the two-level scenarios (4 processes)")
    return parser


def save_and_leave(results, out_dir: str, rank: int) -> None:
    """A worker's last act: save its results for ``launch``, leave the gloo
    group once every rank is done (nobody tears gloo down while a peer's
    last sends are in flight), then end the process without interpreter
    teardown. With teardown, one run in 26 of the robust worker (4 ranks on
    2 cores) aborted after saving ("terminate called without an active
    exception" from a gloo thread), failing a test whose work had all
    succeeded; none of 53 did after this change."""
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
