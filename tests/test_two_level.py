"""The two-level exchange (hierarchy="node"): exact inside a host, DoubleSqueeze
between hosts, on in-process ranks whose hosts are forced with node_size."""
import logging

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.errors import ConfigError, NonFiniteGradientError, PeerFailedError, StateError
from dsq_plugins.layout import HostLayout, choose_layout, chunk_bounds


N = 1000


def grads(rank, steps=3, n=N):
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


def run_two_level(size=4, node_size=2, steps=3, n=N, **options):
    def fn(comm):
        r = dsq.DoubleSqueeze(comm, hierarchy="node", node_size=node_size, **options)
        outs = [r.reduce("x", g) for g in grads(comm.rank, steps, n)]
        return outs, r.cross_comm.bytes_sent if r.cross_comm else 0, comm.bytes_sent, r
    return dsq.LocalGroup(size).run(fn)


def test_exact_operator_gives_the_exact_mean_on_every_rank():
    res = run_two_level(compressor="none", error_feedback="none", steps=1)
    mean = torch.stack([grads(r, 1)[0] for r in range(4)]).mean(0)
    for outs, *_ in res:
        assert torch.equal(outs[0], res[0][0][0])
        assert torch.allclose(outs[0], mean, atol=1e-6)


def test_each_shard_is_flat_doublesqueeze_among_the_hosts_means_bit_for_bit():
    """Stage 2 is Algorithm 1 among hosts: shard i of the average equals a flat
    2-rank DoubleSqueeze of the hosts' exact means of shard i, step by step."""
    steps = 3
    res = run_two_level(steps=steps)
    hosts = [[0, 1], [2, 3]]
    bounds = chunk_bounds(N, 2)
    for i, (a, b) in enumerate(bounds):
        def flat(comm, i=i, a=a, b=b):
            r = dsq.DoubleSqueeze(comm, hierarchy="flat")
            members = hosts[comm.rank]
            out = []
            for t in range(steps):
                host_mean = torch.stack([grads(m, steps)[t][a:b] for m in members]).sum(0).div_(2)
                out.append(r.reduce("x", host_mean))
            return out
        expected = dsq.LocalGroup(2).run(flat)[0]
        for t in range(steps):
            assert torch.equal(res[0][0][t][a:b], expected[t]), f"shard {i}, step {t}"


def test_a_host_link_carries_about_half_of_what_the_flat_exchange_sends_across_it():
    n = 200_000
    two = run_two_level(steps=1, n=n)
    cross_two = sum(x[1] for x in two[:2])  # host 0's ranks, to the other host

    def flat(comm):
        r = dsq.DoubleSqueeze(comm, hierarchy="flat")
        r.reduce("x", grads(comm.rank, 1, n)[0])
        return comm.bytes_sent
    sent = dsq.LocalGroup(4).run(flat)
    cross_flat = sum(sent[:2]) * 2 / 3  # each rank sends equal chunks to 3 peers, 2 of them on the other host
    assert 0.45 < cross_two / cross_flat < 0.55


def test_non_finite_gradient_is_the_same_error_on_every_rank_naming_the_host():
    def fn(comm):
        r = dsq.DoubleSqueeze(comm, hierarchy="node", node_size=2, error_dtype="fp32")
        r.reduce("x", torch.randn(N))
        before = {k: v.clone() for k, v in r.state_dict()["worker_error"].items()}
        g = torch.ones(N)
        if comm.rank == 3:
            g[7] = float("nan")
        try:
            r.reduce("x", g)
        except NonFiniteGradientError as exc:
            after = r.state_dict()["worker_error"]
            return str(exc), all(torch.equal(before[k], after[k]) for k in before), r.steps["x"]
    res = dsq.LocalGroup(4).run(fn)
    assert all(msg is not None and "host(s) [1]" in msg and "ranks [2, 3]" in msg for msg, *_ in res)
    assert all(unchanged and steps == 1 for _, unchanged, steps in res)


def test_skip_skips_on_every_rank():
    def fn(comm):
        r = dsq.DoubleSqueeze(comm, hierarchy="node", node_size=2, on_nonfinite="skip")
        g = torch.ones(N)
        if comm.rank == 0:
            g[0] = float("inf")
        out = r.reduce("x", g)
        return r.last_step_skipped, bool((out == 0).all())
    assert dsq.LocalGroup(4).run(fn) == [(True, True)] * 4


