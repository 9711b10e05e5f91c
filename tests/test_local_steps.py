"""dsq.LocalSteps on in-process ranks: inner steps alone, a DoubleSqueeze sync
of the pseudo-gradients every sync_every steps, the outer Nesterov step."""
import os

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.errors import ConfigError, NonFiniteGradientError

N = 4


def model(seed=0, net=None):
    """``net`` (by default a small MLP) with the same weights for a seed, from a generator of its own (ranks
    are threads: no global RNG)."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)) if net is None else net
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return net


def batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def train(opt, net, rank, steps, poison_at=None):
    for t in steps:
        x, y = batch(rank, t)
        if poison_at == t:
            x = x.clone()
            x[0, 0] = float("nan")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def make(comm, **options):
    net = model()
    options.setdefault("exact_steps", 0)  # (the default warm-up is tested on its own)
    return net, dsq.LocalSteps(net, torch.optim.SGD(net.parameters(), lr=0.1), comm, **options)


def test_exact_local_steps_are_diloco_by_hand():
    """compressor="none" and DiLoCo's outer step: Nesterov on the exact mean pseudo-gradient, as written here."""
    H, lr, mu = 3, 0.7, 0.9

    def fn(comm):
        net, opt = make(comm, sync_every=H, compressor="none", error_feedback="none", error_dtype="fp32",
                        outer_lr=lr, outer_momentum=mu)
        train(opt, net, comm.rank, range(2 * H))
        return [p.detach().clone() for p in net.parameters()]

    def by_hand(comm):
        net = model()
        inner = torch.optim.SGD(net.parameters(), lr=0.1)
        exact = dsq.DoubleSqueeze(comm, "none", error_feedback="none")
        anchor = [p.detach().clone() for p in net.parameters()]
        momentum = [torch.zeros_like(p) for p in anchor]
        for t in range(2 * H):
            x, y = batch(comm.rank, t)
            inner.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            inner.step()
            if (t + 1) % H == 0:
                deltas = exact.reduce_many([(str(i), a - p.detach()) for i, (a, p) in
                                            enumerate(zip(anchor, net.parameters()))])
                with torch.no_grad():
                    for i, (p, d) in enumerate(zip(net.parameters(), deltas)):
                        momentum[i].mul_(mu).add_(d)
                        anchor[i] = anchor[i] - lr * (d + mu * momentum[i])
                        p.copy_(anchor[i])
        return [p.detach().clone() for p in net.parameters()]
    got, expected = dsq.LocalGroup(N).run(fn), dsq.LocalGroup(N).run(by_hand)
    for rank in range(N):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[rank], expected[rank]))
        assert all(torch.equal(a, b) for a, b in zip(got[rank], got[0]))  # one model after a sync


@pytest.mark.parametrize("exact_steps", [0, 4])
def test_a_layer_frozen_after_it_was_built_stays_and_the_rest_syncs_as_without_it(exact_steps):
    """A layer whose ``requires_grad`` is turned off after LocalSteps was built (no gradient, skipped by
    the inner AdamW) is left out of the warm-up's exchange, the sync and the outer step: it stays bit
    for bit (its zero pseudo-gradient, compressed by sign, would have moved it), and the other layer
    takes exactly the steps of a LocalSteps built with the layer already frozen."""
    def fn(comm, frozen_first):
        net = model()
        if frozen_first:
            net[0].requires_grad_(False)
        opt = dsq.LocalSteps(net, torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1), comm,
                             sync_every=2, exact_steps=exact_steps)
        net[0].requires_grad_(False)
        train(opt, net, comm.rank, range(9))
        return [p.detach().clone() for p in net.parameters()]
    start = [p.detach() for p in model().parameters()]
    for later, first in zip(dsq.LocalGroup(N).run(lambda comm: fn(comm, False)),
                            dsq.LocalGroup(N).run(lambda comm: fn(comm, True))):
        assert all(torch.equal(a, b) for a, b in zip(later[:2], start[:2]))
        assert all(torch.equal(a, b) for a, b in zip(later, first)) and not torch.equal(later[2], start[2])


