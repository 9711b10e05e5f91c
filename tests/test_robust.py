"""The robust layer: Election Coding codes (exhaustively), robust rules and
majority vote against attacks, fault injection specs, and malformed payloads
on real multi-process runs."""
import pytest
import torch

import dsq_plugins as dsq
from bench.faultrun import run_case
from dsq_plugins.algorithm.aggregation import get_aggregator
from robust.election import (
    bernoulli_code,
    breaks_with,
    deterministic_code,
    is_perfectly_tolerant,
    minimum_redundancy,
    redundancy,
    simple_code,
)
from robust.faults import FaultSpec
from tests.helpers.launchers import launch
from tests.helpers.states import decoded


@pytest.mark.parametrize("n", [1, 3, 5, 7, 9, 11])
def test_deterministic_codes_are_perfectly_tolerant_and_the_check_has_teeth(n):
    for b in range(0, (n + 1) // 2):
        g = deterministic_code(n, b)
        assert g.shape == (n, n) and set(g.unique().tolist()) <= {0, 1}
        assert is_perfectly_tolerant(g, b), f"n={n} b={b}"
        assert not breaks_with(g, b), f"n={n} b={b}"
        assert breaks_with(g, b + 1), f"n={n} b={b}: b+1 faulty workers must be able to break it"
        if b:
            assert is_perfectly_tolerant(simple_code(n, b), b)
            assert redundancy(g) <= redundancy(simple_code(n, b))


@pytest.mark.parametrize("n", [3, 5])
def test_deterministic_code_reaches_the_exhaustive_minimum_redundancy(n):
    for b in range(1, (n + 1) // 2):
        ones, g, finished = minimum_redundancy(n, b, time_limit=60)
        assert finished and is_perfectly_tolerant(g, b)
        assert int(deterministic_code(n, b).sum()) == ones == (2 * b + 1) * n


def test_tolerance_check_rejects_a_code_that_is_not():
    assert not is_perfectly_tolerant(torch.eye(5, dtype=torch.int64), 1)  # one vote per partition: b = 0 only
    g = bernoulli_code(7, 0.5, seed=3)
    assert torch.equal(g, bernoulli_code(7, 0.5, seed=3)) and g.shape == (7, 7)
    with pytest.raises(dsq.ConfigError, match="odd number of workers"):
        deterministic_code(4, 1)


def contributions(honest=5, faulty=3, scale=-10.0, m=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(m, generator=gen)
    rows = [g + 0.3 * torch.randn(m, generator=gen) for _ in range(honest)]
    return g, torch.stack(rows + [scale * rows[i] for i in range(faulty)])


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("name,params", [("median", {}), ("trimmed_mean", {"f": 3}), ("krum", {"f": 3}),
                                         ("centered_clip", {}), ("majority", {})])
def test_robust_rules_resist_three_flipped_and_inflated_contributions_of_eight(name, params):
    g, c = contributions()
    rule = get_aggregator(name, **params)
    out = rule(c, seed=0) if getattr(rule, "takes_seed", False) else rule(c)
    assert cosine(out, g) > 0.8, name
    assert cosine(get_aggregator("mean")(c), g) < 0  # the plain mean follows the attackers


def test_trimmed_mean_tolerates_f_flippers_when_trim_is_at_least_f():
    g, c = contributions(honest=5, faulty=2)
    assert cosine(get_aggregator("trimmed_mean", f=2)(c), g) > 0.9
    assert cosine(get_aggregator("trimmed_mean", f=1)(c), g) < 0.5  # trim < f: an attacker survives


def test_majority_gives_each_contributor_one_vote_and_breaks_ties_reproducibly():
    rule = get_aggregator("majority")
    c = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1000.0, -1.0]])  # a huge scale is still one vote
    assert torch.sign(rule(c, seed=0)).tolist() == [1.0, -1.0]
    tie = torch.tensor([[1.0] * 64, [-1.0] * 64])
    a, b = rule(tie, seed=5), rule(tie, seed=5)
    assert torch.equal(a, b) and 0 < int((a > 0).sum()) < 64  # seeded coin flips, not always one side


def test_signum_majority_survives_three_sign_flippers_of_eight_and_the_mean_does_not():
    """n = 8, 3 faulty workers send flipped signs claiming a 10x scale (sign
    payloads carry a scale; the vote ignores it, the mean believes it)."""
    kw = dict(steps=150, error_feedback="none", worker_momentum=0.9, lr=2.0, batch=32)
    clean = run_case(8, "majority", "none", 0, **kw)
    voted = run_case(8, "majority", "signflip:scale=10", 3, **kw)
    averaged = run_case(8, "mean", "signflip:scale=10", 3, **kw)
    assert clean["accuracy"] > 0.85
    assert voted["accuracy"] > clean["accuracy"] - 0.04
    assert "error" in averaged or averaged["accuracy"] < 0.5, averaged


