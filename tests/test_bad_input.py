"""Bad input: a clear error on every rank, never a hang, and error-feedback
state exactly as it was before the failed step."""
import contextlib

import pytest
import torch

import dsq_plugins as dsq
from tests.helpers.states import decoded

# each collective's verdict read on the host, or the whole step's judged at its end (dsq_plugins.step)
VERDICTS = pytest.mark.parametrize("verdict", ["collective", "step"])


def state_tensors(r):
    sd = r.state_dict()
    return ({("w", k): decoded(v) for k, v in sd["worker_error"].items()}
            | {("s", k): decoded(v) for k, v in sd["server_error"].items()})


def unchanged(before, after):
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def grad(rank, numel=50):
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@VERDICTS
def test_nonfinite_gradient_raises_on_every_rank_and_touches_no_state(bad_value, verdict):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign", verdict=verdict)
        r.reduce("g", grad(comm.rank))
        before = state_tensors(r)
        g = grad(comm.rank + 10)
        if comm.rank == 2:
            g[7] = bad_value
        try:
            r.reduce("g", g)
        except dsq.NonFiniteGradientError as exc:
            return str(exc), exc.ranks, unchanged(before, state_tensors(r)), r.steps["g"]
        return None

    for got in dsq.LocalGroup(4).run(per_rank):
        assert got is not None, "every rank must raise"
        message, ranks, same, steps = got
        assert ranks == [2] and "'g'" in message and "rank(s) [2]" in message
        assert same and steps == 1


@VERDICTS
def test_nonfinite_skip_mode_skips_the_step_everywhere(verdict):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign", on_nonfinite="skip", verdict=verdict)
        r.reduce("g", grad(comm.rank))
        before = state_tensors(r)
        g = grad(comm.rank).clone()
        if comm.rank == 0:
            g[0] = float("nan")
        out = r.reduce("g", g)
        skipped = (r.last_step_skipped, bool((out == 0).all()), unchanged(before, state_tensors(r)))
        r.reduce("g", grad(comm.rank))  # and the next step works
        return skipped + (r.last_step_skipped, r.steps["g"], r.skipped_steps)

    for got in dsq.LocalGroup(3).run(per_rank):
        assert got == (True, True, True, False, 2, 1)


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
@pytest.mark.parametrize("compressor,error_dtype", [("sign", "int8"), ("sign", "fp32"), ("topk", "int8")])
@VERDICTS
def test_finite_gradients_whose_payloads_overflow_their_mean_fail_the_step_not_the_memories(
        compressor, error_dtype, verdict, paths):
    """Gradients of 1e36 are finite, but sign's scale, a sum of 4,096 of them, is not: it is sent as the largest
    float, and the owner's mean of two such payloads overflows (top-k's, of values above half the largest
    float, as well). That fails the
    step as a non-finite gradient does, the same on every rank, every memory as it was (they stayed finite,
    where the server error took the Inf); with on_nonfinite="skip" the step is skipped and the next one works."""
    from dsq_plugins.compressors import kernels
    params = {"ratio": 0.5} if compressor == "topk" else None

    def per_rank(comm, on_nonfinite):
        r = dsq.DoubleSqueeze(comm, compressor, compressor_params=params, error_dtype=error_dtype, verdict=verdict,
                              on_nonfinite=on_nonfinite)
        r.reduce("g", grad(comm.rank, 8192))
        before = state_tensors(r)
        # one sign, so that the mean must overflow: sign's scales (sums) from 1e36 on, top-k's values themselves
        size = 1e36 if compressor == "sign" else 1.5e38
        huge = grad(comm.rank + 10, 8192).abs_().clamp_(max=1.0).add_(1.0).mul_(size)
        try:
            r.reduce("g", huge)
            error = None
        except dsq.NonFiniteGradientError as exc:
            error = exc.ranks
        after = state_tensors(r)
        finite = all(bool(torch.isfinite(t).all()) for t in after.values())
        r.reduce("g", grad(comm.rank + 20, 8192))  # and the next step works
        return error, unchanged(before, after), finite, r.skipped_steps

    with kernels.gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        raised = dsq.LocalGroup(2).run(per_rank, "raise")
        skipped = dsq.LocalGroup(2).run(per_rank, "skip")
    assert raised[0][0] and all(got[0] == raised[0][0] and got[1:] == (True, True, 0) for got in raised), raised
    assert all(got == (None, True, True, 1) for got in skipped), skipped


def truncate_first_payload(comm):
    """Make this rank send a payload one byte short to rank 0 (a faulty peer)."""
    original = comm.alltoall

    def alltoall(payloads, **kw):
        payloads = list(payloads)
        payloads[0] = payloads[0][:-1]
        return original(payloads, **kw)
    comm.alltoall = alltoall


@VERDICTS
def test_wrong_length_payload_names_the_sender_on_every_rank(verdict):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign", verdict=verdict)
        r.reduce("g", grad(comm.rank))
        before = state_tensors(r)
        if comm.rank == 1:
            truncate_first_payload(comm)
        try:
            r.reduce("g", grad(comm.rank))
        except dsq.PayloadError as exc:
            return exc.rank, str(exc), unchanged(before, state_tensors(r))

    for sender, message, same in dsq.LocalGroup(3).run(per_rank):
        assert sender == 1 and "rank 1 sent a" in message and "expected" in message
        assert same


