"""Deferred verdicts (``verdict="step"``): the same averages, state, bytes
and errors as the collective protocol, with one host read of its checks
per step however many buckets it has. test_bad_input and test_steps run
their failure cases under both verdicts; test_torch_distributed runs the
real transport with deferred verdicts."""
import pytest
import torch

import dsq_plugins as dsq
from bench.syncs import HostReads
from dsq_plugins import step as verdicts
from dsq_plugins.compressors import get_compressor
from dsq_plugins.overlap import Exchange
from tests.helpers.states import decoded

CASES = [("sign", {}), ("topk", {"ratio": 0.2}), ("qsgd", {"levels": 7}), ("randomk", {"ratio": 0.3}),
         ("terngrad", {}), ("fp16", {}), ("blocksign", {}), ("none", {})]
# other passes: single-pass error feedback, none at all, another server operator
SETTINGS = [{"error_feedback": "worker"}, {"error_feedback": "none", "server_compressor": "fp16"},
            {"server_compressor": "topk", "server_compressor_params": {"ratio": 0.3}}]
SMALL_BUCKETS = 40 * 4 / 2**20  # 40 floats


def named(rank, step, sizes=(7, 17, 27, 37, 47)):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [(f"p{i}", torch.randn(n, generator=gen)) for i, n in enumerate(sizes)]


def states_equal(a, b):
    return all(a[kind].keys() == b[kind].keys()
               and all(torch.equal(decoded(a[kind][k]), decoded(b[kind][k])) for k in a[kind])
               for kind in ("worker_error", "server_error", "momentum")) and a["steps"] == b["steps"]


@pytest.mark.filterwarnings("ignore::dsq_plugins.errors.ErrorFeedbackWarning")
@pytest.mark.parametrize("name,params,settings", [(n, p, {}) for n, p in CASES] + [("sign", {}, s) for s in SETTINGS])
def test_a_deferred_step_gives_the_collective_protocols_averages_and_state_bit_for_bit(name, params, settings):
    def run(verdict):
        def per_rank(comm):
            r = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict=verdict, bucket_mb=SMALL_BUCKETS,
                                  worker_momentum=0.5, **settings)
            outs = [r.reduce_many(named(comm.rank, t)) for t in range(2)]
            grads = [t for _, t in named(comm.rank, 2)]
            r.reduce_many([(f"p{i}", g) for i, g in enumerate(grads)], in_place=True)
            outs.append(grads)
            outs.append([r.reduce("single", torch.randn(33, generator=torch.Generator().manual_seed(comm.rank)))])
            return outs, r.state_dict(), comm.bytes_sent, r.defers_verdicts
        return dsq.LocalGroup(3).run(per_rank)
    for (outs_c, state_c, bytes_c, defers_c), (outs_s, state_s, bytes_s, defers_s) in zip(run("collective"),
                                                                                          run("step")):
        assert not defers_c and defers_s
        assert all(torch.equal(a, b) for xs, ys in zip(outs_c, outs_s) for a, b in zip(xs, ys))
        assert states_equal(state_c, state_s)
        assert bytes_s - bytes_c == 4 * 24 * 2  # each of the 4 steps agrees its plan: a 3-int header to 2 peers


@pytest.mark.parametrize("name,params", [("sign", {}), ("topk", {"ratio": 0.2}), ("qsgd", {"levels": 7})])
def test_a_deferred_reduce_scatter_gives_the_collective_protocols_shards_state_and_errors(name, params):
    """ZeRO's and FSDP's worker pass alone, under a plan: the same shards and
    memories, one host read per step, and a NaN on one rank the same error
    on every rank with nothing written."""
    sizes = {"a": 40, "b": 25}

    def run(verdict):
        def per_rank(comm):
            r = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict=verdict)
            plan = verdicts.Plan(list(sizes.items()))
            shards, reads = [], []
            for t in range(3):
                with r.step(plan):
                    for n, size in sizes.items():
                        shards.append(r.reduce_scatter(n, torch.randn(size, generator=torch.Generator().manual_seed(
                            100 * t + 10 * comm.rank + size))))
                reads.append(r.last_step.verdict.host_reads if r.last_step.verdict else None)
            before = r.state_dict()
            try:
                with r.step(plan):
                    for n, size in sizes.items():
                        g = torch.ones(size)
                        g[3] = float("nan") if comm.rank == 1 and n == "a" else 1.0
                        r.reduce_scatter(n, g)
                error = None
            except dsq.DSQError as exc:
                error = type(exc).__name__
            return shards, r.state_dict(), reads, error, states_equal(before, r.state_dict())
        return dsq.LocalGroup(3).run(per_rank)
    for (shards_c, state_c, _, error_c, kept_c), (shards_s, state_s, reads_s, error_s, kept_s) in zip(
            run("collective"), run("step")):
        assert all(torch.equal(a, b) for a, b in zip(shards_c, shards_s))
        assert states_equal(state_c, state_s)
        assert reads_s == [1, 1, 1]
        assert error_c == error_s == "NonFiniteGradientError" and kept_c and kept_s


