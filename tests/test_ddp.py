"""The DDP communication hook on real processes (torchrun, 2 ranks, gloo):
exact where it must be, compressed both ways, one step per iteration."""
import pytest
import torch

import dsq_plugins as dsq
import dsq_plugins.ddp as dsq_ddp
from dsq_plugins.layout import chunk_bounds
from tests.conftest import require
from tests.helpers.launchers import launch

N = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("torchrun", N, "ddp_worker.py", out_dir=str(tmp_path_factory.mktemp("ddp")), timeout=600)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_with_the_exact_operator_the_hook_is_ddps_own_allreduce_bit_for_bit(results):
    for rank in range(N):
        assert same(results[rank]["exact"]["params"], results[rank]["plain"]["params"])


@pytest.mark.parametrize("scenario", ["sign", "topk-int8"])
def test_compressed_both_ways_every_rank_ends_with_the_same_model(results, scenario):
    run = results[0][scenario]
    assert same(run["params"], results[1][scenario]["params"])
    assert sum(run["losses"][-3:]) < sum(run["losses"][:3])
    # DDP's first layout (one bucket) for the first iteration, its final one (two) after
    assert sorted(run["steps"].values()) == [1, 11, 11] and run["iterations"] == 12


def test_lowrank_through_the_hook_keeps_ranks_identical_at_a_tenth_of_the_bytes(results):
    """Each matrix at rank 2 of its own shape: the 4096 x 64 layer shrinks 31x, the 10 x 4096 output
    layer only 2.5x (each owner's 5 rows carry a 4096-wide Q), the 4096 biases travel as values."""
    run = results[0]["lowrank"]
    assert same(run["params"], results[1]["lowrank"]["params"])
    assert run["bytes_per_step"] < run["fp32_allreduce"] / 10


def test_sign_moves_a_twentieth_of_ddps_bytes(results):
    run = results[0]["sign"]
    assert run["bytes_per_step"] < run["fp32_allreduce"] / 20


def test_exact_steps_average_exactly_first(results):
    warm, plain = results[0]["warm"]["losses"], results[0]["plain"]["losses"]
    assert warm[:4] == plain[:4] and results[0]["warm"]["losses"][4:] != results[0]["sign"]["losses"][4:]


def test_the_hook_state_carries_the_compensation_across_a_restart(results):
    """Not bit for bit (a new DDP compresses its first iteration over its
    first bucket layout), but the resumed run stays far closer to the
    uninterrupted one than a resume that drops the hook's state."""
    def distance(a, b):
        return float(sum((x - y).pow(2).sum() for x, y in zip(a, b))) ** 0.5
    for rank in range(N):
        straight, resumed, dropped = results[rank]["resume"]
        assert distance(straight, resumed) < distance(straight, dropped)


class Bucket:
    """What the hook reads of DDP's GradBucket to lay its memories out."""

    def __init__(self, index, params):
        self._index, self._params = index, params

    def index(self):
        return self._index

    def parameters(self):
        return self._params


