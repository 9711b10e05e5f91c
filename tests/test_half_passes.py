"""The two halves of the exchange on their own (what ZeRO maps onto its two
collectives): ``reduce_scatter`` is the worker pass ending at each chunk's
owner, ``all_gather`` the server pass from each owner's own chunk."""
import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors import get_compressor
from dsq_plugins.reducer import chunk_bounds

N, NUMEL = 3, 30


def vectors(step):
    return [torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(N)]


def test_reduce_scatter_is_each_owners_chunk_of_the_compressed_mean_with_worker_error():
    sign = get_compressor("sign")
    bounds = chunk_bounds(NUMEL, N)

    def per_rank(comm):
        reducer = dsq.DoubleSqueeze(comm, "sign", error_dtype="fp32")  # exact memories, as the plain loop keeps
        out = []
        for step in range(2):
            with reducer.step():
                out.append(reducer.reduce_scatter("g", vectors(step)[comm.rank]))
        return out, reducer.worker_error.get("g", NUMEL, torch.device("cpu")).clone()

    results = dsq.LocalGroup(N).run(per_rank)
    errors = [torch.zeros(NUMEL) for _ in range(N)]
    for step in range(2):
        decoded = []
        for r, g in enumerate(vectors(step)):
            v = g + errors[r]
            shared = sign.prepare(v)
            q = torch.cat([sign.decompress_flat(sign.compress(v[a:b], shared=shared).payload, b - a)
                           for a, b in bounds])
            errors[r] = v - q
            decoded.append(q)
        mean = torch.stack(decoded).mean(0)
        for r, (a, b) in enumerate(bounds):
            assert torch.allclose(results[r][0][step], mean[a:b], atol=1e-6)
    for r in range(N):
        assert torch.allclose(results[r][1], errors[r], atol=1e-6)


def test_all_gather_gives_every_rank_the_same_decoded_chunks():
    bounds = chunk_bounds(NUMEL, N)
    full = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))

    def per_rank(comm):
        a, b = bounds[comm.rank]
        with_memory = dsq.DoubleSqueeze(comm, "sign")
        exact = dsq.DoubleSqueeze(comm, "none")
        got = with_memory.all_gather("p", full[a:b], NUMEL)
        plain = dsq.DoubleSqueeze(comm, "sign").all_gather("p", full[a:b], NUMEL, error_feedback=False)
        return (got, exact.all_gather("p", full[a:b], NUMEL), plain,
                len(with_memory.server_error.state_dict()), comm.bytes_sent)

    results = dsq.LocalGroup(N).run(per_rank)
    for got, exact, plain, memories, _ in results:
        assert torch.equal(got, results[0][0]) and torch.equal(plain, got)
        assert torch.equal(exact, full)
        assert memories == 1
        assert torch.equal(got.sign(), full.sign())  # sign of each chunk, scaled per chunk


