"""dsq.reshard: the compensation the error memories owe the model survives a
change of world size (4 -> 3 -> 4), and what cannot be resharded is refused."""
import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.layout import chunk_bounds
from tests.helpers.states import decoded

SHAPES = [("w", (40, 7)), ("b", (13,))]


def grads(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [(name, torch.randn(shape, generator=gen)) for name, shape in SHAPES]


def trained_states(n, steps=4, **options):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.1}, **options)
        for step in range(steps):
            r.reduce_many(grads(comm.rank, step))
        return r.state_dict()
    return dsq.LocalGroup(n).run(per_rank)


def owed(states):
    """Per bucket: the mean worker error plus the whole server error."""
    n, out = len(states), {}
    for name in states[0]["worker_error"]:
        mean = sum(decoded(s["worker_error"][name]).double() for s in states) / n
        server = torch.cat([decoded(s["server_error"][name]).double() for s in states])
        out[name] = mean + server
    return out


def test_resharding_4_to_3_to_4_keeps_what_the_memories_owe():
    four = trained_states(4)
    three = dsq.reshard(four, 3)
    back = dsq.reshard(three, 4)
    assert [s["rank"] for s in three] == [0, 1, 2] and all(s["size"] == 3 for s in three)
    for name, before in owed(four).items():
        assert torch.allclose(owed(three)[name], before, atol=1e-6)
        assert torch.allclose(owed(back)[name], before, atol=1e-6)
        assert torch.equal(torch.cat([decoded(s["server_error"][name]) for s in back]),
                           torch.cat([decoded(s["server_error"][name]) for s in four]))  # re-cut, not changed
    assert all(s["steps"] == four[0]["steps"] for s in three)


def drained(states, steps=60, **options):
    """Zero gradients until the memories are nearly empty: (what the averages added up to, what is left)."""
    n = len(states)

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.1}, **options)
        r.load_state_dict(states[comm.rank])
        total = None
        for _ in range(steps):
            out = r.reduce_many([(name, torch.zeros(shape)) for name, shape in SHAPES])
            flat = torch.cat([t.reshape(-1) for t in out]).double()
            total = flat if total is None else total + flat
        return total, r.state_dict()
    results = dsq.LocalGroup(n).run(per_rank)
    return results[0][0], owed([state for _, state in results])


@pytest.mark.parametrize("error_dtype, tolerance", [("fp32", 1e-5), ("int8", 2e-2)])
def test_draining_the_resharded_memories_with_zero_gradients_pays_the_same_vector(error_dtype, tolerance):
    """Exactly with fp32 memories; with int8 (the default) within what
    rounding the memories to 255 levels per block of 256 drops each step."""
    four = trained_states(4, error_dtype=error_dtype)
    paid4, left4 = drained(four, error_dtype=error_dtype)
    paid3, left3 = drained(dsq.reshard(four, 3), error_dtype=error_dtype)
    (name, _), = owed(four).items()
    total4, total3 = paid4 + left4[name], paid3 + left3[name]
    scale = owed(four)[name].abs().max()
    assert (total3 - total4).abs().max() <= tolerance * scale
    assert (total4 - owed(four)[name]).abs().max() <= tolerance * scale
    assert left3[name].norm() < 0.1 * owed(four)[name].norm()  # the memories did drain


def test_compact_memories_reshard_within_their_rounding():
    four = trained_states(4, error_dtype="int8")
    three = dsq.reshard(four, 3)

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.1}, error_dtype="int8")
        r.load_state_dict(three[comm.rank])
        return r.reduce_many(grads(comm.rank, 9))
    dsq.LocalGroup(3).run(per_rank)  # loads (converted from fp32) and steps


@pytest.mark.parametrize("change, error, message", [
    (lambda s: s[:3], dsq.StateError, "every rank's state"),
    (lambda s: [dict(s[0], steps={"x": 9})] + s[1:], dsq.StateError, "differ in 'steps'"),
    (lambda s: [dict(x, compressor=["sign", {}]) for x in s[:1]] + s[1:], dsq.StateError, "differ in 'compressor'"),
    (lambda s: [dict(x, tracked={"w": torch.zeros(3)}) for x in s], dsq.StateError, "EF21"),
])
def test_what_cannot_be_resharded_is_refused_by_name(change, error, message):
    with pytest.raises(error, match=message):
        dsq.reshard(change(trained_states(4, steps=1)), 3)