def test_robust_reducer_leaves_out_garbage_and_counts_it():
    spec = {"attack": "garbage", "ranks": [2], "seed": 1}

    def per_rank(comm):
        reducer = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.5}, aggregator="median",
                                    faults=spec)
        out = reducer.reduce("g", torch.full((40,), float(comm.rank + 1)))
        return out, dict(reducer.rejected)
    results = dsq.LocalGroup(4).run(per_rank)
    assert all(torch.equal(r[0], results[0][0]) for r in results)
    assert sum(r[1].get(2, 0) for r in results) >= 1  # some owner could not decode rank 2 and left it out


def test_fault_specs_parse_and_refuse_nonsense():
    spec = FaultSpec.parse("attack=alie;count=2;seed=3;z=-1")
    assert spec.params == {"z": -1.0} and spec.faulty_ranks(8) == FaultSpec.parse(
        {"attack": "alie", "count": 2, "seed": 3}).faulty_ranks(8)
    assert FaultSpec.parse("attack=signflip;ranks=1,3").faulty_ranks(4) == [1, 3]
    with pytest.raises(dsq.ConfigError, match="attack must be one of"):
        FaultSpec.parse("attack=flip;ranks=1")
    with pytest.raises(dsq.ConfigError, match="exactly one of ranks"):
        FaultSpec.parse("attack=zero")
    with pytest.raises(dsq.ConfigError, match="unknown field"):
        FaultSpec.parse("attack=zero;ranks=1;z=3")
    with pytest.raises(dsq.ConfigError, match="do not exist"):
        FaultSpec.parse("attack=zero;ranks=9").faulty_ranks(4)


@pytest.mark.parametrize("attack", ["alie", "ipm", "nan", "short", "crash", "randomsign", "gaussian", "zero"])
def test_every_attack_runs_and_robust_aggregation_keeps_every_rank_alive(attack):
    cell = run_case(4, "median", attack, 1, steps=5)
    assert "error" not in cell, cell


def test_election_coded_training_in_process():
    from tests.workers.robust_worker import election_training
    accuracies = dsq.LocalGroup(5).run(election_training)
    assert len(set(accuracies)) == 1 and accuracies[0] > 0.5


def torchrun(n, aggregator, faults, tmp_path, owners="1"):
    return launch("torchrun", n, "robust_worker.py", aggregator, owners, out_dir=str(tmp_path), timeout=300,
                  env={"DSQ_FAULTS": faults})


def test_malformed_payloads_on_real_processes_stop_plain_and_spare_robust(tmp_path):
    plain = torchrun(3, "mean", "attack=short;ranks=1", tmp_path)
    for result in plain:  # every rank stops with the same clear error, naming the sender
        assert result["error"] == "PayloadError" and result["rank"] == 1 and "rank 1 sent a" in result["message"]
    robust_run = torchrun(3, "majority", "attack=garbage;ranks=1", tmp_path)
    assert all("error" not in r and r["steps"] == 4 for r in robust_run)
    assert all(torch.equal(a, b) for a, b in zip(robust_run[0]["params"], robust_run[2]["params"]))
    assert sum(r["rejected"].get(1, 0) for r in robust_run) >= 1
    assert robust_run[0]["election_accuracy"] > 0.4  # election-coded signSGD on the real launcher


def test_a_left_out_non_finite_rank_keeps_its_worker_state_and_stays_in_step():
    """Robust mode: a rank whose own gradient is NaN is left out, keeps its
    worker error, and its step counter (hence the shared seeds) stays in step."""
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "randomk", compressor_params={"ratio": 0.5}, aggregator="median")
        r.reduce("g", torch.randn(30, generator=torch.Generator().manual_seed(comm.rank)))
        before = decoded(r.worker_error.state_dict()["g"])
        g = torch.ones(30)
        if comm.rank == 1:
            g[0] = float("nan")
        out = r.reduce("g", g)
        return out, r.steps["g"], torch.equal(before, decoded(r.worker_error.state_dict()["g"])), dict(r.rejected)
    results = dsq.LocalGroup(3).run(per_rank)
    assert all(torch.equal(res[0], results[0][0]) for res in results)
    assert [res[1] for res in results] == [2, 2, 2]
    assert results[1][2] and not results[0][2]  # rank 1 kept its memory; the others moved on
    assert sum(res[3].get(1, 0) for res in results) >= 1


def test_replicated_owners_on_real_processes_keep_honest_ranks_identical_and_unharmed(tmp_path):
    """4 processes, owners=3: rank 2 serves copies one byte short for the
    chunks it owns. They are left out and its two co-owners decide: every
    rank ends with the parameters of a run without the fault, bit for bit.
    With owners="all" and rank 2 also flipping what it sends as a worker,
    all ranks still end identical."""
    clean = torchrun(4, "median", "", tmp_path / "clean", owners="3")
    served = torchrun(4, "median", "attack=short;ranks=2;pass=server", tmp_path / "served", owners="3")
    for a, b in zip(clean, served):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert sum(r["rejected"].get(2, 0) for r in served) > 0
    everyone = torchrun(4, "median", "attack=signflip;ranks=2;pass=both", tmp_path / "all", owners="all")
    assert all(all(torch.equal(x, y) for x, y in zip(r["params"], everyone[0]["params"])) for r in everyone)
