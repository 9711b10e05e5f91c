"""FSDP2 and HSDP with DoubleSqueeze on real processes (torchrun, 4 gloo
ranks): ``dsq_plugins.fsdp.compress`` on a 1-D mesh (the reduce-scatter is
the worker pass) and on HSDP's 2 x 2 mesh (the replicas exchange by
Algorithm 1), and ``compressed_adam`` on HSDP's shards."""
import pytest
import torch

from tests.helpers.launchers import launch

N = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("torchrun", N, "fsdp_worker.py", out_dir=str(tmp_path_factory.mktemp("fsdp")), timeout=900)


def distance(a, b):
    return max((x - y).abs().max().item() if x.numel() else 0.0 for x, y in zip(a, b))


@pytest.mark.parametrize("mesh", ["1d", "hsdp"])
def test_with_the_exact_operator_training_is_fsdps_own(results, mesh):
    for rank in range(N):
        run, native = results[rank][f"exact-{mesh}"], results[rank][f"native-{mesh}"]
        assert run["losses"] == pytest.approx(native["losses"], rel=1e-6)
        assert distance(run["locals"], native["locals"]) < 1e-6
        assert run["backwards"] == 6


@pytest.mark.parametrize("mesh", ["1d", "hsdp"])
def test_sign_trains_close_to_exact_with_one_step_per_backward(results, mesh):
    run, native = results[0][f"sign-{mesh}"], results[0][f"native-{mesh}"]
    assert run["backwards"] == 6
    assert run["losses"][0] == native["losses"][0] and run["losses"][1:] != native["losses"][1:]
    assert distance(run["locals"], native["locals"]) < 0.1
    assert sum(run["losses"][-2:]) < sum(run["losses"][:2])


@pytest.mark.parametrize("mesh", ["1d", "hsdp"])
def test_exact_steps_average_exactly_first(results, mesh):
    run, native = results[0][f"warm-{mesh}"], results[0][f"native-{mesh}"]
    assert run["losses"][:3] == pytest.approx(native["losses"][:3], rel=1e-6)
    assert run["losses"][3:] != pytest.approx(native["losses"][3:], rel=1e-6)
    assert run["backwards"] == 6


def test_on_a_1d_mesh_sign_sends_a_tenth_of_fsdps_reduce_scatter(results):
    """FSDP's fp32 reduce-scatter sends (n-1)/n of the padded gradients per rank; the worker pass one bit
    each plus a scale per chunk and the header (more of the total on this small model than on a real one)."""
    for rank in range(N):
        run = results[rank]["sign-1d"]
        fsdp_bytes = 6 * run["padded"] * 4 * (N - 1) / N
        assert run["bytes"] < fsdp_bytes / 10
        assert run["worker_error"] == run["padded"] and run["server_error"] == 0  # no server pass: one owner


