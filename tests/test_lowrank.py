"""The low-rank operator as PowerSGD makes it: each tensor compressed as its
own matrix (the reducer tells the operator which tensors a chunk holds), a
warm start from the last applied step's factors, kept per chunk and side,
written only by a successful step, checkpointed and dropped by reshard; and
a rank a tensor cannot take refused by the tensor's name."""
import math

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors.shapes import Shaped, TensorMap, WarmStart
from dsq_plugins.layout import chunk_bounds

SHAPES = [("embed", (40, 24)), ("bias", (24,)), ("proj", (24, 3, 4)), ("scale", (7,))]


def low_rank(shape, r, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape[0], math.prod(shape[1:])
    return (torch.randn(rows, r, generator=gen) @ torch.randn(r, cols, generator=gen)).reshape(shape)


def test_a_described_chunk_goes_tensor_by_tensor_matrices_as_factors_vectors_as_values():
    tensors = TensorMap(tuple(SHAPES))
    flat = torch.cat([low_rank(s, 2, i).reshape(-1) if len(s) > 1 else torch.randn(s) for i, (_, s) in
                      enumerate(SHAPES)])
    q = dsq.get_compressor("lowrank", rank=4)  # a piece's partial first and last rows add 2 to the rank
    bounds = chunk_bounds(flat.numel(), 3)
    for a, b in bounds:
        size = Shaped(tensors.segments(a, b))
        payload = q.compress(flat[a:b], seed=1, size=size).payload
        # each piece of a matrix: its rows' P and the whole width's Q, or its values where those are fewer;
        # a piece of a vector: its values
        values = sum(s.length if s.vector else min(s.length, min(4, s.rows) * (s.rows + s.cols))
                     for s in size.segments)
        assert payload.numel() == 4 * values == q.payload_nbytes(size)
        assert torch.allclose(q.decompress_flat(payload, size), flat[a:b], atol=1e-4)  # rank 4 is exact here
        with pytest.raises(dsq.PayloadError, match="must be"):
            q.decompress_flat(payload[:-4], size)
    # the first chunk cuts "embed" after 13 of its 40 rows ... and the next starts mid-row, zeros in front
    second = tensors.segments(*bounds[1])[0]
    assert (second.tensor, second.cols, second.lead) == ("embed", 24, bounds[1][0] % 24)


def test_a_rank_larger_than_a_tensor_allows_is_refused_naming_the_tensor():
    q = dsq.get_compressor("lowrank", rank=4)
    with pytest.raises(dsq.ConfigError, match=r"larger than a tensor of shape \(3, 40\)"):
        q.compress(torch.randn(3, 40))

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "lowrank", compressor_params={"rank": 4})
        with pytest.raises(dsq.ConfigError, match=r"'head.weight' of shape \(2, 16\).*rank <= 2"):
            r.reduce_many([("body.weight", torch.randn(16, 16)), ("head.weight", torch.randn(2, 16))])
        exact = dsq.DoubleSqueeze(comm, "lowrank", compressor_params={"rank": 4, "small_matrices": "exact"})
        return exact.reduce_many([("body.weight", torch.ones(16, 16)), ("head.weight", torch.ones(2, 16))])
    for body, head in dsq.LocalGroup(2).run(per_rank):  # the head goes as its values
        assert torch.allclose(head, torch.ones(2, 16)) and torch.allclose(body, torch.ones(16, 16), atol=1e-5)


def test_one_d_tensors_travel_as_their_values():
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "lowrank", compressor_params={"rank": 1}, error_dtype="fp32")
        bias = torch.arange(10.0) * (comm.rank + 1)
        return r.reduce_many([("w", torch.randn(8, 8)), ("b", bias)])[1]
    for b in dsq.LocalGroup(2).run(per_rank):
        assert torch.equal(b, torch.arange(10.0) * 1.5)


def test_the_warm_start_converges_to_the_best_rank_one_approximation_a_cold_start_does_not():
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen))
    spectrum = torch.cat([torch.tensor([3.0, 2.5]), torch.linspace(1.0, 0.5, 38)])  # a small gap at the top
    m = u[:, :40] @ torch.diag(spectrum) @ v.T
    best = torch.linalg.svdvals(m)[1:].square().sum().sqrt()
    q = dsq.get_compressor("lowrank", rank=1)
    size, kept = Shaped(TensorMap((("m", (60, 40)),)).segments(0, 2400)), {}

    def error(warm):
        sized = size.with_warm(WarmStart(kept.get("q"), lambda t: kept.__setitem__("q", t)) if warm else None)
        approx = q.decompress_flat(q.compress(m.reshape(-1), seed=3, size=sized).payload, size)
        return (approx - m.reshape(-1)).norm()
    cold = [error(False) for _ in range(30)]
    warm = [error(True) for _ in range(30)]
    assert warm[0] == cold[0] == cold[-1]  # the first warm step starts from the seed too
    assert warm[-1] < 1.001 * best < 0.99 * cold[-1]


