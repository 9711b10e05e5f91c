"""The drop-in under Horovod Elastic: horovodrun --min-np 2 --max-np 3 with
a host-discovery script that drops a slot mid-run (one host, gloo over lo).
Horovod removes rank 2 and resets the others; their next step joins the new
world and reshards the survivors' error state (tests/hvd_elastic_worker.py)."""
import os
import subprocess
import sys

import torch

from tests.conftest import require
from tests.launchers import HERE, _venv_tool


def test_the_drop_in_goes_on_at_the_new_size_after_a_host_update(tmp_path):
    require("horovod.torch")
    shrink, discover = tmp_path / "shrink", tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/bash\nif [ -e {shrink} ]; then echo localhost:2; else echo localhost:3; fi\n")
    discover.chmod(0o755)
    cmd = [_venv_tool("horovodrun"), "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
           str(discover), "--gloo", "--network-interface", "lo", sys.executable,
           os.path.join(HERE, "hvd_elastic_worker.py"), str(tmp_path), str(shrink)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    done = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert not (tmp_path / "rank2.pt").exists()  # rank 2 was removed
    for d in done:
        sizes = [size for _, size in d["seen"]]
        assert [step for step, _ in d["seen"]] == list(range(1, 21)) and sizes[0] == 3 and sizes[-1] == 2
        assert d["size"] == 2 and d["worlds"] == 2  # joined at the start, and once after the reset
        assert list(d["steps"].values()) == [20, 20]  # the step counters (the shared seeds) carried over
        assert d["warnings"] == ["Horovod Elastic: DoubleSqueeze error state of 2 of 3 ranks resharded for 2; "
                                 "what rank(s) [2] still owed is lost"]
    assert all(torch.equal(a, b) for a, b in zip(done[0]["params"], done[1]["params"]))
