"""No trusted rank: chunks served by r owners (or aggregated by everyone),
copies combined by majority of bytes or median, honest ranks bit-identical
whatever faulty ranks do on either pass."""
import warnings

import pytest
import torch

import dsq_plugins as dsq
import robust  # noqa: F401  (registers the robust rules)
from bench.faultrun import run_case
from dsq_plugins.replicated import ReplicatedDoubleSqueeze
from tests.test_bytes import expected_bytes_sent

STEPS = 4


def grads(rank, step, numel=97):
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))


def reduce_steps(n, numel=97, **kw):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, **kw)
        return [r.reduce("g", grads(comm.rank, t, numel)) for t in range(STEPS)]
    return dsq.LocalGroup(n).run(per_rank)


@pytest.mark.parametrize("n,owners", [(4, 2), (4, 3), (5, 5), (7, 3)])
@pytest.mark.parametrize("compressor,params", [("sign", {}), ("topk", {"ratio": 0.2}),
                                               ("randomk", {"ratio": 0.3, "unbiased": False})])
def test_replicated_owners_without_faults_give_the_single_owner_result_bit_for_bit(n, owners, compressor, params):
    one = reduce_steps(n, compressor=compressor, compressor_params=params)
    many = reduce_steps(n, compressor=compressor, compressor_params=params, owners=owners)
    assert all(torch.equal(a, b) for ra, rb in zip(one, many) for a, b in zip(ra, rb))


@pytest.mark.parametrize("compressor,params", [("sign", {}), ("qsgd", {"bucket_size": 8})])
def test_everyone_aggregating_equals_the_exact_server_pass_bit_for_bit(compressor, params):
    """owners="all" has no server pass: it is Algorithm 1 with worker error
    feedback and an exact mean (error_feedback="worker")."""
    exact_server = reduce_steps(4, compressor=compressor, compressor_params=params, error_feedback="worker")
    everyone = reduce_steps(4, compressor=compressor, compressor_params=params, owners="all")
    assert all(torch.equal(a, b) for ra, rb in zip(exact_server, everyone) for a, b in zip(ra, rb))


def bytes_sent(n, numel, **kw):
    def per_rank(comm):
        dsq.DoubleSqueeze(comm, "sign", **kw).reduce("g", torch.randn(numel))
        return comm.bytes_sent
    return dsq.LocalGroup(n).run(per_rank)