@VERDICTS
def test_undecodable_payload_of_the_right_length_is_an_error_on_every_rank(verdict):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.5}, verdict=verdict)
        before = state_tensors(r)
        if comm.rank == 2:  # random bytes, right length: positions far out of range
            original = comm.alltoall

            def alltoall(payloads, **kw):
                return original([torch.full_like(p, 0x7F) for p in payloads], **kw)
            comm.alltoall = alltoall
        try:
            r.reduce("g", grad(comm.rank, 30))
        except dsq.PayloadError as exc:
            return exc.rank, str(exc), unchanged(before, state_tensors(r)), r.steps.get("g", 0)

    results = dsq.LocalGroup(3).run(per_rank)
    for sender, message, same, steps in results:
        assert sender == 2 and "payload rank 2 sent" in message and same and steps == 0
    assert "positions outside" in results[0][1]  # the owner that decoded it says why


@VERDICTS
def test_ranks_reducing_different_tensors_fail_instead_of_mixing_them(verdict):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign", verdict=verdict)
        name, numel = ("a", 10) if comm.rank else ("b", 10)
        r.reduce(name, torch.ones(numel))
    errors = dsq.LocalGroup(3).run(per_rank, return_exceptions=True)
    assert all(isinstance(e, dsq.CollectiveMismatchError) for e in errors)
    assert "different tensor" in str(errors[0])

    def sizes(comm):
        dsq.DoubleSqueeze(comm, "sign", verdict=verdict).reduce("a", torch.ones(10 + comm.rank))
    assert all(isinstance(e, dsq.CollectiveMismatchError)
               for e in dsq.LocalGroup(2).run(sizes, return_exceptions=True))


def test_a_rank_that_fails_or_leaves_never_hangs_the_others():
    def fails(comm):
        if comm.rank == 1:
            raise KeyError("boom")
        dsq.DoubleSqueeze(comm, "sign").reduce("g", torch.ones(8))
    errors = dsq.LocalGroup(3, timeout=30).run(fails, return_exceptions=True)
    assert isinstance(errors[1], KeyError)
    assert isinstance(errors[0], dsq.PeerFailedError) and isinstance(errors[2], dsq.PeerFailedError)
    with pytest.raises(KeyError):
        dsq.LocalGroup(3, timeout=30).run(fails)

    def leaves(comm):
        if comm.rank == 0:
            return "done"
        dsq.DoubleSqueeze(comm, "sign").reduce("g", torch.ones(8))
    errors = dsq.LocalGroup(2, timeout=30).run(leaves, return_exceptions=True)
    assert errors[0] == "done" and "already returned" in str(errors[1])


def test_bad_configuration_is_refused_with_the_valid_choices():
    comm = dsq.LocalGroup(1).run(lambda c: c)[0]
    with pytest.raises(dsq.ConfigError, match="error_feedback must be one of .*both"):
        dsq.DoubleSqueeze(comm, "sign", error_feedback="server")
    with pytest.raises(dsq.ConfigError, match="unknown aggregator 'medain'.*mean"):
        dsq.DoubleSqueeze(comm, "sign", aggregator="medain")
    with pytest.raises(dsq.ConfigError, match="on_nonfinite"):
        dsq.DoubleSqueeze(comm, "sign", on_nonfinite="ignore")
    with pytest.raises(dsq.ConfigError, match="no parameter 'ratio'"):
        dsq.DoubleSqueeze(comm, "sign", compressor_params={"ratio": 0.1})
    for decay in (1.5, -0.1, True):
        with pytest.raises(dsq.ConfigError, match=r"error_decay must be a number in \[0, 1\]"):
            dsq.DoubleSqueeze(comm, "sign", error_decay=decay)
    with pytest.raises(dsq.ConfigError, match="error_decay must be 1 with error_feedback='ef21'"):
        dsq.DoubleSqueeze(comm, "sign", error_feedback="ef21", error_decay=0.5)
    r = dsq.DoubleSqueeze(comm, "sign")
    with pytest.raises(TypeError, match="int64"):
        r.reduce("g", torch.ones(3, dtype=torch.int64))


def test_state_from_another_rank_or_layout_is_refused():
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign")
        r.reduce("g", torch.ones(9))
        return r.state_dict()
    states = dsq.LocalGroup(2).run(per_rank)

    def load_wrong(comm):
        r = dsq.DoubleSqueeze(comm, "sign")
        r.load_state_dict(states[1 - comm.rank])
    errors = dsq.LocalGroup(2).run(load_wrong, return_exceptions=True)
    assert all(isinstance(e, ValueError) and "saved by rank" in str(e) for e in errors)

    def resized(comm):
        r = dsq.DoubleSqueeze(comm, "sign")
        r.load_state_dict(states[comm.rank])
        r.reduce("g", torch.ones(10))
    errors = dsq.LocalGroup(2).run(resized, return_exceptions=True)
    assert any(isinstance(e, ValueError) and "layout changed" in str(e) for e in errors)
