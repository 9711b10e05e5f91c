"""ZeRO stages 1 and 2 with compression, for real: the `deepspeed` launcher,
2 ranks, CPU accelerator, gloo (tests/workers/zero_worker.py). Engine results against
an in-process simulation of the mapping (the gradient pass is
``reduce_scatter`` to each partition's owner, the owner steps its fp32
master, the parameter pass is ``all_gather`` of Q(master - replica))."""
import json

import pytest
import torch
import torch.nn.functional as F

import dsq_plugins as dsq
from dsq_plugins.config import ReducerConfig
from tests.conftest import require
from tests.helpers.launchers import launch
from tests.workers import zero_worker as W
from tests.workers.hvd_worker import batches

N = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("deepspeed", N, "zero_worker.py", out_dir=str(tmp_path_factory.mktemp("zero")), timeout=900)


def simulate(scenario, numel, n=N):
    """What the two compressed passes around ZeRO's partitioned SGD give (``n`` ranks)."""
    _, section, extra = {**W.SCENARIOS, **W.HOST_SCENARIOS}[scenario]
    gas = extra.get("gradient_accumulation_steps", 1)
    clip = extra.get("gradient_clipping", 0.0)

    def per_rank(comm):
        model = W.make_model(seed=1, hidden=32)
        params = list(model.parameters())
        size = sum(p.numel() for p in params)
        replica = torch.zeros(numel)
        replica[:size] = torch.nn.utils.parameters_to_vector(params).detach()
        part = numel // n
        a, b = comm.rank * part, (comm.rank + 1) * part
        master = torch.nn.Parameter(replica[a:b].clone())
        opt = torch.optim.SGD([master], lr=0.1, momentum=0.9)
        reducer = dsq.DoubleSqueeze(comm, config=ReducerConfig.from_dict(section))
        exact = dsq.DoubleSqueeze(comm, "none")
        for step in range(W.STEPS):
            torch.nn.utils.vector_to_parameters(replica[:size], params)
            for x, y in batches(comm.rank, step, gas):
                (F.cross_entropy(model(x), y) / gas).backward()
            g = torch.zeros(numel)
            g[:size] = torch.cat([p.grad.reshape(-1) for p in params])
            model.zero_grad(set_to_none=True)
            with reducer.step():
                average = reducer.reduce_scatter("zero.group0.grads", g)
                average[max(size - a, 0):] = 0.0  # the alignment padding at the end stays zero
                if clip:
                    norm = exact.all_gather("norm", average, numel).norm()
                    average = average.mul(1.0 / torch.clamp((norm + 1e-6) / clip, min=1.0))
                master.grad = average
                opt.step()
                if reducer.error_feedback != "both":  # DeepSpeed's own all-gather of the masters
                    replica = exact.all_gather("masters", master.detach(), numel)
                    continue
                update = reducer.all_gather("zero.group0.params", master.detach() - replica[a:b], numel,
                                            error_feedback=False)
                update[size:] = 0.0
                replica += update
        return replica[:size]
    return dsq.LocalGroup(n).run(per_rank)


@pytest.mark.parametrize("scenario", list(W.SCENARIOS))
def test_zero_engine_matches_the_simulation_and_ranks_agree(results, scenario):
    numel = results[0][f"{scenario}/layout"][0]
    assert numel % N == 0
    expected = simulate(scenario, numel)
    for rank in range(N):
        got = torch.cat([p.reshape(-1) for p in results[rank][scenario]])
        assert all(torch.equal(p, q) for p, q in zip(results[rank][scenario], results[0][scenario]))
        if W.SCENARIOS[scenario][2].get("gradient_clipping"):  # norms summed in another order: last-bit changes
            assert torch.allclose(got, expected[rank], atol=1e-6)
        else:
            assert torch.equal(got, expected[rank])


@pytest.fixture(scope="module")
def host_results(tmp_path_factory):
    return launch("deepspeed", 4, "zero_worker.py", "--hosts", out_dir=str(tmp_path_factory.mktemp("zero-hosts")),
                  timeout=900)