def test_half_passes_announce_a_non_finite_rank_and_write_nothing():
    def per_rank(comm):
        reducer = dsq.DoubleSqueeze(comm, "sign")
        g = vectors(0)[comm.rank]
        if comm.rank == 2:
            g = g.clone()
            g[4] = float("nan")
        with pytest.raises(dsq.NonFiniteGradientError, match=r"rank\(s\) \[2\]"):
            with reducer.step():
                reducer.reduce_scatter("g", g)
        chunk = torch.full((NUMEL // N,), float("inf") if comm.rank == 0 else 1.0)
        with pytest.raises(dsq.NonFiniteGradientError, match=r"rank\(s\) \[0\]"):
            reducer.all_gather("p", chunk, NUMEL)
        return reducer.worker_error.state_dict(), reducer.steps

    for memories, steps in dsq.LocalGroup(N).run(per_rank):
        assert memories == {} and steps == {}


def test_half_passes_refuse_what_they_cannot_serve():
    def per_rank(comm):
        with pytest.raises(dsq.ConfigError, match="owners=3"):
            dsq.DoubleSqueeze(comm, "sign", owners=3).reduce_scatter("g", torch.ones(6))
        with pytest.raises(ValueError, match="holds chunk"):
            dsq.DoubleSqueeze(comm, "sign").all_gather("p", torch.ones(5), 9)
        return True

    assert all(dsq.LocalGroup(N).run(per_rank))


@pytest.mark.parametrize("size", [64, 61])  # a chunk of whole bytes of signs, and one that is not
def test_all_gathers_server_memory_from_the_squeezes_own_pass_is_the_one_from_the_decode(monkeypatch, size):
    """The server residual of ``all_gather`` (ZeRO's and FSDP's server pass) formed with Q'(u), before
    the all-gather, as the int8 memory stores it: the same memories and results as the residual of the
    chunk every rank decoded, bit for bit, over steps that read what the last ones stored."""
    from dsq_plugins.algorithm import arithmetic
    numel = size * N

    def run():
        def per_rank(comm):
            reducer = dsq.DoubleSqueeze(comm, "sign", error_dtype="int8")
            a, b = chunk_bounds(numel, N)[comm.rank]
            outs = [reducer.all_gather("p", torch.randn(numel, generator=torch.Generator().manual_seed(step))[a:b],
                                       numel) for step in range(3)]
            return outs, reducer.server_error.state_dict()
        return dsq.LocalGroup(N).run(per_rank)

    fused = run()
    monkeypatch.setattr(arithmetic, "payloads_with_residual", lambda *a, **k: None)
    plain = run()
    for (outs, memories), (plain_outs, plain_memories) in zip(fused, plain):
        assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(outs, plain_outs))
        assert memories.keys() == plain_memories.keys() == {"p"}
        assert all(torch.equal(memories["p"][k], plain_memories["p"][k]) for k in ("int8", "scales"))


@pytest.mark.parametrize("verdict", ["collective", "step"])
@pytest.mark.parametrize("n,numel", [(1, 4096), (2, 4096), (3, 999), (4, 2000)])
@pytest.mark.parametrize("name,params", [("sign", {}), ("topk", {"ratio": 0.05}), ("blocksign", {"block": 8})])
def test_a_reduce_scatter_that_folds_the_decode_into_the_mean_gives_what_it_did(monkeypatch, verdict, n, numel,
                                                                                 name, params):
    """ZeRO's half pass on a GPU's paths: the owner's mean from its senders' payloads in one kernel
    (``mean_of_payloads``, no server memory) against decoding them and then averaging: the same
    chunks and worker memories, bit for bit, over steps that read what the last ones stored, with
    either verdict; sign's chunks whose signs are not whole bytes take the old path."""
    import contextlib
    import importlib
    from dsq_plugins.compressors import kernels
    from dsq_plugins.step import Deferred, Plan
    from tests.helpers.folding import count_folds
    server_pass = importlib.import_module("dsq_plugins.algorithm._server_pass")
    deferred = []
    monkeypatch.setattr(Deferred, "served_status", lambda *a, _f=Deferred.served_status: deferred.append(1) or _f(*a))

    def run():
        def per_rank(comm):
            reducer = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict=verdict)
            out = []
            for step in range(3):
                g = torch.randn(numel, generator=torch.Generator().manual_seed(10 * step + comm.rank))
                g[::7] = -0.0
                with reducer.step(Plan([("g", numel)])) if verdict == "step" else contextlib.nullcontext():
                    out.append(reducer.reduce_scatter("g", g))
            return out, reducer.state_dict()
        with kernels.gpu_paths():
            return dsq.LocalGroup(n).run(per_rank)

    with monkeypatch.context() as m:
        folded = count_folds(m)
        fused = run()
    owners = sum(name != "sign" or (b - a) % 8 == 0 for a, b in chunk_bounds(numel, n))
    assert len(folded) == 3 * owners
    assert len(deferred) == (3 * n if verdict == "step" and n > 1 else 0)  # each owner's status, each step
    monkeypatch.setattr(server_pass, "folds_mean", lambda *a: False)
    plain = run()
    for (outs, state), (plain_outs, plain_state) in zip(fused, plain):
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(outs, plain_outs))
        assert state.keys() == plain_state.keys()
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                   for x, y in zip(_tensors(state), _tensors(plain_state)))


def _tensors(obj):
    """The tensors of a nested state, in order."""
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return [obj] if isinstance(obj, torch.Tensor) and obj.dim() else []


@pytest.mark.parametrize("verdict", ["collective", "step"])
@pytest.mark.parametrize("name,params", [("sign", {}), ("topk", {"ratio": 0.05}), ("blocksign", {})])
def test_a_reduce_scatter_that_folds_names_a_payload_that_does_not_decode_on_every_rank(monkeypatch, verdict,
                                                                                        name, params):
    """The folded owner's checks and status (``mean_of_payloads``) in ZeRO's half pass: a rank whose
    encoder writes NaN into its payloads' first word is named on every rank."""
    import contextlib
    from dsq_plugins.compressors import kernels
    from dsq_plugins.errors import PayloadError
    from dsq_plugins.step import Plan
    from tests.helpers.folding import count_folds, write_nan_first

    def per_rank(comm):
        reducer = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict=verdict)
        if comm.rank == 2:
            write_nan_first(reducer)
        with pytest.raises(PayloadError) as raised:
            with reducer.step(Plan([("g", 4096)])) if verdict == "step" else contextlib.nullcontext():
                reducer.reduce_scatter("g", torch.randn(4096, generator=torch.Generator().manual_seed(comm.rank)))
        return str(raised.value)

    folded = count_folds(monkeypatch)
    with kernels.gpu_paths():
        messages = dsq.LocalGroup(4).run(per_rank)
    assert len(folded) == 4
    assert all("could not decode the payload rank 2 sent for 'g'" in m for m in messages), messages
