"""The step is the unit of state: a step over several buckets writes the
error memories, momentum and step counters of all of them or of none, on
every rank, whichever bucket fails and however."""

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.comm import header
from dsq_plugins.replicated import ReplicatedDoubleSqueeze
from tests.helpers.states import decoded

SHAPES = [("a", (6, 5)), ("b", (40,)), ("c", (3, 9)), ("d", (25,)), ("e", (8, 4)), ("f", (11,))]
ONE_TENSOR_PER_BUCKET = 40 * 4 / 2**20  # 40 floats: every tensor above gets a bucket of its own
# each collective's verdict read on the host, or the whole step's judged at its end (dsq_plugins.step)
VERDICTS = pytest.mark.parametrize("verdict", ["collective", "step"])


def tensors(rank, step, nan_in=None):
    gen = torch.Generator().manual_seed(100 * step + rank)
    out = [(name, torch.randn(shape, generator=gen)) for name, shape in SHAPES]
    if nan_in is not None:
        out[nan_in][1].view(-1)[3] = float("nan")
    return out


def snapshot(r):
    """Everything a step may write, copied."""
    sd = r.state_dict()
    memories = {(kind, k): decoded(v) for kind in ("worker_error", "server_error", "momentum")
                for k, v in sd[kind].items()}
    return memories, dict(sd["steps"])


def same(a, b):
    (ma, sa), (mb, sb) = a, b
    return sa == sb and ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def reducer(comm, **kw):
    return dsq.DoubleSqueeze(comm, "sign", bucket_mb=ONE_TENSOR_PER_BUCKET, worker_momentum=0.5, **kw)


@VERDICTS
def test_a_nan_in_the_last_bucket_leaves_every_earlier_bucket_untouched_on_every_rank(verdict):
    def per_rank(comm):
        r = reducer(comm, verdict=verdict)
        r.reduce_many(tensors(comm.rank, 0))
        before = snapshot(r)
        try:
            r.reduce_many(tensors(comm.rank, 1, nan_in=5 if comm.rank == 1 else None))
        except dsq.NonFiniteGradientError as exc:
            return exc.ranks, same(before, snapshot(r)), r.last_step.outcome, len(r.layout(SHAPES))
    for ranks, unchanged, outcome, buckets in dsq.LocalGroup(3).run(per_rank):
        assert buckets == 6 and ranks == [1] and unchanged and outcome == "failed"


@VERDICTS
def test_a_skipped_step_writes_nothing_and_the_next_one_goes_on(verdict):
    def per_rank(comm):
        r = reducer(comm, on_nonfinite="skip", verdict=verdict)
        r.reduce_many(tensors(comm.rank, 0))
        before = snapshot(r)
        out = r.reduce_many(tensors(comm.rank, 1, nan_in=4 if comm.rank == 2 else None))
        skipped = (r.last_step.outcome, r.last_step_skipped, all(bool((t == 0).all()) for t in out),
                   same(before, snapshot(r)), r.skipped_steps)
        r.reduce_many(tensors(comm.rank, 2))
        return skipped, r.last_step.outcome, set(r.steps.values())
    for skipped, outcome, steps in dsq.LocalGroup(3).run(per_rank):
        assert skipped == ("skipped", True, True, True, 1)
        assert outcome == "applied" and steps == {2}


@VERDICTS
def test_without_the_step_scope_the_nan_step_would_have_changed_state(verdict):
    """The check has teeth: the same step without the NaN does change every memory."""
    def per_rank(comm):
        r = reducer(comm, verdict=verdict)
        r.reduce_many(tensors(comm.rank, 0))
        before = snapshot(r)
        r.reduce_many(tensors(comm.rank, 1))
        return same(before, snapshot(r))
    assert not any(dsq.LocalGroup(3).run(per_rank))


def short_payload_in(comm, bucket_name, numel):
    """Make this rank a faulty peer: one byte short to rank 0, in one bucket only."""
    original, tag = comm.alltoall, header.make_tag(bucket_name, numel)

    def alltoall(payloads, **kw):
        payloads = list(payloads)
        if kw.get("tag") == tag:
            payloads[0] = payloads[0][:-1]
        return original(payloads, **kw)
    comm.alltoall = alltoall


