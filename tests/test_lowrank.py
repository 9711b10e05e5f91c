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
from tests.helpers.states import decoded_all

SHAPES = [("embed", (40, 24)), ("bias", (24,)), ("proj", (24, 3, 4)), ("scale", (7,))]


def low_rank(shape, r, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape[0], math.prod(shape[1:])
    return (torch.randn(rows, r, generator=gen) @ torch.randn(r, cols, generator=gen)).reshape(shape)


def test_a_described_chunk_goes_tensor_by_tensor_matrices_as_factors_vectors_as_values():
    tensors = TensorMap(tuple(SHAPES))
    flat = torch.cat([low_rank(s, 2, i).reshape(-1) if len(s) > 1 else torch.randn(s) for i, (_, s) in
                      enumerate(SHAPES)])
    q = dsq.get_compressor("lowrank", rank=4, factors="fp32")  # a piece's partial first and last rows add 2 to the rank
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
        exact = dsq.DoubleSqueeze(comm, "lowrank", compressor_params={"rank": 4, "small_matrices": "exact",
                                                                     "factors": "fp32"})
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


# -- warm_start="basis": every rank projects onto the bases the owner served ---------------------------

def test_a_basis_payload_decodes_to_the_projection_linear_in_the_matrix():
    """P = M Q_s, W = M^T P_s decode to M's projection onto span(P_s) columns
    or span(Q_s) rows; linear, so the mean of payloads is the mean's payload."""
    gen = torch.Generator().manual_seed(0)
    size = Shaped(TensorMap((("m", (12, 10)),)).segments(0, 120))
    p_s, q_s = (torch.linalg.qr(torch.randn(n, 3, generator=gen)).Q for n in (12, 10))
    sized = size.with_warm(WarmStart(torch.cat([p_s.reshape(-1), q_s.reshape(-1)]), lambda t: None, True))
    q = dsq.get_compressor("lowrank", rank=3, warm_start="basis", factors="fp32")
    decode = lambda m: q.decompress_flat(q.compress(m.reshape(-1), seed=1, size=sized).payload, sized)  # noqa: E731
    a, b = torch.randn(12, 10, generator=gen), torch.randn(12, 10, generator=gen)
    pp, pq = p_s @ p_s.T, q_s @ q_s.T
    assert torch.allclose(decode(a), (pp @ a + a @ pq - pp @ a @ pq).reshape(-1), atol=1e-5)
    assert torch.allclose((decode(a) + decode(b)) / 2, decode((a + b) / 2), atol=1e-5)
    assert torch.allclose(decode(decode(a)), decode(a), atol=1e-5)  # a projection: nothing left the second time
    assert decode(a).norm() < a.norm()


def test_with_bases_the_server_pass_sends_the_mean_without_a_second_approximation():
    """From the second step every rank keeps the same bases per chunk, and
    the served average is the mean of the senders' projections: the server
    pass adds nothing to its error, which only drains what the first step
    (power iteration) left; the power-iteration scheme's server pass
    squeezes a second time, and its error grows."""
    def per_rank(comm):
        out = {}
        for warm_start in ("basis", "served"):
            r, norms = reducer(comm, warm_start=warm_start), []
            for step in range(5):
                r.reduce_many(grads(comm.rank, step))
                norms.append(float(sum(e.norm() for e in decoded_all(r.server_error.state_dict()).values())))
            out[warm_start] = norms, {k: v.clone() for k, v in r.state.operator.items() if "@basis" in k}
        return out
    results = dsq.LocalGroup(2).run(per_rank)
    for result in results:
        (basis, _), (served, _) = result["basis"], result["served"]
        assert all(later <= earlier * (1 + 1e-5) for earlier, later in zip(basis, basis[1:]))
        assert served[-1] > 2 * served[0] and basis[-1] < served[-1] / 2
    bases = results[0]["basis"][1]
    assert len(bases) == 2 and all(torch.equal(bases[k], results[1]["basis"][1][k]) for k in bases)


def test_bases_are_written_only_by_a_successful_step_and_resume_bit_for_bit():
    def per_rank(comm):
        r = reducer(comm, warm_start="basis")
        for step in range(2):
            r.reduce_many(grads(comm.rank, step))
        before = {k: v.clone() for k, v in r.state.operator.items()}
        with pytest.raises(dsq.NonFiniteGradientError):
            r.reduce_many(grads(comm.rank, 2, nan=comm.rank == 1))
        unchanged = all(torch.equal(before[k], r.state.operator[k]) for k in before)
        resumed = reducer(comm, warm_start="basis")
        resumed.load_state_dict(r.state_dict())
        a, b = r.reduce_many(grads(comm.rank, 3)), resumed.reduce_many(grads(comm.rank, 3))
        return unchanged, any("@basis" in k for k in before), all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(all(result) for result in dsq.LocalGroup(2).run(per_rank))
