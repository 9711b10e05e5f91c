"""ZeRO stage 3 with the section (``deepspeed_ext.zero3``), for real: the
``deepspeed`` launcher, 2 ranks, CPU accelerator, gloo
(tests/workers/zero3_worker.py), and the bucket layout on its own."""
from types import SimpleNamespace

import pytest
import torch

import dsq_plugins as dsq
from tests.conftest import require
from tests.helpers.launchers import launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    require("deepspeed")
    return launch("deepspeed", 2, "zero3_worker.py", out_dir=str(tmp_path_factory.mktemp("zero3")), timeout=900)


def test_the_exact_operator_at_stage_3_is_deepspeeds_own_stage_3_bit_for_bit(results):
    for rank in results:
        assert rank["exact"]["losses"] == rank["deepspeed"]["losses"]
        assert torch.equal(rank["exact"]["params"], rank["deepspeed"]["params"])


def test_on_one_host_auto_reduces_exactly_and_flat_compresses(results):
    for rank in results:
        assert rank["sign-on-one-host"]["losses"] == rank["deepspeed"]["losses"]
        assert torch.equal(rank["sign-on-one-host"]["params"], rank["deepspeed"]["params"])
        assert rank["sign-on-one-host"]["memories"] == []  # nothing compressed, no error memory


def test_sign_at_stage_3_keeps_one_error_memory_per_bucket_and_every_rank_the_same_model(results):
    sign, exact = results[0]["sign"], results[0]["exact"]
    assert torch.equal(sign["params"], results[1]["sign"]["params"])  # gathered from the partitions
    assert not torch.equal(sign["params"], exact["params"])          # compression changed the training
    assert len(sign["memories"]) >= 2 and all(name.startswith("zero3.bucket.") for name in sign["memories"])
    assert all(abs(a - b) < 0.1 for a, b in zip(sign["losses"], exact["losses"]))
    assert sign["bytes"] * 5 < exact["bytes"], (sign["bytes"], exact["bytes"])  # gradients at a bit each


def test_a_stage_3_run_resumed_from_its_checkpoint_continues_bit_for_bit(results):
    for rank in results:
        (continued, params), (resumed, resumed_params) = rank["resume"]["continued"], rank["resume"]["resumed"]
        assert continued == resumed and torch.equal(params, resumed_params)


def test_deepspeeds_zero_to_fp32_rebuilds_the_model_from_a_checkpoint_written_with_the_section(results):
    assert torch.equal(results[0]["zero_to_fp32"], results[0]["saved_at_three"])


def test_a_nan_on_one_rank_is_the_same_error_from_every_ranks_backward_and_writes_nothing(results):
    errors = [rank["nan"][0] for rank in results]
    assert errors[0] == errors[1] and errors[0][0] == "NonFiniteGradientError", errors
    assert "on rank(s) [1]" in errors[0][1] and "state is unchanged on every rank" in errors[0][1]
    assert all(rank["nan"][1] for rank in results)  # the reducer's state is what it was before that backward


def test_verdicts_judged_once_per_backward_give_the_same_model_and_the_same_error(results):
    for rank in results:
        assert rank["sign-step"]["losses"] == rank["sign"]["losses"]
        assert torch.equal(rank["sign-step"]["params"], rank["sign"]["params"])
        assert rank["sign"]["reads"] is None and rank["sign-step"]["reads"] == 1  # one per backward
    errors = [rank["nan-step"][0] for rank in results]
    assert errors[0] == errors[1] == results[0]["nan"][0]
    assert all(rank["nan-step"][1] for rank in results)


@pytest.mark.launcher
@pytest.mark.parametrize("where,error", [("backward", "PeerFailedError"), ("forward", "RuntimeError")])
def test_a_peer_lost_mid_run_is_an_error_on_the_survivor_within_seconds_and_writes_nothing(tmp_path, where, error):
    """Rank 1 is SIGKILLed at its third step, one host per rank (each its own torchrun, as on a cluster).
    Before its backward: rank 0's gradient pass is the first to notice, and names the collective
    (PeerFailedError). Before its forward: DeepSpeed's own parameter gather is, and gloo's error names the
    peer's address. Either way rank 0 raises at once, with its error-feedback state as it was."""
    import os

    from tests.helpers.launchers import run_hosts
    require("deepspeed")
    ran = run_hosts("zero3_worker.py", str(tmp_path), hosts=2, per_host=1, timeout=300, env={"DSQ_LOSE_PEER": where})
    assert all(code != 0 for code, _ in ran), "\n".join(out[-2000:] for _, out in ran)
    lost = torch.load(os.path.join(tmp_path, "lost-rank0.pt"))
    assert lost["raised"] is not None and lost["raised"][0] == error, lost
    assert "peer" in lost["raised"][1] and lost["seconds"] < 60 and lost["unchanged"], lost


