"""Error feedback matters: on sklearn digits with 4 workers, sign with
error feedback on both passes trains; without it, it barely does."""
from examples.train_digits import train

import dsq_plugins as dsq


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
