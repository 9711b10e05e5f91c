"""The sharded reducer equals the paper's Algorithm 1 (central server,
per-chunk compression) step after step, bit for bit."""
import contextlib

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.algorithm.reference import ReferenceDoubleSqueeze
from dsq_plugins.compressors.kernels import gpu_paths
from dsq_plugins.layout import chunk_bounds
from tests.helpers.states import decoded_all, exact_reducer

STEPS = 4


def grads_for(rank, step, numel, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def run_sharded(n, numel, steps=STEPS, **kw):
    def per_rank(comm):
        r = exact_reducer(comm, **kw)
        return [r.reduce("w", grads_for(comm.rank, t, numel)) for t in range(steps)], r
    results = dsq.LocalGroup(n).run(per_rank)
    outs = [res[0] for res in results]
    return outs, results[0][1]


def run_reference(n, numel, reducer, steps=STEPS, **kw):
    ref = ReferenceDoubleSqueeze(
        n, reducer.compressor, reducer.server_compressor, reducer.error_feedback,
        seed_of=lambda step, side, sender, chunk: reducer.chunk_seed("w", step, side, sender, chunk), **kw)
    return [ref([grads_for(i, t, numel) for i in range(n)]) for t in range(steps)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("compressor,params", [
    ("sign", {}), ("sign", {"scale": "rms"}), ("topk", {"ratio": 0.1}), ("fp16", {}), ("bf16", {}), ("none", {}),
    ("blocksign", {"block": 4}),
])
def test_matches_reference_bit_for_bit(n, compressor, params):
    numel = 10 * n + 3  # never divisible by n > 1
    outs, reducer = run_sharded(n, numel, compressor=compressor, compressor_params=params)
    expected = run_reference(n, numel, reducer)
    for rank_outs in outs:
        for t in range(STEPS):
            assert torch.equal(rank_outs[t], expected[t]), f"rank output differs from Algorithm 1 at step {t}"


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("compressor,params", [("sign", {}), ("topk", {"ratio": 0.1}), ("blocksign", {"block": 4})])
def test_a_gpu_s_paths_match_reference_bit_for_bit(n, compressor, params):
    """The paths a GPU takes (rows decoded in one call, the served rows kept as
    the average, top-k's own residual formed by zeroing what it kept) give
    Algorithm 1's bits too."""
    numel = 10 * n + 3
    with gpu_paths():
        outs, reducer = run_sharded(n, numel, compressor=compressor, compressor_params=params)
    expected = run_reference(n, numel, reducer)
    for rank_outs in outs:
        assert all(torch.equal(o, e) for o, e in zip(rank_outs, expected))


@pytest.mark.parametrize("compressor,params", [("sign", {}), ("topk", {"ratio": 0.05}), ("blocksign", {})])
def test_nine_ranks_sum_in_sender_order(compressor, params):
    """From 8 rows on torch.mean reorders its sum; the server sums
    contributions one at a time in sender order (sparse ones without
    densifying them), and must still equal the reference's mean."""
    n, numel = 9, 9 * 4000 + 5
    outs, reducer = run_sharded(n, numel, steps=2, compressor=compressor, compressor_params=params)
    expected = run_reference(n, numel, reducer, steps=2)
    for rank_outs in outs:
        assert all(torch.equal(o, e) for o, e in zip(rank_outs, expected))


@pytest.mark.parametrize("error_feedback", ["both", "worker", "none", "ef21"])
def test_error_feedback_modes_match_reference(error_feedback):
    outs, reducer = run_sharded(3, 31, compressor="sign", error_feedback=error_feedback)
    expected = run_reference(3, 31, reducer)
    assert all(torch.equal(o, e) for o, e in zip(outs[1], expected))
    if error_feedback == "worker":
        assert type(reducer.server_compressor).name == "none"  # the paper's single-pass baseline


@pytest.mark.parametrize("error_feedback", ["both", "worker"])
@pytest.mark.parametrize("compressor,params", [("sign", {"scale": "rms", "block": 4}), ("topk", {"ratio": 0.2})])
def test_decayed_error_feedback_matches_reference(error_feedback, compressor, params):
    """error_decay=γ adds γ times each memory; γ = 0.5 is exact in fp32, so
    the sharded reducer must still equal the reference bit for bit, and
    differ from the undecayed run (the memories are really decayed)."""
    kw = dict(compressor=compressor, compressor_params=params, error_feedback=error_feedback)
    outs, reducer = run_sharded(3, 31, **kw, error_decay=0.5)
    expected = run_reference(3, 31, reducer, error_decay=0.5)
    assert all(torch.equal(o, e) for o, e in zip(outs[1], expected))
    undecayed, _ = run_sharded(3, 31, **kw)
    assert not all(torch.equal(o, e) for o, e in zip(outs[1][1:], undecayed[1][1:]))


def test_no_error_decay_left_sends_as_without_error_feedback():
    """γ = 0: every step sends what error_feedback="none" sends, though the memories are kept."""
    decayed, reducer = run_sharded(3, 31, compressor="sign", error_decay=0.0)
    plain, _ = run_sharded(3, 31, compressor="sign", error_feedback="none")
    assert all(torch.equal(o, e) for o, e in zip(decayed[1], plain[1]))
    assert reducer.worker_error.get("w", 31, torch.device("cpu")).abs().sum() > 0


@pytest.mark.parametrize("compressor,params", [
    ("randomk", {"ratio": 0.2}), ("randomk", {"ratio": 0.2, "unbiased": False}), ("qsgd", {"bucket_size": 4}),
    ("terngrad", {}),
])
def test_randomized_compressors_match_reference_with_shared_seeds(compressor, params):
    outs, reducer = run_sharded(4, 45, compressor=compressor, compressor_params=params)
    expected = run_reference(4, 45, reducer)
    for rank_outs in outs:
        assert all(torch.equal(o, e) for o, e in zip(rank_outs, expected))


def test_different_server_operator():
    outs, reducer = run_sharded(3, 50, compressor="topk", compressor_params={"ratio": 0.2},
                                server_compressor="sign")
    assert type(reducer.server_compressor).name == "sign"
    expected = run_reference(3, 50, reducer)
    assert all(torch.equal(o, e) for o, e in zip(outs[2], expected))


def test_all_ranks_get_the_same_average_and_it_is_the_mean_without_compression():
    outs, _ = run_sharded(4, 21, compressor="none", error_feedback="none")
    for t in range(STEPS):
        exact = torch.stack([grads_for(i, t, 21) for i in range(4)]).mean(0)
        for rank_outs in outs:
            assert torch.allclose(rank_outs[t], exact, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_keep_dtype_and_fp32_memory(dtype):
    def per_rank(comm):
        r = exact_reducer(comm, "sign")
        out = r.reduce("g", grads_for(comm.rank, 0, 33, dtype).reshape(3, 11))
        return out, r.worker_error.state_dict()["g"], r.server_error.state_dict()["g"]
    for out, werr, serr in dsq.LocalGroup(3).run(per_rank):
        assert out.dtype == dtype and out.shape == (3, 11)
        assert werr.dtype == torch.float32 and serr.dtype == torch.float32


@pytest.mark.parametrize("n", [1, 3])
def test_empty_and_tiny_tensors(n):
    def per_rank(comm):
        r = exact_reducer(comm, "topk", compressor_params={"ratio": 0.5})
        return r.reduce("empty", torch.zeros(0, 4)), r.reduce("one", torch.ones(1))
    for empty, one in dsq.LocalGroup(n).run(per_rank):
        assert empty.shape == (0, 4)
        assert one.shape == (1,) and torch.allclose(one, torch.ones(1))


# A bucket of several tensors is summed with the worker error piece by piece
# (never flattened) when that is the whole worker-side sum, on a CPU; on a
# GPU's paths by one batched copy and one add; momentum and no worker-side
# feedback flatten it first. Each must equal the flat exchange.
@pytest.mark.parametrize("options,dtype", [({}, torch.float32), ({}, torch.float16),
                                           ({"error_decay": 0.5}, torch.bfloat16),
                                           ({"error_feedback": "ef21"}, torch.float32),
                                           ({"worker_momentum": 0.5}, torch.float32),
                                           ({"error_feedback": "none"}, torch.float16)])
@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_reduce_many_equals_per_bucket_reduce_and_layout_is_stable(options, dtype, paths):
    shapes = [("a", (5, 3)), ("b", (7,)), ("c", (2, 2, 2)), ("d", (1,))]

    def tensors(rank, step):
        return [(name, grads_for(rank, step, int(torch.tensor(s).prod())).reshape(s).to(dtype)) for name, s in shapes]

    def bucketed(comm):
        r = exact_reducer(comm, "sign", bucket_mb=28 * 4 / 2**20, **options)  # 28 floats: a|b, then c|d
        outs = [r.reduce_many(tensors(comm.rank, t)) for t in range(3)]
        return outs, [b.name for b in r.layout(shapes)], [len(b.slots) for b in r.layout(shapes)]

    def manual(comm):
        r = exact_reducer(comm, "sign", **options)
        outs = []
        for t in range(3):
            ts = dict(tensors(comm.rank, t))
            ab = r.reduce("ab", torch.cat([ts["a"].reshape(-1), ts["b"]]))
            cd = r.reduce("cd", torch.cat([ts["c"].reshape(-1), ts["d"]]))
            outs.append([ab[:15].reshape(5, 3), ab[15:], cd[:8].reshape(2, 2, 2), cd[8:]])
        return outs

    with gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        got = dsq.LocalGroup(3).run(bucketed)
    want = dsq.LocalGroup(3).run(manual)
    assert got[0][2] == [2, 2]
    assert len({tuple(g[1]) for g in got}) == 1  # same layout on every rank
    for (outs, _, _), ref in zip(got, want):
        for step_out, step_ref in zip(outs, ref):
            assert all(torch.equal(a, b) for a, b in zip(step_out, step_ref))


@pytest.mark.parametrize("compressor,options", [
    ("sign", {}), ("sign", {"error_dtype": "int8"}), ("topk", {"compressor_params": {"ratio": 0.3}}),
    ("blocksign", {"error_dtype": "int8", "compressor_params": {"block": 4}}),
    ("sign", {"owners": "all"}), ("sign", {"error_feedback": "none"}), ("sign", {"worker_momentum": 0.5}),
    ("sign", {"hierarchy": "node", "node_size": 2})])
@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_reduce_flat_is_reduce_many_of_the_vector_s_pieces(compressor, options, paths):
    """``reduce_flat`` (CompressedAdam's momentum exchange) reads each bucket
    as one piece of a flat vector: its averages, memories and bytes must be
    ``reduce_many``'s of the same tensors, step after step, and the vector
    it was given is left as it was."""
    shapes = [("a", (40, 3)), ("b", (7,)), ("c", (5, 5)), ("d", (9,))]
    total = sum(int(torch.tensor(s).prod()) for _, s in shapes)

    def per_rank(comm):
        many = exact_reducer(comm, compressor, bucket_mb=100 * 4 / 2**20, **options)  # several buckets
        flat = exact_reducer(comm, compressor, bucket_mb=100 * 4 / 2**20, **options)
        same = True
        for t in range(4):
            vector = grads_for(comm.rank, t, total)
            given = vector.clone()
            pieces = [(n, piece.reshape(s)) for (n, s), piece in
                      zip(shapes, vector.split([int(torch.tensor(s).prod()) for _, s in shapes]))]
            expected = torch.cat([x.reshape(-1) for x in many.reduce_many(pieces)])
            got = flat.reduce_flat(shapes, vector)
            same &= torch.equal(got, expected) and torch.equal(vector, given)
        memories = [(many.state_dict(), flat.state_dict())]
        for role in ("worker_error", "server_error", "momentum"):
            a, b = (decoded_all(sd.get(role, {})) for sd in memories[0])
            same &= a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        return same

    with gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        assert all(dsq.LocalGroup(4).run(per_rank))


def test_reduce_flat_refuses_a_vector_of_another_size_on_every_rank():
    def per_rank(comm):
        r = exact_reducer(comm, "sign")
        numel = 10 if comm.rank else 9  # rank 0 passes one element short
        try:
            r.reduce_flat([("a", (10,))], torch.ones(numel))
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc)
        return None
    results = dsq.LocalGroup(3).run(per_rank)
    assert all(r is not None for r in results)
    assert "reduce_flat: the entries hold 10 elements, the vector 9 torch.float32" in results[0][1]


def test_layerwise_mode_gives_every_tensor_its_own_bucket():
    def per_rank(comm):
        r = exact_reducer(comm, "sign", layerwise=True)
        r.reduce_many([("w", torch.ones(4)), ("b", torch.ones(2))])
        return r.layout([("w", (4,)), ("b", (2,))])
    layout = dsq.LocalGroup(2).run(per_rank)[0]
    assert [len(b.slots) for b in layout] == [1, 1]
    assert layout[0].name.startswith("w#") and layout[1].name.startswith("b#")


@pytest.mark.parametrize("n,owners", [(3, 1), (4, 3), (4, "all")])
def test_ef21_matches_the_reference_and_its_replicas_equal_the_workers_states(n, owners):
    outs, reducer = run_sharded(n, 53, compressor="topk", compressor_params={"ratio": 0.2}, error_feedback="ef21",
                                owners=owners)
    if owners == 1:
        expected = run_reference(n, 53, reducer)
        assert all(torch.equal(o, e) for o, e in zip(outs[0], expected))

    def states(comm):
        r = exact_reducer(comm, "topk", compressor_params={"ratio": 0.2}, error_feedback="ef21", owners=owners)
        for t in range(STEPS):
            r.reduce("w", grads_for(comm.rank, t, 53))
        return r.tracked.state_dict()["w"], r.replicas.state_dict()
    results = dsq.LocalGroup(n).run(states)
    bounds = chunk_bounds(53, n)
    for rank, (_, replicas) in enumerate(results):
        for key, replica in replicas.items():  # every owner holds every sender's h, bit for bit
            chunk, sender = int(key.split("@chunk")[1].split("@")[0]), int(key.split("@from")[1])
            a, b = bounds[chunk]
            assert torch.equal(replica, results[sender][0][a:b])


def test_ef21_without_compression_is_the_exact_mean():
    outs, _ = run_sharded(4, 21, compressor="none", error_feedback="ef21")
    for t in range(STEPS):
        exact = torch.stack([grads_for(i, t, 21) for i in range(4)]).mean(0)
        assert torch.allclose(outs[0][t], exact, atol=1e-6)


@pytest.mark.parametrize("compressor,options,dtype,layout", [
    ("sign", {}, torch.float32, "contiguous"), ("blocksign", {"compressor_params": {"block": 4}}, torch.float32,
                                                "contiguous"),
    ("topk", {"compressor_params": {"ratio": 0.3}}, torch.float16, "contiguous"),
    ("randomk", {"compressor_params": {"ratio": 0.3}}, torch.float32, "contiguous"),  # positions unordered
    ("sign", {"owners": 2}, torch.float32, "contiguous"), ("sign", {"error_feedback": "none"}, torch.float32,
                                                           "contiguous"),
    ("blocksign", {}, torch.float32, "transposed")])
@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_in_place_writes_the_same_averages_into_the_given_tensors(compressor, options, dtype, layout, paths):
    """``in_place=True`` (the engines' allreduce) decodes the served chunks
    straight into the inputs (chunks cross tensor boundaries), or, where it
    cannot (no worker-side feedback, non-contiguous tensors), builds the
    average in a buffer kept across steps and copies it in: the values must
    be those of the plain call, step after step, and the inputs themselves
    come back."""
    shapes = [("a", (40, 3)), ("b", (7,)), ("c", (5, 5))]

    def per_rank(comm):
        plain = exact_reducer(comm, compressor, bucket_mb=100 * 4 / 2**20, **options)  # two buckets
        inplace = exact_reducer(comm, compressor, bucket_mb=100 * 4 / 2**20, **options)
        same = True
        for t in range(4):
            gen = torch.Generator().manual_seed(10 * t + comm.rank)
            named = [(n, torch.randn(s, generator=gen).to(dtype)) for n, s in shapes]
            if layout == "transposed":
                named = [(n, x.t() if x.dim() == 2 else x) for n, x in named]
            expected = plain.reduce_many(named)
            mine = [(n, x.clone()) for n, x in named]
            got = inplace.reduce_many(mine, in_place=True)
            same &= all(g is x for g, (_, x) in zip(got, mine))
            same &= all(torch.equal(g, e) for g, e in zip(got, expected))
        return same
    with gpu_paths() if paths == "gpu" else contextlib.nullcontext():  # (a GPU's: one multi-tensor copy)
        assert all(dsq.LocalGroup(3).run(per_rank))


@pytest.mark.parametrize("error_feedback", ["both", "none"])
def test_on_a_gpus_paths_an_in_place_average_copies_once_however_many_tensors(error_feedback):
    """``in_place=True`` on a GPU's paths writes a bucket's average into its tensors, whether decoded
    straight into them or copied from a buffer (no worker-side feedback), by multi-tensor copies:
    as many ops for twelve tensors as for three, where there was a copy per tensor."""
    from torch.profiler import profile

    def copies(count: int) -> int:
        def per_rank(comm):
            r = exact_reducer(comm, "sign", error_feedback=error_feedback)
            named = [(f"t{i}", torch.randn(96)) for i in range(count)]
            r.reduce_many([(n, x.clone()) for n, x in named], in_place=True)  # the first step lays out the bucket
            with profile() as prof:
                r.reduce_many(named, in_place=True)
            return sum(e.name in ("aten::copy_", "aten::_foreach_copy_") for e in prof.events()
                       if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        with gpu_paths():
            return dsq.LocalGroup(1).run(per_rank)[0]

    assert copies(12) == copies(3)


def test_the_exact_reducer_averages_exactly_and_keeps_no_memory():
    """``DoubleSqueeze.exact``: fp32 both ways, no error feedback, flat."""
    def per_rank(comm):
        r = dsq.DoubleSqueeze.exact(comm)
        out = r.reduce("w", grads_for(comm.rank, 0, 1000))
        return out, r.config.compressor, r.config.error_feedback, r.config.hierarchy, r.state.nbytes()
    results = dsq.LocalGroup(3).run(per_rank)
    mean = sum(grads_for(rank, 0, 1000) for rank in range(3)) / 3
    for out, compressor, error_feedback, hierarchy, nbytes in results:
        assert torch.allclose(out, mean, rtol=0, atol=1e-6)
        assert (compressor, error_feedback, hierarchy, nbytes) == ("none", "none", "flat", 0)