def test_inner_steps_move_no_bytes_and_a_sync_moves_compressed_ones():
    def fn(comm):
        net, opt = make(comm, sync_every=5)
        sent = []
        for t in range(10):
            train(opt, net, comm.rank, [t])
            sent.append(comm.bytes_sent)
        return sent, sum(p.numel() for p in net.parameters())
    sent, numel = dsq.LocalGroup(N).run(fn)[0]
    moves = [b - a for a, b in zip([sent[0]] + sent, sent)]
    assert [m > 0 for m in moves] == [False, False, False, False, True] * 2
    assert moves[4] < 2 * (N - 1) / N * 4 * numel  # sign (and its headers) below an fp32 allreduce of the model


def test_sync_every_below_one_and_different_weights_are_config_errors_on_every_rank():
    errors = dsq.LocalGroup(N).run(lambda comm: make(comm, sync_every=0), return_exceptions=True)
    assert all(isinstance(e, ConfigError) and "sync_every" in str(e) for e in errors)

    def differ(comm):
        net = model(seed=int(comm.rank == 2))
        dsq.LocalSteps(net, torch.optim.SGD(net.parameters(), lr=0.1), comm)
    errors = dsq.LocalGroup(N).run(differ, return_exceptions=True)
    assert all(isinstance(e, ConfigError) and "differ" in str(e) for e in errors)


def test_a_non_finite_pseudo_gradient_fails_the_sync_everywhere_and_keeps_the_last_good_one():
    def fn(comm):
        net, opt = make(comm, sync_every=3, error_dtype="fp32")
        train(opt, net, comm.rank, range(3))
        good = [p.detach().clone() for p in net.parameters()]
        memories = {k: v.clone() for k, v in opt.reducer.state_dict()["worker_error"].items()}
        try:
            train(opt, net, comm.rank, range(3, 6), poison_at=4 if comm.rank == 1 else None)
        except NonFiniteGradientError as exc:
            after = opt.reducer.state_dict()["worker_error"]
            return (str(exc), all(torch.equal(a, b) for a, b in zip(good, net.parameters())),
                    all(torch.equal(memories[k], after[k]) for k in memories), opt.syncs)
    res = dsq.LocalGroup(N).run(fn)
    assert all(msg is not None and "[1]" in msg for msg, *_ in res)
    assert all(same and kept and syncs == 1 for _, same, kept, syncs in res)


def test_state_dict_resumes_bit_for_bit_and_reshards():
    def fn(comm):
        net, opt = make(comm, sync_every=2)
        train(opt, net, comm.rank, range(6))
        straight = [p.detach().clone() for p in net.parameters()]
        net2, opt2 = make(comm, sync_every=2)
        train(opt2, net2, comm.rank, range(4))
        saved = opt2.state_dict()
        net3, opt3 = make(comm, sync_every=2)
        with torch.no_grad():
            for p, q in zip(net3.parameters(), net2.parameters()):
                p.copy_(q)
        opt3.load_state_dict(saved)
        train(opt3, net3, comm.rank, range(4, 6))
        return all(torch.equal(a, b) for a, b in zip(straight, net3.parameters())), saved
    res = dsq.LocalGroup(N).run(fn)
    assert all(ok for ok, _ in res)
    two = dsq.reshard([saved for _, saved in res], 2)
    assert [s["reducer"]["rank"] for s in two] == [0, 1] and all("anchor" in s for s in two)


def test_exact_steps_average_gradients_every_step_first():
    def fn(comm):
        net, opt = make(comm, sync_every=100, exact_steps=3, compressor="none", error_feedback="none")
        train(opt, net, comm.rank, range(3))
        return [p.detach().clone() for p in net.parameters()], comm.bytes_sent
    res = dsq.LocalGroup(N).run(fn)
    assert all(all(torch.equal(a, b) for a, b in zip(res[0][0], r[0])) for r in res)  # DDP-like: one model
    assert res[0][1] > 0