def test_a_new_bucket_layout_moves_every_parameters_memories_with_it():
    """DDP lays [p0 p1 p2] out again as [p2 p1] and [p0]: each parameter's
    worker error, and every owner's server-error chunk, land on the same
    parameter's elements in the new buckets."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 3, 4)]
    worker = {r: torch.arange(12.0) + 100 * r for r in range(N)}
    server = torch.arange(12.0) * -1  # the whole server error of the old bucket, cut between the owners

    def per_rank(comm):
        state = dsq_ddp.HookState(compressor="sign")
        # fp32 memories, so that every moved element can be compared exactly
        state.reducer = dsq.DoubleSqueeze(comm, "sign", error_dtype="fp32")
        state.exact = dsq.DoubleSqueeze(comm, "none", error_feedback="none")
        old = state._begin_bucket(Bucket(0, params), state.reducer)
        state._end_iteration(state.reducer)  # what the hook does after the last bucket
        a, b = chunk_bounds(12, N)[comm.rank]
        state.reducer.worker_error.set(old, worker[comm.rank].clone())
        state.reducer.server_error.set(old, server[a:b].clone())
        new = [state._begin_bucket(Bucket(0, [params[2], params[1]]), state.reducer),
               state._begin_bucket(Bucket(1, [params[0]]), state.reducer)]
        return [(state.reducer.worker_error.get(n, m, torch.device("cpu")),
                 state.reducer.server_error.get(n, chunk_bounds(m, N)[comm.rank][1]
                                                - chunk_bounds(m, N)[comm.rank][0], torch.device("cpu")))
                for n, m in zip(new, (7, 5))]
    results = dsq.LocalGroup(N).run(per_rank)
    for rank, ((w21, s21), (w0, s0)) in enumerate(results):
        mine = worker[rank]
        assert torch.equal(w21, torch.cat([mine[8:12], mine[5:8]])) and torch.equal(w0, mine[0:5])
        whole21, whole0 = torch.cat([server[8:12], server[5:8]]), server[0:5]
        (a, b), (c, d) = chunk_bounds(7, N)[rank], chunk_bounds(5, N)[rank]
        assert torch.equal(s21, whole21[a:b]) and torch.equal(s0, whole0[c:d])


@pytest.mark.parametrize("scenario", ["nan", "nan-inline", "nan-step"])
def test_a_nan_is_the_same_error_on_every_rank_and_changes_no_state(results, scenario):
    """Overlapped (the NaN's bucket fails on the background thread, the last bucket's call raises it)
    and inline alike; the error says how to skip such steps instead (mixed precision's overflows)."""
    for rank in range(N):
        error, unchanged, iterations = results[rank][scenario]
        assert error == ("NonFiniteGradientError", [1], True) and unchanged and iterations == 3


@pytest.mark.parametrize("scenario", ["sparse-sign", "sparse-step"])
def test_a_sparse_embeddings_gradient_is_averaged_exactly_beside_compressed_dense_ones(results, scenario):
    """nn.EmbeddingBag(sparse=True): DDP hands the hook a sparse bucket, which is averaged exactly, its rows
    as they are (DDP's own allreduce's gradient, bit for bit), while the dense layer's is compressed; it
    stays sparse, and every rank trains the same model (the hook refused sparse buckets before)."""
    plain, run = results[0]["sparse-plain"], results[0][scenario]
    assert run["sparse"] and plain["sparse"]
    assert torch.equal(run["grads"][0], plain["grads"][0])
    assert not torch.equal(run["grads"][1], plain["grads"][1])  # (the dense layer's weight: sign's average)
    assert same(run["params"], results[1][scenario]["params"]) and len(run["losses"]) == 8
    assert not same(run["params"], plain["params"])  # (and not DDP's model: the dense layer trained compressed)


def test_a_nan_in_a_sparse_gradient_is_the_same_error_on_every_rank_and_changes_no_state(results):
    for rank in range(N):
        assert results[rank]["sparse-nan"]["error"] == ("NonFiniteGradientError", [1], 3, True)


def test_deferred_verdicts_judge_an_iteration_once_and_train_the_same_model(results):
    """verdict="step" (what "auto" picks on a GPU): once DDP's layout is stable the hook plans each
    iteration's buckets, and the step reads its verdict back once, at the last bucket; the model is the
    collective protocol's, bit for bit."""
    for rank in range(N):
        deferred, collective = results[rank]["sign-step"], results[rank]["sign"]
        assert same(deferred["params"], collective["params"]) and deferred["losses"] == collective["losses"]
        assert deferred["host_reads"] == 1, deferred["host_reads"]
        assert collective["host_reads"] >= 2 * len(collective["buckets"])  # the protocol reads per bucket


def test_a_verdict_left_on_the_device_trains_the_same_model_without_reading_it_in_backward(results):
    """HookState(optimizer=AdamW(fused=True)): each iteration's verdict goes to the optimizer as a device
    flag and is read at the next iteration's first bucket, so backward() returns with it unread; the
    model is the one the verdict read at the last bucket gives, bit for bit."""
    for rank in range(N):
        read, left = results[rank]["late"][False], results[rank]["late"][True]
        assert same(left["params"], read["params"]) and left["losses"] == read["losses"]
        assert left["unjudged"] and not read["unjudged"]
        assert left["host_reads"] == read["host_reads"] == 1 and left["iterations"] == read["iterations"] == 8


def test_a_nan_with_the_verdict_on_the_device_is_skipped_there_and_raised_at_settle(results):
    """The poisoned iteration's backward() returns; the fused optimizer skips it on the device (parameters,
    moments and step counts unchanged); settle() raises the same error on every rank and puts the error
    memories back."""
    for rank in range(N):
        error, unchanged, iterations = results[rank]["nan-late"]
        assert error == ("NonFiniteGradientError", [1]) and unchanged and iterations == 3


def test_skipping_a_nonfinite_step_with_the_optimizer_handed_over_changes_nothing(results):
    """on_nonfinite="skip" with the optimizer handed to the hook: a poisoned iteration is skipped on every
    rank, and training goes on as if it had not been (the same model as the run without it)."""
    for rank in range(N):
        poisoned, clean = results[rank]["skip-late"]
        assert same(poisoned["params"], clean["params"])
        assert (poisoned["skipped"], clean["skipped"]) == (1, 0)
        assert poisoned["iterations"] == clean["iterations"] == 5


def test_with_gradscaler_a_condemned_iteration_is_skipped_whatever_the_scaler_found(results):
    """torch.amp.GradScaler hands the fused optimizer a found_inf of its own just before its step; the step
    takes the larger of the scaler's and the hook's. A NaN on rank 1 whose gradients the script then made
    finite (the scaler finds nothing) is skipped all the same: the model of the run without that iteration.
    An overflow on every rank (non-finite gradients everywhere) is skipped once, by both, and the scaler
    halves its scale; the ranks keep one model."""
    for rank in range(N):
        runs = results[rank]["scaler"]
        assert same(runs["poisoned"]["params"], runs["left-out"]["params"])
        assert runs["poisoned"]["skipped"] == 1 and runs["left-out"]["skipped"] == 0
        overflow = runs["overflow"]
        assert overflow["skipped"] == 1 and overflow["scale"] == 2.0 ** 15
        assert all(torch.isfinite(p).all() for p in overflow["params"])
    assert same(results[0]["scaler"]["overflow"]["params"], results[1]["scaler"]["overflow"]["params"])


def test_iterations_accumulated_into_one_step_skip_it_if_any_was_condemned(results):
    """Two backward passes (two iterations of the hook, no no_sync) into one step, the first condemned: the
    second's verdict joins the first's, so the step is skipped (parameters and step counts as they were)."""
    for rank in range(N):
        unchanged, skipped = results[rank]["scaler"]["accumulated"]
        assert unchanged and skipped == 1


def test_accelerates_wrapped_optimizer_hands_the_verdict_to_the_one_inside(results):
    for rank in range(N):
        inner, unchanged, steps, skipped = results[rank]["accelerate-skip"]
        assert inner and unchanged and steps == [3.0] and skipped == 1


def test_averaging_during_backward_gives_the_inline_hooks_model_bit_for_bit(results):
    """overlap=True (the default) moves the work to a background thread, in DDP's bucket order: the same
    collectives, the same sums, the same model as overlap=False, on every rank."""
    for rank in range(N):
        overlapped, inline = results[rank]["sign"], results[rank]["sign-inline"]
        assert same(overlapped["params"], inline["params"]) and overlapped["losses"] == inline["losses"]
        assert overlapped["bytes_per_step"] == inline["bytes_per_step"]
        assert overlapped["background"] and not inline["background"]


@pytest.mark.parametrize("scenario", ["adam", "adam-views", "adam-static", "adam-unused"])
def test_compressed_adam_on_a_ddp_model_is_compressed_adam_on_its_module(results, scenario):
    """DDP's own allreduce is gone (else the optimizer would average averages);
    with gradient_as_bucket_view, static_graph and find_unused_parameters too."""
    for rank in range(N):
        via_ddp, plain = results[rank][scenario]
        assert same(via_ddp, plain)
    assert same(results[0][scenario][0], results[1][scenario][0])


def test_accelerate_takes_the_hook_on_the_model_it_prepared(results):
    kind, iterations, sent, losses, params = results[0]["accelerate"]
    assert kind == "DistributedDataParallel" and iterations == 12 and sent > 0
    assert sum(losses[-4:]) < sum(losses[:4]) and same(params, results[1]["accelerate"][4])


def test_a_wrapped_optimizer_hands_the_verdict_to_the_torch_optimizer_inside():
    """Lightning's LightningOptimizer copies the fused AdamW's attributes (it looks fused itself) but its step
    calls the AdamW's, which must be the one handed the flag."""
    require("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer
    inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], fused=True)
    state = dsq_ddp.HookState(compressor="sign", optimizer=LightningOptimizer(inner), on_nonfinite="skip")
    assert state.optimizer is inner


