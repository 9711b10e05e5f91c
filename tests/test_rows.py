"""Many payloads of one size decoded in one call (``Compressor.decode_rows``
over ``comm.rows``), as an owner decodes what every sender sent it and
every rank what every owner served: the same values bit for bit as one
decode per payload, each row's checks on its own row, and a number of ops
that does not grow with the rows."""
import contextlib
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 - torch has no public path to it

import dsq_plugins as dsq
from dsq_plugins.comm import rows
from dsq_plugins.compressors.base import TRUSTED
from dsq_plugins.compressors.kernels import gpu_paths
from dsq_plugins.errors import PayloadError

#: every operator with a seed where it draws, at sizes that leave a short last byte or block
CASES = [("sign", {}), ("sign", {"scale": "rms"}), ("sign", {"block": 4}), ("topk", {"ratio": 0.2}),
         ("randomk", {"ratio": 0.3}), ("qsgd", {"levels": 7}), ("terngrad", {}), ("blocksign", {}), ("fp16", {}),
         ("bf16", {}), ("none", {})]


NAN_SCALE = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)  # fp32 NaN


def payload_rows(q, count, numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seeds = [1000 + r for r in range(count)]
    values = torch.randn(count, numel, generator=gen) * torch.logspace(-3, 3, count)[:, None]
    return torch.stack([q.compress(v, seed=s).payload for v, s in zip(values, seeds)]), seeds


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("count,numel", [(1, 9), (3, 13), (5, 64), (4, 1001)])
@pytest.mark.parametrize("paths", ["gpu", "cpu"])
def test_rows_decode_to_each_payloads_own_decode_bit_for_bit(name, params, count, numel, paths):
    """On the GPU's paths (the row decoders) and a CPU's (sparse operators decode row by row there)."""
    q = dsq.get_compressor(name, **params)
    payloads, seeds = payload_rows(q, count, numel)
    with gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        together = q.decode_rows(payloads, numel, seeds)
    one_by_one = torch.stack([q.decompress_flat(p, numel, s) for p, s in zip(payloads, seeds)])
    assert together.shape == (count, numel)
    assert torch.equal(together.view(torch.int32), one_by_one.view(torch.int32))
    assert torch.equal(q.decode_rows(payloads, numel, seeds, refusals=TRUSTED), together)


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("count,numel", [(1, 9), (3, 13), (4, 1001), (2, 1 << 16)])
@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_worker_s_own_residual_is_its_vector_less_its_decode_bit_for_bit(monkeypatch, name, params, count, numel,
                                                                           mode):
    """v - Q(v) of this rank's own payloads (``subtract_own_rows_``, and ``subtract_own_``
    for one chunk), which sign forms from v's own signs without decoding: the same
    bits as a decode and a subtraction, zeros of either sign and all-zero rows included."""
    monkeypatch.setenv("DSQ_COMPILE", mode)
    q = dsq.get_compressor(name, **params)
    gen = torch.Generator().manual_seed(numel)
    values = torch.randn(count, numel, generator=gen) * torch.logspace(-3, 3, count)[:, None]
    values[:, ::5] = -0.0
    values[:, 1::5] = 0.0
    values[-1] = -0.0  # a scale of zero: its values are ±0.0
    seeds = [1000 + r for r in range(count)]
    payloads = torch.stack([q.compress(v, seed=s).payload for v, s in zip(values, seeds)])
    expected = values - q.decode_rows(payloads, numel, seeds, refusals=TRUSTED)
    rows_of = q.subtract_own_rows_(values.clone(), payloads, seeds)
    each = torch.stack([q.subtract_own_(v.clone(), p, numel, s) for v, p, s in zip(values, payloads, seeds)])
    for got in (rows_of, each):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("paths", ["gpu", "cpu"])
@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("numel", [64, 1 << 16, 61])
def test_a_sign_payload_decoded_into_a_buffer_is_its_decode_there(monkeypatch, paths, mode, numel):
    """``decode(..., into=)`` and ``decode_rows(..., into=)`` (served chunks written straight into the average):
    the same bits as a plain decode, in the buffer itself where whole bytes fill it,
    and a vector of its own where they do not (a last byte's padding)."""
    monkeypatch.setenv("DSQ_COMPILE", mode)
    q = dsq.get_compressor("sign")
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    values[::3] = -0.0
    payload = q.compress(values).payload
    with gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        plain = q.decode(payload, numel, refusals=TRUSTED).values
        buffer = torch.full((numel,), 7.0)
        into = q.decode(payload, numel, refusals=TRUSTED, into=buffer).values
    assert torch.equal(into.view(torch.int32), plain.view(torch.int32))
    assert (into.data_ptr() == buffer.data_ptr()) == (numel % 8 == 0)
    payloads, seeds = payload_rows(q, 3, numel)  # several served chunks, as rows
    with gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        plain_rows = q.decode_rows(payloads, numel, seeds, refusals=TRUSTED)
        buffer = torch.full((3, numel), 7.0)
        into_rows = q.decode_rows(payloads, numel, seeds, refusals=TRUSTED, into=buffer)
    assert torch.equal(into_rows.view(torch.int32), plain_rows.view(torch.int32))
    assert (into_rows.data_ptr() == buffer.data_ptr()) == (numel % 8 == 0)


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("numel", [64, 1 << 16, 61])
@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.05}), ("blocksign", {}), ("blocksign", {"block": 7})])
def test_kept_rows_decoded_into_a_buffer_are_their_decode_there(monkeypatch, mode, numel, name, params):
    """Top-k's and blocksign's ``decode_rows(..., into=)`` on a GPU's paths (served chunks written
    straight into the average): the same bits and checks as a plain decode, in the buffer itself,
    whatever it held, with a row whose first word is NaN (flagged)."""
    monkeypatch.setenv("DSQ_COMPILE", mode)
    q = dsq.get_compressor(name, **params)
    payloads, seeds = payload_rows(q, 3, numel)
    payloads[1, :4] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)  # fp32 NaN: a scale, or a kept value
    with gpu_paths():
        checks: list = []
        plain = q.decode_rows(payloads, numel, seeds, refusals=checks)
        into_checks: list = []
        buffer = torch.full((3, numel), 7.0)
        into = q.decode_rows(payloads, numel, seeds, refusals=into_checks, into=buffer)
    assert into.data_ptr() == buffer.data_ptr()
    assert torch.equal(into.view(torch.int32), plain.view(torch.int32))
    assert [w for _, w in into_checks] == [w for _, w in checks]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(into_checks, checks))
    assert torch.stack([f for f, _ in checks]).any(0).tolist() == [False, True, False]


