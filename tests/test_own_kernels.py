"""The library's own Triton kernels on a GPU's hot path, each the bytes and values of torch's path it replaces:
sign's codec (``compressors.sign_codec``: payloads and decodes), sign's bucket kernels (``algorithm._sign_triton``:
payloads with their int8 residual, an owner's u) and the int8 memory's addition with its status
(``state._int8_triton``). On a CPU they run under Triton's interpreter, in a process of their own (the
interpreter is chosen when Triton is imported); on a GPU, compiled. (Top-k's radix select: test_radix_select.)"""
import importlib
import os

import pytest
import torch

import dsq_plugins as dsq
from tests.helpers import triton_workers
from tests.helpers.triton_workers import needs_triton, on_a_cpu_only
from dsq_plugins.compressors import sign_codec



def run_worker(*args: str, interpret: bool, **env_vars: str) -> str:
    return triton_workers.run_worker("tests.workers.own_kernels_worker", *args, interpret=interpret, **env_vars)


@needs_triton
@on_a_cpu_only
@pytest.mark.parametrize("blocks", ["default", "small"])
def test_the_interpreted_kernels_write_and_read_torchs_bytes(blocks):
    """Encode: signed zeros, NaN of either sign, infinities, subnormals, magnitudes that overflow, are NaN or zero,
    rows of a wider tensor, rows whose last byte is part full (against the compressor's own encode). Decode of
    each: whole rows, rows whose values end inside a byte, scales to refuse (negative, NaN, infinite, -0.0, the
    largest float), rows at an odd offset in a receive buffer; into a buffer and not, with and without the flags.
    Small blocks make a row span several programs."""
    out = run_worker(*(["--small-blocks"] if blocks == "small" else []), interpret=True)
    assert "DIFFERENT" not in out and f"matched {49 if blocks == 'default' else 29}" in out, out[-2000:]
    assert "first-call check passes" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_sign_compressor_takes_the_codec_with_the_same_bytes_values_and_refusals():
    """The compressor's own calls (a vector, a bucket's chunks as rows, rows decoded checked, trusted, into a
    buffer, a refused scale deferred and raised) give what torch's path gives, and the codec ran for each."""
    out = run_worker("--through-sign", interpret=True)
    assert "triton: the codec encoded 3 times, decoded 7 times" in out and "matched 14" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_the_interpreted_payloads_with_their_residual_are_torchs_bits():
    """Sign's payloads and the int8 codes and block scales of their residual from one kernel: chunks and vectors
    that end inside an int8 block, several programs, a chunk all zero, a magnitude that overflows, zero ones."""
    out = run_worker("--with-residual", interpret=True)
    assert "DIFFERENT" not in out and "matched 21" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_the_interpreted_mean_of_senders_payloads_is_torchs_u_flags_and_status():
    """An owner's u from 1 to 9 senders' payloads with no memory, one made new past the chunk's end and one
    written in place; a sender refused (a negative scale, a NaN one) and a mean that overflows, each with its
    status; the same bits, flags and status as torch's kernel."""
    out = run_worker("--mean", interpret=True)
    assert "DIFFERENT" not in out and "matched 60" in out, out[-2000:]
    assert "refused, new: status 7" in out and "overflow, new: status -1" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_the_interpreted_memory_addition_is_torchs_sum_and_status():
    """A worker's compensation x + e and its status: vectors of whole int8 blocks, ending inside one, shorter than
    one, over several programs; into a new vector, another, x itself, without the status; finite, overflowing, a
    NaN; the memory's encode of a vector and of a difference."""
    out = run_worker("--memory", interpret=True)
    assert "DIFFERENT" not in out and "matched 70" in out, out[-2000:]
    assert "overflow into itself: status 1" in out and "finite into new: status 0" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_the_interpreted_payloads_and_residual_of_uneven_chunks_are_torchs():
    """A bucket cut for 1 to 7 ranks as ``chunk_bounds`` cuts it (a run one value longer first, chunks whose last
    byte is part full) and an owner's one chunk: the payloads and the int8 residual are what torch's path makes
    of each chunk's encode and v less its own decode."""
    out = run_worker("--runs", interpret=True)
    assert "DIFFERENT" not in out and "matched 7" in out, out[-2000:]


@needs_triton
@on_a_cpu_only
def test_doublesqueeze_with_sign_reduces_to_the_same_bits_with_the_triton_kernels():
    """Three ranks, five steps, on the GPU's paths with the Triton kernels taken on this CPU (the interpreter):
    the averages, which carry both error memories from step to step, are those of torch's kernels, and a NaN in
    one rank's gradient is the same error on every rank with the memories left as they were."""
    out = run_worker("--reduce", interpret=True)
    assert "three ranks, five steps: same" in out and "NonFiniteGradientError" in out, out[-2000:]


