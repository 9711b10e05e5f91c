"""The Horovod drop-in keeps hvd.DistributedOptimizer's contract: resume
through Horovod's broadcasts, process sets, sparse embeddings, the
synchronize/step warning, clean shutdown, and no silent hang. One
``horovodrun -np 3`` launch (tests/workers/hvd_contract_worker.py); a hang fails the
launch's timeout instead of the suite."""
import functools
import re

import pytest
import torch

from tests.helpers.launchers import launch
from tests.test_reshard import owed

N = 3


@functools.lru_cache(maxsize=None)
def contract_results():
    return launch("horovodrun", N, "hvd_contract_worker.py", timeout=300, env={"DSQ_EXCHANGE_TIMEOUT": "60"})


@pytest.fixture(scope="module")
def results():
    return contract_results()


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_resume_through_broadcast_optimizer_state_does_not_hang_and_syncs_every_rank(results):
    momentum, params = results[0]["resume-horovod"]
    for rank in range(1, N):
        other_momentum, other_params = results[rank]["resume-horovod"]
        assert equal(momentum, other_momentum) and equal(params, other_params)
    assert any(bool(m.abs().sum() > 0) for m in momentum)  # rank 0's loaded state, not fresh zeros


def test_each_rank_resuming_its_own_state_continues_bit_for_bit(results):
    assert all(results[rank]["resume-per-rank"] for rank in range(N))


def test_loading_another_ranks_broadcast_state_keeps_this_ranks_error_memory(results):
    for rank in range(N):
        kept, warned = results[rank]["resume-broadcast-object"]
        assert kept
        assert len(warned) == (0 if rank == 0 else 1)


@pytest.mark.parametrize("scenario", ["process-set", "process-set-torch"])
def test_process_set_members_exchange_among_themselves_and_others_pass_through(results, scenario):
    inside = [results[rank][scenario] for rank in (0, 2)]
    assert equal(inside[0][0], inside[1][0]) and all(sent > 0 for _, _, sent in inside)
    assert not equal(inside[0][0], inside[0][1])  # averaged with rank 2, not its own steps
    params, alone, sent = results[1][scenario]
    assert equal(params, alone) and sent == 0  # rank 1 stepped on its own gradients, moved nothing


def test_sparse_embeddings_train_like_horovods_sparse_path_with_one_warning(results):
    for rank in range(N):
        params, grad_sparse, warnings_seen = results[rank]["sparse-dropin"]
        stock_params, _, _ = results[rank]["sparse-stock"]
        assert grad_sparse and warnings_seen == 1
        assert equal(params, results[0]["sparse-dropin"][0])
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, stock_params))


def test_step_after_synchronize_warns_like_horovod_and_exchanges_once(results):
    for rank in range(N):
        (plain, in_context), names_ok = results[rank]["synchronize-warning"]
        messages, not_exchanged_again = plain
        assert len(messages) == 1 and "optimizer.step() called without optimizer.skip_synchronize()" in messages[0]
        assert not_exchanged_again
        assert in_context == ([], True)
        assert names_ok  # opt._parameter_names maps every parameter to its name, as Horovod's does


def test_stock_path_refuses_skip_by_name_on_every_rank(results):
    for rank in range(N):
        kind, message = results[rank]["stock-skip"]
        assert kind == "ConfigError" and "on_nonfinite='skip'" in message
        assert "horovod_ext.DistributedOptimizer" in message


def test_close_and_garbage_collection_stop_the_exchange_thread(results):
    assert all(results[rank]["close"] == (True, True, True) for rank in range(N))


def test_a_rank_waiting_in_another_collective_is_a_timeout_naming_it_not_a_hang(results):
    kind, message = results[0]["stuck"]
    assert kind == "PeerFailedError" and "did not finish within 3 s" in message and "dsq.ps0." in message
    assert results[1]["stuck"] is None and results[2]["stuck"] is None


def test_a_stuck_step_on_the_torch_transport_names_the_torch_collective(results):
    kind, message = results[0]["stuck-torch"]
    assert kind == "PeerFailedError" and "did not finish within 3 s" in message
    assert re.search(r"collective 'torch\.distributed [a-z_ ()]+ #\d+ on 3 ranks'", message), message
    assert results[1]["stuck-torch"] is None and results[2]["stuck-torch"] is None


@pytest.mark.parametrize("transport, compression, message", [
    ("mpi", "sign", "transport must be one of"),
    ("torch", None, 'transport="torch" needs a DoubleSqueeze compression'),
])
def test_a_bad_transport_is_refused_by_name_before_any_collective(transport, compression, message):
    from dsq_plugins.errors import ConfigError
    from tests.conftest import require
    require("horovod.torch")
    import horovod_ext as hx
    model = torch.nn.Linear(3, 2)
    comp = hx.Compression.doublesqueeze(compression) if compression else hx.Compression.none
    with pytest.raises(ConfigError, match=message):
        hx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), compression=comp, transport=transport)


def test_a_torch_distributed_that_disagrees_with_horovod_is_refused_on_every_rank():
    results = launch("horovodrun", 2, "hvd_transport_worker.py", timeout=120)
    for rank in range(2):
        kind, message = results[rank]
        assert kind == "ConfigError" and "{0: None, 1: (0, 1)}" in message


def test_the_drop_in_resumes_at_another_world_size_through_reshard(tmp_path):
    """Saved at 2 ranks, loaded at 3 with ``opt.load_state_dict(dsq.reshard(old, 3)[rank])``:
    what the memories owe is kept (within int8 rounding) and the ranks train on identical."""
    ckpt = str(tmp_path / "ckpt")
    saved = launch("horovodrun", 2, "hvd_resize_worker.py", "save", ckpt, out_dir=str(tmp_path / "save"),
                   timeout=300)
    loaded = launch("horovodrun", 3, "hvd_resize_worker.py", "load", ckpt, out_dir=str(tmp_path / "load"),
                    timeout=300)
    assert all(r["state"]["size"] == 3 and r["state"]["rank"] == i for i, r in enumerate(loaded))
    before, after = owed([r["state"] for r in saved]), owed([r["state"] for r in loaded])
    assert before.keys() == after.keys() and before
    assert all((after[k] - v).abs().max() <= 1e-2 * v.abs().max() for k, v in before.items())
    assert all(torch.equal(a, b) for r in loaded[1:] for a, b in zip(loaded[0]["params"], r["params"]))
