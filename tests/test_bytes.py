"""Counted bytes equal what the protocol moves, and 1-bit sign moves about
1/32 of an fp32 ring allreduce whatever the number of workers."""
import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.reducer import chunk_bounds
from tests.test_compressors import wire_formula


def expected_bytes_sent(name, numel, n, rank, server=None, fused=True, **p):
    """Per worker per step: pass 1 sends every chunk but its own, pass 2 sends
    its own result to every other rank; each exchange carries an int64 header
    [tag, status, lengths] per message (n lengths in pass 1, one in pass 2).
    Fused transports (LocalGroup, Horovod) send pass 2 at its own length; the
    two-collective one (torch.distributed) pads it to the longest result."""
    server = server or name
    if n == 1:
        return 0
    sizes = [b - a for a, b in chunk_bounds(numel, n)]
    pass1 = sum(wire_formula(name, m, **p) for k, m in enumerate(sizes) if k != rank)
    width = wire_formula(server, sizes[rank], **p) if fused else max(wire_formula(server, m, **p) for m in sizes)
    headers = 8 * (2 + n) * (n - 1) + 8 * 3 * (n - 1)
    return pass1 + width * (n - 1) + headers


@pytest.mark.parametrize("name", list(dsq.COMPRESSORS))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_counted_bytes_equal_the_wire_formula(name, n):
    numel = 1000 + n  # uneven chunks

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, name)
        r.reduce("g", torch.randn(numel))
        return comm.bytes_sent, comm.bytes_received

    for rank, (sent, received) in enumerate(dsq.LocalGroup(n).run(per_rank)):
        assert sent == expected_bytes_sent(name, numel, n, rank)
        assert received > 0 or n == 1


def test_worker_only_mode_sends_the_exact_mean_back():
    def per_rank(comm):
        dsq.DoubleSqueeze(comm, "sign", error_feedback="worker").reduce("g", torch.randn(400))
        return comm.bytes_sent
    sent = dsq.LocalGroup(4).run(per_rank)
    assert sent[0] == expected_bytes_sent("sign", 400, 4, 0, server="none")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sign_moves_at_most_a_thirtieth_of_an_fp32_ring_allreduce(n):
    numel = 1 << 20

    def per_rank(comm):
        dsq.DoubleSqueeze(comm, "sign").reduce("g", torch.randn(numel))
        return comm.bytes_sent, comm.bytes_received

    ring = 2 * (n - 1) / n * 4 * numel  # bytes each worker sends in an fp32 ring allreduce
    for sent, received in dsq.LocalGroup(n).run(per_rank):
        assert sent <= ring / 30 and received <= ring / 30
        assert sent >= ring / 33  # and the count is not suspiciously low: 1 bit really is ~1/32


def test_per_worker_bytes_do_not_grow_with_workers():
    numel = 1 << 16
    per_worker = []
    for n in (2, 4, 8):
        def per_rank(comm):
            dsq.DoubleSqueeze(comm, "sign").reduce("g", torch.randn(numel))
            return comm.bytes_sent
        per_worker.append(max(dsq.LocalGroup(n).run(per_rank)))
    assert per_worker[2] < 2 * 1.05 * (numel / 8)  # bounded by 2 passes of 1 bit per element


def test_payloads_that_follow_one_another_join_without_a_copy():
    """The rows of a batched encode are one message as they lie (a view);
    anything else is concatenated. Either way the bytes are the same."""
    from dsq_plugins.comm import joined
    rows = torch.arange(24, dtype=torch.uint8).view(4, 6)
    payloads = list(rows.unbind(0))
    message = joined(payloads)
    assert torch.equal(message, torch.cat(payloads)) and message.data_ptr() == rows.data_ptr()
    for shuffled in (payloads[::-1], [payloads[0], payloads[2]], [payloads[1], payloads[1]]):
        message = joined(shuffled)
        assert torch.equal(message, torch.cat(shuffled)) and message.data_ptr() != rows.data_ptr()
    assert joined([payloads[2]]) is payloads[2]
