"""The compressors, their fused kernels and the reducer on CUDA tensors: the
same formats and the same answers as on a CPU, over nccl (one rank per GPU)
and over gloo with several ranks holding CUDA tensors. Skipped where torch
sees no GPU; run on one with ``python -m pytest tests/test_cuda.py``.

Within one device, compiled (Triton) and eager kernels give the same bytes
(``tests/test_kernels.py``, which runs on CUDA too where it is present).
Across devices the bytes are the same wherever no float sum is involved;
where a scale or a norm is a sum, CUDA adds in another order, so the last
bit of that scale may differ, and so may the few elements whose rounding
it decides: those compare by their decoded values instead."""
import logging

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors import kernels
from tests.helpers.launchers import launch
from tests.helpers.states import decoded
from tests.test_kernels import payloads, sample
from tests.workers import dist_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")

CASES = [(name, {}) for name in dsq.COMPRESSORS] + [
    ("topk", {"ratio": 0.1}), ("qsgd", {"levels": 7}), ("terngrad", {"bucket_size": 100}), ("blocksign", {"block": 7}),
    ("sign", {"scale": "rms"}), ("sign", {"scale": "rms", "block": 128})]
# odd tails, a CPU block and a bit, and one past the size from which CUDA compiles its kernels
SIZES = (9, 1000, kernels.CPU_BLOCK + 24, (1 << 21) + 5)
SUMLESS = {"none", "fp16", "bf16", "topk", "randomk"}  # formats whose bytes involve no float sum


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32).cpu()