def test_a_rank_that_fails_fails_the_step_on_every_rank():
    def fn(comm):
        r = dsq.DoubleSqueeze(comm, hierarchy="node", node_size=2)
        g = torch.ones(N, dtype=torch.int64) if comm.rank == 1 else torch.ones(N)
        r.reduce("x", g)
    errors = dsq.LocalGroup(4).run(fn, return_exceptions=True)
    assert isinstance(errors[1], (TypeError, ValueError, ConfigError)) and "rank" not in type(errors[1]).__name__
    assert all(isinstance(e, PeerFailedError) for r, e in enumerate(errors) if r != 1)


def _deferred_or_not(verdict, body, **options):
    """``body(comm, r, step)`` on 4 ranks in 2 hosts, each exchange inside a step whose plan covers it."""
    from dsq_plugins.step import Plan

    def fn(comm):
        r = dsq.DoubleSqueeze(comm, hierarchy="node", node_size=2, error_dtype="fp32", verdict=verdict, **options)
        return body(comm, r, lambda: r.step(Plan([("x", N)])))
    return dsq.LocalGroup(4).run(fn)


def test_a_deferred_step_in_two_levels_reads_the_host_once_and_matches_the_collective_protocol():
    """verdict="step" (what "auto" picks on a GPU): each stage passes what it found to the next stage's header
    as a device status, and the step reads the host once, at its end. Averages bit for bit; a NaN names its
    host on every rank; a payload one byte short in one cross group, and a rank that fails, fail the step on
    every rank with the collective protocol's errors; nothing is written; an Inf under "skip" skips it everywhere."""
    def averages(comm, r, step):
        outs, reads = [], []
        for g in grads(comm.rank):
            with step():
                outs.append(r.reduce("x", g))
            reads.append(r.last_step.verdict and r.last_step.verdict.host_reads)
        return outs, reads

    def failures(comm, r, step):
        with step():
            r.reduce("x", grads(comm.rank, 1)[0])
        before = {k: v.clone() for k, v in r.state_dict()["worker_error"].items()}
        seen = []
        for fault in ("nan", "short", "fails"):
            g, original = torch.ones(N), r.cross_comm.alltoall
            if comm.rank == 1 and fault == "fails":
                g = torch.ones(N, dtype=torch.int64)  # refused by rank 1 alone, before it sends anything
            if comm.rank == 3 and fault == "nan":
                g[7] = float("nan")
            if comm.rank == 3 and fault == "short":
                r.cross_comm.alltoall = lambda payloads, **kw: original([payloads[0][:-1], *payloads[1:]], **kw)
            try:
                with step():
                    r.reduce("x", g)
                seen.append(None)
            except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
                seen.append((type(exc).__name__, str(exc)))
            r.cross_comm.alltoall = original
        after = r.state_dict()["worker_error"]
        return seen, all(torch.equal(before[k], after[k]) for k in before)

    collective, step = _deferred_or_not("collective", averages), _deferred_or_not("step", averages)
    for (want, _), (got, reads) in zip(collective, step):
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and reads == [1, 1, 1]
    collective, step = _deferred_or_not("collective", failures), _deferred_or_not("step", failures)
    assert [seen[:2] for seen, _ in step] == [seen[:2] for seen, _ in collective]
    assert all(unchanged for _, unchanged in step)
    # a rank that fails raises its own error, every other rank a PeerFailedError (the collective protocol's
    # types; its words differ on the failing rank's host, which learns it at the end here)
    assert [seen[2][0] for seen, _ in step] == ["PeerFailedError", "TypeError", "PeerFailedError", "PeerFailedError"]

    def skipped(comm, r, step):
        g = torch.ones(N)
        if comm.rank == 0:
            g[0] = float("inf")
        with step():
            r.reduce("x", g)
        return r.last_step_skipped, r.skipped_steps, r.last_step.verdict.host_reads
    assert _deferred_or_not("step", skipped, on_nonfinite="skip") == [(True, 1, 1)] * 4
    assert all(seen[0][0] == "NonFiniteGradientError" and "host(s) [1]" in seen[0][1] for seen, _ in step)
    assert {seen[1][0] for seen, _ in step} == {"PayloadError", "PeerFailedError"}