@VERDICTS
def test_a_wrong_length_payload_in_the_last_bucket_fails_the_step_everywhere_with_state_untouched(verdict):
    def per_rank(comm):
        r = reducer(comm, verdict=verdict)
        r.reduce_many(tensors(comm.rank, 0))
        before = snapshot(r)
        last = r.layout(SHAPES)[-1]
        if comm.rank == 2:
            short_payload_in(comm, last.name, last.numel)
        try:
            r.reduce_many(tensors(comm.rank, 1))
        except dsq.PayloadError as exc:
            return exc.rank, same(before, snapshot(r))
    assert dsq.LocalGroup(3).run(per_rank) == [(2, True)] * 3


@VERDICTS
def test_after_a_failed_bucket_no_later_bucket_moves_a_byte(verdict):
    def bytes_of_step(nan_in):
        def per_rank(comm):
            r = reducer(comm, verdict=verdict)
            comm.reset_counters()
            try:
                r.reduce_many(tensors(comm.rank, 0, nan_in=nan_in if comm.rank == 0 else None))
            except dsq.NonFiniteGradientError:
                pass
            return comm.bytes_sent
        return dsq.LocalGroup(3).run(per_rank)[1]
    full, failed_at_first = bytes_of_step(None), bytes_of_step(0)
    if verdict == "collective":
        assert 0 < failed_at_first < full / 6  # one bucket's header round, nothing after it
    else:  # a deferred step learns its verdict at the end: every bucket moved (the price of one host read)
        assert failed_at_first == full


@VERDICTS
def test_the_step_scope_groups_calls_and_reports_the_outcome(verdict):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.5}, verdict=verdict)
        with r.step() as s:
            r.reduce("x", torch.ones(10) * (comm.rank + 1))
            r.reduce("y", torch.ones(7))
            inside = dict(r.steps)
        applied = (s.outcome, inside, dict(r.steps))
        before = snapshot(r)
        with pytest.raises(KeyError):
            with r.step() as s2:
                r.reduce("x", torch.ones(10))
                raise KeyError("the user's own code failed mid-step")
        return applied, s2.outcome, same(before, snapshot(r))
    for applied, outcome, unchanged in dsq.LocalGroup(2).run(per_rank):
        assert applied == ("applied", {}, {"x": 1, "y": 1})
        assert outcome == "failed" and unchanged


@VERDICTS
def test_a_rank_that_cannot_build_its_payloads_stops_every_rank_naming_itself(verdict):
    """A stale error memory (another layout) on one rank: that rank raises
    its StateError, the others a PeerFailedError naming it; nobody hangs."""
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign", verdict=verdict)
        if comm.rank == 1:
            r.worker_error.set("g", torch.zeros(5))
        try:
            r.reduce("g", torch.ones(12))
        except dsq.DSQError as exc:
            return type(exc).__name__, getattr(exc, "ranks", None), str(exc)
    results = dsq.LocalGroup(3, timeout=30).run(per_rank)
    assert results[1][0] == "StateError" and "layout changed" in results[1][2]
    for kind, ranks, message in (results[0], results[2]):
        assert kind == "PeerFailedError" and ranks == [1] and "rank(s) [1]" in message


@VERDICTS
def test_a_bad_dtype_on_one_rank_is_announced_instead_of_hanging_the_others(verdict):
    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "sign", verdict=verdict)
        t = torch.ones(8, dtype=torch.int64 if comm.rank == 0 else torch.float32)
        try:
            r.reduce_many([("w", t), ("b", torch.ones(3))])
        except (TypeError, dsq.PeerFailedError) as exc:
            return type(exc).__name__
    assert dsq.LocalGroup(3, timeout=30).run(per_rank) == ["TypeError", "PeerFailedError", "PeerFailedError"]


