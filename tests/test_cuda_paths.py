"""The round's user paths on CUDA tensors, against the same run on a CPU:
the DDP hook's two-level exchange, the DDP hook with lowrank, the DDP hook
with deferred verdicts inline and on its thread and handing them to a fused
AdamW on the device (no wait for the device in backward, checked on nccl),
with a sparse embedding's gradient beside the dense ones,
each on the hook's side stream, and on backward's own stream, LocalSteps' defaults,
LocalSteps exact inside a host and overlapped, and FSDP2 / HSDP
with sign (``tests/workers/paths_worker.py``); and DeepSpeed's ZeRO-3 with
the section (``tests/workers/zero3_worker.py``).
On nccl with one rank (nccl takes a GPU per rank) and on gloo with four
ranks holding CUDA tensors on one GPU. Skipped where torch sees no GPU.

Sign's scale and FSDP's reductions are sums, which CUDA adds in another
order, so parameters compare in aggregate (as ``test_cuda.py`` compares a
training run), and every rank must hold the same model."""
import pytest
import torch

from tests.conftest import require
from tests.helpers.launchers import launch
from tests.test_cuda import close_in_aggregate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCENARIOS = ("two-level", "lowrank", "hook-inline", "hook-thread", "hook-late", "hook-sparse", "hook-one-stream",
             "local-steps", "local-steps-hosts-overlapped", "fsdp", "hsdp")


def run(n, device, backend, out_dir):
    return launch("torchrun", n, "paths_worker.py", out_dir=str(out_dir), timeout=300,
                  env={"DSQ_TEST_DEVICE": device, "DSQ_TEST_BACKEND": backend})


def compare(cuda, cpu):
    failures = []
    for name in cuda[0]:
        errors = [r[name]["error"] for r in cuda if "error" in r[name]]
        if errors:
            failures.append(f"{name}: {errors[0]}")
            continue
        for rank, (got, want) in enumerate(zip(cuda, cpu)):
            assert all(torch.equal(a, b) for a, b in zip(got[name]["params"], cuda[0][name]["params"])), (name, rank)
            if not all(close_in_aggregate(a, b, 1e-2) for a, b in zip(got[name]["params"], want[name]["params"])):
                failures.append(f"{name}, rank {rank}: CUDA's model is not the CPU's")
            if got[name].get("bytes") != want[name].get("bytes"):
                failures.append(f"{name}, rank {rank}: {got[name].get('bytes')} bytes, the CPU sent "
                                f"{want[name].get('bytes')}")
    assert not failures, "\n".join(failures)


def test_the_rounds_paths_on_nccl_with_one_rank(tmp_path):
    cuda = run(1, "cuda", "nccl", tmp_path / "cuda")
    assert set(cuda[0]) == set(SCENARIOS)
    assert cuda[0]["hook-late"].get("strict", True)  # its stable iterations ran with every sync an error
    compare(cuda, run(1, "cpu", "gloo", tmp_path / "cpu"))


def test_the_rounds_paths_on_gloo_ranks_holding_cuda_tensors(tmp_path):
    cuda = run(4, "cuda", "gloo", tmp_path / "cuda")
    assert all(r["two-level"].get("two_level") for r in cuda if "error" not in r["two-level"])
    compare(cuda, run(4, "cpu", "gloo", tmp_path / "cpu"))


def test_zero_3_with_the_section_on_nccl_with_one_rank(tmp_path):
    """DeepSpeed's CUDA accelerator, one rank over nccl: the exact operator is
    DeepSpeed's own stage 3, sign resumes bit for bit, a NaN is refused."""
    require("deepspeed")
    [rank] = launch("deepspeed", 1, "zero3_worker.py", out_dir=str(tmp_path), timeout=600,
                    env={"DSQ_TEST_BACKEND": "nccl"})
    assert rank["exact"]["losses"] == rank["deepspeed"]["losses"]
    assert torch.equal(rank["exact"]["params"], rank["deepspeed"]["params"])
    (continued, params), (resumed, resumed_params) = rank["resume"]["continued"], rank["resume"]["resumed"]
    assert continued == resumed and torch.equal(params, resumed_params)
    assert rank["nan"][0] is not None and rank["nan"][0][0] == "NonFiniteGradientError" and rank["nan"][1]
