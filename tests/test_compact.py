"""Compact error memories (``error_dtype``): what each stores, what it
costs in bytes, that a run resumes bit for bit, that checkpoints convert
between dtypes, and that int8 memories still train where error feedback is
needed."""
import contextlib
import logging

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors import kernels
from dsq_plugins.state import ErrorMemory
from dsq_plugins.state.compact import BLOCK, Int8Blocks
from examples.train_digits import train

DTYPES = ["fp32", "bf16", "int8"]


def residual_like(n=3000, seed=0):
    """Values spread over four decades, as residuals are."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)


@pytest.mark.parametrize("dtype, bytes_per_element, worst", [("fp32", 4.0, 0.0), ("bf16", 2.0, 2 ** -8),
                                                              ("int8", 1 + 4 / BLOCK, 1 / 254)])
def test_each_dtype_stores_what_it_says_in_the_bytes_it_says(dtype, bytes_per_element, worst):
    x = residual_like()
    memory = ErrorMemory(dtype)
    memory.set("e", x.clone(), private=True)
    y = memory.get("e", x.numel(), torch.device("cpu"))
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert memory.nbytes() == pytest.approx(bytes_per_element * x.numel(), abs=4)
    if dtype == "int8":  # half a level of each block's own scale
        scales = Int8Blocks.encode(x).scales
        bound = scales.repeat_interleave(BLOCK)[: x.numel()] / 2 * (1 + 1e-6)
        assert bool(((y - x).abs() <= bound).all())
    else:  # relative rounding of each element
        assert bool(((y - x).abs() <= worst * x.abs()).all())


def test_int8_keeps_zero_blocks_and_a_tail_shorter_than_a_block():
    x = torch.zeros(BLOCK + 7)
    x[-3:] = torch.tensor([2.0, -2.0, 1.0])
    y = Int8Blocks.encode(x).decode()
    assert bool((y[:-3] == 0).all()) and torch.equal(y[-3:-1], torch.tensor([2.0, -2.0]))
    assert y[-1] == pytest.approx(1.0, abs=1 / 127)


def grads(rank, step):
    return torch.randn(600, generator=torch.Generator().manual_seed(100 * step + rank))


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_compact_run_resumes_bit_for_bit_from_its_checkpoint(dtype, tmp_path):
    def uninterrupted(comm):
        r = dsq.DoubleSqueeze(comm, "sign", error_dtype=dtype)
        return [r.reduce("g", grads(comm.rank, t)) for t in range(6)]

    def interrupted(comm):
        r = dsq.DoubleSqueeze(comm, "sign", error_dtype=dtype)
        outs = [r.reduce("g", grads(comm.rank, t)) for t in range(3)]
        torch.save(r.state_dict(), tmp_path / f"rank{comm.rank}.pt")
        fresh = dsq.DoubleSqueeze(comm, "sign", error_dtype=dtype)
        fresh.load_state_dict(torch.load(tmp_path / f"rank{comm.rank}.pt"))
        return outs + [fresh.reduce("g", grads(comm.rank, t)) for t in range(3, 6)]

    a, b = dsq.LocalGroup(3).run(uninterrupted), dsq.LocalGroup(3).run(interrupted)
    assert all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    saved = torch.load(tmp_path / "rank0.pt")["worker_error"]["g"]
    assert (saved["int8"].dtype if dtype == "int8" else saved.dtype) == {"bf16": torch.bfloat16,
                                                                       "int8": torch.int8}[dtype]


@pytest.mark.parametrize("saved, loaded", [("fp32", "int8"), ("int8", "fp32"), ("bf16", "int8")])
def test_a_checkpoint_of_one_dtype_loads_into_another_with_one_log_line(saved, loaded, caplog):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign", error_dtype=saved)
        r.reduce("g", grads(comm.rank, 0))
        other = dsq.DoubleSqueeze(comm, "sign", error_dtype=loaded)
        with caplog.at_level(logging.WARNING, logger="dsq_plugins"):
            other.load_state_dict(r.state_dict())
        before, after = (m.worker_error.get("g", 600, torch.device("cpu")) for m in (r, other))
        return float((after - before).norm() / before.norm()), other.worker_error.dtype
    results = dsq.LocalGroup(2).run(per_rank)
    assert all(err < 0.02 and dtype == loaded for err, dtype in results)
    lines = [rec.message for rec in caplog.records if "converted" in rec.message]
    assert len(lines) == 2 and all(f"saved as {saved} were loaded as {loaded}" in m for m in lines)  # once per rank


def test_state_in_bytes_per_parameter_per_rank():
    """Worker error (the whole vector) plus this rank's server error chunk."""
    def per_rank(comm, dtype):
        r = dsq.DoubleSqueeze(comm, "sign", error_dtype=dtype)
        r.reduce("g", grads(comm.rank, 0)[:512])
        return r.state.nbytes() / 512
    for dtype, per_element in (("fp32", 4), ("bf16", 2), ("int8", 1 + 4 / BLOCK)):
        got = dsq.LocalGroup(4).run(lambda comm: per_rank(comm, dtype))
        assert got[0] == pytest.approx(per_element * (1 + 1 / 4), rel=0.02)