def close_in_aggregate(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-3) -> bool:
    """Equal but for a few elements whose rounding an ulp of a scale decided."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().sum()) <= tol * float(a.abs().sum()) + 1e-30


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name,params", CASES)
def test_cuda_payloads_are_the_cpu_format(name, params, n):
    cpu_payload, cpu_values = payloads(name, n, "cpu", **params)
    payload, values = payloads(name, n, CUDA, **params)
    assert payload.device.type == values.device.type == CUDA.type
    assert payload.dtype == torch.uint8 and payload.numel() == cpu_payload.numel()
    if name in SUMLESS:
        assert torch.equal(payload.cpu(), cpu_payload)
        assert torch.equal(bits(values), bits(cpu_values))
    else:
        assert close_in_aggregate(values, cpu_values), f"{name}: CUDA's decoded values are not the CPU's"
    # each device decodes the other's bytes to what it decodes its own to
    q = dsq.get_compressor(name, **params)
    assert torch.equal(bits(q.decompress_flat(cpu_payload.to(CUDA), n, 7)), bits(cpu_values))


def _spoiled_payloads():
    """(compressor, params, numel, how the bytes are spoiled in place, the error's words)"""
    u8 = lambda *values: torch.tensor(values, dtype=torch.uint8)  # noqa: E731
    return [
        ("sign", {}, 1000, lambda p: p[:4].copy_(u8(0, 0, 192, 127)), "not finite"),  # a NaN scale
        ("sign", {"block": 128}, 1000, lambda p: p[2:4].copy_(u8(192, 127)), "not finite"),  # block 1's: bf16 NaN
        ("topk", {"k": 2}, 10, lambda p: p[8:12].copy_(u8(255, 255, 255, 127)), "positions outside"),
        ("topk", {"k": 2}, 10, lambda p: p[8:].view(torch.int32).copy_(p[8:].view(torch.int32).flip(0)),
         "strictly increasing"),
        ("qsgd", {"levels": 7}, 40, lambda p: p[4:].fill_(255), "codes above"),
        ("qsgd", {}, 40, lambda p: p[-1:].fill_(255), "codes above"),
        ("terngrad", {}, 40, lambda p: p[-1:].fill_(255), "codes above"),
    ]


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("n,size", [(1000, 4), ((1 << 21) + 5, 8), (13, 3)])
def test_cuda_compresses_a_buckets_chunks_in_one_batched_call(name, params, n, size):
    """compress_chunks on CUDA (rows for every format but none, chunks of
    any size: short last buckets and blocks included): each
    chunk's payload in its own format, decoding to what compress's decodes
    to (a sign scale's sum may add in another order)."""
    from dsq_plugins.reducer import chunk_bounds
    q = dsq.get_compressor(name, **params)
    x = sample(n).to(CUDA)
    bounds = chunk_bounds(n, size)
    seeds = [7 + k for k in range(size)]
    shared = q.prepare(x)
    for (a, b), seed, payload in zip(bounds, seeds, q.compress_chunks(x, bounds, seeds, shared=shared)):
        expected = q.compress(x[a:b], seed=seed, shared=shared).payload
        assert payload.numel() == expected.numel() == q.payload_nbytes(b - a)
        if name in SUMLESS:
            assert torch.equal(payload, expected) or name == "topk"  # top-k: ties at the k-th place may differ
        assert close_in_aggregate(q.decompress_flat(payload.clone(), b - a, seed),
                                  q.decompress_flat(expected, b - a, seed))


@pytest.mark.parametrize("case", range(len(_spoiled_payloads())))
def test_cuda_decoders_refuse_what_they_cannot_decode(case):
    name, params, n, spoil, match = _spoiled_payloads()[case]
    q = dsq.get_compressor(name, **params)
    payload = q.compress(sample(n).to(CUDA), seed=1).payload.clone()
    with pytest.raises(dsq.PayloadError, match="must be .* bytes"):
        q.decompress_flat(payload[:-1], n, 1)
    spoil(payload)
    with pytest.raises(dsq.PayloadError, match=match):
        q.decompress_flat(payload, n, 1)


@pytest.mark.parametrize("compressor,params", [("sign", {}), ("topk", {"ratio": 0.1}), ("qsgd", {}),
                                               ("blocksign", {"block": 4}), ("fp16", {}), ("none", {}),
                                               ("sign", {"scale": "rms", "block": 128})])
@pytest.mark.parametrize("verdict", ["auto", "collective"])
def test_reducer_on_cuda_gives_the_cpu_answers(compressor, params, verdict):
    n, numel, steps = 3, 50_003, 4

    def run(device):
        def per_rank(comm):
            r = dsq.DoubleSqueeze(comm, compressor, compressor_params=params, worker_momentum=0.5, verdict=verdict)
            # "auto" judges a step's verdicts once, at its end, on a GPU (dsq_plugins.step)
            assert r.defers_verdicts == (verdict == "auto" and torch.device(device).type == "cuda")
            outs = [r.reduce("w", dist_worker.grad(comm.rank, t, numel).to(device)) for t in range(steps)]
            return outs, r.state_dict()
        return dsq.LocalGroup(n, device=device).run(per_rank)

    cpu, gpu = run("cpu"), run(CUDA)

    def same(got, want, what):
        if compressor in SUMLESS:  # the same bits: CUDA's arithmetic here is the CPU's
            assert torch.equal(bits(got), bits(want)), what
        else:
            assert close_in_aggregate(got, want, 1e-2), what

    for rank in range(n):
        for t in range(steps):
            assert gpu[rank][0][t].device.type == CUDA.type
            same(gpu[rank][0][t], cpu[rank][0][t], f"rank {rank}, step {t}")
        for kind in ("worker_error", "server_error"):
            for key, entry in gpu[rank][1][kind].items():  # int8 memories (the default) are {codes, scales}
                state = decoded(entry)
                tensors = entry.values() if isinstance(entry, dict) else [entry]
                assert all(t.device.type == "cpu" for t in tensors)  # checkpoints load on any device
                same(state, decoded(cpu[rank][1][kind][key]), f"rank {rank}: {kind} {key}")


@pytest.mark.parametrize("verdict", ["auto", "collective"])
def test_a_nonfinite_cuda_gradient_is_the_same_clear_error_on_every_rank(verdict):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign", verdict=verdict)
        r.reduce("w", dist_worker.grad(comm.rank, 0).to(CUDA))
        before = r.state_dict()
        g = dist_worker.grad(comm.rank, 1).to(CUDA)
        if comm.rank == 1:
            g[5] = float("inf")
        try:
            r.reduce("w", g)
            return None
        except dsq.NonFiniteGradientError as exc:
            after = r.state_dict()
            return exc.ranks, all(torch.equal(decoded(after[k][key]), decoded(before[k][key]))
                                  for k in ("worker_error", "server_error") for key in before[k])
    assert dsq.LocalGroup(3, device=CUDA).run(per_rank) == [([1], True)] * 3


def compare_with_local_group(real: list, n: int) -> None:
    """torchrun's ranks on CUDA against LocalGroup's on the CPU: errors and
    byte counts exactly, averages as the formats allow."""
    local = dsq.LocalGroup(n).run(dist_worker.per_rank)
    for rank in range(n):
        assert real[rank].keys() == local[rank].keys()
        assert real[rank]["nan"] == local[rank]["nan"] == ("NonFiniteGradientError", [min(1, n - 1)])
        assert real[rank]["short"] == local[rank]["short"]
        assert real[rank]["atomic"] == local[rank]["atomic"]
        for name, _ in dist_worker.CASES:
            assert real[rank][name + ":bytes"][0] > 0 or n == 1
            for got, want in zip(real[rank][name], local[rank][name]):
                assert got.device.type == CUDA.type
                assert close_in_aggregate(got, want, 1e-2), f"rank {rank}: {name}"
        history, resumed = real[rank]["adam"]
        assert resumed and all(close_in_aggregate(a, b, 1e-2) for a, b in zip(history, local[rank]["adam"][0]))


def test_nccl_with_one_rank(tmp_path):
    real = launch("torchrun", 1, "dist_worker.py", out_dir=str(tmp_path), timeout=300,
                  env={"DSQ_TEST_DEVICE": "cuda", "DSQ_TEST_BACKEND": "nccl"})
    compare_with_local_group(real, 1)


@pytest.mark.parametrize("n,verdict", [(2, "auto"), (3, "auto"), (3, "step")])
def test_gloo_ranks_holding_cuda_tensors(n, verdict, tmp_path):
    real = launch("torchrun", n, "dist_worker.py", out_dir=str(tmp_path), timeout=300,
                  env={"DSQ_TEST_DEVICE": "cuda", "DSQ_TEST_BACKEND": "gloo", "DSQ_TEST_VERDICT": verdict})
    compare_with_local_group(real, n)


def compiled_step_run(device: torch.device, compressor: str, ranks: int, numel: int, monkeypatch, caplog,
                      compile_mode: str = "always") -> tuple[list, int]:
    """Three steps of ``DoubleSqueeze`` with its defaults (int8 memories on both passes, deferred
    verdicts where the device allows) and every kernel compiled (``compile_mode``), over two tensors
    of their own buckets (as DDP hands a hook its buckets: one flat tensor each): (each rank's
    averages, how many compensations formed blocksign's codes in their own kernel).
    Fails if any kernel failed to compile (it would run eager for good, with the same bits: a
    slowdown no other test sees)."""
    from dsq_plugins.algorithm import arithmetic
    monkeypatch.setenv("DSQ_COMPILE", compile_mode)
    coded = []
    plain = arithmetic.compensated_with_codes
    monkeypatch.setattr(arithmetic, "compensated_with_codes",
                        lambda *a: (lambda r: coded.append(r is not None) or r)(plain(*a)))

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, compressor)
        grads = [(name, dist_worker.grad(comm.rank, t, numel).to(device).view(-1)[: numel - shift])
                 for t, (name, shift) in enumerate([("a", 0), ("b", 64)])]
        return [[r.reduce(name, g * (step + 1)) for name, g in grads] for step in range(3)]

    with caplog.at_level(logging.WARNING, logger="dsq_plugins"):
        averages = dsq.LocalGroup(ranks, device=device).run(per_rank)
    failed = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert not failed, failed
    return averages, sum(coded)