def test_by_default_two_rounds_of_exact_steps_come_first():
    """``LocalSteps(model, opt, sync_every=H)`` as a user writes it warms up
    for 2·H exact steps (the setting every measured figure used): one model
    on every rank through the warm-up, ranks apart right after it."""
    def fn(comm):
        net = model()
        opt = dsq.LocalSteps(net, torch.optim.SGD(net.parameters(), lr=0.1), comm, sync_every=3)
        train(opt, net, comm.rank, range(6))
        warm = [p.detach().clone() for p in net.parameters()]
        train(opt, net, comm.rank, [6])
        return opt.exact_steps, warm, [p.detach().clone() for p in net.parameters()]
    res = dsq.LocalGroup(N).run(fn)
    assert all(r[0] == 6 for r in res)
    assert all(all(torch.equal(a, b) for a, b in zip(res[0][1], r[1])) for r in res)
    assert not all(torch.equal(a, b) for a, b in zip(res[0][2], res[1][2]))


def test_on_two_hosts_each_host_is_one_diloco_worker_exact_inside():
    """hierarchy="node", 2 hosts of 2 ranks: a host's ranks average their gradients every step, so exact syncs
    make it DiLoCo of two workers, each stepping on its host's batches (here, one rank training on both)."""
    H, exact = 3, dict(compressor="none", error_feedback="none", error_dtype="fp32")

    def fn(comm):
        net, opt = make(comm, sync_every=H, hierarchy="node", node_size=2, **exact)
        trace = []
        for t in range(2 * H):
            train(opt, net, comm.rank, [t])
            trace.append([p.detach().clone() for p in net.parameters()])
        return trace

    def by_hand(comm):  # host h's worker: the mean loss over ranks 2h and 2h + 1's batches
        net, opt = make(comm, sync_every=H, **exact)
        trace = []
        for t in range(2 * H):
            xs, ys = zip(*(batch(2 * comm.rank + i, t) for i in range(2)))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
            trace.append([p.detach().clone() for p in net.parameters()])
        return trace
    got, expected = dsq.LocalGroup(N).run(fn), dsq.LocalGroup(2).run(by_hand)
    for rank in range(N):
        for step in range(2 * H):
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[rank][step], expected[rank // 2][step]))
    assert not all(torch.equal(a, b) for a, b in zip(got[0][1], got[2][1]))  # the hosts differ between syncs

    def overlapped(comm):  # the inner steps' host mean runs beside a sync in flight, on a group of its own
        net, opt = make(comm, sync_every=H, hierarchy="node", node_size=2, overlap_steps=2)
        train(opt, net, comm.rank, range(2 * H))
        opt.finish()
        return [p.detach().clone() for p in net.parameters()], opt.syncs
    res = dsq.LocalGroup(N).run(overlapped)
    assert all(syncs == 2 and all(torch.equal(a, b) for a, b in zip(res[0][0], p)) for p, syncs in res)


def test_an_overlapped_sync_counts_the_bytes_a_blocking_one_does_on_every_rank():
    """The inner steps' host mean runs while an overlapped sync's reducer agrees its settings on its thread; that
    agreement is left out of the counters by its own thread alone (it once saved and restored them, dropping the
    host mean's bytes counted meanwhile: ranks' counts then differed run to run, as on an H200)."""
    def counted(overlap):
        def fn(comm):
            net, opt = make(comm, sync_every=2, hierarchy="node", node_size=2, overlap_steps=overlap)
            train(opt, net, comm.rank, range(6))
            opt.finish()
            return comm.bytes_sent
        return dsq.LocalGroup(N).run(fn)
    blocking = counted(0)
    for _ in range(3):
        assert counted(2) == blocking


def test_on_two_hosts_only_syncs_cross_a_host_link_and_a_host_gone_non_finite_fails_the_sync_everywhere():
    def fn(comm):
        net, opt = make(comm, sync_every=3, hierarchy="node", node_size=2, error_dtype="fp32")
        train(opt, net, comm.rank, range(3))
        crossed = [opt.reducer.cross_comm.bytes_sent]
        good = [p.detach().clone() for p in net.parameters()]
        try:
            for t in range(3, 6):
                train(opt, net, comm.rank, [t], poison_at=4 if comm.rank == 1 else None)
                crossed.append(opt.reducer.cross_comm.bytes_sent)
        except NonFiniteGradientError as exc:
            return str(exc), all(torch.equal(a, b) for a, b in zip(good, net.parameters())), opt.syncs, crossed
    res = dsq.LocalGroup(N).run(fn)
    assert all(msg is not None and "host" in msg for msg, *_ in res), res[0][0]
    assert all(same and syncs == 1 for _, same, syncs, _ in res)
    assert all(crossed[0] > 0 and crossed[0] == crossed[1] == crossed[2] for *_, crossed in res)


def test_inside_host_alone_lets_every_rank_step_alone_and_exact_needs_hosts():
    def fn(comm):
        net, opt = make(comm, sync_every=2, hierarchy="node", node_size=2, inside_host="alone")
        train(opt, net, comm.rank, range(1))
        alone = [p.detach().clone() for p in net.parameters()]
        train(opt, net, comm.rank, range(1, 2))
        return alone, [p.detach().clone() for p in net.parameters()], opt.host_exact
    res = dsq.LocalGroup(N).run(fn)
    assert not all(torch.equal(a, b) for a, b in zip(res[0][0], res[1][0]))  # ranks 0 and 1 share a host
    assert all(all(torch.equal(a, b) for a, b in zip(res[0][1], r[1])) for r in res) and res[0][2] is None
    for bad in (dict(inside_host="exact"), dict(inside_host="host", hierarchy="node", node_size=2)):
        errors = dsq.LocalGroup(2).run(lambda comm: make(comm, **bad), return_exceptions=True)
        assert all(isinstance(e, ConfigError) and "inside_host" in str(e) for e in errors), errors


@pytest.mark.launcher
def test_under_torchrun_without_ddp_on_the_default_group():
    from tests.helpers.launchers import launch
    results = launch("torchrun", 2, "local_steps_worker.py")
    assert all(r["syncs"] == 2 for r in results)
    assert all(all(torch.equal(a, b) for a, b in zip(results[0]["params"], r["params"])) for r in results)
    sent = results[0]["sent"]
    assert sent[0] == sent[1] < sent[2] == sent[3] == sent[4] < sent[5]  # bytes move only at the syncs


@pytest.mark.launcher
@pytest.mark.parametrize("overlap", ["0", "1"])
def test_a_rank_that_dies_between_syncs_is_a_named_error_at_the_next_sync(tmp_path, overlap):
    """Rank 1 is SIGKILLed after step 4 (syncs at 3 and 6): rank 0's sync at step 6 raises PeerFailedError
    within the group's timeout, and its weights are the last good sync's; overlapped (overlap_steps=1), where
    that sync lands, at the run's finish(). One host per rank, each with its own torchrun, as on a cluster: a
    single torchrun would tear rank 0 down itself as soon as rank 1 died."""
    from tests.helpers.launchers import run_hosts
    ran = run_hosts("local_steps_worker.py", str(tmp_path), hosts=2, per_host=1, timeout=300,
                    env={"DSQ_KILL_RANK": "1", "DSQ_KILL_AFTER": "4", "DSQ_OVERLAP": overlap})
    assert all(code != 0 for code, _ in ran), "\n".join(out[-2000:] for _, out in ran)
    failed = torch.load(os.path.join(tmp_path, "failed-rank0.pt"))
    assert failed["error"] == "PeerFailedError" and failed["step"] == 6 and failed["syncs"] == 1, failed
    assert failed["seconds"] < 60 and failed["at_anchor"], failed


def test_the_defaults_are_sign_with_an_rms_scale_per_block_of_128_half_decayed_memories_and_nesterov_07_08():
    def fn(comm):
        _, default = make(comm)
        _, mean = make(comm, compressor_params={"scale": "mean"})
        _, kept = make(comm, error_decay=1.0)
        q = default.reducer.compressor
        return (q.scale, q.block, mean.reducer.compressor.scale, mean.reducer.compressor.block, default.outer_lr,
                default.outer_momentum, default.nesterov, default.reducer.config.error_dtype,
                default.reducer.config.error_decay, kept.reducer.config.error_decay)
    assert dsq.LocalGroup(2).run(fn)[0] == ("rms", 128, "mean", None, 0.7, 0.8, True, "int8", 0.5, 1.0)


def test_error_decay_reaches_the_exchange_from_the_second_sync_on():
    """The first sync has empty memories, so it lands in the same place whatever ``error_decay`` is; from the
    second on, half-decayed memories land elsewhere than full ones or none (the reducer's arithmetic itself is
    test_reducer_reference's)."""
    H = 2

    def fn(comm, decay):
        net, opt = make(comm, sync_every=H, error_dtype="fp32", error_decay=decay, outer_lr=1.0, outer_momentum=0.0)
        train(opt, net, comm.rank, range(H))
        first = [p.detach().clone() for p in net.parameters()]
        train(opt, net, comm.rank, range(H, 2 * H))
        return first, [p.detach().clone() for p in net.parameters()]
    half, full, none = (dsq.LocalGroup(N).run(lambda comm: fn(comm, d))[0] for d in (0.5, 1.0, 0.0))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(half[0], full[0], none[0]))
    assert all(not torch.equal(a, b) and not torch.equal(a, c) for a, b, c in zip(half[1], full[1], none[1]))