def host_reads(fn):
    """How many times the code in ``fn`` reads a tensor's values on the host
    (``bool``, ``item``, ``tolist``): on a GPU each is a sync."""
    with HostReads() as reads:
        reads.start()
        fn()
        reads.stop()
    return sum(reads.sites.values())


@pytest.mark.parametrize("name,params", [("sign", {}), ("qsgd", {"levels": 7}), ("blocksign", {})])
def test_a_deferred_step_reads_its_checks_once_however_many_buckets(name, params):
    def reads(verdict, sizes):
        def per_rank(comm):
            r = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict=verdict, bucket_mb=SMALL_BUCKETS)
            r.reduce_many(named(comm.rank, 0, sizes))
            return r.last_step.verdict.host_reads if r.last_step.verdict else None
        out = []
        return host_reads(lambda: out.extend(dsq.LocalGroup(2).run(per_rank))), out
    one, many = (30,), (30, 30, 30, 30)
    (step_one, settled_one), (step_many, settled_many) = reads("step", one), reads("step", many)
    collective_one, collective_many = reads("collective", one)[0], reads("collective", many)[0]
    assert settled_one == settled_many == [1, 1]  # one read back per rank per step
    assert step_many == step_one  # nothing read per bucket
    assert collective_many > collective_one + 3 * 2  # the collective protocol reads per bucket, on every rank


def test_ranks_whose_plans_differ_fail_before_any_payload_moves():
    def per_rank(comm):  # (settings that differ are refused before any step: see test_newcomer; here the tensor)
        r = dsq.DoubleSqueeze(comm, "topk", compressor_params={"ratio": 0.1}, verdict="step")
        try:
            r.reduce("g", torch.ones(100 if comm.rank else 120))
        except dsq.CollectiveMismatchError as exc:
            return str(exc), comm.bytes_sent
    for message, sent in dsq.LocalGroup(3, timeout=30).run(per_rank):
        assert "planned steps over different tensors" in message and sent == 24 * 2  # the plan's header only


def exchange_run(comm, nan_step=None, mode="raise"):
    """Three steps through an overlapped ``Exchange`` (buckets handed over in
    reverse order, as backward makes them ready): (each step's averages or
    error name, whether skipped)."""
    r = dsq.DoubleSqueeze(comm, "sign", verdict="step", bucket_mb=SMALL_BUCKETS, worker_momentum=0.5,
                          on_nonfinite=mode)
    layout = r.layout([(n, tuple(t.shape)) for n, t in named(0, 0)])
    exchange = Exchange(r, layout, timeout=60)
    out = []
    try:
        for step in range(3):
            by_name = dict(named(comm.rank, step))
            if step == nan_step and comm.rank == 1:
                by_name["p4"][2] = float("nan")
            for b in reversed(range(len(layout))):
                exchange.submit(step, b, [by_name[slot.name] for slot in layout[b].slots])
            results, skipped = exchange.collect(step)
            errors = [type(x).__name__ for x in results if isinstance(x, Exception)]
            out.append((errors[0] if errors else [t for bucket in results for t in bucket], skipped))
    finally:
        exchange.close()
    return out, comm.bytes_sent, r.state_dict()


def test_an_overlapped_exchange_agrees_its_plan_once_and_judges_each_step_at_its_end():
    clean = dsq.LocalGroup(3).run(exchange_run)
    for out, sent, _ in clean:
        assert [skipped for _, skipped in out] == [False] * 3
    # the same averages as reduce_many, whose steps each agree their plan
    def reference(comm):
        r = dsq.DoubleSqueeze(comm, "sign", verdict="step", bucket_mb=SMALL_BUCKETS, worker_momentum=0.5)
        outs = [r.reduce_many(named(comm.rank, t)) for t in range(3)]
        return outs, comm.bytes_sent
    for (out, sent, _), (outs, ref_sent) in zip(clean, dsq.LocalGroup(3).run(reference)):
        assert all(torch.equal(a, b) for (got, _), want in zip(out, outs) for a, b in zip(got, want))
        assert ref_sent - sent == 2 * 24 * 2  # the exchange agreed its plan in its first step only

    raised = dsq.LocalGroup(3).run(exchange_run, 1)
    skipped = dsq.LocalGroup(3).run(exchange_run, 1, "skip")
    for (out_r, _, state_r), (out_s, _, state_s) in zip(raised, skipped):
        assert out_r[1] == ("NonFiniteGradientError", False) and isinstance(out_r[2][0], list)
        assert out_s[1][1] and all(bool((t == 0).all()) for t in out_s[1][0])  # skipped: zeros, not NaN
        assert not out_s[2][1]
        # the failed or skipped step wrote nothing; the ones around it did
        assert set(state_r["steps"].values()) == set(state_s["steps"].values()) == {2}