@pytest.mark.parametrize("compressor", ["sign", "topk", "blocksign"])
@pytest.mark.parametrize("numel", [3 * 256 * 32, 50_016])
def test_the_gpu_kernels_compile_on_cuda_and_answer_as_the_cpu_proxy(compressor, numel, monkeypatch, caplog):
    """The fused kernels a GPU runs (the payloads with their residual, an owner's fold of three
    senders, blocksign's codes from the compensation ...) all compile with Triton at a bucket's
    sizes, whole int8 blocks and not, and answer as the same paths do on a CPU (``kernels.gpu_paths``,
    the CPU proxy, eager: the same bits as compiled, without the C++ compiles): the same bits where no
    float sum is involved, within an ulp's consequences where one is."""
    ranks = 3
    gpu, gpu_coded = compiled_step_run(CUDA, compressor, ranks, numel, monkeypatch, caplog)
    with kernels.gpu_paths():
        cpu, cpu_coded = compiled_step_run(torch.device("cpu"), compressor, ranks, numel, monkeypatch, caplog,
                                           compile_mode="never")
    assert gpu_coded == cpu_coded and (gpu_coded > 0) == (compressor == "blocksign")
    for rank in range(ranks):
        for step in range(3):
            for got, want in zip(gpu[rank][step], cpu[rank][step]):
                if compressor in SUMLESS:
                    assert torch.equal(bits(got), bits(want)), (rank, step)
                else:
                    assert close_in_aggregate(got, want, 1e-2), (rank, step)


def test_the_side_stream_starts_after_the_handover_and_its_waiters_wait_for_it():
    """``overlap.Handoff`` (the DDP hook's side stream): work on the side stream sees what the producer's
    stream wrote before the handover, however long that takes, and a consumer that waits on the published
    future sees what the side stream wrote, however long that takes; the host waits for neither."""
    from dsq_plugins.overlap import SideStreams
    x = torch.zeros(1 << 20, device=CUDA)
    torch.cuda._sleep(200_000_000)  # the producer's stream is busy for a while ...
    x.fill_(1.0)  # ... before it writes what it hands over
    handoff = SideStreams().handoff(x)
    future = handoff.future(CUDA)
    with handoff.on_side():
        torch.cuda._sleep(200_000_000)  # the side stream's work is slow too
        y = x + 1.0
        handoff.publish(future, y)
    got = future.wait().clone()  # on the producer's stream, after the side stream's event
    assert torch.equal(got, torch.full_like(got, 2.0))
    assert SideStreams().handoff(torch.zeros(3)) is None  # a CPU's work stays where it is
