"""Top-k's payloads written by the radix select's last launch on a GPU, alone (``radix_select.radix_payloads``:
a bucket's chunks) and with the int8 residual the error memory keeps (``algorithm._topk_triton``: a worker's and an
owner's encode), and an owner's u from its senders' payloads (``mean_of_topk``): the bytes of torch's path. On a
CPU the kernels run under Triton's interpreter, in a process of their own; on a GPU, compiled."""
import importlib

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors import kernels, radix_select, topk_codec
from tests.helpers import triton_workers
from tests.helpers.triton_workers import needs_triton, on_a_cpu_only

_topk_triton = importlib.import_module("dsq_plugins.algorithm._topk_triton")


def run_worker(*args: str, interpret: bool, **env_vars: str) -> str:
    return triton_workers.run_worker("tests.workers.topk_triton_worker", *args, interpret=interpret, **env_vars)


@needs_triton
@on_a_cpu_only
@pytest.mark.parametrize("blocks", ["default", "small"])
def test_the_interpreted_kernel_writes_torchs_payloads_codes_and_scales(blocks):
    """One row ending inside an int8 block, rows of whole blocks over several programs, every element kept, a row
    shorter than a block; signed zeros, ties of either sign at the k-th place, a NaN (kept, its residual +0.0), an
    Inf, subnormals; small blocks make the writing pass sum earlier blocks' counts over several rounds, and the
    mean search its senders' entries over several stretches and add them over several rounds."""
    out = run_worker(*(["--small-blocks"] if blocks == "small" else []), interpret=True)
    assert "DIFFERENT" not in out and f"matched {8 if blocks == 'default' else 13}" in out, out[-2000:]
    if blocks == "default":
        assert "first-call check passes" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_top_k_takes_the_select_s_payloads_with_the_same_bytes():
    """A bucket cut for 1 to 4 ranks: ``compress_chunks`` and the payloads with their int8 residual are those of
    torch's selection and kernels, and the select wrote them (one launch of each kind per call)."""
    out = run_worker("--through-topk", interpret=True)
    assert "DIFFERENT" not in out and "matched 4" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_rows_of_any_length_in_runs_get_torchs_payloads_and_residual():
    """A bucket cut for several ranks into chunks that are not whole int8 blocks, in one run or two (lengths one
    apart), over one program or several, rows of a few elements: each run's payloads are torch's, the vector
    becomes v - Q(v) (a kept NaN or Inf stays non-finite), its codes and scales ``compact.int8_codes``'; through
    ``payloads_with_residual`` for 2 to 5 ranks only where the vector is the caller's scratch; the first-call
    check."""
    out = run_worker("--runs", interpret=True)
    assert "DIFFERENT" not in out and "matched 19" in out and "first-call check passes" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_the_interpreted_mean_of_senders_payloads_is_torchs_u_flags_and_status():
    """An owner's u from 1 to 9 senders' payloads, with no memory, one written in place, one made new past the
    chunk's end; k from 1 to the chunk's length; a sender refused for each of the three checks and several
    refused (the first one's status); a mean that overflows (``header.OVERFLOW`` with a memory)."""
    out = run_worker("--mean", interpret=True)
    assert "DIFFERENT" not in out and "matched 42" in out, out[-2000:]
    assert "several, memory new: status 4" in out and "overflow, memory new: status -1" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_the_interpreted_decode_of_received_rows_is_torchs():
    """The codec's decode (``compressors.topk_codec``) of rows over several programs, every element kept, one kept,
    tiles and searches of several rounds; as sent, with a position outside, positions out of order and a NaN,
    unaligned, into a buffer, without flags: torch's flags, and its values for every row that passes; top-k's own
    decodes with it (a vector, rows checked, into a buffer, trusted, a refusal deferred and raised); the first-call
    check."""
    out = run_worker("--decode", interpret=True)
    assert "DIFFERENT" not in out and "matched 25" in out and "first-call check passes" in out, out[-2000:]
    assert "the codec decoded 7 times" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_doublesqueeze_with_top_k_reduces_to_the_same_bits_with_the_select_s_payloads():
    """Three ranks, five steps, on the GPU's paths with the kernels taken on this CPU (the interpreter): the
    averages, which carry both int8 error memories, are torch's, and a NaN in one rank's gradient is the same
    error on every rank; the payloads with their residual (of chunks of whole blocks and, in runs, of other
    lengths), the mean and the decode each ran."""
    out = run_worker("--reduce", interpret=True)
    assert "three ranks, five steps: same" in out and "NonFiniteGradientError" in out, out[-2000:]
    assert "reduce, radix: 51 launches of the payloads with their residual, 29 of them in runs" in out, out[-2000:]