def test_an_overlapped_sync_lands_k_steps_late_and_keeps_the_steps_taken_meanwhile():
    """overlap_steps=H: each sync's outer step is applied H steps later, on top of what the rank did
    meanwhile (θ = anchor' + θ − θ_sent); finish() right after a sync leaves one model on every rank."""
    H, mu = 3, 0.5

    def fn(comm):
        net, opt = make(comm, sync_every=H, compressor="none", error_feedback="none", error_dtype="fp32",
                        overlap_steps=H, outer_lr=1.0, outer_momentum=mu)
        train(opt, net, comm.rank, range(2 * H))
        syncs = opt.syncs
        opt.finish()
        return [p.detach().clone() for p in net.parameters()], syncs, opt.syncs

    def by_hand(comm):
        net = model()
        inner, exact = torch.optim.SGD(net.parameters(), lr=0.1), dsq.DoubleSqueeze(comm, "none", error_feedback="none")
        anchor = [p.detach().clone() for p in net.parameters()]
        momentum, in_flight = [torch.zeros_like(p) for p in anchor], None  # in flight: (the average, the weights sent)

        def apply(flight):
            deltas, sent = flight
            with torch.no_grad():
                for i, (p, d) in enumerate(zip(net.parameters(), deltas)):
                    momentum[i].mul_(mu).add_(d)
                    anchor[i] = anchor[i] - (d + mu * momentum[i])
                    p.copy_(anchor[i] + (p.detach() - sent[i]))
        for t in range(2 * H):
            train(inner, net, comm.rank, [t])
            if (t + 1) % H == 0:
                if in_flight is not None:
                    apply(in_flight)
                sent = [p.detach().clone() for p in net.parameters()]
                in_flight = (exact.reduce_many([(str(i), a - s) for i, (a, s) in enumerate(zip(anchor, sent))]), sent)
        apply(in_flight)
        return [p.detach().clone() for p in net.parameters()]
    got, expected = dsq.LocalGroup(N).run(fn), dsq.LocalGroup(N).run(by_hand)
    for rank in range(N):
        params, syncs_before_finish, syncs = got[rank]
        assert (syncs_before_finish, syncs) == (1, 2)  # the second sync was still in flight
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, expected[rank]))
        assert all(torch.equal(a, b) for a, b in zip(params, got[0][0]))