def test_a_bad_error_dtype_is_a_config_error_naming_the_choices():
    with pytest.raises(dsq.ConfigError, match="error_dtype must be one of fp32, bf16, int8"):
        dsq.ReducerConfig(error_dtype="fp8")


def test_int8_memories_still_train_where_error_feedback_is_needed():
    """Digits, 4 workers, 1-bit sign: int8 memories train about as the fp32
    ones do, far above sign without error feedback."""
    def run(**kw):
        return dsq.LocalGroup(4).run(lambda comm: train(comm, steps=250, lr=0.05, compressor="sign", **kw))[0]
    fp32, int8, none = run(), run(error_dtype="int8"), run(error_feedback="none")
    assert int8.test_accuracy > fp32.test_accuracy - 0.03
    assert int8.test_accuracy > none.test_accuracy + 0.1


def _memory_and_vector(monkeypatch, mode: str, n: int, paths: str) -> tuple[Int8Blocks, torch.Tensor]:
    """An int8 memory of ``n`` elements over 40 orders of magnitude and a vector to add it to (zeros of
    either sign), with ``DSQ_COMPILE`` at ``mode`` and a CPU's or a GPU's ``paths``."""
    monkeypatch.setenv("DSQ_COMPILE", mode)
    if paths == "gpu":
        monkeypatch.setattr(kernels, "_GPU_PATHS", 1)
    gen = torch.Generator().manual_seed(n)
    memory = Int8Blocks.encode(torch.randn(n, generator=gen) * torch.logspace(-20, 20, n))
    x = torch.randn(n, generator=gen)
    x[::7] = -0.0
    return memory, x


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("n", [1000, 40 * BLOCK, 40 * BLOCK + 5])
def test_an_int8_memory_added_in_its_decode_s_pass_is_the_decode_plus_the_vector(monkeypatch, mode, n, paths):
    """``Int8Blocks.added_to`` (the worker's g + error, the server's aggregate
    + error, in one pass where compiled) gives ``x + decode()`` bit for bit:
    a trimmed small vector, whole blocks, a partial last block, into a
    buffer or into ``x`` itself, on a CPU's paths and a GPU's."""
    memory, x = _memory_and_vector(monkeypatch, mode, n, paths)
    expected = x + memory.decode()
    in_place = x.clone()
    for got in (memory.added_to(x), memory.added_to(x, torch.empty(n)), memory.added_to(in_place, in_place)):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    spare = ErrorMemory("int8")
    spare.set("bucket", torch.randn(n), private=True)  # the vector it encoded is its next scratch of that size
    assert spare.scratch("other", n, torch.device("cpu")).numel() == n


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("n", [1000, 40 * BLOCK, 40 * BLOCK + 5])
@pytest.mark.parametrize("bad", [None, "nan-first", "inf-last"])
def test_an_int8_memory_added_with_its_status_tests_the_sum_in_the_same_pass(monkeypatch, mode, n, paths, bad):
    """``Int8Blocks.added_with_status`` (a worker's compensation, tested for NaN and
    Inf in its own pass where compiled) gives ``added_to``'s bits and the status
    word ``step.nonfinite`` gives: a NaN in the first block, an Inf in the last
    element (a partial block's, where there is one), or none."""
    from dsq_plugins.step import nonfinite
    memory, x = _memory_and_vector(monkeypatch, mode, n, paths)
    if bad == "nan-first":
        x[3] = float("nan")
    elif bad == "inf-last":
        x[-1] = float("-inf")
    expected = memory.added_to(x)
    for out in (None, torch.empty(n)):
        got, status = memory.added_with_status(x, out)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
        assert status.dtype == torch.int64 and status.shape == ()
        assert int(status) == int(nonfinite(expected)) == (bad is not None)


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("n", [1000, 40 * BLOCK, 40 * BLOCK + 5])
def test_a_residual_encoded_as_it_is_subtracted_is_the_encode_of_the_difference(monkeypatch, mode, n):
    """``Int8Blocks.encode_difference(v, d)`` (the residual v - Q(v) never
    written out in fp32) stores what ``encode(v - d)`` stores, byte for byte,
    and an int8 memory keeps it as it is."""
    monkeypatch.setenv("DSQ_COMPILE", mode)
    gen = torch.Generator().manual_seed(n)
    v = torch.randn(n, generator=gen) * torch.logspace(-20, 20, n)
    d = torch.randn(n, generator=gen).sign() * 0.5
    fused, plain = Int8Blocks.encode_difference(v, d), Int8Blocks.encode(v - d)
    assert torch.equal(fused.codes, plain.codes) and torch.equal(fused.scales.view(torch.int32),
                                                                 plain.scales.view(torch.int32))
    memory = ErrorMemory("int8")
    memory.set("bucket", fused, private=True)
    assert torch.equal(memory.get("bucket", n, torch.device("cpu")), plain.decode())


