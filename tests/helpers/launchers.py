"""The real launchers the engine tests run their workers under: torchrun,
horovodrun and deepspeed, each with several processes on gloo. A worker
writes OUT_DIR/rank{R}.pt; ``launch`` returns those results in rank order,
or fails the test with the launcher's output (a timeout fails it too, so a
hang costs minutes, not the suite)."""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
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


#: DeepSpeed's CPU accelerator maps a shared-memory buffer per rank (for its own in-node all-reduce) when
#: its launcher says all ranks are local, named after the job's master address and port, and never
#: unlinks it: tens of MB per rank that stay in /dev/shm, which is this machine's memory, after every job.
DEEPSPEED_SHM = "/dev/shm/deepspeed_allreduce_buffer_"


def master_port(cmd: list[str]) -> str | None:
    """The ``--master_port`` a launcher command line names (either spelling), if any."""
    for i, word in enumerate(cmd):
        if word.startswith("--master_port=") or word.startswith("--master-port="):
            return word.split("=", 1)[1]
        if word in ("--master_port", "--master-port") and i + 1 < len(cmd):
            return cmd[i + 1]
    return None


def remove_deepspeed_shm(port: str) -> None:
    """Unlink the shared-memory buffers a finished job on ``port`` left (the name's last two fields are
    the port and the rank); a job still running elsewhere has another port, as its store holds it."""
    for path in glob.glob(f"{DEEPSPEED_SHM}*_{port}_*"):
        if path.rsplit("_", 2)[-2] == port:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def remove_orphaned_deepspeed_shm(prefix: str = DEEPSPEED_SHM) -> list[str]:
    """Unlink the DeepSpeed buffers (named ``prefix*``) that no live process maps: what jobs before this
    run left (a benchmark's, a killed test's). Run before any job starts: a buffer is created before its
    peers map it, and unlinking one then would leave them waiting for it. Returns the paths removed."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split()[-1] for line in f if prefix in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    removed = []
    for path in sorted(glob.glob(f"{prefix}*")):
        if path not in mapped:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def kill_group(leader: int) -> None:
    """SIGKILL the process group ``leader`` started (``start_new_session``), if any of it is left."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_job(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a launcher: in a process group of its own, so that a timeout kills its
    ranks too (killing the launcher alone leaves them running, spending the cores the next tests
    need), and with the DeepSpeed buffers of its port removed when it ends, however it ends."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
    finally:
        kill_group(proc.pid)  # a rank the launcher left behind
        port = master_port(cmd)
        if port is not None:
            remove_deepspeed_shm(port)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def launch(launcher: str, n: int, worker: str, *args: str, out_dir: str | None = None, timeout: float = 600,
           env: dict[str, str] | None = None) -> list:
    """Run the worker (its first argument is the output folder) and load
    every rank's results."""
    out_dir = out_dir or tempfile.mkdtemp(prefix=f"dsq-{launcher}{n}-")
    os.makedirs(out_dir, exist_ok=True)
    proc = run_job(command(launcher, n, worker, str(out_dir), *args), timeout=timeout,
                   env={**os.environ, **launcher_env(launcher), **(env or {})})
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
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, **launcher_env("torchrun"), **(env or {})}) for i in range(hosts)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:  # each host's agent and the ranks it started
            kill_group(proc.pid)
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