def _short_payload_to_rank_0(comm):
    original = comm.alltoall
    comm.alltoall = lambda payloads, **kw: original([payloads[0][:-1], *payloads[1:]], **kw)


def _bytes_out_of_range(comm):
    original = comm.alltoall
    comm.alltoall = lambda payloads, **kw: original([torch.full_like(p, 0x7F) for p in payloads], **kw)


def _nan(g):
    g[3] = float("nan")


#: (what goes wrong on rank 1 in the second step, the operator, on_nonfinite, the error every rank gets or None)
UNJUDGED = [("nothing", None, "sign", "raise", None),
            ("nan", _nan, "sign", "raise", "NonFiniteGradientError"),
            ("nan-skipped", _nan, "sign", "skip", None),
            ("short payload", _short_payload_to_rank_0, "sign", "raise", "PayloadError"),
            ("undecodable", _bytes_out_of_range, "topk", "raise", "PayloadError")]


@pytest.mark.parametrize("case,fault,name,mode,error", UNJUDGED, ids=[c[0] for c in UNJUDGED])
def test_a_step_closed_unjudged_flags_on_the_device_what_its_verdict_then_says(case, fault, name, mode, error):
    """``StepScope.close_unjudged`` (the DDP hook's optimizer mode): its state is written at once and the device
    flag, which a fused optimizer skips a step on, must say exactly what the verdict read later says (else an
    optimizer would step on what the reducer condemns, or skip what it applied). Judged, a condemned step
    raises the error the collective protocol raises, on every rank, with its state put back; a skipped one
    is counted, its state put back too."""
    sizes = {"a": 30, "b": 50}
    params = {"ratio": 0.5} if name == "topk" else None

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict="step", on_nonfinite=mode)
        plan = verdicts.Plan(list(sizes.items()))
        r.open_step(plan)
        for n, size in sizes.items():
            r.reduce(n, grad_of(comm.rank, size, 0))
        assert float(r.scope.close_unjudged(comm.device)) == 0.0
        r.scope.judge_pending()
        before = r.state_dict()
        r.open_step(plan)
        if comm.rank == 1 and fault is not None and case != "nan" and case != "nan-skipped":
            fault(comm)
        for n, size in sizes.items():
            g = grad_of(comm.rank, size, 1)
            if comm.rank == 1 and n == "b" and case.startswith("nan"):
                fault(g)
            r.reduce(n, g)
        flag = float(r.scope.close_unjudged(comm.device))
        written = r.scope.pending is not None and r.state.steps == {"a": 2, "b": 2}
        try:
            judged = r.scope.judge_pending().outcome
        except dsq.DSQError as exc:
            judged = type(exc).__name__
        return flag, written, judged, states_equal(before, r.state_dict()), r.skipped_steps

    for flag, written, judged, kept, skipped in dsq.LocalGroup(3).run(per_rank):
        assert written
        if case == "nothing":
            assert (flag, judged, kept, skipped) == (0.0, "applied", False, 0)
        elif error is None:  # skipped
            assert (flag, judged, kept, skipped) == (1.0, "skipped", True, 1)
        else:
            assert (flag, judged, kept, skipped) == (1.0, error, True, 0)


def test_closing_a_step_unjudged_costs_a_few_ops_however_many_buckets():
    """What the hook's optimizer mode launches at an iteration's end to learn its verdict on the device: a
    comparison per collective's header table and one reduction over all of them (ops counted as torch
    dispatches them, on the paths a GPU takes), not a reduction per reading."""
    from dsq_plugins.compressors import kernels

    class Ops(torch.overrides.TorchFunctionMode):
        count, seen = 0, []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name not in NOT_KERNELS:
                Ops.count += 1
                Ops.seen.append(name)
            return func(*args, **(kwargs or {}))

    def per_rank(comm, buckets):
        r = dsq.DoubleSqueeze(comm, "sign", verdict="step")
        plan = verdicts.Plan([(f"b{i}", 64) for i in range(buckets)])
        for t in range(2):
            r.open_step(plan)
            for name, numel in plan.buckets:
                r.reduce(name, grad_of(comm.rank, numel, t))
            if t == 1 and comm.rank == 0:
                with Ops():
                    r.scope.close_unjudged(comm.device)
            else:
                r.scope.close_unjudged(comm.device)
            r.scope.judge_pending()
    counts = []
    for buckets in (2, 16):
        Ops.count = 0
        with kernels.gpu_paths():  # around the ranks, which are threads
            dsq.LocalGroup(2).run(per_rank, buckets)
        counts.append(Ops.count)
    assert counts[1] - counts[0] <= 2 * 14 + 1, (counts, Ops.seen)  # two collectives a bucket, one comparison each
    assert counts[1] <= 2 * 16 + 6, (counts, Ops.seen)


