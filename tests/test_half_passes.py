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