@pytest.mark.launcher
def test_the_ddp_hook_in_two_levels_over_torchrun_defers_to_the_same_model(tmp_path):
    """4 gloo processes as 2 hosts: the hook's deferred steps (headers behind the payloads, each stage's
    findings passed on) give the per-collective protocol's model bit for bit, inline and on the hook's
    thread, reading the host once per step."""
    from tests.helpers.launchers import launch
    ranks = launch("torchrun", 4, "hook_levels_worker.py", out_dir=str(tmp_path), timeout=300)
    base = ranks[0][("collective", False)][0]
    for got in ranks:
        for (verdict, _), (params, reads, two_level) in got.items():
            assert two_level and torch.equal(params, base)
            assert reads == (1 if verdict == "step" else None)


def test_node_size_that_does_not_divide_the_world_is_a_config_error_on_every_rank():
    errors = dsq.LocalGroup(4).run(lambda comm: dsq.DoubleSqueeze(comm, hierarchy="node", node_size=3),
                                   return_exceptions=True)
    assert all(isinstance(e, ConfigError) and "node_size=3" in str(e) for e in errors)


def test_ranks_that_disagree_on_the_layout_get_one_config_error_each():
    errors = dsq.LocalGroup(4).run(
        lambda comm: dsq.DoubleSqueeze(comm, hierarchy="node", node_size=2 if comm.rank else 4),
        return_exceptions=True)
    assert all(isinstance(e, ConfigError) and "disagree" in str(e) for e in errors)


def test_node_on_one_host_averages_exactly_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="dsq_plugins"):
        res = run_two_level(size=4, node_size=4, steps=1)
    mean = torch.stack([grads(r, 1)[0] for r in range(4)]).mean(0)
    assert all(torch.allclose(outs[0], mean, atol=1e-6) for outs, *_ in res)
    assert any("one host" in rec.message for rec in caplog.records)


def test_unequal_hosts_stay_flat_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="dsq_plugins"):
        layout = choose_layout([(0, 1, 2), (3, 4)], "auto", 5)
    assert layout == HostLayout(((0, 1, 2, 3, 4),), False)
    assert sum("different numbers of ranks" in rec.message for rec in caplog.records) == 1


def test_auto_without_a_launcher_stays_flat():
    res = dsq.LocalGroup(4).run(lambda comm: dsq.DoubleSqueeze(comm).hosts.two_level)
    assert res == [False] * 4


def test_checkpoint_resumes_bit_for_bit_and_refuses_another_layout():
    def fn(comm):
        gs = grads(comm.rank, 4)
        a = dsq.DoubleSqueeze(comm, hierarchy="node", node_size=2)
        straight = [a.reduce("x", g) for g in gs]
        b = dsq.DoubleSqueeze(comm, hierarchy="node", node_size=2)
        [b.reduce("x", g) for g in gs[:2]]
        saved = b.state_dict()
        c = dsq.DoubleSqueeze(comm, hierarchy="node", node_size=2)
        c.load_state_dict(saved)
        resumed = [c.reduce("x", g) for g in gs[2:]]
        flat = dsq.DoubleSqueeze(comm, hierarchy="flat")
        with pytest.raises(StateError, match="host layout"):
            flat.load_state_dict(saved)
        return all(torch.equal(x, y) for x, y in zip(straight[2:], resumed)), saved
    res = dsq.LocalGroup(4).run(fn)
    assert all(ok for ok, _ in res)
    with pytest.raises(StateError, match="two-level"):
        dsq.reshard([saved for _, saved in res], 2)


def test_worker_error_is_a_host_shard():
    res = run_two_level(steps=1, error_dtype="fp32")
    r = res[0][3]
    assert sum(t.numel() for t in r.state_dict()["worker_error"].values()) == N // 2


def test_structured_operator_is_refused_by_name():
    errors = dsq.LocalGroup(4).run(
        lambda comm: dsq.DoubleSqueeze(comm, "lowrank", hierarchy="node", node_size=2), return_exceptions=True)
    assert all(isinstance(e, ConfigError) and "hierarchy='flat'" in str(e) for e in errors)


def test_a_faulty_host_is_outvoted_by_a_robust_rule_among_three_hosts():
    """f counts hosts: with 3 hosts of 2 ranks, one host sending flipped signs
    between hosts changes the median of the hosts' means very little."""
    pytest.importorskip("robust")
    import robust  # noqa: F401  (registers the robust rules)
    n = 600

    def fn(comm, faults):
        r = dsq.DoubleSqueeze(comm, "none", error_feedback="none", aggregator="median", hierarchy="node",
                              node_size=2, faults=faults)
        return r.reduce("x", torch.full((n,), 1.0) + 0.01 * comm.rank)
    honest = dsq.LocalGroup(6).run(fn, None)[0]
    attacked = dsq.LocalGroup(6).run(fn, "attack=signflip;ranks=2")[0]
    assert bool((honest > 0.9).all()) and bool((attacked > 0.9).all())
    mean_rule = dsq.LocalGroup(6).run(
        lambda comm: dsq.DoubleSqueeze(comm, "none", error_feedback="none", hierarchy="node", node_size=2,
                                       faults="attack=signflip;ranks=2;scale=10").reduce(
            "x", torch.full((n,), 1.0)))[0]
    assert not bool((mean_rule > 0.9).all())  # without the robust rule the faulty host moves the average


