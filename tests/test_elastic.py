"""A rank killed with SIGKILL mid-step: the others stop with a clear error
and write nothing; the job restarted at the smaller size (3 -> 2) resumes
from the last checkpoint with its error memories resharded
(tests/workers/elastic_worker.py under torchrun; CPU, gloo)."""
import os
import sys

import torch

from tests.helpers.launchers import launcher_env, run_job
from tests.test_reshard import owed

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "elastic_worker.py")


def torchrun(n, out_dir, ckpt, env=None, timeout=300):
    """(exit code, log tail) of ``n`` workers under torchrun."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "--monitor-interval=2", WORKER, out_dir, ckpt]
    proc = run_job(cmd, timeout=timeout, env={**os.environ, **launcher_env("torchrun"), **(env or {})})
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_rank_killed_mid_step_stops_the_others_cleanly_and_the_job_resumes_smaller(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    killed, resumed = str(tmp_path / "killed"), str(tmp_path / "resumed")
    code, log = torchrun(3, killed, ckpt, env={"DSQ_KILL_AT": "5", "DSQ_KILL_RANK": "2"})
    assert code != 0 and "exitcode  : -9" in log, log  # rank 2 died by SIGKILL
    for rank in range(2):
        failed = torch.load(os.path.join(killed, f"failed-rank{rank}.pt"))
        assert failed["error"] == "PeerFailedError" and failed["step"] == 5 and failed["size"] == 3
        assert "torch.distributed all_to_all_single" in failed["message"]  # names the collective
        assert failed["seconds"] < 60 and failed["unchanged"]  # within the group's timeout; nothing written
    code, log = torchrun(2, resumed, ckpt)
    assert code == 0, log
    done = [torch.load(os.path.join(resumed, f"rank{rank}.pt")) for rank in range(2)]
    assert all(d["size"] == 2 and d["resumed_at"] == 5 and d["resharded_from"] == 3 for d in done)
    assert all(list(d["steps"].values()) == [12, 12] for d in done)
    assert all(torch.equal(done[0]["params"][k], done[1]["params"][k]) for k in done[0]["params"])
    # what the memories owed at the checkpoint is what the two new ranks start with (int8 rounding aside)
    saved = [torch.load(os.path.join(ckpt, "step5", f"rank{r}.pt"))["reducer"] for r in range(3)]
    before, after = owed(saved), owed([d["loaded"] for d in done])
    assert before.keys() == after.keys() and before
    assert all((after[k] - v).abs().max() <= 1e-2 * v.abs().max() for k, v in before.items())