def test_the_replicated_reducer_commits_a_step_only_when_all_its_tensors_are_in():
    """The stock-Horovod path: a NaN average in the second tensor leaves the
    first tensor's memories (already decompressed) as they were."""
    reps = [ReplicatedDoubleSqueeze("sign", rank=r) for r in range(2)]

    def step(grads):
        wire = [[rep.compress(n, g) for n, g in grads[r]] for r, rep in enumerate(reps)]
        out = []
        for i, (name, _) in enumerate(grads[0]):
            avg = (wire[0][i] + wire[1][i]) / 2
            out.append([rep.decompress(name, avg) for rep in reps])
        return out

    def grads(seed, nan=False):
        gen = torch.Generator().manual_seed(seed)
        g = [[("w", torch.randn(10, generator=gen)), ("b", torch.randn(4, generator=gen))] for _ in range(2)]
        if nan:
            g[1][1][1][0] = float("nan")
        return g

    step(grads(0))
    before = [rep.state_dict() for rep in reps]
    with pytest.raises(dsq.NonFiniteGradientError):
        step(grads(1, nan=True))
    for rep, old in zip(reps, before):
        new = rep.state_dict()
        assert new["steps"] == old["steps"] == {"w": 1, "b": 1}
        assert new["worker_error"].keys() == old["worker_error"].keys()
        assert all(torch.equal(decoded(new["worker_error"][k]), decoded(old["worker_error"][k]))
                   for k in old["worker_error"])
    step(grads(2))
    assert reps[0].steps == {"w": 2, "b": 2}
    with pytest.raises(dsq.ConfigError, match="on_nonfinite='skip' cannot skip"):
        ReplicatedDoubleSqueeze(config=dsq.ReducerConfig(on_nonfinite="skip"))


def test_header_statuses_round_trip():
    assert header.describe(header.OK) == ("ok", None)
    assert header.describe(header.NONFINITE) == ("nonfinite", None)
    assert header.describe(header.LOCAL_FAILURE) == ("local_failure", None)
    assert header.describe(header.bad_payload(5)) == ("bad_payload", 5)


# -- one configuration, every frontend ----------------------------------------------------------------------

SETTINGS = dict(compressor="topk", compressor_params={"ratio": 0.05}, server_compressor="sign",
                server_compressor_params={"scale": "rms"}, error_feedback="both", bucket_mb=2.0, layerwise=True,
                on_nonfinite="skip", strict_payloads=True, seed=7, worker_momentum=0.5,
                faults="attack=zero;ranks=0;from_step=9;pass=worker", owners="all", error_dtype="fp32")


def frontends(settings):
    """The ReducerConfig each frontend builds from the same settings."""
    from deepspeed_ext.backend import backend_config
    from deepspeed_ext.engine import split_config
    from horovod_ext.compression import Compression
    comm = dsq.LocalGroup(1).run(lambda c: c)[0]
    kwargs = dict(settings)
    return {
        "DoubleSqueeze(**kwargs)": dsq.DoubleSqueeze(comm, **kwargs).config,
        "DoubleSqueeze(config=)": dsq.DoubleSqueeze(comm, config=dsq.ReducerConfig(**kwargs)).config,
        "DeepSpeed section": split_config({"train_batch_size": 1, "doublesqueeze": dict(settings)})[1],
        "hx.Compression.doublesqueeze(**params)": Compression.doublesqueeze(
            kwargs.pop("compressor"), **kwargs.pop("compressor_params"), **kwargs).config,
        "DoubleSqueezeBackend": backend_config(**settings),
    }


def test_every_frontend_builds_the_same_reducer_from_the_same_settings():
    configs = frontends(SETTINGS)
    reference = configs["DoubleSqueeze(**kwargs)"].to_dict()
    assert reference["faults"]["attack"] == "zero" and reference["compressor_params"]["ratio"] == 0.05
    for name, cfg in configs.items():
        assert cfg.to_dict() == reference, name
    comm = dsq.LocalGroup(1).run(lambda c: c)[0]
    by_instance = dsq.DoubleSqueeze(comm, dsq.get_compressor("topk", ratio=0.05), "sign",
                                    server_compressor_params={"scale": "rms"})
    by_name = dsq.DoubleSqueeze(comm, "topk", "sign", compressor_params={"ratio": 0.05},
                                server_compressor_params={"scale": "rms"})
    assert by_instance.config.to_dict() == by_name.config.to_dict()


