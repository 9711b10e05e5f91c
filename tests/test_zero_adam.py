"""CompressedAdam at ZeRO stages 1 and 2 (a OneBitAdam config), for real:
the `deepspeed` launcher, 2 ranks, CPU accelerator, gloo
(tests/workers/zero_adam_worker.py). The warm-up must be DeepSpeed's own ZeRO path
bit for bit; after the freeze the run must follow CompressedAdam at stage 0
(the same algorithm, the optimizer state replicated) on the same batches."""
import json

import pytest
import torch
import torch.nn.functional as F

import dsq_plugins as dsq
from examples.train_digits import make_model
from tests.conftest import require
from tests.helpers.launchers import launch
from tests.workers import zero_adam_worker as W
from tests.workers.hvd_worker import batches

N = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    require("deepspeed")
    return launch("deepspeed", N, "zero_adam_worker.py", out_dir=str(tmp_path_factory.mktemp("zero-adam")),
                  timeout=900)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def stage0_losses(steps=W.STEPS, n=N, max_grad_norm=1.0, **kw):
    """CompressedAdam (stage 0, in process) on the batches the worker trains on."""
    def per_rank(comm):
        model = make_model(seed=1, hidden=32)
        opt = dsq.CompressedAdam(model.named_parameters(), comm=comm, lr=W.LR, freeze_step=W.FREEZE,
                                 weight_decay=0.01, max_grad_norm=max_grad_norm, **kw)
        losses = []
        for step in range(steps):
            for x, y in batches(comm.rank, step, 1):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses
    return dsq.LocalGroup(n).run(per_rank)[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_the_warm_up_is_deepspeeds_own_zero_adamw_bit_for_bit(results, stage):
    for rank in range(N):
        ours, deepspeeds = results[rank][f"warmup{stage}"]
        assert same(ours, deepspeeds)


@pytest.mark.parametrize("scenario", ["onebit1", "onebit2", "fp32", "gas-clip", "bf16"])
def test_every_rank_holds_the_same_model_and_the_variance_froze(results, scenario):
    assert results[0][scenario]["frozen"] and results[0][scenario]["kind"] == "ZeroCompressedAdam"
    assert same(results[0][scenario]["params"], results[1][scenario]["params"])


@pytest.mark.parametrize("scenario", ["onebit1", "onebit2", "bf16", "fp32"])
def test_after_the_freeze_it_follows_compressed_adam_at_stage_0(results, scenario):
    ours, stage0 = results[0][scenario]["losses"], stage0_losses()
    assert ours[:W.FREEZE + 1] == pytest.approx(stage0[:W.FREEZE + 1], abs=2e-3)  # bf16 rounds the model
    assert max(abs(a - b) for a, b in zip(ours, stage0)) < 0.02


def test_with_the_exact_operator_it_is_the_frozen_variance_control():
    """Sanity of the reference: stage 0 with "none" differs from sign by more than the bound above."""
    exact, sign = stage0_losses(compressor="none"), stage0_losses()
    assert max(abs(a - b) for a, b in zip(exact, sign)) > 1e-3


def test_where_the_variance_is_zero_the_momentum_stays_zero_on_every_rank(results):
    """As CompressedAdam masks it: else sign would give those coordinates a
    value every step, which inflates the scale of every real one (a GPT with
    unseen bytes diverged that way)."""
    for rank in range(N):
        assert results[rank]["onebit2"]["never"] > 0 and results[rank]["onebit2"]["momentum_there"] == 0


def test_accumulation_and_clipping_train(results):
    losses = results[0]["gas-clip"]["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4


def test_two_one_bit_passes_per_step_after_the_freeze(results):
    """Momentum to its owner and back: about 1/32 of ZeRO's fp32 reduce-scatter
    and all-gather; this model is small (4.8K parameters), so headers and
    per-chunk scales keep it under 32x."""
    d = results[0]["onebit2"]
    assert d["fp32_allreduce"] / d["bytes_per_step"] > 24


def test_the_state_is_the_memories_and_the_momentums_payloads(results):
    """The worker error over the whole vector and the server error over this
    rank's half (4 + 2 bytes per parameter in fp32, 1.5 in int8), and the
    momentum as the server pass's payloads: 1 bit per element, plus scales."""
    fp32, int8 = (results[0][k]["state_bytes"] / results[0][k]["numel"] for k in ("fp32", "onebit2"))
    assert 6.1 < fp32 < 6.3 and 1.6 < int8 < 1.8


@pytest.mark.parametrize("scenario", ["resume", "resume-fp32"])
def test_a_checkpoint_after_the_freeze_resumes_bit_for_bit(results, scenario):
    for rank in range(N):
        straight, resumed, frozen = results[rank][scenario]
        assert frozen and same(straight, resumed)


def test_install_makes_hf_style_deepspeed_initialize_use_it(results):
    assert results[0]["install"][:2] == ("ZeroCompressedAdam", True)
    assert same(results[0]["install"][2], results[1]["install"][2])


def test_a_nan_after_the_freeze_is_the_same_error_or_a_skipped_step_on_every_rank(results):
    for rank in range(N):
        assert results[rank]["nan"][:2] == ("NonFiniteGradientError", True)
        error, unchanged, skipped = results[rank]["nan-skip"]
        assert error is None and unchanged and skipped == 1


def test_an_auto_freeze_is_decided_alike_on_every_rank(results):
    frozen_at, frozen, losses, params = results[0]["auto"]
    assert frozen and 2 <= frozen_at < W.STEPS and frozen_at % 2 == 0
    assert results[1]["auto"][:2] == (frozen_at, True) and same(params, results[1]["auto"][3])
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("zero, message", [({"stage": 3, "offload_param": {"device": "cpu"}}, "offload_param"),
                                           ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "offload")])
def test_what_the_mapping_cannot_serve_is_refused_by_name(tmp_path, zero, message):
    require("deepspeed")
    import deepspeed_ext as dx
    model = torch.nn.Linear(2, 2)
    cfg = {**W.one_bit_config(2), "zero_optimization": zero}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(dsq.ConfigError, match=message):
        dx.initialize(model=model, model_parameters=model.parameters(), config=str(path))


# -- two levels: 2 hosts of 2 ranks (hierarchy "node", node_size 2) --------------------------------------

@pytest.fixture(scope="module")
def host_results(tmp_path_factory):
    require("deepspeed")
    return launch("deepspeed", 4, "zero_adam_worker.py", "--hosts",
                  out_dir=str(tmp_path_factory.mktemp("zero-adam-hosts")), timeout=900)


@pytest.mark.parametrize("scenario", ["hosts1", "hosts2"])
def test_in_two_levels_every_rank_holds_the_same_model_and_follows_stage_0(host_results, scenario):
    """The momentum's host shards, stepped by each local rank and gathered
    inside the host, make one model everywhere; after the freeze it trains
    as CompressedAdam at stage 0 in two levels (the same algorithm; the
    compressor's chunks differ, so not bit for bit)."""
    assert host_results[0][scenario]["frozen"]
    assert [host_results[r][scenario]["position"] for r in range(4)] == [(2, 2, 0, 0), (2, 2, 0, 1), (2, 2, 1, 0),
                                                                          (2, 2, 1, 1)]
    for rank in range(1, 4):
        assert same(host_results[0][scenario]["params"], host_results[rank][scenario]["params"])
    ours = host_results[0][scenario]["losses"]
    stage0 = stage0_losses(n=4, hierarchy="node", node_size=2)
    assert ours[:W.FREEZE + 1] == pytest.approx(stage0[:W.FREEZE + 1], abs=2e-3)
    assert max(abs(a - b) for a, b in zip(ours, stage0)) < 0.02


def test_in_two_levels_the_state_is_one_host_shard(host_results):
    """Momentum payloads, worker error and denominators 1/L of flat's per
    rank; the server error is a partition either way."""
    flat, hosts = host_results[0]["flat2"], host_results[0]["hosts2"]
    for key in ("denominator_bytes",):
        assert hosts[key] == flat[key] / 2
    flat_total, hosts_total = (d["state_bytes"] + d["denominator_bytes"] for d in (flat, hosts))
    server_partition = flat["numel"] / 4  # int8 server error of one partition, about 1 byte per element
    assert hosts_total <= flat_total / 2 + server_partition


def test_in_two_levels_a_checkpoint_resumes_bit_for_bit_and_a_nan_changes_nothing(host_results):
    for rank in range(4):
        straight, resumed, frozen = host_results[rank]["hosts-resume"]
        assert frozen and same(straight, resumed)
        assert host_results[rank]["hosts-nan"][:2] == ("NonFiniteGradientError", True)


def test_in_two_levels_a_checkpoint_loaded_at_another_layout_is_refused_by_name(host_results):
    for rank in range(4):
        kind, message = host_results[rank]["other-layout"]
        assert kind == "StateError" and "hosts" in message


def test_node_on_one_host_averages_exactly_and_trains(host_results):
    d = host_results[0]["one-host"]
    assert d["frozen"] and d["position"] == (1, 4, 0, 0) and d["losses"][-1] < d["losses"][0]
    for rank in range(1, 4):
        assert same(d["params"], host_results[rank]["one-host"]["params"])