@pytest.mark.parametrize("n", [3, 5])
def test_bytes_grow_as_the_ownership_says(n):
    numel = 8 * 1000 + 3
    chunk = [numel // n + (1 if k < numel % n else 0) for k in range(n)]
    sign = lambda m: 4 + (m + 7) // 8  # noqa: E731
    for rank, sent in enumerate(bytes_sent(n, numel, owners=2)):
        served = [(rank - i) % n for i in range(2)]
        to_others = sum(sign(chunk[k]) for j in range(n) if j != rank for k in [(j - i) % n for i in range(2)])
        back = (n - 1) * sum(sign(chunk[k]) for k in served)
        assert sent == to_others + back + 8 * (2 + n) * (n - 1) + 8 * 3 * (n - 1)
    for rank, sent in enumerate(bytes_sent(n, numel, owners="all")):
        assert sent == (n - 1) * sum(sign(m) for m in chunk) + 8 * 3 * (n - 1)  # one all-gather, no second pass
    assert bytes_sent(n, numel, owners=1) == [expected_bytes_sent("sign", numel, n, r) for r in range(n)]


@pytest.mark.filterwarnings("ignore:faults .* attack the server pass")
def test_three_faulty_ranks_attacking_both_passes_cost_no_more_than_a_worker_only_attack():
    """8 ranks, sign, majority vote: 3 faulty ranks flip what they send as
    workers and what they serve as owners. With owners="all" honest ranks
    train as under a worker-only attack; with owners=1 they do not."""
    kw = dict(steps=60, error_feedback="none", worker_momentum=0.9, lr=2.0, batch=32)  # at 60 steps: 0.89, 0.14
    worker_only = run_case(8, "majority", "signflip", 3, passes="worker", **kw)
    trusted = run_case(8, "majority", "signflip", 3, passes="both", **kw)
    everyone = run_case(8, "majority", "signflip", 3, passes="both", owners="all", **kw)
    assert everyone["identical"] and everyone["accuracy"] >= worker_only["accuracy"] - 0.03
    assert trusted["accuracy"] < everyone["accuracy"] - 0.2


def test_five_owners_tolerate_two_faulty_owners_per_chunk():
    kw = dict(steps=60, error_feedback="none", worker_momentum=0.9, lr=2.0, batch=32)  # 60 steps: 0.94 in both
    worker_only = run_case(8, "majority", "signflip", 2, passes="worker", **kw)
    five = run_case(8, "majority", "signflip", 2, passes="both", owners=5, **kw)
    assert five["identical"] and five["accuracy"] >= worker_only["accuracy"] - 0.03


def test_server_copies_that_do_not_decode_are_left_out_or_an_error_naming_the_owner():
    def per_rank(comm, faults):
        r = dsq.DoubleSqueeze(comm, "sign", aggregator="median", owners=3, faults=faults)
        return [r.reduce("g", grads(comm.rank, t)) for t in range(3)], dict(r.rejected)
    robust_run = dsq.LocalGroup(5).run(per_rank, {"attack": "garbage", "ranks": [1], "pass": "server"})
    clean = [outs for outs, _ in dsq.LocalGroup(5).run(per_rank, {"attack": "zero", "ranks": [], "pass": "server"})]
    for (outs, rejected), reference in zip(robust_run, clean):
        assert all(torch.equal(a, b) for a, b in zip(outs, reference))  # one bad owner of three changed nothing
    assert sum(rej.get(1, 0) for _, rej in robust_run) > 0

    def short(comm):
        r = dsq.DoubleSqueeze(comm, "sign", owners=3, faults={"attack": "short", "ranks": [2], "pass": "server"})
        r.reduce("g", grads(comm.rank, 0))
    errors = dsq.LocalGroup(5).run(short, return_exceptions=True)
    assert all(isinstance(e, dsq.PayloadError) and e.rank == 2 for e in errors)
    assert "rank 2" in str(errors[0])


@pytest.mark.parametrize("owners", [0, 6, "some", 2.5, True])
def test_owners_outside_the_group_are_config_errors(owners):
    comms = dsq.LocalGroup(5).run(lambda c: c)
    with pytest.raises(dsq.ConfigError, match="owners must be"):
        dsq.DoubleSqueeze(comms[0], "sign", owners=owners)


def test_attacking_a_trusted_owner_warns_once_that_it_is_trusted():
    comm = dsq.LocalGroup(4).run(lambda c: c)[0]
    with pytest.warns(UserWarning, match="owner is trusted"):
        dsq.DoubleSqueeze(comm, "sign", aggregator="majority", faults="attack=signflip;ranks=1;pass=both")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dsq.DoubleSqueeze(comm, "sign", aggregator="majority", owners=3, faults="attack=signflip;ranks=1;pass=both")


def test_a_rule_that_starts_from_its_last_result_gets_it_and_a_failed_step_keeps_it():
    seen = []

    def remembering(stacked, previous=None):
        seen.append(None if previous is None else float(previous[0]))
        return stacked.mean(0)
    remembering.takes_previous = True

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "none", aggregator=remembering, error_feedback="none")
        r.reduce("g", torch.full((4,), float(comm.rank + 1)))
        kept = {k: v.clone() for k, v in r.aggregates.state_dict().items()}
        bad = torch.full((4,), 5.0)
        if comm.rank == 1:
            bad[0] = float("nan")
        try:
            r.reduce("g", bad)
        except dsq.NonFiniteGradientError:
            pass
        same = all(torch.equal(kept[k], v) for k, v in r.aggregates.state_dict().items())
        r.reduce("g", torch.full((4,), 7.0))
        return same, "aggregates" in r.state_dict()
    assert dsq.LocalGroup(2).run(per_rank) == [(True, True)] * 2
    assert seen[:2] == [None, None] and seen[-2:] == [1.5, 1.5]  # the second good step sees the first's mean


@pytest.mark.filterwarnings("ignore:faults .* attack the server pass")
def test_ef21_with_momentum_keeps_centered_clipping_robust_where_double_squeeze_does_not():
    """The finding behind the README's robust-with-error-feedback table:
    ALIE on both passes, 3 of 8 ranks, owners="all". DoubleSqueeze's error
    feedback loses far more than EF21's, which aggregates replicated states."""
    kw = dict(steps=120, batch=32, owners="all", passes="both", worker_momentum=0.9)
    clean = run_case(8, "centered_clip", "none", 0, error_feedback="ef21", lr=0.3, **kw)
    ef21 = run_case(8, "centered_clip", "alie", 3, error_feedback="ef21", lr=0.3, **kw)
    both = run_case(8, "median", "alie", 3, error_feedback="both", lr=0.1, **{**kw, "worker_momentum": 0.0})
    assert ef21["identical"] and ef21["accuracy"] > clean["accuracy"] - 0.1
    assert both["accuracy"] < ef21["accuracy"] - 0.2


def test_ef21_needs_owners_so_the_dense_allreduce_refuses_it():
    with pytest.raises(dsq.ConfigError, match="ef21"):
        ReplicatedDoubleSqueeze(config=dsq.ReducerConfig(error_feedback="ef21"))