def test_a_bad_row_is_named_and_flagged_on_its_own_row():
    q = dsq.get_compressor("sign")
    payloads, seeds = payload_rows(q, 4, 100)
    payloads[2, :4] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)  # fp32 NaN as the scale
    with pytest.raises(PayloadError, match=r"scale in payload is negative or not finite \(row 2\)"):
        q.decode_rows(payloads, 100, seeds)
    checks = []
    q.decode_rows(payloads, 100, seeds, refusals=checks)
    assert [flag.tolist() for flag, _ in checks] == [[False, False, True, False]]
    generic = []  # the row-by-row fallback of an operator without a row decoder flags rows the same way
    t = dsq.get_compressor("terngrad")
    payloads, seeds = payload_rows(t, 3, 50)
    payloads[1, :4] = torch.tensor([0, 0, 128, 255], dtype=torch.uint8)  # -inf
    t.decode_rows(payloads, 50, seeds, refusals=generic)
    assert any(flag.tolist() == [False, True, False] for flag, _ in generic)


@pytest.mark.parametrize("paths", ["gpu", "cpu"])
def test_a_top_k_row_with_a_nan_value_is_refused_by_its_own_check_without_a_dense_pass(paths):
    """Top-k checks its k values, not the dense row they scatter into
    (``checks_finite``): a NaN value is refused on its own row in the words
    of every decoder's finiteness test, and a deferred decode adds no check
    of its own after the decoder's."""
    from dsq_plugins.compressors.finite import NONFINITE_WORDS
    q = dsq.get_compressor("topk", ratio=0.1)
    payloads, seeds = payload_rows(q, 4, 100)
    payloads[1, 4:8] = NAN_SCALE  # row 1's second kept value
    assert q.checks_finite  # what a deferred decode relies on to add no dense test of its own
    checks = []
    with gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        with pytest.raises(PayloadError, match=rf"{NONFINITE_WORDS} \(row 1\)"):
            q.decode_rows(payloads, 100, seeds)
        q.decode_rows(payloads, 100, seeds, refusals=checks)
    assert [words for _, words in checks][-1] == NONFINITE_WORDS
    assert torch.stack([flag for flag, _ in checks]).any(0).tolist() == [False, True, False, False]


def test_rows_refuse_a_wrong_width_or_seed_count_by_name():
    q = dsq.get_compressor("sign")
    payloads, seeds = payload_rows(q, 3, 40)
    with pytest.raises(PayloadError, match="must be 9 bytes, got rows of 8"):
        q.decode_rows(payloads[:, :8], 40, seeds)
    with pytest.raises(PayloadError, match="2-D torch.uint8"):
        q.decode_rows(payloads[0], 40, seeds)
    with pytest.raises(ValueError, match="3 rows but 2 seeds"):
        q.decode_rows(payloads, 40, seeds[:2])


def test_comm_rows_views_consecutive_equal_payloads_and_nothing_else():
    buffer = torch.arange(12, dtype=torch.uint8)
    received = list(buffer.split(4))
    view = rows(received)
    assert view.shape == (3, 4) and view.data_ptr() == buffer.data_ptr()
    assert torch.equal(view, buffer.view(3, 4))
    assert rows(received[:2] + [None]) is None                      # a refused payload
    assert rows(list(buffer.split(5))) is None                      # lengths differ
    assert rows([received[0], received[2], received[1]]) is None    # not at even steps
    assert rows([received[0].clone(), received[1].clone()]) is None  # copies