def test_an_overlapped_sync_that_fails_raises_everywhere_where_it_lands_and_keeps_the_last_good_one():
    def fn(comm):
        net, opt = make(comm, sync_every=3, error_dtype="fp32", overlap_steps=2)
        train(opt, net, comm.rank, range(5))  # the sync of step 3 lands at step 5
        good = [p.detach().clone() for p in opt.anchor.values()]
        memories = {k: v.clone() for k, v in opt.reducer.state_dict()["worker_error"].items()}
        try:
            train(opt, net, comm.rank, range(5, 8), poison_at=5 if comm.rank == 1 else None)  # sent at 6, lands at 8
        except NonFiniteGradientError as exc:
            after = opt.reducer.state_dict()["worker_error"]
            return (str(exc), opt.steps, all(torch.equal(a, b) for a, b in zip(good, net.parameters())),
                    all(torch.equal(memories[k], after[k]) for k in memories), opt.syncs)
    res = dsq.LocalGroup(N).run(fn)
    assert all(msg is not None and "[1]" in msg for msg, *_ in res)
    assert all(steps == 8 and same and kept and syncs == 1 for _, steps, same, kept, syncs in res)


def test_overlap_steps_outside_zero_to_sync_every_is_a_config_error_on_every_rank():
    for bad in (-1, 4, 1.5, True):
        errors = dsq.LocalGroup(2).run(lambda comm: make(comm, sync_every=3, overlap_steps=bad),
                                       return_exceptions=True)
        assert all(isinstance(e, ConfigError) and "overlap_steps" in str(e) for e in errors), bad