@pytest.mark.parametrize("mode", ["always", "never"])
def test_the_server_s_u_from_one_contribution_skips_the_mean_for_the_same_bits(monkeypatch, mode):
    """One dense contribution d: u = mean + error is formed as d + error, with no
    mean pass (``arithmetic.adds_mean_of_one``), and that is ``mean_of``'s d + 0
    plus the error bit for bit, -0.0 in d included, because an int8 memory's
    values are never -0.0 (its zeros are +0.0 whatever the sign of what it encoded)."""
    from dsq_plugins.algorithm import aggregation, arithmetic
    from dsq_plugins.compressors import get_compressor
    from dsq_plugins.compressors.decoded import Decoded
    monkeypatch.setenv("DSQ_COMPILE", mode)
    n = 40 * BLOCK + 5
    gen = torch.Generator().manual_seed(5)
    stored = torch.randn(n, generator=gen)
    stored[: 3 * BLOCK] = -0.0  # blocks whose codes are all zero, a scale of zero
    stored[3 * BLOCK: 4 * BLOCK] *= 1e-30
    memory = Int8Blocks.encode(stored)
    assert not torch.signbit(memory.decode()[memory.decode() == 0]).any()
    d = torch.randn(n, generator=gen)
    d[::3] = -0.0
    q = get_compressor("sign")
    assert arithmetic.adds_mean_of_one([Decoded(d, n)], memory, 1.0)
    assert not arithmetic.adds_mean_of_one([Decoded(d, n)] * 2, memory, 1.0)
    assert not arithmetic.adds_mean_of_one([Decoded(d, n)], memory, 0.9)  # a decayed memory: an FMA, not an add
    skipped = arithmetic.server_squeeze(q, d, memory, 0, out=torch.empty(n))
    averaged = arithmetic.server_squeeze(q, aggregation.mean_of([Decoded(d, n)], torch.empty(n)), memory, 0,
                                         owned=True)
    assert torch.equal(skipped.u.view(torch.int32), averaged.u.view(torch.int32))
    assert torch.equal(skipped.payload, averaged.payload) and skipped.owned
    assert torch.equal(d.view(torch.int32)[::3], torch.full((len(d[::3]),), -2**31, dtype=torch.int32))  # d untouched


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("n", [1000, 40 * BLOCK, 40 * BLOCK + 5])
def test_a_sign_residual_encoded_from_the_vector_alone_is_the_encode_of_the_difference(monkeypatch, mode, n):
    """``Int8Blocks.encode_sign_residual(v, s)`` (v - Q(v) where Q(v) is v's own
    sign payload, never decoded) stores what ``encode_difference(v, decode(payload))``
    stores, byte for byte: zeros of either sign, and a zero scale."""
    from dsq_plugins.compressors import get_compressor
    from dsq_plugins.compressors.base import TRUSTED
    monkeypatch.setenv("DSQ_COMPILE", mode)
    gen = torch.Generator().manual_seed(n)
    q = get_compressor("sign", scale="rms")
    for v in (torch.randn(n, generator=gen) * torch.logspace(-20, 20, n), torch.zeros(n)):
        v[::5] = -0.0
        payload = q.compress(v).payload
        fused = Int8Blocks.encode_sign_residual(v, q.sign_scale(payload))
        plain = Int8Blocks.encode_difference(v, q.decode(payload, n, refusals=TRUSTED).values)
        assert torch.equal(fused.codes, plain.codes)
        assert torch.equal(fused.scales.view(torch.int32), plain.scales.view(torch.int32))
    assert get_compressor("sign", block=64).sign_scale(payload) is None  # a scale per block: not one s
    assert get_compressor("topk", ratio=0.1).sign_scale(payload) is None


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
@pytest.mark.parametrize("n,numel", [(1, 40 * BLOCK), (2, 40 * BLOCK), (4, 12 * BLOCK + 64), (3, 999)])
@pytest.mark.parametrize("name,params,unit", [("sign", {"scale": "mean"}, 8), ("sign", {"scale": "rms"}, 8),
                                              ("blocksign", {}, 32), ("blocksign", {"block": 8}, 8),
                                              ("topk", {"ratio": 0.05}, 1)])
