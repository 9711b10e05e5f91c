"""The drop-in under Horovod Elastic (horovodrun --min-np 2 --max-np 3, gloo
over lo): a host-discovery script that drops a slot mid-run, and a rank
killed with SIGKILL inside a step. Either way Horovod resets the others;
their next step joins the new world and reshards the survivors' error
state (tests/workers/hvd_elastic_worker.py)."""
import os
import re
import sys

import torch

from tests.conftest import require
from tests.helpers.launchers import WORKERS, run_job, venv_tool


def elastic_run(tmp_path, hosts: str, *args: str):
    """The worker under elastic horovodrun; the discovery script prints ``hosts``."""
    require("horovod.torch")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/bash\n{hosts}\n")
    discover.chmod(0o755)
    cmd = [venv_tool("horovodrun"), "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
           str(discover), "--gloo", "--network-interface", "lo", sys.executable,
           os.path.join(WORKERS, "hvd_elastic_worker.py"), str(tmp_path), *args]
    proc = run_job(cmd, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert not (tmp_path / "rank2.pt").exists()  # one rank left
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def check_went_on_at_two(done):
    for d in done:
        sizes = [size for _, size in d["seen"]]
        assert [step for step, _ in d["seen"]] == list(range(1, 21)) and sizes[0] == 3 and sizes[-1] == 2
        assert d["size"] == 2 and d["worlds"] == 2  # joined at the start, and once after the reset
        assert list(d["steps"].values()) == [20, 20]  # the step counters (the shared seeds) carried over
        assert len(d["warnings"]) == 1 and re.fullmatch(
            r"Horovod Elastic: DoubleSqueeze error state of 2 of 3 ranks resharded for 2; what rank\(s\) \[\d\] "
            r"still owed is lost", d["warnings"][0])
    assert all(torch.equal(a, b) for a, b in zip(done[0]["params"], done[1]["params"]))


def test_the_drop_in_goes_on_at_the_new_size_after_a_host_update(tmp_path):
    shrink = tmp_path / "shrink"
    done = elastic_run(tmp_path, f"if [ -e {shrink} ]; then echo localhost:2; else echo localhost:3; fi",
                       str(shrink), "shrink")
    check_went_on_at_two(done)


def test_a_rank_killed_mid_step_leaves_the_others_at_their_last_commit_and_they_go_on(tmp_path):
    """The rank on host 127.0.0.1 (its one slot) SIGKILLs itself inside step 7's
    exchange: the others' step fails with Horovod's HorovodInternalError,
    hvd.elastic restores the last commit (step 6, error state included),
    blacklists the host and resets; step 7 is done again at 2 ranks."""
    done = elastic_run(tmp_path, "echo localhost:2; echo 127.0.0.1:1", str(tmp_path / "unused"), "kill")
    check_went_on_at_two(done)
    assert all(d["seen"][5:7] == [(6, 3), (7, 2)] for d in done)