@needs_triton
def test_the_kernels_compile_for_an_a100_and_an_h100_moving_16_bytes_at_a_time(tmp_path):
    """Down to machine code by Triton's own ptxas, in a cache of its own, specialised as a bucket's launch is:
    the encodes read their tiles and the decodes and the mean write theirs with 16-byte vector instructions,
    nothing flushes subnormals to zero or fuses a multiply and an add, and the rounding's constant is there."""
    out = run_worker("--compile-for", "80", "90", interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    assert "compiled 20" in out, out[-2000:]


def test_a_cpu_keeps_torchs_path_and_a_wrong_choice_is_named(monkeypatch):
    rows = torch.randn(2, 64)
    assert sign_codec.signs_encoded(rows, rows.abs().sum(1), torch.full((), 64.0)) is None
    assert sign_codec.signs_decoded_into(torch.zeros(2, 12, dtype=torch.uint8), 64, None, flags=True) is None
    merged = importlib.import_module("dsq_plugins.algorithm._sign_triton")
    memory = importlib.import_module("dsq_plugins.state._int8_triton")
    assert merged.signs_with_residual(rows, rows.abs().sum(1), torch.full((), 64.0), torch.full((), 127.0)) is None
    payloads = torch.zeros(3, 12, dtype=torch.uint8)
    assert merged.mean_of_signs(payloads, torch.full((), 3.0), None, None, None) is None
    codes, scales = torch.zeros(256, dtype=torch.int8), torch.ones(1)
    assert memory.added_with_status(torch.randn(200), codes, scales, 256, None) is None
    monkeypatch.setenv("DSQ_OWN_KERNELS", "trition")
    with pytest.raises(ValueError, match="DSQ_OWN_KERNELS='trition'"):
        memory.added_with_status(torch.randn(200), codes, scales, 256, None)
    with pytest.raises(ValueError, match="DSQ_OWN_KERNELS='trition'"):
        sign_codec.signs_encoded(rows, rows.abs().sum(1), torch.full((), 64.0))


@needs_triton
def test_rows_it_cannot_take_are_refused_by_name():
    with pytest.raises(ValueError, match="float32 rows of unit stride"):
        sign_codec.encoded_rows(torch.randn(2, 12, dtype=torch.bfloat16), torch.ones(2), torch.ones(()))
    with pytest.raises(ValueError, match="a magnitude per row"):
        sign_codec.encoded_rows(torch.randn(2, 12), torch.ones(3), torch.ones(()))
    merged = importlib.import_module("dsq_plugins.algorithm._sign_triton")
    with pytest.raises(ValueError, match="runs of \\[2, 2\\] chunks"):  # two runs of equal chunks: not a cut
        merged.sign_residual_codes(torch.randn(40), [(torch.ones(2), torch.ones(())), (torch.ones(2), torch.ones(()))],
                                   torch.ones(()))
    with pytest.raises(ValueError, match="holding 100 values"):
        sign_codec.decoded_rows(torch.zeros(2, 12, dtype=torch.uint8), 100)
    with pytest.raises(ValueError, match="out must be float32"):
        sign_codec.decoded_rows(torch.zeros(2, 12, dtype=torch.uint8), 64, out=torch.empty(2, 63))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_codec_compiles_and_gives_torchs_bytes():
    """Compiled by Triton: the interpreter's cases, the compressor's calls, the first-call check, and a bucket of
    millions whose bytes and values are those of ``DSQ_OWN_KERNELS=torch``."""
    out = run_worker("--device", "cuda", interpret=False)
    assert "matched 49" in out and "first-call check passes" in out, out[-2000:]
    out = run_worker("--device", "cuda", "--through-sign", interpret=False)
    assert "matched 14" in out, out[-2000:]
    for mode in ("--with-residual", "--mean", "--memory", "--runs", "--reduce"):
        out = run_worker("--device", "cuda", mode, interpret=False)
        assert "DIFFERENT" not in out and "matched" in out, out[-2000:]
    assert sign_codec._works_on(torch.cuda.current_device())
    for module in ("dsq_plugins.algorithm._sign_triton", "dsq_plugins.state._int8_triton"):
        assert importlib.import_module(module)._works_on(torch.cuda.current_device()), module
    x = torch.randn((1 << 24) + 8, device="cuda")
    q = dsq.get_compressor("sign")
    payload = q.compress(x, seed=1).payload
    values = q.decompress_flat(payload, x.numel())
    os.environ["DSQ_OWN_KERNELS"] = "torch"
    try:
        assert torch.equal(payload, q.compress(x, seed=1).payload)
        assert torch.equal(values, q.decompress_flat(payload, x.numel()))
    finally:
        del os.environ["DSQ_OWN_KERNELS"]