def test_payloads_encoded_with_their_residual_send_and_store_what_the_exchange_did(monkeypatch, paths, n, numel,
                                                                                  name, params, unit):
    """Sign's, blocksign's and top-k's payloads and both passes' int8 residuals
    from one kernel (``payloads_with_residual``, before the payloads travel)
    against the residuals formed after the exchange: the same averages and
    memories, bit for bit, over steps that read what the last ones stored;
    chunks that are not whole bytes of signs or whole blocks take the old
    path, and so does top-k on a CPU's paths (it selects chunk by chunk), and
    anything but sign's single chunk there (``_one_flat_pass``)."""
    import importlib
    from dsq_plugins.algorithm import arithmetic
    worker_pass = importlib.import_module("dsq_plugins.algorithm._worker_pass")

    def run():
        return _three_steps(n, numel, paths, name, compressor_params=params, error_dtype="int8")

    formed = []
    with monkeypatch.context() as m:  # counts the payloads encoded with their residual
        for module in (worker_pass, arithmetic):
            m.setattr(module, "payloads_with_residual", lambda *a, _f=module.payloads_with_residual, **k:
                      formed.append(_f(*a, **k)) or formed[-1])
        fused = run()
    whole = numel % n == 0 and numel // n % unit == 0  # one run of chunks, each of whole units
    if paths == "gpu":
        merged = 2 * 3 * n if whole else 0  # both passes, every step and rank
    else:  # the server's one chunk, and the worker's where it has only one
        merged = (3 * n * (1 + (n == 1)) if whole else 0) if name == "sign" else 0
    assert sum(f is not None for f in formed) == merged
    with monkeypatch.context() as m:
        m.setattr(worker_pass, "payloads_with_residual", lambda *a, **k: None)
        m.setattr(arithmetic, "payloads_with_residual", lambda *a, **k: None)
        plain = run()
    for (outs, state), (plain_outs, plain_state) in zip(fused, plain):
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(outs, plain_outs))
        assert _same_tensors(state, plain_state)


@pytest.mark.parametrize("verdict", ["collective", "step"])
@pytest.mark.parametrize("n,numel", [(1, 40 * BLOCK), (2, 40 * BLOCK), (2, 12 * BLOCK + 64), (4, 384), (3, 999),
                                     (2, 999)])
@pytest.mark.parametrize("name,params", [("sign", {}), ("topk", {"ratio": 0.05}), ("blocksign", {"block": 8})])
def test_an_owner_that_folds_the_decode_into_its_mean_averages_and_stores_what_it_did(monkeypatch, verdict, n,
                                                                                      numel, name, params):
    """An owner's u from its senders' payloads in one kernel (``mean_of_payloads``, a GPU's paths)
    against decoding them and then averaging: the same averages and memories, bit for bit, over
    steps that read what the last ones stored, with either verdict; the first step, with no server
    error yet, and sign's chunks whose signs are not whole bytes take the old path."""
    import importlib
    from tests.helpers.folding import count_folds
    server_pass = importlib.import_module("dsq_plugins.algorithm._server_pass")

    def run():
        return _three_steps(n, numel, "gpu", name, compressor_params=params, error_dtype="int8", verdict=verdict)

    with monkeypatch.context() as m:
        folded = count_folds(m)
        fused = run()
    from dsq_plugins.layout import chunk_bounds
    owners = sum(name != "sign" or (b - a) % 8 == 0 for a, b in chunk_bounds(numel, n))  # whose chunk folds
    assert len(folded) == 2 * owners  # steps 2 and 3
    monkeypatch.setattr(server_pass, "folds_mean", lambda *a: False)
    plain = run()
    for (outs, state), (plain_outs, plain_state) in zip(fused, plain):
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(outs, plain_outs))
        assert _same_tensors(state, plain_state)