def test_lightning_trains_through_the_hook_its_callback_registers(tmp_path):
    """Lightning's DDPStrategy on CPU ranks, the hook registered by
    dsq_ddp.lightning_callback: every iteration goes through it (2 exact,
    then compressed), and the ranks stay identical."""
    require("lightning")
    got = launch("torchrun", N, "lightning_worker.py", out_dir=str(tmp_path), timeout=600)
    for r in got:
        assert r["iterations"] == 12 and list(r["steps"].values()) == [10] and r["bytes"] > 0
        assert sum(r["losses"][-4:]) < sum(r["losses"][:4])
    assert same(got[0]["params"], got[1]["params"])


def test_compressed_adam_needs_a_ddp_model():
    with pytest.raises(dsq.ConfigError, match="needs a DistributedDataParallel model, got Linear"):
        dsq_ddp.compressed_adam(torch.nn.Linear(2, 2), lr=1e-3)


@pytest.mark.parametrize("options, message", [
    (dict(on_nonfinite="skip"), "cannot skip the optimizer's step"),
    (dict(exact_steps=-1), "exact_steps must be a non-negative integer"),
    (dict(compresor="sign"), "unknown option"),
    (dict(optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], foreach=True)),
     "optimizer must be a fused torch optimizer.*got AdamW with fused=None"),
    (dict(optimizer="adamw"), "optimizer must be a fused torch optimizer"),
    (dict(side_stream="yes"), "side_stream must be True or False"),
])
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(dsq.ConfigError, match=message):
        dsq_ddp.HookState(**options)
