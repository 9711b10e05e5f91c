"""``randomsign``: the signs of a shared random fraction of the elements."""
from __future__ import annotations

import math

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors.randomk import random_positions


def test_the_payload_is_one_scale_and_the_signs_of_the_drawn_elements():
    q = dsq.get_compressor("randomsign", ratio=0.25)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    packet = q.compress(x, seed=9)
    assert packet.nbytes == 4 + math.ceil(250 / 8)
    drawn = random_positions(1000, 250, 9, x.device)
    y = q.decompress(packet)
    s = x[drawn].abs().mean()
    assert torch.allclose(y[drawn], torch.where(x[drawn] >= 0, s, -s))
    rest = torch.ones(1000, dtype=torch.bool)
    rest[drawn] = False
    assert torch.equal(y[rest], torch.zeros(750))
    rms_q = dsq.get_compressor("randomsign", ratio=0.25, scale="rms")
    rms = rms_q.decompress(rms_q.compress(x, seed=9))
    assert torch.allclose(rms[drawn].abs(), x[drawn].norm() / math.sqrt(250) * torch.ones(250))
    assert 32 * 1000 * 4 / (8 * q.payload_nbytes(1000)) > 100  # a quarter of the signs: ~128x below fp32


def test_bad_parameters_and_payloads_are_refused_by_name():
    with pytest.raises(dsq.ConfigError, match="randomsign: ratio"):
        dsq.get_compressor("randomsign", ratio=0)
    with pytest.raises(dsq.ConfigError, match="randomsign: scale"):
        dsq.get_compressor("randomsign", scale="max")
    q = dsq.get_compressor("randomsign")
    payload = q.compress(torch.randn(64), seed=1).payload.clone()
    payload[:4] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(dsq.PayloadError, match="randomsign: scale"):
        q.decompress_flat(payload, 64, 1)
    with pytest.raises(dsq.PayloadError, match="randomsign"):
        q.decompress_flat(payload[:-1], 64, 1)


def test_every_sender_and_the_owner_draw_one_seed_per_chunk_and_step():
    def seeds(compressor):
        def per_rank(comm):
            r = dsq.DoubleSqueeze(comm, compressor)
            return [r.chunk_seed("g", 3, side, sender, 1) for side in "ws" for sender in range(2)]
        return dsq.LocalGroup(2).run(per_rank)[0]
    assert len(set(seeds("randomsign"))) == 1
    assert len(set(seeds("randomk"))) == 4  # the other randomized operators keep a seed per sender and pass


def test_the_server_pass_squeezes_what_arrived_not_a_fresh_draw():
    """With one draw for both passes, the first step's average has the true
    sign at every drawn element (a fresh server draw would send the sign of
    zero, +, at the elements no worker sent)."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(2))

    def per_rank(comm):
        return dsq.DoubleSqueeze(comm, "randomsign", compressor_params={"ratio": 0.5}).reduce("g", x)
    for y in dsq.LocalGroup(2).run(per_rank):
        sent = y != 0
        assert 0.45 < sent.float().mean() < 0.55
        assert torch.equal(y[sent] > 0, x[sent] >= 0)


def test_error_feedback_delivers_every_element_over_steps():
    """A constant gradient: what the exchange delivered over T steps is T·g up
    to what the error memories hold, which stays bounded though each step
    sends a quarter of the signs: the relative gap falls as 1/T."""
    g = torch.randn(2000, generator=torch.Generator().manual_seed(4))

    def per_rank(comm):
        r = dsq.DoubleSqueeze(comm, "randomsign", compressor_params={"ratio": 0.25}, error_dtype="fp32")
        totals, total = {}, torch.zeros(2000)
        for t in range(1, 241):
            total += r.reduce("g", g * (comm.rank + 1))
            totals[t] = total.clone()
        return totals
    for totals in dsq.LocalGroup(2).run(per_rank):
        gap = {t: float((totals[t] - t * 1.5 * g).norm() / (t * 1.5 * g).norm()) for t in (60, 240)}
        assert gap[240] < 0.12 and gap[240] < 0.6 * gap[60], gap
