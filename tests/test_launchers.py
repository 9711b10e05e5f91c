"""The test launchers leave the machine as they found it: a DeepSpeed job's
shared-memory buffers (in /dev/shm, i.e. memory) are unlinked when it ends, and
a launch that times out takes its ranks with it. A suite that leaked both
swapped on a 24 GB machine until its later launches timed out."""
import mmap
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import require
from tests.helpers.launchers import DEEPSPEED_SHM, command, master_port, remove_orphaned_deepspeed_shm, run_job


def test_a_deepspeed_job_leaves_none_of_its_shared_memory_behind(tmp_path):
    require("deepspeed")
    cmd = command("deepspeed", 2, "shm_worker.py", str(tmp_path))
    port = master_port(cmd)
    done = run_job(cmd, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = [torch.load(tmp_path / f"rank{rank}.pt")["seen"] for rank in range(2)]
    assert seen[0] == seen[1] and len(seen[0]) == 2, seen  # DeepSpeed made one per rank, named by the port
    assert not [path for path in seen[0] if os.path.exists(path)], port


def test_a_launch_that_times_out_ends_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent = (f"import subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              f"child.wait()\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_job([sys.executable, "-c", parent], timeout=15)
    child = int(pid_file.read_text())
    # SIGKILL is delivered as the killed process runs its exit: it closes its pipes (which ends the launcher's
    # wait) before it leaves the running state, so the state is read until it leaves, for at most 10 s
    deadline = time.monotonic() + 10
    while (state := process_state(child)) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state in ("gone", "Z"), f"the launcher's child {child} is still running ({state})"


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (R, S, Z, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_only_the_buffers_no_process_maps_are_swept(tmp_path):
    prefix = f"{DEEPSPEED_SHM}pytest{os.getpid()}_"
    orphan, in_use = prefix + "1_0", prefix + "1_1"
    for path in (orphan, in_use):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mapped:
        try:
            removed = remove_orphaned_deepspeed_shm(prefix)
            assert removed == [orphan] and not os.path.exists(orphan) and os.path.exists(in_use)
            assert mapped[0] == 0
        finally:
            os.unlink(in_use)
