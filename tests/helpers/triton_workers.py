"""Running a worker of the library's Triton kernels in a process of its own: Triton chooses its interpreter
(``TRITON_INTERPRET=1``, how a CPU runs the kernels) when it is imported, so a test that wants one or the other
starts a fresh interpreter."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_worker(module: str, *args: str, interpret: bool, **env_vars: str) -> str:
    """``python -m module args`` from the repository's root, interpreted or compiled; its stdout, once it exited 0."""
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1" if interpret else "0", **env_vars)
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
