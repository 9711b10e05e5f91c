"""Every quickstart under its real launcher: the code each guide in
docs/guides/ shows (``literalinclude`` of examples/quickstart/) trains, and
every rank ends with the same weights and a lower loss."""
import os
import sys

import pytest

from tests.helpers.launchers import command, launcher_env, run_job

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart")
RUNS = [  # (launcher, ranks, script, arguments)
    ("torchrun", 2, "with_ddp.py", []),
    ("torchrun", 2, "with_ddp.py", ["--adam"]),
    ("torchrun", 2, "plain_torch.py", []),
    ("torchrun", 2, "local_steps.py", []),
    ("torchrun", 4, "with_fsdp.py", []),
    ("torchrun", 4, "robust_layer.py", []),
    ("torchrun", 2, "bad_input.py", []),
    ("torchrun", 2, "checkpoint.py", []),
    ("horovodrun", 2, "with_horovod.py", []),
    ("horovodrun", 2, "with_horovod.py", ["--stock"]),
    ("deepspeed", 2, "with_deepspeed.py", []),
    ("deepspeed", 2, "with_deepspeed.py", ["--install"]),
    ("deepspeed", 2, "with_deepspeed.py", ["--onebit"]),
]


@pytest.mark.parametrize("launcher,n,script,args", RUNS, ids=[f"{s[:-3]}{''.join(a)}" for _, _, s, a in RUNS])
def test_each_quickstart_trains_on_its_launcher(launcher, n, script, args):
    run = run_job(command(launcher, n, os.path.join(HERE, script), *args), cwd=HERE, timeout=600,
                  env={**os.environ, **launcher_env(launcher)})
    output = run.stdout + run.stderr
    said = [line.rsplit(":", 1)[-1].strip() for line in run.stdout.splitlines()]  # (horovodrun prefixes each line)
    assert run.returncode == 0 and "ok" in said, output[-4000:]


def test_the_readme_s_main_job_trains_and_exits_cleanly_under_torchrun():
    """The README's first command (``make demo``: 4 gloo ranks, 1-bit DoubleSqueeze on
    digits), shortened: it learns, reports its bytes, and every rank exits 0. Its end
    used to abort about one run in ten at interpreter teardown ("terminate called
    without an active exception", gloo's threads) after the training had succeeded."""
    root = os.path.dirname(HERE)
    run = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   os.path.join(root, "train_digits.py"), "--compressor", "sign", "--steps", "150"],
                  cwd=os.path.dirname(root), timeout=600,
                  env={**os.environ, **launcher_env("torchrun"), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    accuracy = float(run.stdout.split("test accuracy")[1].split("%")[0])
    assert accuracy > 60.0 and "less" in run.stdout, run.stdout[-2000:]
