"""Running a worker of the library's Triton kernels in a process of its own: Triton chooses its interpreter
(``TRITON_INTERPRET=1``, how a CPU runs the kernels) when it is imported, so a test that wants one or the other
starts a fresh interpreter."""
import os
import subprocess
import sys

import pytest
import torch

from dsq_plugins.compressors.own_kernels import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: a test of the kernels themselves: Triton must be installed (a CPU build of torch brings none)
needs_triton = pytest.mark.skipif(triton is None, reason="Triton is not installed")
#: a test of the interpreter's cases: a GPU runs the same cases compiled, in a test of its own
on_a_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the same cases compiled")


def run_worker(module: str, *args: str, interpret: bool, **env_vars: str) -> str:
    """``python -m module args`` from the repository's root, interpreted or compiled; its stdout, once it exited 0."""
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1" if interpret else "0", **env_vars)
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def compiled(fn, constants: dict, pointers: dict[str, str], aligned: set[str], capability: int,
             options: dict | None = None) -> tuple[str, str]:
    """(PTX, registers and spills) of the Triton kernel ``fn`` compiled for a GPU of this compute capability by
    Triton's own ptxas, with no GPU here, specialised as Triton's launcher specialises a bucket's call: the
    ``pointers`` (name: type; every other argument but the ``constants`` is an int32) and the ``aligned`` sizes
    divisible by 16."""
    from triton import compile as compile_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if name in pointers or name in aligned}
    kernel = compile_kernel(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=divisible),
                            target=GPUTarget("cuda", capability, 32), options=options)
    return kernel.asm["ptx"], resource_usage(kernel.asm["cubin"])


def resource_usage(cubin: bytes) -> str:
    """Registers per thread and spill bytes of a compiled kernel, by Triton's own cuobjdump (where it has one)."""
    import pathlib
    import tempfile

    import triton
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return "no cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    line = next((line for line in done.stdout.splitlines() if "REG:" in line), done.stdout.strip()[-200:])
    return " ".join(line.split())


def reducing_with_a_nan(compressor: str, device, sizes=(600, 24, 1000), **params):
    """A rank's five steps of ``DoubleSqueeze`` with ``compressor`` (and its ``params``) over tensors of ``sizes``
    in buckets of about 1,000 values, the third with a NaN in rank 1's third tensor, for ``LocalGroup(3).run``:
    (the averages of the four good steps, which carry both error memories; the error the third step raised)."""
    import dsq_plugins as dsq

    def per_rank(comm):
        reducer = dsq.DoubleSqueeze(comm, dsq.get_compressor(compressor, **params), bucket_mb=0.004)
        gen = torch.Generator().manual_seed(comm.rank)
        steps, refusals = [], []
        for step in range(5):
            named = [(f"p{i}", torch.randn(size, generator=gen).to(device)) for i, size in enumerate(sizes)]
            if step == 2 and comm.rank == 1:
                named[2][1][7] = float("nan")  # the step fails on every rank; the memories stay as they were
            try:
                steps.append(torch.cat(reducer.reduce_many(named)))
            except Exception as failed:  # noqa: BLE001 - what each rank raised is compared
                refusals.append(f"{type(failed).__name__}: {failed}")
        assert len(refusals) == 1, refusals
        return torch.stack(steps), refusals[0]
    return per_rank


def same_reductions(torchs: list, ours: list) -> bool:
    """Whether two runs of ``reducing_with_a_nan`` on every rank gave the same averages and errors; printed."""
    same = all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(torchs, ours, strict=True))
    print(f"a NaN on rank 1 at step 3: {ours[0][1]}", flush=True)
    print(f"reduce, three ranks, five steps: {'same' if same else 'DIFFERENT'}", flush=True)
    return same
