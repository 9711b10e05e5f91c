"""Top-k's radix select (``compressors.radix_select``): the positions torch.topk and a sort give, in a fixed
number of launches. Its kernels are Triton's: on a CPU they run under Triton's interpreter, in a process of
their own (the interpreter is chosen when Triton is imported); on a GPU, compiled, against torch.topk."""

import pytest
import torch

import dsq_plugins as dsq
from tests.helpers import triton_workers
from tests.helpers.triton_workers import needs_triton
from dsq_plugins.compressors import kernels, own_kernels, radix_select



def run_worker(*args: str, interpret: bool, **env_vars: str) -> str:
    return triton_workers.run_worker("tests.workers.radix_select_worker", *args, interpret=interpret, **env_vars)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the same cases compiled (the last test)")
@pytest.mark.parametrize("blocks", ["default", "small"])
def test_the_interpreted_kernels_keep_the_first_of_the_largest_magnitudes(blocks):
    """Ties at the k-th place (zeros of either sign, equal magnitudes of either sign, a row all equal), k from
    1 to the row's length, subnormals, Inf, a row stride wider than the row; small blocks make the writing
    pass sum the earlier blocks' counts over several rounds."""
    out = run_worker(*(["--small-blocks"] if blocks == "small" else []), interpret=True)
    assert "DIFFERENT" not in out and f"matched {62 if blocks == 'default' else 14}" in out, out[-2000:]


@needs_triton
def test_the_kernels_compile_for_an_a100_and_an_h100_without_a_gpu(tmp_path):
    """Down to machine code by Triton's own ptxas, in a cache of its own (so nothing compiled earlier is taken):
    the compiler's rules, which the interpreter does not apply, hold for every kernel the select launches."""
    out = run_worker("--compile-for", "80", "90", interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    assert "compiled 14" in out, out[-2000:]


def test_a_cpu_selects_with_torch_and_a_wrong_choice_is_named(monkeypatch):
    """A CPU's tensors never take the radix select (its kernels are Triton's), so a CPU's bytes stay
    ``top_magnitudes``'; a misspelt DSQ_TOPK_SELECT is an error naming it, not a silent default."""
    rows = torch.randn(2, 100)
    assert radix_select.positions_of_largest(rows, 3) is None
    monkeypatch.setenv("DSQ_TOPK_SELECT", "radx")
    with pytest.raises(ValueError, match="DSQ_TOPK_SELECT='radx'"):
        radix_select.positions_of_largest(rows, 3)
    q = dsq.get_compressor("topk", ratio=0.1)
    with kernels.gpu_paths(), pytest.raises(ValueError, match="DSQ_TOPK_SELECT"):
        q.kept_positions(rows)


@needs_triton
def test_rows_it_cannot_read_are_refused_by_name():
    with pytest.raises(ValueError, match="float32 rows"):
        radix_select.radix_positions(torch.randn(2, 10, dtype=torch.bfloat16), 3)
    with pytest.raises(ValueError, match="k=11, n=10"):
        radix_select.radix_positions(torch.randn(2, 10), 11)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_it_compiles_and_selects_as_torch_and_the_interpreter_do():
    """Compiled by Triton: the same cases as the interpreter's, the first-call check passes, and a bucket's
    rows of millions give torch.topk's positions (random floats: no ties at the k-th place)."""
    out = run_worker("--device", "cuda", interpret=False)
    assert "matched 62" in out, out[-2000:]
    out = run_worker("--device", "cuda", "--small-blocks", interpret=False)
    assert "matched 14" in out, out[-2000:]
    rows = torch.randn(3, (1 << 22) + 5000, device="cuda")  # more blocks than the writing pass sums at once
    k = rows.shape[1] // 100
    assert radix_select._works_on(torch.cuda.current_device())
    want = torch.topk(rows.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
    assert torch.equal(radix_select.positions_of_largest(rows, k), want)
    q = dsq.get_compressor("topk", ratio=0.01)
    assert torch.equal(q.kept_positions(rows), want)
    many = torch.randn(own_kernels.MOST_ROWS + 1, 4, device="cuda")  # more rows than a grid holds: torch's
    assert radix_select.positions_of_largest(many, 2) is None
    assert torch.equal(dsq.get_compressor("topk", ratio=0.5).kept_positions(many),
                       torch.topk(many.abs(), 2, dim=1).indices.sort(dim=1).values)