@pytest.mark.parametrize("scenario", list(W.HOST_SCENARIOS))
def test_zero_in_two_levels_matches_the_simulation_and_ranks_agree(host_results, scenario):
    """Hosts of 2 ranks at ZeRO 1 and 2: partition k still ends on rank k, bit for bit as in process."""
    numel = host_results[0][f"{scenario}/layout"][0]
    expected = simulate(scenario, numel, n=4)
    for rank in range(4):
        got = torch.cat([p.reshape(-1) for p in host_results[rank][scenario]])
        assert torch.equal(got, expected[rank])
        assert all(torch.equal(p, q) for p, q in zip(host_results[rank][scenario], host_results[0][scenario]))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_checkpoints_resume_bit_for_bit(results, stage):
    for rank in range(N):
        straight, resumed = results[rank][f"checkpoint{stage}"]
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_sign_sends_over_ten_times_fewer_bytes(results, stage):
    for rank in range(N):
        sent, plain = results[rank][f"bytes{stage}"]
        assert plain / sent > 25  # sign on both passes: about 32x


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_bf16_engines_train_and_stay_in_sync(results, stage):
    first, last, weights, dtype = results[0][f"bf16-{stage}"]
    assert dtype == torch.bfloat16
    assert last < first - 0.15
    for rank in range(1, N):
        assert torch.equal(results[rank][f"bf16-{stage}"][2], weights)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_fp16_overflows_skip_steps_everywhere_and_back_the_scale_off(results, stage):
    if results[0][f"fp16-{stage}"] is None:
        pytest.skip("DeepSpeed does not run fp16 on this CPU (its accelerator's is_fp16_supported() is False)")
    skipped, ours, scale, first, last, weights, dtype = results[0][f"fp16-{stage}"]
    assert dtype == torch.float16
    assert 0 < skipped == ours < 40 and scale < 2.0**30
    assert last < first
    for rank in range(1, N):
        assert results[rank][f"fp16-{stage}"][:3] == (skipped, ours, scale)
        assert torch.equal(results[rank][f"fp16-{stage}"][5], weights)


def test_zero_nan_on_one_rank_is_the_same_error_everywhere_and_writes_nothing(results):
    for rank in range(N):
        (kind, message), unchanged, steps = results[rank]["nan"]
        assert kind == "NonFiniteGradientError" and "rank(s) [1]" in message
        assert unchanged and steps == {"zero.group0.grads": 2, "zero.group0.params": 2}


def test_zero_skip_mode_skips_the_step_on_every_rank(results):
    for rank in range(N):
        assert results[rank]["skip"] == (1, True, "skipped")


def test_zero_with_deferred_verdicts_judges_the_gradient_pass_once_before_the_optimizer_step(results):
    """verdict="step": the gradient pass read once, at the boundary (the
    simulation test above checks the weights); a NaN is the same error and
    a skip the same skip as the collective protocol's, before ZeRO steps."""
    for rank in range(N):
        assert results[rank]["stage2-sign-step/reads"] == 1 and results[rank]["stage2-sign/reads"] is None
        assert results[rank]["nan-step"] == results[rank]["nan"]
        assert results[rank]["skip-step"] == (1, True, "skipped")


def test_zero_checkpoint_without_the_section_warns_and_trains(results):
    for rank in range(N):
        warned, params = results[rank]["without-section"]
        assert len(warned) == 1
        assert all(torch.equal(a, b) for a, b in zip(params, results[0]["without-section"][1]))


def test_install_makes_plain_deepspeed_initialize_compress_at_zero_2(results):
    kinds = {results[rank]["install"][0] for rank in range(N)}
    assert kinds == {"ZeroCompression"}
    assert all(torch.equal(a, b) for a, b in zip(results[0]["install"][1], results[1]["install"][1]))


def test_uninstall_puts_back_everything_deepspeed_ext_changed_in_deepspeed(results):
    for rank in range(N):
        restored = results[rank]["install"][2]
        assert restored == {"constructor replaced while installed": True, "all-gather after steps": True,
                            "constructor after uninstall": True, "all-gather after uninstall": True}


def write(tmp_path, cfg):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("zero, section, message", [
    ({"stage": 3, "offload_param": {"device": "cpu"}}, {}, "offload_param"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}, "offload_optimizer"),
    ({"stage": 1}, {"owners": 2}, "one owner"),
    ({"stage": 2}, {"aggregator": "median"}, "must be trusted"),
    ({"stage": 2}, {"error_feedback": "ef21"}, "ef21"),
])
def test_what_zero_cannot_serve_is_refused_at_initialize(tmp_path, zero, section, message):
    require("deepspeed")
    import deepspeed_ext as dx
    model = torch.nn.Linear(2, 2)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "doublesqueeze": section}
    with pytest.raises(dsq.ConfigError, match=message):
        dx.initialize(model=model, model_parameters=model.parameters(), config=write(tmp_path, cfg))