@pytest.mark.parametrize("verdict", ["collective", "step"])
@pytest.mark.parametrize("name,params", [("sign", {}), ("topk", {"ratio": 0.05}), ("blocksign", {})])
def test_a_folding_owner_names_a_payload_that_does_not_decode_on_every_rank(monkeypatch, verdict, name, params):
    """An owner that forms u from the payloads in one kernel (``mean_of_payloads``) checks them as
    the row decode did: a rank whose encoder writes NaN into its payloads' first word (a scale; top-k's
    first value) is named on every rank, and no rank's state changes."""
    from dsq_plugins.errors import PayloadError
    from tests.helpers.folding import count_folds, write_nan_first

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict=verdict)
        r.reduce("w", torch.randn(4096, generator=torch.Generator().manual_seed(comm.rank)))  # a server error now
        before = r.state_dict()
        if comm.rank == 2:
            write_nan_first(r)
        with pytest.raises(PayloadError) as raised:
            r.reduce("w", torch.randn(4096, generator=torch.Generator().manual_seed(10 + comm.rank)))
        assert _same_tensors(r.state_dict(), before)
        return str(raised.value)

    folded = count_folds(monkeypatch)
    with kernels.gpu_paths():
        messages = dsq.LocalGroup(4).run(per_rank)
    assert len(folded) == 4  # every owner, at the second step
    assert all("could not decode the payload rank 2 sent for 'w'" in m and "state is unchanged" in m
               for m in messages), messages


def _three_steps(n: int, numel: int, paths: str, name: str, **options):
    """Each rank's averages and state after three ``reduce`` steps of ``numel`` elements (zeros of
    both signs among them) on ``n`` ranks, on a CPU's or the GPU's ``paths``."""
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, name, **options)
        outs = []
        for t in range(3):
            g = torch.randn(numel, generator=torch.Generator().manual_seed(10 * t + comm.rank))
            g[::7] = -0.0
            outs.append(r.reduce("w", g))
        return outs, r.state_dict()
    with kernels.gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        return dsq.LocalGroup(n).run(per_rank)


