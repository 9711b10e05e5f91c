"""QSGD's and TernGrad's payloads on a GPU in one Triton launch each (``compressors.levels_codec``): the bytes,
values and refusals of torch's path. On a CPU the kernels run under Triton's interpreter, in a process of their own
(the interpreter is chosen when Triton is imported); on a GPU, compiled."""
import os

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors import levels_codec
from tests.helpers import triton_workers
from tests.helpers.triton_workers import needs_triton, on_a_cpu_only



def run_worker(*args: str, interpret: bool, **env_vars: str) -> str:
    return triton_workers.run_worker("tests.workers.levels_codec_worker", *args, interpret=interpret, **env_vars)


@needs_triton
@on_a_cpu_only
def test_the_interpreted_codec_writes_and_reads_torchs_bytes():
    """Every code width; buckets wider than the row, ending inside a byte, of one element; signed zeros,
    subnormals, infinities, an all-zero bucket, values that overflow; each payload decoded as sent, with refused
    scales, with codes above the top one (a last byte's padding too), at an odd offset, into a buffer and without
    flags; a NaN's row; and the first-call check."""
    out = run_worker(interpret=True)
    assert "DIFFERENT" not in out and "matched 51" in out and "first-call check passes" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_qsgd_and_terngrad_take_the_codec_with_the_same_bytes_values_and_refusals():
    """Each compressor's own calls (a vector, a bucket's chunks as rows, rows decoded checked, trusted, into a
    buffer, a refused scale deferred and raised) give what torch's path gives, and the codec ran for each."""
    out = run_worker("--through-compressors", interpret=True)
    assert out.count("the codec encoded 3 times, decoded 7 times") == 4 and "matched 68" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_doublesqueeze_with_qsgd_reduces_to_the_same_bits_with_the_codec():
    """Three ranks, five steps, on the GPU's paths with the codec taken on this CPU (the interpreter): the averages,
    which carry both error memories, are torch's, and a NaN in one rank's gradient is the same error on every
    rank."""
    out = run_worker("--reduce", interpret=True)
    assert "three ranks, five steps: same" in out and "NonFiniteGradientError" in out, out[-2000:]


@needs_triton
def test_the_codec_compiles_for_an_a100_and_an_h100_moving_16_bytes_at_a_time(tmp_path):
    """Down to machine code by Triton's own ptxas, for every code width, with and without buckets: the encode reads
    and the decode writes its values 16 bytes at a time, with torch's roundings."""
    out = run_worker("--compile-for", "80", "90", interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    assert "compiled 24" in out, out[-2000:]


def test_a_cpu_keeps_torchs_path(monkeypatch):
    rows = torch.randn(2, 64)
    assert not levels_codec.encodes(rows) and not levels_codec.runs_on(torch.device("cpu"))
    assert levels_codec.levels_decoded(torch.zeros(2, 12, dtype=torch.uint8), 64, 1, 2, 64) is None
    q = dsq.get_compressor("qsgd")
    assert not q.decodes_rows(torch.device("cpu"))
    monkeypatch.setenv("DSQ_OWN_KERNELS", "trition")
    with pytest.raises(ValueError, match="DSQ_OWN_KERNELS='trition'"):
        levels_codec.runs_on(torch.device("cuda"))


@needs_triton
def test_what_the_codec_cannot_take_is_refused_by_name():
    words = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32 rows of unit stride"):
        levels_codec.encoded_rows(torch.randn(2, 12, dtype=torch.bfloat16), torch.ones(2, 1), words, 1, 2, 12)
    with pytest.raises(ValueError, match="a scale per bucket of 4"):
        levels_codec.encoded_rows(torch.randn(2, 12), torch.ones(2, 2), words, 1, 2, 4)
    with pytest.raises(ValueError, match="127 levels in 4 bits"):
        levels_codec.encoded_rows(torch.randn(2, 12), torch.ones(2, 1), words, 127, 4, 12)
    with pytest.raises(ValueError, match="of 20 bytes for 64 values"):
        levels_codec.decoded_rows(torch.zeros(2, 12, dtype=torch.uint8), 64, 1, 2, 64)
    with pytest.raises(ValueError, match="out must be float32"):
        levels_codec.decoded_rows(torch.zeros(2, 20, dtype=torch.uint8), 64, 1, 2, 64, out=torch.empty(2, 63))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_codec_compiles_and_gives_torchs_bytes():
    """Compiled by Triton: the interpreter's cases, the compressors' calls, DoubleSqueeze, the first-call check, and
    a vector of millions whose bytes and values are those of ``DSQ_OWN_KERNELS=torch``."""
    out = run_worker("--device", "cuda", interpret=False)
    assert "matched 51" in out and "first-call check passes" in out, out[-2000:]
    for mode in ("--through-compressors", "--reduce"):
        out = run_worker("--device", "cuda", mode, interpret=False)
        assert "DIFFERENT" not in out and "matched" in out, out[-2000:]
    assert levels_codec._works_on(torch.cuda.current_device())
    x = torch.randn((1 << 24) + 5, device="cuda")
    for q in (dsq.get_compressor("qsgd"), dsq.get_compressor("terngrad")):
        payload = q.compress(x, seed=1).payload
        values = q.decompress_flat(payload, x.numel(), seed=1)
        os.environ["DSQ_OWN_KERNELS"] = "torch"
        try:
            assert torch.equal(payload, q.compress(x, seed=1).payload), q
            assert torch.equal(values, q.decompress_flat(payload, x.numel(), seed=1)), q
        finally:
            del os.environ["DSQ_OWN_KERNELS"]