@needs_triton
def test_the_kernel_compiles_for_an_a100_and_an_h100(tmp_path):
    """Down to machine code by Triton's own ptxas: the payloads with their residual (one pass, and in runs), the
    checks, the decode and the mean (with and without a memory), with torch's roundings and the senders' additions
    ordered by barriers."""
    out = run_worker("--compile-for", "80", "90", interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    assert "compiled 12" in out, out[-2000:]


def test_a_cpu_keeps_torchs_path():
    rows = torch.randn(2, 512)
    levels = torch.full((), 127.0)
    assert radix_select.payloads_of_largest(rows, 5) is None
    assert _topk_triton.topk_with_residual(rows, 5, levels) is None
    assert topk_codec.topk_decoded(torch.zeros(2, 40, dtype=torch.uint8), 512) is None
    assert not topk_codec.runs_on(torch.device("cpu"))
    with kernels.gpu_paths():
        q = dsq.get_compressor("topk", ratio=0.01)
        payloads = q.compress_chunks(rows.reshape(-1), [(0, 512), (512, 1024)], [None, None])
    assert torch.equal(payloads[1][20:].view(torch.int32), torch.topk(rows[1].abs(), 5).indices.sort().values.int())


@needs_triton
def test_rows_it_cannot_tile_are_refused_by_name():
    with pytest.raises(ValueError, match="one of them or each whole blocks of 256"):
        _topk_triton.payloads_and_residual_rows(torch.randn(2, 300), 5, torch.full((), 127.0))
    with pytest.raises(ValueError, match="k=11, n=10"):
        radix_select.radix_payloads(torch.randn(2, 10), 11)
    with pytest.raises(ValueError, match="8k bytes for k from 1 to 4"):
        topk_codec.decoded_rows(torch.zeros(2, 40, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="out must be float32"):
        topk_codec.decoded_rows(torch.zeros(2, 40, dtype=torch.uint8), 10, out=torch.empty(2, 9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_kernels_compile_and_write_torchs_bytes():
    """Compiled by Triton: the interpreter's cases, the compressor's calls, DoubleSqueeze, the first-call checks,
    and a bucket of millions whose payloads and residual are those of ``DSQ_TOPK_SELECT=torch``."""
    out = run_worker("--device", "cuda", interpret=False)
    assert "matched 8" in out and "first-call check passes" in out, out[-2000:]
    for mode in ("--small-blocks", "--mean", "--decode", "--through-topk", "--runs", "--reduce"):
        out = run_worker("--device", "cuda", mode, interpret=False)
        assert "DIFFERENT" not in out and "matched" in out, out[-2000:]
    assert _topk_triton._works_on(torch.cuda.current_device())
    rows = torch.randn(4, 1 << 20, device="cuda")
    levels = torch.full((), 127.0, device="cuda")
    reference = importlib.import_module("dsq_plugins.algorithm._payloads_and_residual")._topk_and_residual
    want = reference(rows, radix_select.torch_positions(rows, 10486), levels)
    got = _topk_triton.topk_with_residual(rows, 10486, levels)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(radix_select.payloads_of_largest(rows, 10486), want[0])
