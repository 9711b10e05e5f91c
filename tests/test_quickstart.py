"""Every quickstart under its real launcher: the code each guide in
docs/guides/ shows (``literalinclude`` of examples/quickstart/) trains, and
every rank ends with the same weights and a lower loss."""
import os
import subprocess
import sys

import pytest

from tests.conftest import require
from tests.helpers.launchers import launcher_env, venv_tool

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


def command(launcher: str, n: int, script: str, args: list[str]) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", script, *args]
    if launcher == "horovodrun":
        require("horovod.torch")
        return [venv_tool("horovodrun"), "-np", str(n), "-H", f"localhost:{n}", sys.executable, script, *args]
    require("deepspeed")
    return [venv_tool("deepspeed"), "--num_gpus", str(n), script, *args]


@pytest.mark.parametrize("launcher,n,script,args", RUNS, ids=[f"{s[:-3]}{''.join(a)}" for _, _, s, a in RUNS])
def test_each_quickstart_trains_on_its_launcher(launcher, n, script, args):
    run = subprocess.run(command(launcher, n, script, args), cwd=HERE, capture_output=True, text=True, timeout=600,
                         env={**os.environ, **launcher_env(launcher)})
    output = run.stdout + run.stderr
    said = [line.rsplit(":", 1)[-1].strip() for line in run.stdout.splitlines()]  # (horovodrun prefixes each line)
    assert run.returncode == 0 and "ok" in said, output[-4000:]