def test_the_bucket_layout_gives_rank_k_every_parameters_partition_k():
    from deepspeed_ext.zero3 import layout_of
    numels, size = (10, 3, 7), 4
    params = [SimpleNamespace(ds_numel=n, partition_numel=lambda n=n: -(-n // size)) for n in numels]
    layout = layout_of(params, ["a", "b", "c"], size)
    grads = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(numels)]
    flat = layout.flatten(grads).view(size, layout.width)
    for k in range(size):
        for g, part, got in zip(grads, layout.partitions, layout.partitions_of(flat[k])):
            want = torch.zeros(part)
            piece = g[k * part:(k + 1) * part]
            want[:piece.numel()] = piece
            assert torch.equal(got, want)
        padding = layout.padding(k, torch.device("cpu"))
        real = torch.tensor([k * part + j < n for n, part in zip(numels, layout.partitions) for j in range(part)])
        assert torch.equal(padding if padding is not None else torch.zeros_like(real), ~real)
    assert layout.name == layout_of(params, ["a", "b", "c"], size).name != layout_of(params, ["a", "c", "b"],
                                                                                     size).name


@pytest.mark.parametrize("zero, section, message", [
    ({"stage": 3, "offload_param": {"device": "cpu"}}, {}, "offload_param"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, {}, "offload_optimizer"),
    ({"stage": 3}, {"on_nonfinite": "skip"}, "on_nonfinite='skip' is not served at ZeRO stage 3"),
    ({"stage": 3}, {"owners": 2}, "one owner"),
    ({"stage": 3}, {"aggregator": "median"}, "must be trusted"),
])
def test_what_stage_3_cannot_serve_is_refused_by_name_before_deepspeed_builds_anything(zero, section, message):
    require("deepspeed")
    import deepspeed_ext as dx
    with pytest.raises(dsq.ConfigError, match=message):
        dx.split_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "doublesqueeze": section})


@pytest.fixture(scope="module")
def two_hosts():
    """tests/workers/zero3_hosts_worker.py on 2 simulated hosts x 2 ranks (one torchrun per host)."""
    from tests.helpers.launchers import launch_hosts
    require("deepspeed")
    return launch_hosts("zero3_hosts_worker.py", hosts=2, per_host=2, timeout=900)


@pytest.mark.parametrize("scenario", ["sign", "sign-persistent", "sign-pieces"])
def test_across_hosts_the_parameter_pass_moves_hpzs_secondary_partition_as_the_replica(two_hosts, scenario):
    """The section sets hpZ's groups to the hosts; after each step the owners' compressed ``Q(master -
    replica)`` moves every secondary partition, so each forward computes with the replica, not with the
    masters (their gap is the owners' error memory, small and not zero), the same model on every rank, and
    each owner's own copy is exactly its partition of it; with DeepSpeed's persistence (this model kept whole)
    too, its kept parameters gathered from the moved secondary partitions. A secondary partition dropped
    after a step, as DeepSpeed does, or a replica moved by another update than its owner's, fails this. With
    small buckets each group moves in several pieces (the decoded rows held at once are a bucket's)."""
    for run in two_hosts:
        result = run[scenario]
        assert result["pass"] and result["hpz"] == 2
        pieces, groups = result["pieces"]
        assert pieces > groups if scenario == "sign-pieces" else pieces == groups
        matches, kept, gap = result["check"]
        assert matches and kept and 0 < gap < 0.1, result["check"]
        assert set(result["steps"].values()) == {6}  # every bucket and the parameter pass, once a step
    assert all(torch.equal(two_hosts[0][scenario]["params"], run[scenario]["params"]) for run in two_hosts[1:])


def test_across_hosts_a_run_resumed_from_its_checkpoint_continues_bit_for_bit(two_hosts):
    """A save or a load restarts the replicas from the exact weights (DeepSpeed's next gather), so the run
    that wrote the checkpoint and a fresh engine that loads it go on alike."""
    for run in two_hosts:
        (continued, model), (resumed, resumed_model) = run["resume"]["continued"], run["resume"]["resumed"]
        assert continued == resumed and torch.equal(model, resumed_model)


@pytest.mark.parametrize("verdict", ["collective", "step"])
def test_across_hosts_a_nan_in_a_master_is_the_same_error_on_every_rank_and_moves_no_replica(two_hosts, verdict):
    """The last rank's fp32 master holds a NaN as the parameter pass runs: every rank raises the error naming
    its host, at once (one cross group saw it; the others learn it inside their hosts before their own cross
    stage, where they waited for it before), and no replica copy or secondary partition moved."""
    raised = [run["nan"][verdict][0] for run in two_hosts]
    assert all(r is not None and r[0] == "NonFiniteGradientError" and "host(s) [1] (ranks [2, 3])" in r[1]
               for r in raised), raised
    assert len({r[1] for r in raised}) == 1 and all(run["nan"][verdict][1] for run in two_hosts)