class Ops(TorchDispatchMode):
    """Counts the aten ops that would launch a kernel (views and allocations
    left out), but not the in-process transport's own copies, which stand
    for the network."""

    FREE = {"empty", "new_empty", "view", "as_strided", "slice", "select", "reshape", "_reshape_alias", "alias",
            "unsqueeze", "squeeze", "detach", "set_", "t", "expand", "_unsafe_view", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] not in self.FREE and not self._in_transport():
            self.count += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _in_transport():
        """Whether the library's innermost frame that made this op is the in-process transport's."""
        frame = sys._getframe(2)
        while frame is not None and "dsq_plugins" not in frame.f_code.co_filename:
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.endswith(os.path.join("comm", "_local.py"))


def test_the_row_decoder_costs_the_same_ops_for_2_or_16_rows():
    q = dsq.get_compressor("sign")
    counts = []
    for count in (2, 16):
        payloads, seeds = payload_rows(q, count, 1000)
        checks = []
        with Ops() as ops:
            q.decode_rows(payloads, 1000, seeds, refusals=checks)
        counts.append(ops.count)
    assert counts[0] == counts[1] <= 8



@pytest.mark.parametrize("verdict", ["collective", "step"])
@pytest.mark.parametrize("fault", ["nan scale", "garbage", "nan"])
def test_a_peer_payload_that_does_not_decode_is_the_same_error_on_every_rank(verdict, fault):
    """Row-decoded on every receiver (the in-process transport delivers one
    buffer's rows, as a network does): the faulty rank is named on every
    rank. (Fault injection runs with collective verdicts only; a step
    verdict meets a rank whose encoder writes a NaN scale.)"""
    if verdict == "step" and fault != "nan scale":
        pytest.skip("fault injection runs with verdict='collective'")

    def per_rank(comm):
        faults = None if fault == "nan scale" else {"attack": fault, "ranks": [2], "seed": 1}
        r = dsq.DoubleSqueeze(comm, "sign", verdict=verdict, faults=faults)
        g = torch.randn(96, generator=torch.Generator().manual_seed(comm.rank))
        if fault == "nan scale" and comm.rank == 2:
            q, encode = r.worker.q, r.worker.q.compress_chunks
            q.compress_chunks = lambda *a, **k: [p.index_copy_(0, torch.arange(4), NAN_SCALE) for p in encode(*a, **k)]
        with pytest.raises(PayloadError) as raised:
            r.reduce("w", g)
        return str(raised.value)
    messages = dsq.LocalGroup(4).run(per_rank)
    # (the owner that refused it also says why; the others know which payload)
    assert all("could not decode the payload rank 2 sent for 'w'" in m and "state is unchanged" in m
               for m in messages), messages


@pytest.mark.parametrize("name,params", [("sign", {}), ("topk", {"ratio": 0.01}), ("blocksign", {})])
@pytest.mark.parametrize("sizes,longer", [((2, 4, 8), 0), ((4, 8, 16), 2)])
def test_a_ranks_ops_per_bucket_do_not_grow_with_the_ranks(name, params, sizes, longer):
    """Rank 0's ops for one bucket of a deferred step on the paths a GPU
    takes, at 2 to 16 ranks, with equal chunks or with two runs of them
    (the first ``size // longer`` one element longer): two ops per added
    rank at most, the plain mean's addition of each contribution (it sums
    in sender order, which keeps its bits) and the in-process transport's
    cast of each peer's status; everything else is a fixed number per
    bucket."""
    def ops(size):
        def per_rank(comm):
            r = dsq.DoubleSqueeze(comm, name, compressor_params=params, verdict="step")
            numel = size * 512 + (size // longer if longer else 0)
            g = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank))
            r.reduce("w", g)  # the first step makes the memories
            if comm.rank:
                r.reduce("w", g)
                return None
            with Ops() as counted:
                r.reduce("w", g)
            return counted.count
        with gpu_paths():
            return dsq.LocalGroup(size).run(per_rank)[0]
    counts = [ops(size) for size in sizes]
    assert all(later - earlier <= 2 * (b - a) for (a, earlier), (b, later) in zip(zip(sizes, counts),
                                                                                  zip(sizes[1:], counts[1:]))), counts


def test_rows_of_a_padded_gather_are_strided_views():
    """A gather pads every payload to the longest: the shorter ones are rows of a wider buffer."""
    buffer = torch.arange(15, dtype=torch.uint8).view(3, 5)
    view = rows([row[:4] for row in buffer])
    assert view.shape == (3, 4) and view.stride() == (5, 1) and torch.equal(view, buffer[:, :4])
    assert rows([buffer[0, :4], buffer[2, :4]]) is not None  # evenly spaced
    assert rows([buffer[0, :4], buffer[1, :4], buffer[1, 1:5]]) is None