def test_zero_halves_in_two_levels_give_each_rank_its_own_partition():
    """reduce_scatter then all_gather of the exact operator: partition r of
    the mean on rank r, then the whole vector on every rank."""
    n = 4 * 250

    def fn(comm):
        r = dsq.DoubleSqueeze(comm, "none", error_feedback="none", hierarchy="node", node_size=2)
        g = grads(comm.rank, 1, n)[0]
        with r.step():
            part = r.reduce_scatter("z", g)
        with r.step():
            whole = r.all_gather("z.params", part, n, error_feedback=False)
        return part, whole
    res = dsq.LocalGroup(4).run(fn)
    mean = torch.stack([grads(r, 1, n)[0] for r in range(4)]).mean(0)
    for rank, (part, whole) in enumerate(res):
        assert torch.allclose(part, mean[rank * 250:(rank + 1) * 250], atol=1e-6)
        assert torch.allclose(whole, mean, atol=1e-6)


def test_zero_halves_with_sign_agree_on_every_rank_and_nan_fails_everywhere():
    """Also with verdict="step", where the gradient half (ZeRO's gradient pass across hosts) is judged when
    its step settles: the same parts bit for bit, one host read, and the same error."""
    from dsq_plugins.step import Plan
    n = 4 * 250

    def fn(comm, poison, verdict):
        r = dsq.DoubleSqueeze(comm, "sign", hierarchy="node", node_size=2, verdict=verdict)
        g = grads(comm.rank, 1, n)[0]
        if poison and comm.rank == 1:
            g[3] = float("nan")
        with r.step(Plan([("z", n)])):
            part = r.reduce_scatter("z", g)
        reads = r.last_step.verdict and r.last_step.verdict.host_reads
        with r.step():
            whole = r.all_gather("z.params", part, n)
        return part, whole, reads
    collective, step = (dsq.LocalGroup(4).run(fn, False, verdict) for verdict in ("collective", "step"))
    assert all(torch.equal(collective[0][1], whole) for _, whole, _ in collective)
    for (part, whole, _), (part_s, whole_s, reads) in zip(collective, step):
        assert torch.equal(part, part_s) and torch.equal(whole, whole_s) and reads == 1
    for verdict in ("collective", "step"):
        errors = dsq.LocalGroup(4).run(fn, True, verdict, return_exceptions=True)
        assert all(isinstance(e, NonFiniteGradientError) and "host(s) [0]" in str(e) for e in errors), errors


def test_the_stock_dense_allreduce_path_refuses_node_by_name():
    from dsq_plugins.replicated import check_replicable
    with pytest.raises(ConfigError, match="HOROVOD_HIERARCHICAL_ALLREDUCE"):
        check_replicable(dsq.ReducerConfig(hierarchy="node"))


def test_every_exchange_that_runs_flat_only_refuses_node_by_the_one_rule():
    """A dense allreduce and HSDP's replicate exchange cannot run two levels:
    both ask ``config.flat_hierarchy``, which refuses "node" naming why and
    makes "auto" flat."""
    from dsq_plugins.config import ReducerConfig, flat_hierarchy
    from dsq_plugins.fsdp._seams import replicas_exchange_flat  # noqa: PLC2701 - the seam itself is what is tested
    from dsq_plugins.replicated import check_replicable
    assert flat_hierarchy("auto", "why") == flat_hierarchy("flat", "why") == "flat"
    assert ReducerConfig(hierarchy="auto").flat_only("why").hierarchy == "flat"
    for refuse, why in ((lambda: check_replicable(ReducerConfig(hierarchy="node")), "dense allreduce"),
                        (lambda: replicas_exchange_flat("node"), "HSDP's shard dimension")):
        with pytest.raises(dsq.ConfigError, match=f"hierarchy='node' cannot be used here: .*{why}"):
            refuse()