@pytest.mark.parametrize("bad,message", [
    ({"bucket_mb": -1}, "bucket_mb must be a positive number, got -1"),
    ({"error_feedback": "server"}, "error_feedback must be one of both, worker, none, ef21, got 'server'"),
    ({"compressor": "sgn"}, "unknown compressor 'sgn'; available: none, fp16"),
    ({"compressor_params": {"rate": 0.1}}, "compressor 'topk' has no parameter 'rate'; its parameters are: ratio"),
    ({"on_nonfinite": "ignore"}, "on_nonfinite must be one of raise, skip, got 'ignore'"),
    ({"faults": "attack=flip;ranks=1"}, "attack must be one of signflip"),
])
def test_a_bad_setting_is_the_same_config_error_from_every_frontend(bad, message):
    settings = {**SETTINGS, **bad}
    messages = set()
    for name in frontends(dict(SETTINGS)):
        with pytest.raises(dsq.ConfigError) as caught:
            frontends_one(name, settings)
        messages.add(str(caught.value))
    assert len(messages) == 1 and message in messages.pop()


def frontends_one(name, settings):
    """Build one frontend's config from ``settings`` (raising what it raises)."""
    from deepspeed_ext.backend import backend_config
    from deepspeed_ext.engine import split_config
    from horovod_ext.compression import Compression
    kwargs = dict(settings)
    if name == "DoubleSqueeze(**kwargs)":
        comm = dsq.LocalGroup(1).run(lambda c: c)[0]
        return dsq.DoubleSqueeze(comm, **kwargs)
    if name == "DoubleSqueeze(config=)":
        return dsq.ReducerConfig(**kwargs)
    if name == "DeepSpeed section":
        return split_config({"doublesqueeze": kwargs})
    if name == "hx.Compression.doublesqueeze(**params)":
        return Compression.doublesqueeze(kwargs.pop("compressor"), **kwargs.pop("compressor_params"), **kwargs)
    return backend_config(**kwargs)


def test_recycled_error_buffers_never_touch_state_that_is_still_in_use():
    """The buffer a successful step replaced is where the next step builds
    its residual; a buffer set from outside (DeepSpeed's compressed_allreduce
    hands in its own) is never recycled, and a failed step after recycling
    still leaves the state as it was."""
    from dsq_plugins.state import ErrorMemory
    memory = ErrorMemory()
    theirs = torch.ones(8)
    memory.set("w", theirs)
    memory.set("w", torch.zeros(8), private=True)
    assert memory.scratch("w", 8, torch.device("cpu")).data_ptr() != theirs.data_ptr()
    first = torch.full((8,), 2.0)
    memory.set("w", first, private=True)
    memory.set("w", torch.full((8,), 3.0), private=True)
    assert memory.scratch("w", 8, torch.device("cpu")).data_ptr() == first.data_ptr()
    assert memory.scratch("w", 8, torch.device("cpu")).data_ptr() != first.data_ptr()  # handed over once

    def per_rank(comm):
        # fp32 memories: the ones whose buffers are recycled
        r = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.2}, error_dtype="fp32")
        for t in range(3):  # long enough that both buffers of each memory take turns
            r.reduce("g", torch.randn(50, generator=torch.Generator().manual_seed(10 * t + comm.rank)))
        before = snapshot(r)
        bad = torch.randn(50)
        bad[7] = float("nan")
        with pytest.raises(dsq.NonFiniteGradientError):
            r.reduce("g", bad if comm.rank == 1 else torch.randn(50))
        return same(before, snapshot(r))
    assert all(dsq.LocalGroup(3).run(per_rank))