#: what a torch-function mode sees that launches nothing: attributes, views, and moves to where a tensor is
NOT_KERNELS = {"__get__", "reshape", "view", "to", "dim", "size", "numel", "detach"}


def grad_of(rank, numel, step):
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + numel))


def test_verdict_step_is_refused_where_payloads_are_judged_one_by_one():
    for kwargs, words in [({"owners": 3}, "owners=3"), ({"aggregator": "median"}, "strict_payloads=False"),
                          ({"error_feedback": "ef21"}, "ef21"),
                          ({"faults": "attack=signflip;count=1"}, "fault injection")]:
        if kwargs.get("aggregator") == "median":
            pytest.importorskip("robust")
        with pytest.raises(dsq.ConfigError, match=words):
            dsq.ReducerConfig(verdict="step", **kwargs)
    with pytest.raises(dsq.ConfigError, match="verdict must be one of auto, collective, step"):
        dsq.ReducerConfig(verdict="later")
    for device, defers in [("cpu", False), ("meta", False)]:
        assert dsq.LocalGroup(1, device=device).run(lambda c: dsq.DoubleSqueeze(c).defers_verdicts) == [defers]


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.3}), ("blocksign", {"block": 8}), ("sign", {}),
                                         ("qsgd", {"levels": 3}), ("terngrad", {}), ("qsgd", {"levels": 127})])
def test_a_deferred_decode_of_any_bytes_stays_inside_its_vector_and_flags_them(name, params):
    """Nothing is refused inside a deferred step, so decoding random bytes
    must not index outside the vector; the checks it recorded say they are bad."""
    q = get_compressor(name, **params)
    numel = 61
    gen = torch.Generator().manual_seed(5)
    flagged = 0
    for trial in range(20):
        payload = torch.randint(0, 256, (q.payload_nbytes(numel),), generator=gen, dtype=torch.uint8)
        checks = []
        decoded = q.decode(payload, numel, seed=trial, refusals=checks)
        dense = decoded.dense()
        assert dense.shape == (numel,)
        if decoded.positions is not None:
            assert int(decoded.positions.min()) >= 0 and int(decoded.positions.max()) < numel
        flagged += any(bool(flag) for flag, _ in checks)
    if name in ("topk", "blocksign", "qsgd", "sign"):  # random bytes break their positions, codes or scales
        assert flagged > 0


def test_the_verdict_judges_in_order_and_explains_what_it_raises():
    v = verdicts.StepVerdict()
    seen = []
    first = v.read(torch.tensor([0, 1]))
    v.then(lambda: seen.append(first.values))

    def explain(exc):
        raise dsq.PayloadError(f"explained: {exc}") from None
    with v.explained_by(explain):
        v.then(lambda: (_ for _ in ()).throw(KeyError("second")))
    v.then(lambda: seen.append("never"))
    with pytest.raises(dsq.PayloadError, match="explained: 'second'"):
        v.settle()
    assert seen == [[0, 1]] and v.host_reads == 1
    assert bool(verdicts.nonfinite(torch.tensor([1.0, float("-inf")])))
    assert not bool(verdicts.nonfinite(torch.tensor([1.0, 3e38, 3e38])))  # a sum would overflow; min/max do not
    assert int(verdicts.first_true(torch.tensor([False, True, True]), 10)) == 11
    assert int(verdicts.first_true(torch.tensor([False, False]), 10)) == 0


EXTREMES = [0.0, -0.0, 1.0, -3.0e38, 3.0e38, torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max,
            1e-45, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("low", EXTREMES)
@pytest.mark.parametrize("high", EXTREMES)
def test_the_device_finiteness_and_scale_tests_agree_with_isfinite(low, high):
    from dsq_plugins.compressors.base import not_finite_nonnegative
    t = torch.tensor([low, high, 0.5])
    assert bool(verdicts.nonfinite(t)) == (not bool(torch.isfinite(t).all()))
    expected = ~torch.isfinite(t) | (t < 0)
    assert torch.equal(not_finite_nonnegative(t), expected)