def test_several_owners_per_chunk_and_size_zero_are_refused():
    with pytest.raises(dsq.StateError, match="owners > 1"):
        dsq.reshard(trained_states(4, steps=1, owners=3), 3)
    with pytest.raises(ValueError, match="size must be a positive integer"):
        dsq.reshard(trained_states(2, steps=1), 0)


def test_compressed_adam_states_reshard_and_load_at_the_new_size():
    def per_rank(comm, n_steps=5):
        model = torch.nn.Linear(30, 4)
        torch.manual_seed(0)
        opt = dsq.CompressedAdam(model.named_parameters(), comm=comm, lr=1e-2, freeze_step=2)
        for step in range(n_steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + comm.rank))
            opt.step()
        return opt.state_dict()
    four = dsq.LocalGroup(4).run(per_rank)
    three = dsq.reshard(four, 3)
    assert [s["compressed"]["rank"] for s in three] == [0, 1, 2]
    before, after = owed([s["compressed"]["momentum"] for s in four]), owed([s["compressed"]["momentum"]
                                                                             for s in three])
    assert all(torch.allclose(after[k], v, atol=1e-6) for k, v in before.items())

    def load(comm):
        model = torch.nn.Linear(30, 4)
        opt = dsq.CompressedAdam(model.named_parameters(), comm=comm, lr=1e-2, freeze_step=2)
        opt.load_state_dict(three[comm.rank])
        return opt.global_step
    assert dsq.LocalGroup(3).run(load) == [5, 5, 5]


def test_the_offline_command_reshards_a_folder_of_rank_files(tmp_path):
    from dsq_plugins.state.reshard import main
    four = trained_states(4)
    (tmp_path / "in").mkdir()
    for rank, state in enumerate(four):
        torch.save({"reducer": state, "replicas": []}, tmp_path / "in" / f"doublesqueeze_rank{rank}.pt")
    assert main([str(tmp_path / "in"), str(tmp_path / "out"), "--size", "3"]) == 0
    three = [torch.load(tmp_path / "out" / f"doublesqueeze_rank{r}.pt")["reducer"] for r in range(3)]
    assert not (tmp_path / "out" / "doublesqueeze_rank3.pt").exists()
    for name, value in owed(four).items():
        assert torch.allclose(owed(three)[name], value, atol=1e-6)


def test_ddp_hook_states_reshard_and_load_at_the_new_size():
    import dsq_plugins.ddp as dsq_ddp

    def hook_state(comm, steps):
        state = dsq_ddp.HookState(compressor="topk", compressor_params={"ratio": 0.1})
        state.reducer = dsq.DoubleSqueeze(comm, config=state.config)
        state.exact = dsq.DoubleSqueeze(comm, "none", error_feedback="none")
        for step in range(steps):
            state.reducer.reduce("ddp.bucket", grads(comm.rank, step)[0][1].reshape(-1))
        return state
    four = [s for s in dsq.LocalGroup(4).run(lambda comm: hook_state(comm, 3).state_dict())]
    three = dsq.reshard(four, 3)
    assert owed([s["reducer"] for s in three]).keys() == owed([s["reducer"] for s in four]).keys()
    for name, value in owed([s["reducer"] for s in four]).items():
        assert torch.allclose(owed([s["reducer"] for s in three])[name], value, atol=1e-6)

    def load(comm):
        state = hook_state(comm, 0)
        state.load_state_dict(three[comm.rank])
        return state.reducer.steps
    assert dsq.LocalGroup(3).run(load) == [{"ddp.bucket": 3}] * 3


def test_the_survivors_of_a_job_reshard_without_the_ranks_that_left():
    """Horovod Elastic's case: rank 3 of 4 is gone. The survivors' mean
    worker error, their server chunks, and zeros for the chunk rank 3 owned."""
    four = trained_states(4)
    with pytest.raises(dsq.StateError, match="every rank's state"):
        dsq.reshard(four[:3], 2)
    two = dsq.reshard(four[:3], 2, survivors=True)
    for name in four[0]["worker_error"]:
        mean = sum(decoded(s["worker_error"][name]) for s in four[:3]) / 3
        assert all(torch.allclose(decoded(t["worker_error"][name]), mean, atol=1e-6) for t in two)
        whole = torch.cat([decoded(s["server_error"][name]) for s in four])
        cut = chunk_bounds(whole.numel(), 4)[3][0]
        expected = torch.cat([whole[:cut], torch.zeros(whole.numel() - cut)])
        assert torch.equal(torch.cat([decoded(t["server_error"][name]) for t in two]), expected)