def _same_tensors(a, b) -> bool:
    """Nested dicts and lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8)
                                                  if b.dim() else b)
    return a == b


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("numel", [40 * BLOCK, 40 * BLOCK + 5, 3 * BLOCK - 1])
@pytest.mark.parametrize("count", [2, 3])
def test_the_servers_mean_plus_its_memory_in_one_pass_is_the_mean_then_the_addition(monkeypatch, mode, numel, count):
    """``arithmetic.mean_plus_stored``: the senders' mean and the int8 memory
    added in one kernel, bit for bit what ``aggregation.mean_of`` then
    ``compact.added`` give: zeros of either sign, an infinity and a NaN sent,
    blocks whose scale is zero, a vector that ends inside a block."""
    from dsq_plugins.algorithm import aggregation, arithmetic
    from dsq_plugins.compressors.decoded import Decoded
    from dsq_plugins.state import compact
    monkeypatch.setenv("DSQ_COMPILE", mode)
    gen = torch.Generator().manual_seed(numel + count)
    senders = torch.randn(count, numel, generator=gen) * torch.logspace(-30, 30, numel)
    senders[:, ::5] = -0.0
    senders[0, 7], senders[-1, 11] = float("inf"), float("nan")
    stored = torch.randn(numel, generator=gen)
    stored[: BLOCK] = 0.0
    memory = Int8Blocks.encode(stored)
    with kernels.gpu_paths():
        plain = compact.added(aggregation.mean_of([Decoded(row, numel) for row in senders], torch.empty(numel)),
                              memory)
        fused = arithmetic.mean_plus_stored(senders, memory, torch.empty(numel))
    assert torch.equal(plain.view(torch.int32), fused.view(torch.int32))


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("numel", [40 * BLOCK, 3 * BLOCK - 8, 8])
@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("name,params", [("sign", {"scale": "rms"}), ("topk", {"ratio": 0.05}), ("blocksign", {})])
def test_the_servers_mean_of_the_payloads_themselves_is_their_decode_then_the_mean(monkeypatch, mode, numel, count,
                                                                                   name, params):
    """``mean_of_payloads``: the senders' payloads decoded, checked, averaged and added to the
    int8 memory in one kernel, bit for bit what the row decode then ``mean_plus_stored`` give,
    with the same flags and the status ``first_true`` forms from them: values of every size, a
    zero scale, a negative, an infinite or a NaN first word (flagged where it is a scale or a
    value), a vector that ends inside a block; compiled, payload rows whose length is not a multiple
    of four bytes."""
    import importlib
    from dsq_plugins.algorithm import arithmetic
    from dsq_plugins.comm import header
    from dsq_plugins.compressors import get_compressor
    from dsq_plugins.step import first_true_of
    folding = importlib.import_module("dsq_plugins.algorithm._mean_of_payloads")
    monkeypatch.setenv("DSQ_COMPILE", mode)
    gen = torch.Generator().manual_seed(numel + count)
    q = get_compressor(name, **params)
    payloads = torch.stack([q.compress(torch.randn(numel, generator=gen) * 10.0 ** (8 * j - 8)).payload
                            for j in range(count)])
    if count > 1:
        first_word = [-1.5, float("inf"), float("nan")][numel % 3] if name != "topk" else float("nan")
        payloads[1, :4] = torch.tensor([first_word]).view(torch.uint8)
    if name != "topk":
        payloads[0, :4] = torch.tensor([0.0 if numel == 8 else 2.5]).view(torch.uint8)
    stored = torch.randn(numel, generator=gen)
    stored[: BLOCK] = 0.0
    memory = Int8Blocks.encode(stored)
    with kernels.gpu_paths():
        assert folding.folds_mean(q, payloads, numel, memory)
        checks: list = []
        values = q.decode_rows(payloads, numel, [None] * count, refusals=checks)
        plain = arithmetic.mean_plus_stored(values, memory, torch.empty(numel))
        folded, flags, words, bad, status, _ = folding.mean_of_payloads(q, payloads, numel, memory, torch.empty(numel))
    assert [w for _, w in checks] == words and torch.equal(flags, torch.stack([f for f, _ in checks]))
    assert flags.any(0).tolist() == bad.tolist() == [False, True, False][:count]
    assert status.item() == first_true_of(flags.any(0), header.BAD_PAYLOAD).item() == \
        (header.BAD_PAYLOAD + 1 if count > 1 else 0)
    assert torch.equal(plain.view(torch.int32), folded.view(torch.int32))
    kernel = folding._mean_of_signs_kernel if name == "sign" else folding._KEPT[type(q)]
    assert not kernel._failed  # compiled for every shape (a failed compile runs eager for good, the same bits)
    assert not folding.folds_mean(q, payloads, numel, stored)  # an fp32 memory
    assert not folding.folds_mean(q, payloads[:, :-1], numel - 8, Int8Blocks.encode(stored[:-8])) or name != "sign"


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("numel", [40 * BLOCK, 3 * BLOCK - 8, 24])
@pytest.mark.parametrize("count", [1, 3])
def test_a_blocksign_owners_fold_forms_the_codes_its_encode_would(monkeypatch, mode, numel, count):
    """Where the owner's server encode is blocksign over whole blocks, ``mean_of_payloads`` also
    forms u's block codes (``Folded.coded``): the codes and kept values blocksign's own encode takes
    of that u, eager or compiled alike (a NaN and equal magnitudes in a block included), and a
    payload and residual built from them identical to those built without; none where u is not
    whole blocks or the encoder is not blocksign."""
    import importlib
    from dsq_plugins.algorithm.arithmetic import payloads_with_residual
    from dsq_plugins.compressors import get_compressor
    folding = importlib.import_module("dsq_plugins.algorithm._mean_of_payloads")
    monkeypatch.setenv("DSQ_COMPILE", mode)
    gen = torch.Generator().manual_seed(numel + count)
    q, encoder = get_compressor("blocksign", block=8), get_compressor("blocksign", block=8)
    values = [torch.randn(numel, generator=gen) for _ in range(count)]
    values[0][8:16] = 1.0  # equal magnitudes: the first is kept
    values[-1][24:32] = float("nan") if numel > 32 else values[-1][24:32]
    payloads = torch.stack([q.compress(v).payload for v in values])
    memory = Int8Blocks.encode(torch.randn(numel, generator=gen))
    with kernels.gpu_paths():
        folded = folding.mean_of_payloads(q, payloads, numel, memory, torch.empty(numel), encoder)
        assert (folded.coded is None) == (numel % 8 != 0)
        if folded.coded is None:
            return
        rows = folded.u.view(1, -1)
        _, codes, magnitudes, _ = encoder.whole_block_codes(rows)
        assert torch.equal(folded.coded[0], codes)
        assert torch.equal(folded.coded[1].abs().sum(dim=1).view(torch.int32), magnitudes.view(torch.int32))
        with_codes = payloads_with_residual(encoder, folded.u, [(0, numel)], folded.coded)
        without = payloads_with_residual(encoder, folded.u, [(0, numel)])
        assert folding.mean_of_payloads(q, payloads, numel, memory, torch.empty(numel),
                                        get_compressor("sign")).coded is None
    assert not folding._CODED[type(q)]._failed  # compiled for every shape, so its codes are compiled ones
    assert torch.equal(with_codes[0][0], without[0][0])
    assert _same_tensors(with_codes[1].state(), without[1].state())


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("numel", [12 * BLOCK, 3 * BLOCK - 24, 3 * BLOCK - 4])
@pytest.mark.parametrize("chunks", [1, 3])
def test_a_blocksign_workers_compensation_forms_the_codes_its_encode_would(monkeypatch, mode, numel, chunks):
    """Where a worker's v = g + its int8 error will be encoded by blocksign over chunks of whole
    blocks, the compensation's kernel also forms v's block codes (``Compensated.coded``), in both of
    its forms (whole int8 blocks; a vector ending inside one): the same v and status as the plain
    compensation, the codes and kept values blocksign's own encode takes of v, eager or compiled
    alike (a NaN and equal magnitudes in a block included), and a payload and residual built from
    them identical to those built without; none where the chunks are not whole blocks, the
    encoder is not blocksign or its blocks do not tile the memory's, or on a CPU's own paths."""
    import importlib
    from dsq_plugins.algorithm import arithmetic
    from dsq_plugins.compressors import get_compressor
    coding = importlib.import_module("dsq_plugins.algorithm._compensated_codes")
    monkeypatch.setenv("DSQ_COMPILE", mode)
    gen = torch.Generator().manual_seed(numel + chunks)
    q = get_compressor("blocksign", block=4)
    g = torch.randn(chunks * numel, generator=gen)
    g[8:12] = 1.0  # equal magnitudes: the first is kept
    g[-16:-12] = float("nan")
    bounds = [(k * numel, (k + 1) * numel) for k in range(chunks)]
    memory = Int8Blocks.encode(torch.randn(chunks * numel, generator=gen))
    assert arithmetic.compensate(g, worker_error=memory, check=False, encoder=q, bounds=bounds).coded is None
    with kernels.gpu_paths():
        plain = arithmetic.compensate(g, worker_error=memory, check=False)
        c = arithmetic.compensate(g, worker_error=memory, check=False, encoder=q, bounds=bounds)
        assert (c.coded is None) == (numel % 4 != 0)
        assert torch.equal(c.v.view(torch.int32), plain.v.view(torch.int32))
        assert int(c.status) == int(plain.status) == 1
        if c.coded is None:
            return
        _, codes, magnitudes, _ = q.whole_block_codes(c.v.view(chunks, -1))
        assert torch.equal(c.coded[0], codes)
        # the same bits but a NaN's (its chunk's payload is refused, its step fails on every rank)
        torch.testing.assert_close(c.coded[1].abs().sum(dim=1), magnitudes, rtol=0, atol=0, equal_nan=True)
        assert c.coded[1].isnan().sum() == 1
        finite = torch.nan_to_num(c.v)
        coded = coding.compensated_with_codes(finite - memory.decode(), memory, None, q, bounds)[2]
        with_codes = arithmetic.payloads_with_residual(q, finite, bounds, coded)
        without = arithmetic.payloads_with_residual(q, finite, bounds)
        assert arithmetic.compensate(g, worker_error=memory, check=False, encoder=get_compressor("sign"),
                                     bounds=bounds).coded is None
        assert arithmetic.compensate(g, worker_error=memory, check=False, encoder=q,
                                     bounds=[(0, 4), (4, chunks * numel)]).coded is None
        untiled = get_compressor("blocksign", block=24)  # its blocks do not tile the memory's
        assert numel % 24 or arithmetic.compensate(g, worker_error=memory, check=False, encoder=untiled,
                                                   bounds=bounds).coded is None
    for kernel in (coding._WHOLE_CODED, coding._PADDED_CODED):
        assert not kernel._failed  # compiled for every shape, so its codes are compiled ones
    assert all(torch.equal(a, b) for a, b in zip(with_codes[0], without[0]))
    assert _same_tensors(with_codes[1].state(), without[1].state())


@pytest.mark.parametrize("name", ["sign", "topk", "blocksign"])
def test_on_a_gpus_paths_a_bucket_of_several_tensors_costs_the_calls_of_one(monkeypatch, name):
    """A bucket of several tensors (``reduce_many``) is compensated as a flat one is on a GPU's paths:
    one batched copy, then the int8 error added in its decode's pass with the test (and blocksign's
    codes), where the decode, the copy, the addition and the test were four launches: the same
    compiled calls as the same values in one tensor, and the same averages and memories."""
    monkeypatch.setenv("DSQ_COMPILE", "always")
    counted, calls = kernels.FusedKernel.__call__, []
    monkeypatch.setattr(kernels.FusedKernel, "__call__",
                        lambda self, *a, numel: calls.append(self.eager.__name__) or counted(self, *a, numel=numel))
    shapes = [(32, 24), (40,), (24, 16)]

    def per_rank(comm):
        gen = torch.Generator().manual_seed(comm.rank)
        many, one = (dsq.DoubleSqueeze(comm, name, error_dtype="int8", verdict="step") for _ in range(2))
        out, counts = [], []
        for step in range(3):
            tensors = [torch.randn(s, generator=gen) for s in shapes]
            del calls[:]
            averaged = many.reduce_many([(f"t{i}", t) for i, t in enumerate(tensors)])
            counts.append(len(calls))
            del calls[:]
            flat = one.reduce("t", torch.cat([t.reshape(-1) for t in tensors]))
            counts.append(len(calls))
            out.append(torch.equal(torch.cat([a.reshape(-1) for a in averaged]), flat))
        return out, counts

    with kernels.gpu_paths():
        (same, counts), = dsq.LocalGroup(1).run(per_rank)
    assert all(same)
    assert counts[-2] == counts[-1], counts  # (the first step has no memory to add yet)


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
@pytest.mark.parametrize("name", ["sign", "blocksign"])
def test_the_replicated_reducers_server_memory_from_its_squeeze_is_the_one_from_the_decode(monkeypatch, paths, name):
    """``ReplicatedDoubleSqueeze`` (Horovod's ``compression=``) stages its int8 server residual from
    Q'(u)'s own pass: the same averages and memories as the residual of the decoded Q'(u), bit for
    bit, over steps that read what the last ones stored (on a CPU's paths, sign's only: blocksign's
    merged kernel does not pay there)."""
    from dsq_plugins.algorithm import arithmetic
    from dsq_plugins.replicated import ReplicatedDoubleSqueeze

    def run():
        reps = [ReplicatedDoubleSqueeze(name, rank=r, error_dtype="int8") for r in range(2)]
        outs = []
        with kernels.gpu_paths() if paths == "gpu" else contextlib.nullcontext():
            for step in range(3):
                sent = [rep.compress("w", torch.randn(4096, generator=torch.Generator().manual_seed(10 * step + r)))
                        for r, rep in enumerate(reps)]
                outs += [rep.decompress("w", torch.stack(sent).mean(0)) for rep in reps]
        return outs, [rep.state_dict() for rep in reps]

    formed = []
    with monkeypatch.context() as m:
        m.setattr(arithmetic, "payloads_with_residual", lambda *a, _f=arithmetic.payloads_with_residual: formed.append(
            _f(*a)) or formed[-1])
        fused = run()
    merged = paths == "gpu" or name == "sign"
    assert sum(f is not None for f in formed) == (2 * 3 if merged else 0)  # every rank's squeeze, every step
    monkeypatch.setattr(arithmetic, "payloads_with_residual", lambda *a, **k: None)
    plain = run()
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(fused[0], plain[0]))
    assert _same_tensors(fused[1], plain[1])


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_a_sign_scale_shared_by_the_whole_vector_is_sent_as_without_the_merged_kernel(monkeypatch, paths):
    """``scope="tensor"``: one scale for every chunk of a worker's vector (``Compressor.prepare``), which
    the merged kernel, a scale per chunk, does not make: the worker keeps the plain encode (it once took
    the merged one and sent each chunk's own scale), and averages and memories are those of the plain path."""
    import importlib
    from dsq_plugins.algorithm import arithmetic
    worker_pass = importlib.import_module("dsq_plugins.algorithm._worker_pass")

    def run():
        def per_rank(comm):
            r = dsq.DoubleSqueeze(comm, "sign", compressor_params={"scope": "tensor"}, error_dtype="int8")
            outs = [r.reduce("w", torch.randn(4096, generator=torch.Generator().manual_seed(10 * t + comm.rank)))
                    for t in range(3)]
            return outs, r.state_dict()
        with kernels.gpu_paths() if paths == "gpu" else contextlib.nullcontext():
            return dsq.LocalGroup(2).run(per_rank)

    merged = run()
    for module in (worker_pass, arithmetic):
        monkeypatch.setattr(module, "payloads_with_residual", lambda *a, **k: None)
    plain = run()
    for (outs, state), (plain_outs, plain_state) in zip(merged, plain):
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(outs, plain_outs))
        assert _same_tensors(state, plain_state)
