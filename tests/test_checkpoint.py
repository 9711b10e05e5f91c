"""state_dict round trip through a real file continues bit for bit."""
import pytest
import torch

import dsq_plugins as dsq


def grads(rank, step):
    return torch.randn(37, generator=torch.Generator().manual_seed(100 * step + rank))


@pytest.mark.parametrize("compressor", ["sign", "qsgd", "randomk"])
def test_resume_from_checkpoint_is_bit_identical(compressor, tmp_path):
    def uninterrupted(comm):
        r = dsq.DoubleSqueeze(comm, compressor)
        return [r.reduce("g", grads(comm.rank, t)) for t in range(6)]

    def interrupted(comm):
        r = dsq.DoubleSqueeze(comm, compressor)
        outs = [r.reduce("g", grads(comm.rank, t)) for t in range(3)]
        torch.save(r.state_dict(), tmp_path / f"rank{comm.rank}.pt")
        fresh = dsq.DoubleSqueeze(comm, compressor)
        fresh.load_state_dict(torch.load(tmp_path / f"rank{comm.rank}.pt"))
        return outs + [fresh.reduce("g", grads(comm.rank, t)) for t in range(3, 6)]

    a = dsq.LocalGroup(3).run(uninterrupted)
    b = dsq.LocalGroup(3).run(interrupted)
    for ra, rb in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ra, rb))

    def without_state(comm):  # the check has teeth: dropping the state changes the result
        r = dsq.DoubleSqueeze(comm, compressor)
        [r.reduce("g", grads(comm.rank, t)) for t in range(3)]
        return dsq.DoubleSqueeze(comm, compressor).reduce("g", grads(comm.rank, 3))
    c = dsq.LocalGroup(3).run(without_state)
    assert not torch.equal(c[0], a[0][3])
