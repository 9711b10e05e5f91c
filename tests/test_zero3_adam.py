"""CompressedAdam at ZeRO stage 3 (a OneBitAdam config), for real: the
`deepspeed` launcher, CPU accelerator, gloo (tests/workers/zero3_adam_worker.py),
on 2 ranks and on 4 as 2 hosts of 2. The warm-up must be DeepSpeed's own
stage 3 bit for bit; after the freeze, on one host, the run must follow
CompressedAdam at stage 0 on the same batches, and with the exact operator
be its frozen-variance control to a few ulps."""
import json

import pytest
import torch

import dsq_plugins as dsq
from tests.conftest import require
from tests.helpers.launchers import launch
from tests.test_zero_adam import stage0_losses
from tests.workers import zero3_adam_worker as W


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    require("deepspeed")
    return launch("deepspeed", 2, "zero3_adam_worker.py", out_dir=str(tmp_path_factory.mktemp("zero3-adam")),
                  timeout=900)


def test_the_warm_up_is_deepspeeds_own_stage_3_adamw_bit_for_bit(results):
    for rank in range(2):
        ours, deepspeeds = results[rank]["warmup"]
        assert torch.equal(ours, deepspeeds)


@pytest.mark.parametrize("scenario", ["onebit", "bf16"])
def test_after_the_freeze_it_follows_compressed_adam_at_stage_0_and_every_rank_holds_one_model(results, scenario):
    """Gradient clipping is off in both (at stage 3 each bucket's momentum is
    exchanged before the whole gradient's norm exists); the compressor's
    chunks are laid out by bucket here and by tensor at stage 0, so the
    runs agree to a bound, not bit for bit (the next test pins the rest)."""
    d = results[0][scenario]
    assert d["kind"] == "Zero3CompressedAdam" and d["frozen"]
    assert torch.equal(d["params"], results[1][scenario]["params"])
    stage0 = stage0_losses(max_grad_norm=0.0)
    assert d["losses"][:W.FREEZE + 1] == pytest.approx(stage0[:W.FREEZE + 1], abs=2e-3)  # bf16 rounds the model
    assert max(abs(a - b) for a, b in zip(d["losses"], stage0)) < 0.03


def test_where_the_variance_is_zero_the_momentum_stays_zero(results):
    for rank in range(2):
        assert results[rank]["onebit"]["never"] > 0 and results[rank]["onebit"]["momentum_there"] == 0


def test_two_one_bit_passes_per_step_after_the_freeze(results):
    """u to its owner and back, against the 2(N-1)/N·4 bytes per parameter of
    an fp32 ring allreduce; this model is small (2.4K parameters), so
    headers and per-chunk scales keep it well under 32x."""
    d = results[0]["onebit"]
    assert 2 * (2 - 1) / 2 * 4 * d["numel"] / d["bytes_per_step"] > 12


def test_a_checkpoint_after_the_freeze_resumes_bit_for_bit(results):
    """On one host, as if the run had never stopped."""
    for rank in range(2):
        d = results[rank]["resume"]
        assert d["frozen"] and torch.equal(d["straight"], d["resumed"]) and torch.equal(d["straight"], d["continued"])


def test_deepspeeds_zero_to_fp32_rebuilds_the_model_from_a_checkpoint_written_after_the_freeze(results):
    d = results[0]["resume"]
    assert torch.equal(d["zero_to_fp32"], d["saved"])


def test_a_nan_after_the_freeze_is_the_same_error_on_every_rank_and_writes_nothing(results):
    for rank in range(2):
        assert results[rank]["nan"] == ("NonFiniteGradientError", True)


def test_install_makes_hf_style_deepspeed_initialize_use_it(results):
    assert results[0]["install"][:2] == ("Zero3CompressedAdam", True)
    assert torch.equal(results[0]["install"][2], results[1]["install"][2])


@pytest.mark.parametrize("extra, message", [
    ({"fp16": {"enabled": True}}, "OneBitAdam with fp16 at ZeRO stage 3"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
])
def test_what_stage_3_cannot_serve_is_refused_by_name_before_deepspeed_builds_anything(tmp_path, extra, message):
    require("deepspeed")
    import deepspeed_ext as dx
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(W.one_bit_config(extra=extra)))
    with pytest.raises(dsq.ConfigError, match=message):
        dx.initialize(model=model, model_parameters=model.parameters(), config=str(path))


# -- two levels: 2 hosts of 2 ranks (hierarchy "node", node_size 2) --------------------------------------

@pytest.fixture(scope="module")
def host_results(tmp_path_factory):
    require("deepspeed")
    return launch("deepspeed", 4, "zero3_adam_worker.py", "--hosts",
                  out_dir=str(tmp_path_factory.mktemp("zero3-adam-hosts")), timeout=900)


def test_in_two_levels_the_parameter_pass_is_compressed_and_every_rank_holds_one_model(host_results):
    """hpZ over each host; the parameters reach the other host through the
    compressed replica (``zero3_params``): the same model on every rank, and it trains."""
    d = host_results[0]["hosts"]
    assert d["frozen"] and d["parameter_pass"]
    assert [host_results[r]["hosts"]["position"] for r in range(4)] == [(2, 2, 0, 0), (2, 2, 0, 1), (2, 2, 1, 0),
                                                                        (2, 2, 1, 1)]
    for rank in range(1, 4):
        assert torch.equal(d["params"], host_results[rank]["hosts"]["params"])
    stage0 = stage0_losses(n=4, max_grad_norm=0.0, hierarchy="node", node_size=2)
    assert d["losses"][:W.FREEZE + 1] == pytest.approx(stage0[:W.FREEZE + 1], abs=0.02)
    assert sum(d["losses"][-3:]) / 3 < sum(d["losses"][:3]) / 3


def test_in_two_levels_the_state_is_one_host_shard(host_results):
    """m, D and the worker error over a host shard: about half of flat's per
    rank at 2 ranks per host; the server error is a partition either way."""
    flat, hosts = host_results[0]["flat"], host_results[0]["hosts"]
    server_partition = flat["numel"] / 4  # int8 server error of one partition, about 1 byte per element
    assert hosts["state_bytes"] <= flat["state_bytes"] / 2 + server_partition


def test_in_two_levels_a_checkpoint_resumes_bit_for_bit_and_a_nan_changes_nothing(host_results):
    for rank in range(4):  # (a save restarts the replicas from the exact weights: the run that saved goes on alike)
        d = host_results[rank]["hosts-resume"]
        assert d["frozen"] and torch.equal(d["continued"], d["resumed"])
        assert host_results[rank]["hosts-nan"] == ("NonFiniteGradientError", True)


def test_in_two_levels_a_checkpoint_loaded_at_another_layout_is_refused_by_name(host_results):
    for rank in range(4):
        kind, message = host_results[rank]["other-layout"]
        assert kind == "StateError" and "hosts" in message
