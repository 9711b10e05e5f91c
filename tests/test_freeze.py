"""freeze_step="auto": the variance freezes when it has settled, at the
same step on every rank, at max_freeze_step at the latest (with a warning),
and a run resumed from a checkpoint decides as the uninterrupted one did."""
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

import dsq_plugins as dsq
from examples.train_digits import make_model
from tests.workers.hvd_worker import batches


def train(comm, steps, state=None, **kw):
    model = make_model(seed=1, hidden=32)
    opt = dsq.CompressedAdam(model.named_parameters(), comm=comm, lr=3e-3, **kw)
    if state is not None:
        model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
    start = opt.global_step
    for step in range(start, start + steps):
        for x, y in batches(comm.rank, step, 1):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model, opt


def test_auto_freezes_once_the_variance_settles_and_every_rank_agrees(caplog):
    def per_rank(comm):
        with caplog.at_level(logging.WARNING, logger="dsq_plugins"):
            model, opt = train(comm, 60, freeze_step="auto", freeze_window=5, freeze_threshold=0.1)
        return opt.freeze_step, opt.frozen, opt.freeze.last_change, [p.detach().clone() for p in model.parameters()]
    results = dsq.LocalGroup(2).run(per_rank)
    frozen_at, frozen, change, params = results[0]
    assert frozen and 5 <= frozen_at < 60 and frozen_at % 5 == 0 and change < 0.1
    assert results[1][:2] == (frozen_at, True)
    assert all(torch.equal(a, b) for a, b in zip(params, results[1][3]))
    settled = [r.message for r in caplog.records if "settled" in r.message]
    assert len(settled) == 2 and all(f"frozen at step {frozen_at}" in m for m in settled)  # one line per rank


def test_a_variance_that_never_settles_freezes_at_max_freeze_step_with_a_warning():
    def per_rank(comm):
        _, opt = train(comm, 15, freeze_step="auto", freeze_window=3, freeze_threshold=1e-12, max_freeze_step=12)
        return opt.freeze_step
    with warnings.catch_warnings(record=True) as caught:  # the ranks' threads warn into the main thread's record
        warnings.simplefilter("always")
        assert dsq.LocalGroup(2).run(per_rank) == [12, 12]
    assert sum("had not settled by max_freeze_step=12" in str(w.message) for w in caught) == 2


def test_a_resumed_run_decides_the_freeze_as_the_uninterrupted_one(tmp_path):
    options = dict(freeze_step="auto", freeze_window=4, freeze_threshold=0.1)

    def uninterrupted(comm):
        model, opt = train(comm, 50, **options)
        return opt.freeze_step, [p.detach().clone() for p in model.parameters()]

    def resumed(comm):
        model, opt = train(comm, 6, **options)
        torch.save((model.state_dict(), opt.state_dict()), tmp_path / f"r{comm.rank}.pt")
        model, opt = train(comm, 44, state=torch.load(tmp_path / f"r{comm.rank}.pt"), **options)
        return opt.freeze_step, [p.detach().clone() for p in model.parameters()]
    a, b = dsq.LocalGroup(2).run(uninterrupted), dsq.LocalGroup(2).run(resumed)
    assert a[0][0] is not None and a[0][0] > 6 and a[0][0] == b[0][0]
    assert all(torch.equal(x, y) for x, y in zip(a[0][1], b[0][1]))


@pytest.mark.parametrize("options, message", [
    (dict(freeze_step="sometimes"), "freeze_step must be a positive integer .* or 'auto'"),
    (dict(freeze_step="auto", max_freeze_step=0), "max_freeze_step must be a positive integer"),
    (dict(freeze_step="auto", freeze_threshold=-1), "freeze_threshold must be a positive number"),
])
def test_bad_freeze_options_are_config_errors_naming_the_option(options, message):
    with pytest.raises(dsq.ConfigError, match=message):
        dsq.CompressedAdam.momentum_config(**options)


def test_auto_waits_while_coordinates_still_get_their_first_gradients():
    """Half the tensor has a settled variance; in each window another 5% of
    it gets a first, tiny gradient (rare features), which hardly moves the
    summed denominators: the variance is still young, so no freeze; once
    the share of coordinates with a gradient stops moving, it freezes."""
    policy = dsq.optim.FreezePolicy("auto", window=2, threshold=0.05, max_step=1000)
    v = torch.zeros(1000)
    v[:500] = 1.0
    frozen_at = None
    for t in range(1, 40):
        if t <= 20 and t % 2 == 0:
            v[500 + 50 * (t // 2 - 1): 500 + 50 * (t // 2)] = 1e-8
        settled = v * (1 - 0.999 ** t)  # Adam's v, whose bias-corrected value does not move
        if policy.observe(t, lambda: dsq.optim.denominator_sums([(settled, 0.999)], t)):
            frozen_at = policy.frozen_at
            break
    assert frozen_at is not None and frozen_at > 20, frozen_at