def reducer(comm, warm_start="served", **kw):
    return dsq.DoubleSqueeze(comm, "lowrank", compressor_params={"rank": 1, "warm_start": warm_start},
                             error_dtype="fp32", **kw)


def grads(rank, step, nan=False):
    gen = torch.Generator().manual_seed(10 * step + rank)
    out = [(name, torch.randn(shape, generator=gen)) for name, shape in SHAPES]
    if nan:
        out[0][1][0, 0] = float("nan")
    return out


def test_warm_starts_are_per_chunk_written_only_by_a_successful_step_and_resume_bit_for_bit():
    def per_rank(comm):
        r = reducer(comm)
        r.reduce_many(grads(comm.rank, 0))
        bucket = r.layout(SHAPES)[0].name
        keys = sorted(r.state.operator)
        first = {k: v.clone() for k, v in r.state.operator.items()}
        try:
            r.reduce_many(grads(comm.rank, 1, nan=comm.rank == 1))
        except dsq.NonFiniteGradientError:
            pass
        unchanged = first.keys() == r.state.operator.keys() and all(
            torch.equal(first[k], r.state.operator[k]) for k in first)
        r.reduce_many(grads(comm.rank, 2))
        moved = not torch.equal(first[f"{bucket}@w0"], r.state.operator[f"{bucket}@w0"])
        saved = r.state_dict()
        resumed = reducer(comm)
        resumed.load_state_dict(saved)
        a, b = r.reduce_many(grads(comm.rank, 3)), resumed.reduce_many(grads(comm.rank, 3))
        return bucket, keys, unchanged, moved, all(torch.equal(x, y) for x, y in zip(a, b)), saved
    results = dsq.LocalGroup(2).run(per_rank)
    for rank, (bucket, keys, unchanged, moved, same, _) in enumerate(results):
        # this rank's Q for every chunk it sends, for the chunk it serves, and the Q every owner served
        assert keys == sorted([f"{bucket}@w0", f"{bucket}@w1", f"{bucket}@s{rank}", f"{bucket}@served0",
                               f"{bucket}@served1"])
        assert unchanged and moved and same
    resharded = dsq.reshard([saved for *_, saved in results], 3)
    assert all(state["operator"] == {} for state in resharded)  # the old chunks' factors: a fresh start


def test_without_a_warm_start_the_same_steps_end_elsewhere():
    """The warm start is what the exchange uses: dropping it changes the average."""
    def per_rank(comm):
        r, cold = reducer(comm), reducer(comm)
        for step in range(3):
            a = r.reduce_many(grads(comm.rank, step))
            cold.state.operator.clear()
            b = cold.reduce_many(grads(comm.rank, step))
        return not torch.equal(a[0], b[0])
    assert all(dsq.LocalGroup(2).run(per_rank))


def test_a_served_warm_start_is_one_q_for_every_sender_of_a_chunk():
    """warm_start="served" (the default): every rank keeps the Q each owner
    served, and every sender of that chunk starts its next step from it
    (PowerSGD's shared Q), so the senders' payloads of a chunk share their start."""
    def per_rank(comm):
        r, own = reducer(comm), reducer(comm, warm_start="own")
        for step in range(3):
            r.reduce_many(grads(comm.rank, step))
            own.reduce_many(grads(comm.rank, step))
        bucket = r.layout(SHAPES)[0].name
        return bucket, {k: v.clone() for k, v in r.state.operator.items()}, own.state.operator.keys()
    (bucket, first, own_keys), (_, second, _) = dsq.LocalGroup(2).run(per_rank)
    served = sorted(k for k in first if "@served" in k)
    assert served == [f"{bucket}@served0", f"{bucket}@served1"]
    assert all(torch.equal(first[k], second[k]) for k in served)  # the same start on every rank
    assert not any("@served" in k for k in own_keys)  # "own" keeps only its own


def test_a_served_warm_start_is_what_the_senders_start_from():
    def per_rank(comm):
        a, b = reducer(comm), reducer(comm, warm_start="own")
        for step in range(3):
            x, y = a.reduce_many(grads(comm.rank, step)), b.reduce_many(grads(comm.rank, step))
        return not torch.equal(x[0], y[0])
    assert all(dsq.LocalGroup(2).run(per_rank))