def test_state_dict_applies_the_sync_in_flight_and_resumes_bit_for_bit():
    def fn(comm):
        net, opt = make(comm, sync_every=2, overlap_steps=2)
        train(opt, net, comm.rank, range(4))
        opt.finish()
        train(opt, net, comm.rank, range(4, 7))
        straight = [p.detach().clone() for p in net.parameters()]
        opt.finish()  # its sync of step 6 is in flight on the comm the next optimizers are built on
        net2, opt2 = make(comm, sync_every=2, overlap_steps=2)
        train(opt2, net2, comm.rank, range(4))
        saved = opt2.state_dict()
        net3, opt3 = make(comm, sync_every=2, overlap_steps=2)
        with torch.no_grad():
            for p, q in zip(net3.parameters(), net2.parameters()):
                p.copy_(q)
        opt3.load_state_dict(saved)
        train(opt3, net3, comm.rank, range(4, 7))
        same = all(torch.equal(a, b) for a, b in zip(straight, net3.parameters()))
        opt3.finish()
        return saved["syncs"], same
    assert dsq.LocalGroup(N).run(fn) == [(2, True)] * N


@pytest.mark.launcher
def test_overlapped_under_torchrun_on_a_group_of_its_own_beside_the_training_threads_collectives():
    from tests.helpers.launchers import launch
    results = launch("torchrun", 2, "local_steps_worker.py", env={"DSQ_OVERLAP": "2"})
    assert all(r["syncs"] == 2 and r["own_group"] for r in results)
    assert all(all(torch.equal(a, b) for a, b in zip(results[0]["params"], r["params"])) for r in results)


