"""Blocksign on a GPU in Triton (``compressors.blocksign_codec``, ``algorithm._blocksign_triton``): the codec's
bytes, values and refusals, and the bucket kernels' (the compensation with its codes, the payloads with their
residual, an owner's mean), those of torch's path. On a CPU the kernels run under Triton's interpreter, in a
process of their own (the interpreter is chosen when Triton is imported); on a GPU, compiled."""
import importlib
import os

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors import blocksign_codec
from tests.helpers import triton_workers
from tests.helpers.triton_workers import needs_triton, on_a_cpu_only

_blocksign_triton = importlib.import_module("dsq_plugins.algorithm._blocksign_triton")


def run_worker(*args: str, interpret: bool, **env_vars: str) -> str:
    return triton_workers.run_worker("tests.workers.blocksign_triton_worker", *args, interpret=interpret, **env_vars)


@needs_triton
@on_a_cpu_only
def test_the_interpreted_kernels_give_torchs_bytes_values_and_refusals():
    """The codec over ten shapes (widths that are not powers of two, short last blocks, rows shorter than a block;
    signed zeros, ties, infinities, subnormals, a NaN), each payload decoded as sent, refused, with a position
    outside its block, unaligned, into a buffer, without flags; the compensation with its codes, the payloads with
    their residual and the mean over six shapes, widths 2 to 128; and both first-call checks."""
    out = run_worker(interpret=True)
    assert "DIFFERENT" not in out and "matched 128" in out and "first-call checks pass" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_blocksign_takes_the_codec_with_the_same_bytes_values_and_refusals():
    """Blocksign's own calls (a vector, a bucket's chunks as rows, rows decoded checked, trusted, into a buffer, a
    refused scale deferred and raised) give what torch's path gives, for three widths, and the codec ran for each."""
    out = run_worker("--through", interpret=True)
    assert out.count("the codec encoded 3 times, decoded 7 times") == 3 and "matched 51" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_doublesqueeze_with_blocksign_reduces_to_the_same_bits_with_our_kernels():
    """Three ranks, five steps, on the GPU's paths with the kernels taken on this CPU (the interpreter): the
    averages, which carry both error memories, are torch's, a NaN in one rank's gradient is the same error on every
    rank, and the compensation, the merged encode, the mean and the decode each ran."""
    out = run_worker("--reduce", interpret=True)
    assert "three ranks, five steps: same" in out and "NonFiniteGradientError" in out, out[-2000:]


@needs_triton
def test_the_kernels_compile_for_an_a100_and_an_h100(tmp_path):
    """Down to machine code by Triton's own ptxas: the passes over a vector move 16 bytes at a time, with torch's
    roundings."""
    out = run_worker("--compile-for", "80", "90", interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    assert "compiled 16" in out, out[-2000:]


def test_a_cpu_keeps_torchs_path(monkeypatch):
    rows = torch.randn(2, 64)
    assert not blocksign_codec.encodes(rows) and not blocksign_codec.runs_on(torch.device("cpu"))
    assert blocksign_codec.blocksign_decoded(torch.zeros(2, 6, dtype=torch.uint8), 64, 32) is None
    assert _blocksign_triton.compensated_codes(rows.view(-1), torch.zeros(256, dtype=torch.int8), torch.ones(1), 32,
                                               None) is None
    assert _blocksign_triton.mean_of_blocksign(torch.zeros(2, 6, dtype=torch.uint8), torch.ones(()), None, None,
                                               None, 64, 32) is None
    monkeypatch.setenv("DSQ_OWN_KERNELS", "trition")
    with pytest.raises(ValueError, match="DSQ_OWN_KERNELS='trition'"):
        blocksign_codec.runs_on(torch.device("cuda"))


@needs_triton
def test_what_the_kernels_cannot_take_is_refused_by_name():
    with pytest.raises(ValueError, match="a block from 2 to 128"):
        blocksign_codec.block_codes_rows(torch.randn(2, 12), 129)
    with pytest.raises(ValueError, match="codes must be uint8"):
        blocksign_codec.block_codes_rows(torch.randn(2, 12), 4, torch.empty(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="of 6 bytes for 64 values"):
        blocksign_codec.decoded_rows(torch.zeros(2, 7, dtype=torch.uint8), 64, 32)
    with pytest.raises(ValueError, match="out must be float32"):
        blocksign_codec.decoded_rows(torch.zeros(2, 6, dtype=torch.uint8), 64, 32, out=torch.empty(2, 63))
    with pytest.raises(ValueError, match="whole blocks of 24"):
        _blocksign_triton.compensated_rows(torch.randn(48), torch.zeros(256, dtype=torch.int8), torch.ones(1), 24)
    with pytest.raises(ValueError, match="the longer first, in blocks of 2 to 128, with each run.s contiguous codes"):
        _blocksign_triton.blocksign_and_residual_rows(torch.randn(2, 48), torch.zeros(2, 3, dtype=torch.uint8),
                                                      torch.ones(2), torch.ones(()), torch.ones(()), 24)
    with pytest.raises(ValueError, match="of 6 bytes for 64 values in blocks of 32"):
        _blocksign_triton.mean_of_blocksign_rows(torch.zeros(2, 7, dtype=torch.uint8), torch.ones(()), None, None,
                                                 None, 64, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_kernels_compile_and_give_torchs_bytes():
    """Compiled by Triton: the interpreter's cases, blocksign's calls, DoubleSqueeze, the first-call checks, and a
    vector of millions whose bytes and values are those of ``DSQ_OWN_KERNELS=torch``."""
    out = run_worker("--device", "cuda", interpret=False)
    assert "matched 128" in out and "first-call checks pass" in out, out[-2000:]
    for mode in ("--through", "--reduce"):
        out = run_worker("--device", "cuda", mode, interpret=False)
        assert "DIFFERENT" not in out and "matched" in out, out[-2000:]
    assert blocksign_codec._works_on(torch.cuda.current_device())
    assert _blocksign_triton._works_on(torch.cuda.current_device())
    x = torch.randn((1 << 24) + 5, device="cuda")
    q = dsq.get_compressor("blocksign")
    payload = q.compress(x).payload
    values = q.decompress_flat(payload, x.numel())
    os.environ["DSQ_OWN_KERNELS"] = "torch"
    try:
        assert torch.equal(payload, q.compress(x).payload)
        assert torch.equal(values, q.decompress_flat(payload, x.numel()))
    finally:
        del os.environ["DSQ_OWN_KERNELS"]
