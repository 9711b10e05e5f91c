"""A sparse gradient's exact mean (``comm.sparse_mean``), the way the DDP hook moves an
``nn.Embedding(sparse=True)``'s gradient: on in-process ranks, against the dense mean."""
import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.comm import sparse_mean
from dsq_plugins.errors import PayloadError, PeerStatusError

SHAPE = (50, 6)


def rows_of(rank, dtype=torch.float32):
    """Rank r's gradient: a few rows of the table, some repeated (an uncoalesced sum, as backward makes it)."""
    g = torch.Generator().manual_seed(rank)
    rows = torch.randint(SHAPE[0], (4 + 3 * rank,), generator=g)
    values = torch.randn(len(rows), SHAPE[1], generator=g)
    return torch.sparse_coo_tensor(rows.view(1, -1), values, SHAPE, check_invariants=True).to(dtype)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_mean_is_the_dense_mean_the_same_on_every_rank(size):
    def run(comm):
        return sparse_mean(comm, rows_of(comm.rank), name="emb"), comm.bytes_sent
    results = dsq.LocalGroup(size).run(run)
    want = sum(rows_of(r).to_dense() for r in range(size)) / size
    for mean, _ in results:
        assert mean.is_sparse and mean.is_coalesced() and mean.dtype == torch.float32
        assert torch.allclose(mean.to_dense(), want, atol=1e-6)
        assert torch.equal(mean.to_dense(), results[0][0].to_dense())
    # only the touched rows travel, padded to the longest rank's: nowhere near the whole table
    row_bytes = 8 + 4 * SHAPE[1]
    longest = max(rows_of(r).coalesce().values().shape[0] for r in range(size))
    assert results[0][1] <= (size - 1) * (longest * row_bytes + 64)


def test_a_half_precision_gradient_keeps_its_dtype():
    results = dsq.LocalGroup(2).run(lambda comm: sparse_mean(comm, rows_of(comm.rank, torch.bfloat16), name="e"))
    want = (rows_of(0, torch.bfloat16).to_dense().float() + rows_of(1, torch.bfloat16).to_dense().float()) / 2
    assert results[0].dtype == torch.bfloat16 and torch.equal(results[0].to_dense(), want.to(torch.bfloat16))


def test_a_nan_on_one_rank_is_the_same_status_error_on_every_rank():
    def run(comm):
        g = rows_of(comm.rank)
        if comm.rank == 1:
            g = torch.sparse_coo_tensor(g._indices(), g._values().index_fill(0, torch.tensor([0]), float("nan")),
                                        SHAPE, check_invariants=True)
        return sparse_mean(comm, g, name="emb")
    errors = dsq.LocalGroup(3).run(run, return_exceptions=True)
    assert all(isinstance(e, PeerStatusError) and e.statuses == {1: 1} for e in errors)


@pytest.mark.parametrize("bad", ["length", "index"])
def test_an_unreadable_payload_is_the_same_payload_error_on_every_rank(bad):
    """Rank 2's bytes, damaged on the way: not whole rows, or a row outside the table. Every rank
    names rank 2 and nobody sums what it sent."""
    def damaged(payload):
        if bad == "length":
            return payload[:-3]
        payload = payload.clone()
        payload[:8] = torch.tensor([SHAPE[0] + 7], dtype=torch.int64).view(torch.uint8)  # its first row's index
        return payload

    def run(comm):
        if comm.rank == 2:
            send = comm.allgather
            comm.allgather = lambda payload, **kw: send(damaged(payload), **kw)
        return sparse_mean(comm, rows_of(comm.rank), name="emb")
    errors = dsq.LocalGroup(3).run(run, return_exceptions=True)
    assert all(isinstance(e, PayloadError) and e.rank == 2 for e in errors), errors


def test_ranks_with_tables_of_different_sizes_are_the_same_mismatch_error_on_every_rank():
    """A rank configured with another vocabulary: its collective's tag differs, and every rank says so."""
    from dsq_plugins.errors import CollectiveMismatchError

    def run(comm):
        g = rows_of(comm.rank)
        if comm.rank == 1:
            g = torch.sparse_coo_tensor(g._indices(), g._values(), (SHAPE[0] + 1, SHAPE[1]), check_invariants=True)
        return sparse_mean(comm, g, name="emb")
    errors = dsq.LocalGroup(3).run(run, return_exceptions=True)
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors
