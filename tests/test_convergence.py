"""Error feedback matters: on sklearn digits with 4 workers, sign with
error feedback on both passes trains; without it, it barely does."""
import dsq_plugins as dsq
from examples.train_digits import train


def run(**kw):
    return dsq.LocalGroup(4).run(lambda comm: train(comm, steps=250, lr=0.05, **kw))


def test_double_squeeze_sign_beats_sign_without_error_feedback_and_matches_fp32():
    ef = run(compressor="sign", error_feedback="both")
    plain = run(compressor="sign", error_feedback="none")
    exact = run(compressor="none", error_feedback="none")
    assert all(r.test_accuracy == ef[0].test_accuracy for r in ef)  # all ranks hold the same model
    tail = lambda r: sum(r.losses[-25:]) / 25  # noqa: E731
    assert tail(ef[0]) < 0.6 * tail(plain[0])
    assert ef[0].test_accuracy > plain[0].test_accuracy + 0.1
    assert ef[0].test_accuracy > exact[0].test_accuracy - 0.05
    assert ef[0].bytes_per_step < exact[0].bytes_per_step / 15


def test_staleness_one_applies_each_average_one_step_late():
    """With staleness 1 the first step applies nothing and the last average
    is applied after the loop: one step of training ends where staleness 0
    does, two steps do not (the second gradient was taken at the old point)."""
    def losses_and_acc(steps, staleness):
        r = dsq.LocalGroup(2).run(lambda comm: train(comm, compressor="none", error_feedback="none", steps=steps,
                                                      lr=0.5, staleness=staleness))[0]
        return r.losses, r.test_loss
    one_sync, one_stale = losses_and_acc(1, 0), losses_and_acc(1, 1)
    assert one_sync == one_stale
    two_sync, two_stale = losses_and_acc(2, 0), losses_and_acc(2, 1)
    assert two_sync[0][0] == two_stale[0][0]
    assert two_sync[0][1] != two_stale[0][1]  # the stale run took its second gradient before any update
    assert two_sync[1] != two_stale[1]


def test_warmup_ramps_the_learning_rate():
    """Warm-up over 4 steps makes the first step a quarter as long: the first
    losses agree, the second is higher than without warm-up (deterministic
    seeds, so this is not a matter of luck from run to run)."""
    def run2(**kw):
        return dsq.LocalGroup(1).run(lambda c: train(c, compressor="none", error_feedback="none", steps=2,
                                                     lr=0.4, **kw))[0]
    full, ramp = run2(), run2(warmup_steps=4)
    assert full.losses[0] == ramp.losses[0]
    assert ramp.losses[1] > full.losses[1] + 0.01