def test_fragments_sync_in_turn_each_its_own_parameters_at_its_own_step():
    """fragments=2, H=4 on 83 parameters: the first weight (48) syncs at steps 2 and 6, the rest (35) at 4 and 8;
    with the plain average as the outer step a fragment's weights are the ranks' mean when it syncs."""
    def fn(comm, overlap=0):
        net, opt = make(comm, sync_every=4, fragments=2, overlap_steps=overlap, compressor="none",
                        error_feedback="none", outer_lr=1.0, outer_momentum=0.0)
        sent = [comm.bytes_sent]
        for t in range(8):
            train(opt, net, comm.rank, [t])
            sent.append(comm.bytes_sent)
        opt.finish()
        return [p.detach().clone() for p in net.parameters()], sent, opt.fragments, opt.syncs

    def by_hand(comm):
        net = model()
        inner = torch.optim.SGD(net.parameters(), lr=0.1)
        exact = dsq.DoubleSqueeze(comm, "none", error_feedback="none")
        params = list(net.parameters())
        for t in range(8):
            train(inner, net, comm.rank, [t])
            group = [0] if (t + 1) % 4 == 2 else [1, 2, 3] if (t + 1) % 4 == 0 else []
            if group:
                means = exact.reduce_many([(str(i), params[i].detach().clone()) for i in group])
                with torch.no_grad():
                    for i, m in zip(group, means):
                        params[i].copy_(m)
        return [p.detach().clone() for p in params]
    got, expected = dsq.LocalGroup(N).run(fn), dsq.LocalGroup(N).run(by_hand)
    params, sent, fragments, syncs = got[0]
    assert fragments == [(0,), (1, 2, 3)] and syncs == 4
    moves = [b - a for a, b in zip(sent, sent[1:])]
    assert [m > 0 for m in moves] == [False, True, False, True] * 2
    assert moves[1] > moves[3] > 0  # a fragment's sync carries its own parameters only (48 against 35 values)
    for rank in range(N):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[rank][0], expected[rank]))
    overlapped = dsq.LocalGroup(N).run(lambda comm: fn(comm, overlap=2))
    for rank in range(N):  # the last weights' sync (step 8) lands at finish(), with no step since: one model there
        assert all(torch.equal(a, b) for a, b in zip(overlapped[rank][0][1:], overlapped[0][0][1:]))
        assert not torch.equal(overlapped[rank][0][0], expected[rank][0]) and overlapped[rank][3] == 4


def test_fragments_and_overlap_outside_their_range_are_config_errors_on_every_rank():
    for options, what in [(dict(fragments=0), "fragments"), (dict(fragments=5), "fragments"),
                          (dict(fragments=2, overlap_steps=3), "overlap_steps")]:
        errors = dsq.LocalGroup(2).run(lambda comm: make(comm, sync_every=4, **options), return_exceptions=True)
        assert all(isinstance(e, ConfigError) and what in str(e) for e in errors), options
    errors = dsq.LocalGroup(2).run(lambda comm: make(comm, sync_every=8, fragments=5), return_exceptions=True)
    assert all(isinstance(e, ConfigError) and "more than the model's 4 parameters" in str(e) for e in errors)


def test_a_sparse_embeddings_gradient_is_averaged_exactly_in_the_warm_up():
    """nn.Embedding(sparse=True) under LocalSteps: the warm-up averages its sparse gradient exactly, rows as
    they are, beside the dense ones (refused before as a sparse tensor), and it stays sparse for the inner
    optimizer; a NaN in it is the same error on every rank."""
    def tokens(rank, step):
        gen = torch.Generator().manual_seed(100 * rank + step)
        return torch.randint(20, (16, 2), generator=gen), torch.randint(0, 3, (16,), generator=gen)

    def fn(comm, poison):
        net = model(net=torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Flatten(),
                                            torch.nn.Linear(8, 3)))
        opt = dsq.LocalSteps(net, torch.optim.SGD(net.parameters(), lr=0.1), comm, sync_every=2, exact_steps=2)
        grads = []
        for step in range(4):
            x, y = tokens(comm.rank, step)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            if poison and step == 1 and comm.rank == 2:
                loss = loss * float("nan")
            loss.backward()
            local = net[0].weight.grad.to_dense().clone()
            opt.step()
            grads.append((local, net[0].weight.grad))
        return grads, [p.detach().clone() for p in net.parameters()]

    runs = dsq.LocalGroup(N).run(fn, False)
    for step in range(2):  # the warm-up's: every rank holds the mean of every rank's own, sparse
        want = sum(run[0][step][0] for run in runs) / N
        for run in runs:
            assert run[0][step][1].is_sparse and torch.allclose(run[0][step][1].to_dense(), want, atol=1e-7)
    assert all(torch.equal(a, b) for run in runs for a, b in zip(run[1], runs[0][1]))  # a sync at step 4
    errors = dsq.LocalGroup(N).run(fn, True, return_exceptions=True)
    assert all(isinstance(e, NonFiniteGradientError) for e in errors), errors