def test_hsdp_replicas_hold_the_same_shard_and_memories_a_shard_long(results):
    for a, b in [(0, 2), (1, 3)]:  # mesh (replicate, shard) = (2, 2): ranks 0 and 2 hold shard 0
        assert distance(results[a]["sign-hsdp"]["locals"], results[b]["sign-hsdp"]["locals"]) == 0
        assert distance(results[a]["cadam-hsdp"]["locals"], results[b]["cadam-hsdp"]["locals"]) == 0
    run = results[0]["sign-hsdp"]
    assert run["worker_error"] == run["padded"] // 2  # this rank's shard, not the model
    assert run["server_error"] == -(-run["worker_error"] // 2)  # its chunk of the shard among 2 replicas


@pytest.mark.parametrize("mesh", ["1d", "hsdp"])
def test_a_nan_on_one_rank_is_the_same_error_everywhere_and_writes_nothing(results, mesh):
    for rank in range(N):
        run = results[rank][f"failure-{mesh}"]
        assert run["error"] is not None and "NaN or Inf" in run["error"]
        assert run["state_unchanged"] and run["backwards"] == 2
    errors = {results[rank][f"failure-{mesh}"]["error"] for rank in range(N)}
    assert len(errors) == 1, errors
    if mesh == "hsdp":
        assert "replicas" in errors.pop()
    # FSDP goes on after the error: the next step exchanges and is applied
    assert all(isinstance(results[rank][f"failure-{mesh}"]["recovered"], list) for rank in range(N))
    assert results[0][f"failure-{mesh}"]["backwards_after"] == 3


@pytest.mark.parametrize("mesh", ["1d", "hsdp"])
def test_verdicts_judged_once_per_backward_give_the_same_training_and_errors(results, mesh):
    """verdict="step" (what "auto" is on a GPU): the modules of a backward
    are planned after the first one, and a backward then reads the host
    once; the weights are the collective protocol's bit for bit, and a NaN
    is the same error on every rank with nothing written."""
    for rank in range(N):
        step, collective = results[rank][f"sign-step-{mesh}"], results[rank][f"sign-{mesh}"]
        assert distance(step["locals"], collective["locals"]) == 0 and step["backwards"] == collective["backwards"]
        assert step["reads"] == 1
        run = results[rank][f"failure-step-{mesh}"]
        assert run["error"] is not None and "NaN or Inf" in run["error"] and run["state_unchanged"]
        assert run["backwards"] == 2 and isinstance(run["recovered"], list)
    assert len({results[rank][f"failure-step-{mesh}"]["error"] for rank in range(N)}) == 1


def test_accumulation_without_sync_exchanges_nothing(results):
    for mesh in ("1d", "hsdp"):
        run = results[0][f"accumulation-{mesh}"]
        assert run["quiet_bytes"] == 0 and run["quiet_backwards"] == 0 and run["quiet_memories"] == 0
        assert run["bytes"] > 0 and run["backwards"] == 1


def test_the_state_resumes_bit_for_bit_through_dcp_and_refuses_another_ranks(results):
    for rank in range(N):
        run = results[rank]["resume-hsdp"]
        assert distance(run["first"], run["again"]) == 0
        assert "not this rank's (rank" in run["refused"]["another rank's file"]
        refused = run["refused"]["another rank's state"]
        assert "saved by rank" in refused and f"this is rank {rank} of 4" in refused


def test_bf16_reduction_trains(results):
    run = results[0]["bf16-hsdp"]
    assert run["backwards"] == 6 and all(torch.isfinite(torch.tensor(run["losses"])))
    assert sum(run["losses"][-2:]) < sum(run["losses"][:2])


def test_compressed_adam_is_adamw_until_the_freeze(results):
    for rank in range(N):
        warm, adamw = results[rank]["warmup-hsdp"], results[rank]["adamw-hsdp"]
        assert not warm["frozen"] and distance(warm["locals"], adamw["locals"]) < 1e-6
        frozen = results[rank]["cadam-hsdp"]
        assert frozen["frozen"] and frozen["losses"][:3] == pytest.approx(adamw["losses"][:3], rel=1e-6)


def test_compressed_adam_on_one_shard_per_replica_is_flat_compressed_adam_bit_for_bit(results):
    for rank in range(N):
        assert distance(results[rank]["cadam-one-shard"]["locals"], results[rank]["cadam-flat"]) == 0


def test_compressed_adam_leaves_a_layer_frozen_after_it_was_built_as_it_was(results):
    """Its shards do not require a gradient themselves: whether a layer trains is its parameters'
    ``requires_grad``. The frozen layer (weights and bias) stays bit for bit, the others train."""
    for rank in range(N):
        run = results[rank]["cadam-frozen-layer"]
        before, after = run["before"], run["after"]
        assert distance(before[2:4], after[2:4]) == 0 and distance(before[:2], after[:2]) > 0
        assert distance(before[4:], after[4:]) > 0 and run["frozen"]


def test_compressed_adam_keeps_a_shard_of_state_and_freezes_together(results):
    sharded, whole = results[0]["cadam-hsdp"], results[0]["cadam-one-shard"]
    # rank 0's shards are unpadded (FSDP pads the last shard): exp_avg and exp_avg_sq of half the padded model
    assert sharded["state_numel"] == 2 * (results[0]["sign-hsdp"]["padded"] // 2)
    assert sharded["state_numel"] * 1.9 < whole["state_numel"] + 1
    assert sharded["memories"] * 1.5 < whole["memories"]
    assert {results[rank]["cadam-auto-hsdp"]["freeze_step"] for rank in range(N)} == {4}
    # the budget: compression state at most the fp32 model's bytes x 1.1 / L (L = 2 shards), int8 here
    for rank in range(N):
        run = results[rank]["cadam-hsdp"]
        assert run["memory_bytes"] <= 1.1 * 4 * run["model_numel"] / 2


def test_bad_input_is_a_config_error_naming_it(results):
    bad = results[0]["bad"]
    assert "fully_shard" in bad["before fully_shard"]
    assert "already wired" in bad["twice"]
    assert "1-D mesh" in bad["adam on a 1-D mesh"]
    assert "bucket_size" in bad["bad key"]
    assert "set_requires_gradient_sync" in bad["set_requires_all_reduce"]


def test_lightning_model_parallel_strategy_trains_through_compress(tmp_path):
    """A LightningModule's configure_model shards with fully_shard and calls dsq_fsdp.compress, as the
    README says: every step goes through it, the replicas agree."""
    from tests.conftest import require
    require("lightning")
    got = launch("torchrun", N, "lightning_fsdp_worker.py", "hsdp", out_dir=str(tmp_path), timeout=600)
    assert all(r["backwards"] == 8 and r["mesh"] == "HSDP 2 replicas x 2 shards" for r in got)
    assert got[0]["bytes"] > 0
    assert distance(got[0]["locals"], got[2]["locals"]) == 0 and distance(got[1]["locals"], got[3]["locals"]) == 0
