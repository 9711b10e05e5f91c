"""Every compressor: wire size equal to its documented formula, shape and dtype
preserved, reproducible with a seed, unbiased ones unbiased, biased ones
contractions, and malformed payloads refused with a PayloadError."""
import contextlib
import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors import bitpack
from dsq_plugins.errors import ErrorFeedbackWarning

ALL = list(dsq.COMPRESSORS)


def wire_formula(name, n, **p):
    """Each module's documented wire size, written out independently."""
    if n == 0:
        return 0
    k = lambda: min(n, max(1, round(p.get("ratio", 0.01) * n)))  # noqa: E731
    return {
        "none": 4 * n, "fp16": 2 * n, "bf16": 2 * n,
        "sign": 4 + math.ceil(n / 8),
        "topk": 8 * k(), "randomk": 4 * k(),
        # buckets of 512; 2*levels+1 codes packed at 2, 4 or 8 bits (127 levels by default: 8 bits)
        "qsgd": 4 * math.ceil(n / 512) + math.ceil(n * next(b for b in (2, 4, 8)
                                                              if 2 * p.get("levels", 127) + 1 <= 2 ** b) / 8),
        "terngrad": 4 + math.ceil(n / 4),
        "blocksign": 4 + math.ceil(n / p.get("block", 32)),
        # the signs of k = ratio·n drawn elements (half by default) behind one fp32 scale
        "randomsign": 4 + math.ceil(min(n, max(1, round(p.get("ratio", 0.5) * n))) / 8),
        # an n x m matrix, n = ceil(sqrt(n)): factors P (rows x r) and Q (cols x r), 2 bytes each in
        # bf16 (the default) or fp16, 4 in fp32; the n values themselves where the factors would not be fewer
        "lowrank": (4 if p.get("factors", "bf16") == "fp32" else 2) * min(
            n, min(p.get("rank", 4), rows(n), -(-n // rows(n))) * (rows(n) + -(-n // rows(n)))),
    }[name]


def rows(n):
    return math.ceil(math.sqrt(n) - 1e-9)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 513, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_payload_is_exactly_the_documented_bytes(name, numel, dtype):
    q = dsq.get_compressor(name)
    x = torch.randn(numel).to(dtype)
    pkt = q.compress(x)
    assert pkt.payload.dtype == torch.uint8 and pkt.payload.dim() == 1
    assert pkt.payload.numel() == wire_formula(name, numel) == q.payload_nbytes(numel)
    y = q.decompress(pkt)
    assert y.dtype == dtype and y.shape == x.shape


@pytest.mark.parametrize("name", ALL)
def test_shapes_are_kept(name):
    q = dsq.get_compressor(name, **({"rank": 3} if name == "lowrank" else {}))  # its 3 x 35 matrix allows 3
    x = torch.randn(3, 5, 7)
    assert q.decompress(q.compress(x)).shape == (3, 5, 7)


def test_exact_and_cast_formats():
    x = torch.randn(1000) * 10
    assert torch.equal(dsq.get_compressor("none").decompress(dsq.get_compressor("none").compress(x)), x)
    fp16 = dsq.get_compressor("fp16")
    assert torch.equal(fp16.decompress(fp16.compress(x)), x.half().float())
    big = torch.tensor([1e6, -1e6, 3.0])
    assert fp16.decompress(fp16.compress(big)).tolist() == [65504.0, -65504.0, 3.0]  # saturates, never inf
    bf16 = dsq.get_compressor("bf16")
    assert torch.equal(bf16.decompress(bf16.compress(x)), x.bfloat16().float())


def test_sign_bits_and_scales():
    x = torch.tensor([0.5, -2.0, 0.0, 3.5, -1.0, 1.0, 2.0, -0.5, 4.0])
    q = dsq.get_compressor("sign")
    pkt = q.compress(x)
    bits = np.packbits((x >= 0).numpy().astype(np.uint8))
    assert pkt.payload[4:].tolist() == bits.tolist()  # numpy.packbits order
    scale = x.abs().mean()
    assert torch.allclose(q.decompress(pkt), torch.where(x >= 0, scale, -scale))
    rms = dsq.get_compressor("sign", scale="rms")
    assert torch.allclose(rms.decompress(rms.compress(x)).abs(), (x.norm() / 3).expand(9))


def test_sign_scale_shared_over_a_whole_vector():
    x = torch.randn(100)
    q = dsq.get_compressor("sign", scale="rms", scope="tensor")
    shared = q.prepare(x)
    assert torch.allclose(shared, x.norm() / 10)
    chunk = q.decompress(q.compress(x[:30], shared=shared))
    assert torch.allclose(chunk.abs(), shared.expand(30))  # the vector's scale, not the chunk's
    assert dsq.get_compressor("sign").prepare(x) is None  # per-chunk scope shares nothing


@pytest.mark.parametrize("scale", ["rms", "mean"])
@pytest.mark.parametrize("numel", [1, 7, 16, 33, 1000])
def test_sign_block_sends_a_bfloat16_scale_per_block_then_the_bits(scale, numel):
    block = 16
    x = torch.randn(numel) * torch.logspace(-3, 2, numel)  # magnitudes of five decades: one scale fits none
    q = dsq.get_compressor("sign", scale=scale, block=block)
    pkt = q.compress(x)
    count = -(-numel // block)
    assert pkt.payload.numel() == 2 * count + math.ceil(numel / 8) == q.payload_nbytes(numel)
    assert pkt.payload[2 * count:].tolist() == np.packbits((x >= 0).numpy().astype(np.uint8)).tolist()
    blocks = x.split(block)
    expected = torch.stack([b.norm() / math.sqrt(b.numel()) if scale == "rms" else b.abs().mean() for b in blocks])
    sent = pkt.payload[:2 * count].view(torch.bfloat16).float()
    assert torch.equal(sent, expected.bfloat16().float())
    y = q.decompress(pkt)
    per_element = torch.cat([s.expand(b.numel()) for s, b in zip(sent, blocks)])
    assert torch.equal(y, torch.where(x >= 0, 1.0, -1.0) * per_element)
    one = dsq.get_compressor("sign", scale=scale)
    if count > 1:  # the point of a scale per block (one block is one scale, rounded to bfloat16)
        assert (y - x).norm() < (one.decompress(one.compress(x)) - x).norm()


def test_sign_block_refuses_bad_blocks_and_scales():
    for bad in (0, -3, 2.5, "8"):
        with pytest.raises(dsq.ConfigError, match="block"):
            dsq.get_compressor("sign", block=bad)
    with pytest.raises(dsq.ConfigError, match="exclude each other"):
        dsq.get_compressor("sign", block=8, scope="tensor")
    q = dsq.get_compressor("sign", block=4)
    bad = q.compress(torch.randn(10)).payload.clone()
    bad[2:4] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)  # block 1's scale
    with pytest.raises(dsq.PayloadError, match="block's scale .* not finite"):
        q.decompress_flat(bad, 10)
    huge = q.decompress(q.compress(torch.full((8,), 3e38)))
    assert torch.isfinite(huge).all()  # float32's largest scale is clamped to bfloat16's, not rounded to inf


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bitpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (37,), dtype=torch.uint8)
    packed = bitpack.pack(codes, bits)
    assert packed.numel() == math.ceil(37 * bits / 8)
    assert torch.equal(bitpack.unpack(packed, bits, 37), codes)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("numel", [1, 4, 7, 4096, 100_003])
def test_multi_bit_packing_puts_code_0_in_the_top_bits(bits, numel):
    """The multiply-gather packer against the definition, with all-ones codes
    included (the case where a carry between products would show)."""
    codes = torch.randint(0, 2**bits, (numel,), dtype=torch.uint8, generator=torch.Generator().manual_seed(numel))
    codes[: numel // 2] = 2**bits - 1
    per = 8 // bits
    padded = torch.cat([codes, codes.new_zeros(-numel % per)]).view(-1, per).to(torch.int32)
    expected = sum(padded[:, j] << (bits * (per - 1 - j)) for j in range(per)).to(torch.uint8)
    assert torch.equal(bitpack.pack(codes, bits), expected)


@pytest.mark.parametrize("numel", [8, 9, 4096, 100_003])
def test_one_bit_packing_is_numpy_packbits_order(numel):
    flags = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.5
    packed = bitpack.pack(flags, 1)
    assert np.array_equal(packed.numpy(), np.packbits(flags.numpy()))
    assert torch.equal(bitpack.unpack(packed, 1, numel), flags.to(torch.uint8))


@pytest.mark.parametrize("kind", ["normal", "heavy-tailed", "ties", "mostly-zero", "spike"])
def test_topk_sampled_threshold_selects_the_exact_top_k(kind):
    """Large tensors go through a sampled threshold; the set kept must still
    be exactly the k largest magnitudes, whatever the distribution."""
    from dsq_plugins.compressors.topk import top_magnitudes
    g = torch.Generator().manual_seed(7)
    n = 300_000
    x = {"normal": lambda: torch.randn(n, generator=g),
         "heavy-tailed": lambda: torch.randn(n, generator=g) ** 5,
         "ties": lambda: torch.randint(-3, 4, (n,), generator=g).float(),
         "mostly-zero": lambda: torch.where(torch.rand(n, generator=g) < 0.001, 1.0, 0.0),
         "spike": lambda: torch.cat([torch.full((50,), 1e6), torch.randn(n - 50, generator=g)])}[kind]()
    for k in (1, 30, 3000, 60_000):
        idx = top_magnitudes(x, k)
        assert idx.numel() == k and idx.unique().numel() == k
        expected = torch.topk(x.abs(), k).values
        assert torch.equal(x.abs()[idx].sort(descending=True).values, expected), (kind, k)


def test_topk_positions_come_increasing_and_ties_at_the_kth_place_keep_the_first():
    """The sampled path selects by mask, not by a sort of torch.topk's indices:
    positions must still come out increasing, exactly k of them, and of equal
    magnitudes at the k-th place the first ones."""
    from dsq_plugins.compressors.topk import top_magnitudes
    n, k = 200_000, 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.1
    big = torch.randperm(n, generator=torch.Generator().manual_seed(4))[:1500]
    x[big[:600]] = 5.0  # the 600 largest
    x[big[600:]] = -4.0  # 900 tied for the remaining 400 places
    idx = top_magnitudes(x, k)
    assert idx.numel() == k and bool((idx.diff() > 0).all())
    assert set(big[:600].tolist()) <= set(idx.tolist())
    assert idx[x[idx] == -4.0].tolist() == big[600:].sort().values[:400].tolist()


def test_topk_keeps_the_largest_magnitudes():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 4.0, 0.05])
    q = dsq.get_compressor("topk", k=3)
    y = q.decompress(q.compress(x))
    assert y.tolist() == [0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 4.0, 0.0]


def test_randomk_positions_are_distinct_and_uniform():
    from dsq_plugins.compressors.randomk import random_positions
    counts = torch.zeros(50)
    for seed in range(4000):
        pos = random_positions(50, 5, seed, torch.device("cpu"))
        assert len(set(pos.tolist())) == 5
        counts[pos] += 1
    freq = counts / 4000  # each element kept with probability k/n = 0.1
    assert (freq - 0.1).abs().max() < 0.03


@pytest.mark.parametrize("name,params", [("randomk", {"ratio": 0.1}), ("qsgd", {}), ("qsgd", {"levels": 1}),
                                         ("terngrad", {})])
def test_seeded_and_reproducible(name, params):
    x = torch.randn(300)
    a, b = dsq.get_compressor(name, **params), dsq.get_compressor(name, **params)
    assert torch.equal(a.compress(x, seed=7).payload, b.compress(x, seed=7).payload)
    assert torch.equal(a.compress(x).payload, b.compress(x).payload)  # same call sequence, same seeds
    assert not torch.equal(a.compress(x, seed=1).payload, a.compress(x, seed=2).payload)


@pytest.mark.parametrize("name,params", [("randomk", {"ratio": 0.25}), ("qsgd", {"levels": 3, "bucket_size": 16}),
                                         ("terngrad", {})])
def test_unbiased_compressors_are_unbiased(name, params):
    """z = (mean of T decodings - x) / standard error is ~N(0, 1) per coordinate
    when unbiased, so mean(z**2) over 64 coordinates stays near 1."""
    q = dsq.get_compressor(name, **params)
    assert q.unbiased
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    trials = 4000
    samples = torch.stack([q.decompress(q.compress(x, seed=s)) for s in range(trials)])
    stderr = samples.std(0) / math.sqrt(trials) + 1e-7
    z2 = ((samples.mean(0) - x) / stderr).pow(2).mean()
    assert z2 < 2.0
    # the test has power: the same samples read as a 10% biased operator fail it
    assert ((samples.mean(0) * 1.1 - x) / stderr).pow(2).mean() > 2.0


@pytest.mark.parametrize("name,params", [("sign", {}), ("topk", {"ratio": 0.1}),
                                         ("randomk", {"ratio": 0.1, "unbiased": False}), ("fp16", {}), ("bf16", {}),
                                         ("blocksign", {}), ("blocksign", {"block": 128})])
def test_biased_compressors_are_contractions(name, params):
    q = dsq.get_compressor(name, **params)
    for seed in range(20):
        x = torch.randn(200, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
        y = q.decompress(q.compress(x, seed=seed))
        assert (x - y).norm() < x.norm()


def test_topk_contraction_bound():
    q = dsq.get_compressor("topk", ratio=0.1)
    x = torch.randn(1000)
    y = q.decompress(q.compress(x))
    assert (x - y).norm() ** 2 <= (1 - 0.1) * x.norm() ** 2


@pytest.mark.parametrize("block", [2, 7, 32, 128])
def test_blocksign_keeps_each_blocks_largest_with_one_shared_magnitude(block):
    q = dsq.get_compressor("blocksign", block=block)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(block))
    y = q.decompress(q.compress(x))
    blocks = [(a, min(a + block, 1000)) for a in range(0, 1000, block)]
    kept = [a + int(x[a:b].abs().argmax()) for a, b in blocks]
    assert torch.equal(torch.nonzero(y).squeeze(1), torch.tensor(kept))  # one per block, the largest
    s = x[kept].abs().mean()
    assert torch.allclose(y[kept], s * torch.sign(x[kept]))
    # the contraction identity of the module docstring: ||x - C(x)||^2 = ||x||^2 - k s^2
    assert torch.allclose((x - y).pow(2).sum(), x.pow(2).sum() - len(kept) * s ** 2, rtol=1e-4)
    assert q.payload_nbytes(1000) == 4 + len(blocks) and 8 * q.payload_nbytes(1000) / 1000 < 8 / block + 0.05


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
@pytest.mark.parametrize("name", sorted(n for n, cls in dsq.compressors.COMPRESSORS.items() if cls.decodes_finite))
def test_an_operator_that_says_it_decodes_finite_vectors_to_finite_values_does(name, paths):
    """``decodes_finite`` lets a server take its own payload unchecked: every operator that claims
    it decodes a finite vector to finite values, also where a sum of its magnitudes overflows
    float32 (the largest floats of both signs), alongside zeros of either sign and subnormals."""
    big = torch.finfo(torch.float32).max
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    x[::3], x[1::3], x[2::97], x[5::101] = big, -big, -0.0, 1e-42
    q = dsq.get_compressor(name)
    with dsq.compressors.kernels.gpu_paths() if paths == "gpu" else contextlib.nullcontext():
        for flat in (x, x[:1000], x * 0):
            assert q.decompress_flat(q.compress(flat, seed=1).payload, flat.numel(), 1).isfinite().all(), name


def test_blocksign_refuses_positions_outside_their_block():
    q = dsq.get_compressor("blocksign", block=16)
    bad = q.compress(torch.randn(40)).payload.clone()
    bad[4] = 2 * 16 + 1  # position 16 in a block of 16
    with pytest.raises(dsq.PayloadError, match="outside their blocks"):
        q.decompress_flat(bad, 40)
    bad = q.compress(torch.randn(40)).payload.clone()
    bad[-1] = 2 * 9  # the last block holds 8 elements: position 9 is past the end
    with pytest.raises(dsq.PayloadError, match="outside their blocks"):
        q.decompress_flat(bad, 40)
    with pytest.raises(dsq.ConfigError, match="block must be between 2 and 128"):
        dsq.get_compressor("blocksign", block=256)


def test_unknown_names_and_parameters_list_what_exists():
    with pytest.raises(dsq.ConfigError, match="unknown compressor 'sgn'.*sign.*topk"):
        dsq.get_compressor("sgn")
    with pytest.raises(dsq.ConfigError, match="no parameter 'rate'.*ratio"):
        dsq.get_compressor("topk", rate=0.1)
    with pytest.raises(dsq.ConfigError, match="ratio must be a number in \\(0, 1\\]"):
        dsq.get_compressor("topk", ratio=2)
    with pytest.raises(dsq.ConfigError, match="scale must be one of"):
        dsq.get_compressor("sign", scale="max")
    with pytest.raises(dsq.ConfigError, match="levels must be a positive integer"):
        dsq.get_compressor("qsgd", levels=0)
    with pytest.raises(TypeError, match="int64 is not supported"):
        dsq.get_compressor("sign").compress(torch.arange(4))


@pytest.mark.parametrize("name", ALL)
def test_wrong_length_or_dtype_payload_is_refused(name):
    q = dsq.get_compressor(name)
    pkt = q.compress(torch.randn(100))
    with pytest.raises(dsq.PayloadError, match="must be .* bytes"):
        q.decompress_flat(pkt.payload[:-1], 100, pkt.seed)
    with pytest.raises(dsq.PayloadError, match="1-D torch.uint8"):
        q.decompress_flat(pkt.payload.to(torch.int32), 100, pkt.seed)


def test_undecodable_contents_are_refused():
    topk = dsq.get_compressor("topk", k=2)
    bad = topk.compress(torch.randn(10)).payload.clone()
    bad[8:12] = torch.tensor([255, 255, 255, 127], dtype=torch.uint8)  # position 2**31-1
    with pytest.raises(dsq.PayloadError, match="positions outside"):
        topk.decompress_flat(bad, 10)
    good = topk.compress(torch.randn(10)).payload
    positions = good[8:].view(torch.int32)
    repeated = good.clone()
    repeated[8:].view(torch.int32)[:] = positions[0]
    swapped = good.clone()
    swapped[8:].view(torch.int32)[:] = positions.flip(0)
    for bad in (repeated, swapped):  # a repeated position would decode by scatter order, differently on CUDA
        with pytest.raises(dsq.PayloadError, match="strictly increasing"):
            topk.decompress_flat(bad, 10)
    sign = dsq.get_compressor("sign")
    bad = sign.compress(torch.randn(10)).payload.clone()
    bad[:4] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)  # NaN scale
    with pytest.raises(dsq.PayloadError, match="not finite"):
        sign.decompress_flat(bad, 10)
    qsgd = dsq.get_compressor("qsgd", levels=7)
    bad = qsgd.compress(torch.randn(10)).payload.clone()
    bad[4:] = 255  # codes of 15 > 2*7
    with pytest.raises(dsq.PayloadError, match="codes above"):
        qsgd.decompress_flat(bad, 10, seed=0)


@pytest.mark.parametrize("name, params, contraction", [
    ("sign", {}, True), ("topk", {}, True), ("none", {}, True), ("fp16", {}, True),
    ("randomk", {}, False), ("randomk", {"unbiased": False}, True),
    ("qsgd", {}, True), ("qsgd", {"levels": 7}, False), ("qsgd", {"levels": 23}, True),
    ("terngrad", {}, False), ("blocksign", {}, True), ("randomsign", {}, True), ("randomsign", {"scale": "rms"}, True)])
def test_contraction_property_matches_the_measured_residuals(name, params, contraction):
    """is_contraction() is what the reducer's error-feedback warning trusts:
    where it says no, some input has E||x - C(x)||² >= ||x||²; where it says
    yes, the residual of spread-out inputs stays below ||x||²."""
    q = dsq.get_compressor(name, **params)
    assert q.is_contraction() is contraction
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    residual = statistics_mean([float((x - q.decompress(q.compress(x, seed=s))).pow(2).sum()) for s in range(20)])
    assert (residual < float(x.pow(2).sum())) is contraction


def statistics_mean(values):
    return sum(values) / len(values)


def test_unbucketed_qsgd_is_not_trusted_as_a_contraction():
    # its variance bound grows as sqrt(chunk size) / levels: no size-independent guarantee
    assert dsq.get_compressor("qsgd", bucket_size=None).is_contraction() is False


def _operators(compressor, server_compressor, error_feedback, compressor_params=None):
    return dsq.ReducerConfig(compressor=compressor, server_compressor=server_compressor, error_feedback=error_feedback,
                             compressor_params=compressor_params).build_compressors(warn=True)


def test_error_feedback_on_a_non_contraction_warns_and_names_the_pass():
    with pytest.warns(ErrorFeedbackWarning, match="server pass"):
        _operators("sign", "terngrad", "both")
    with pytest.warns(ErrorFeedbackWarning, match="worker pass"):
        _operators("qsgd", "sign", "both", {"levels": 7})
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _operators("terngrad", None, "none")  # no memory, nothing to grow
        _operators("qsgd", None, "both")  # 8-bit QSGD is a contraction
        _operators("sign", "terngrad", "worker")  # the server pass keeps no memory


@pytest.mark.parametrize("name, params", [("topk", {"ratio": 0.05}), ("randomk", {"ratio": 0.05}),
                                          ("blocksign", {"block": 8}), ("sign", {}), ("qsgd", {})])
def test_decoded_arithmetic_matches_the_dense_vector(name, params):
    """The reducer adds and subtracts decoded payloads without densifying
    the sparse ones; each operation must give the dense result's values."""
    q = dsq.get_compressor(name, **params)
    x = torch.randn(1003, generator=torch.Generator().manual_seed(5))
    payload = q.compress(x, seed=9).payload
    decoded = q.decode(payload, 1003, 9)
    dense = q.decompress_flat(payload, 1003, 9)
    assert decoded.is_sparse is q.sparse
    assert torch.equal(decoded.dense(), dense)
    base = torch.randn(1003, generator=torch.Generator().manual_seed(6))
    assert torch.equal(decoded.add_to_(base.clone()), base + dense)
    assert torch.equal(decoded.subtract_from_(base.clone()), base - dense)
    assert torch.equal(decoded.write_to_(base.clone()), dense)
    assert decoded.is_finite()
    # a range, as a bucket's tensor is written from the chunk covering it: by bisection where positions increase
    # on a CPU, by adding into zeros with no host read elsewhere (forced here by increasing=False)
    assert decoded.increasing is (name in ("topk", "blocksign"))
    unordered = dataclasses.replace(decoded, increasing=False)
    for start, end in [(0, 1003), (0, 1), (5, 500), (499, 1003), (1000, 1003), (100, 101)]:
        for d, dtype in itertools.product((decoded, unordered), (torch.float32, torch.float16)):
            out = torch.full((end - start,), 7.0, dtype=dtype)
            assert torch.equal(d.write_range_to_(out, start), dense[start:end].to(dtype)), (start, end)


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    from dsq_plugins.reducer import chunk_bounds
    return chunk_bounds(n, size)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("n,size", [(1000, 4), (1003, 4), (13, 3), (3, 5), (0, 2), (4096, 8)])
def test_compress_chunks_sends_what_compress_sends_for_each_chunk(name, n, size):
    """The batched call (casts batch on every device) gives each chunk's own payload, bit for bit."""
    q = dsq.get_compressor(name)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    bounds = _chunks(n, size)
    seeds = [100 + k for k in range(size)]
    shared = q.prepare(x)
    batched = q.compress_chunks(x, bounds, seeds, shared=shared)
    assert len(batched) == size
    for (a, b), seed, payload in zip(bounds, seeds, batched):
        assert torch.equal(payload, q.compress(x[a:b], seed=seed, shared=shared).payload), (a, b)


ROW_ENCODERS = [("sign", {}), ("sign", {"scale": "rms"}), ("sign", {"scope": "tensor"}), ("sign", {"block": 16}),
                ("topk", {"ratio": 0.05}),
                ("fp16", {}), ("randomk", {}), ("randomk", {"unbiased": False}), ("blocksign", {}),
                ("blocksign", {"block": 7}), ("qsgd", {}), ("qsgd", {"levels": 7, "bucket_size": 64}),
                ("qsgd", {"bucket_size": None}), ("terngrad", {}), ("terngrad", {"bucket_size": 100}),
                ("terngrad", {"bucket_size": 7})]


@pytest.mark.parametrize("name,params", ROW_ENCODERS)
@pytest.mark.parametrize("n,size", [(4096, 8), (4096, 2), (1003, 4), (13, 3), (3, 5), (1400, 2)])
@pytest.mark.parametrize("compile_mode", ["never", "always"])
def test_row_encoders_match_the_chunk_encoder(monkeypatch, name, params, n, size, compile_mode):
    """The row encoders run where a GPU is; here they are forced on the CPU,
    eager and compiled: the same bits, each chunk's sign scale up to its
    sum's order, whatever the chunks' size (short last buckets and blocks,
    buckets that end inside a byte)."""
    if compile_mode == "always" and name not in ("qsgd", "terngrad", "blocksign"):
        pytest.skip("no compiled kernel in this row encoder")
    monkeypatch.setenv("DSQ_COMPILE", compile_mode)
    q = dsq.get_compressor(name, **params)
    monkeypatch.setattr(type(q), "encodes_rows", lambda self, device: True)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    if name in ("qsgd", "terngrad", "blocksign"):
        x[: n // 3] = 0.0  # whole buckets and blocks of zeros (top-k's ties among them may go either way)
    bounds = _chunks(n, size)
    seeds = [100 + k for k in range(size)]
    shared = q.prepare(x)
    batched = q.compress_chunks(x, bounds, seeds, shared=shared)
    for (a, b), seed, payload in zip(bounds, seeds, batched):
        expected = q.compress(x[a:b], seed=seed, shared=shared).payload
        assert payload.shape == expected.shape and payload.is_contiguous()
        if name == "sign" and b > a and "block" not in params:
            assert torch.equal(payload[4:], expected[4:])
            s, t = payload[:4].clone().view(torch.float32), expected[:4].clone().view(torch.float32)
            assert torch.allclose(s, t, rtol=1e-6, atol=0), (s, t)
        else:
            assert torch.equal(payload, expected), (a, b)
    from dsq_plugins.compressors import blocksign, levels
    assert not any(k._failed for k in (*levels._row_codes_kernels.values(), blocksign._codes_kernel)), \
        "a kernel fell back to eager: nothing compiled was compared"


@pytest.mark.parametrize("name", ["randomk", "qsgd", "terngrad"])
def test_row_encoders_draw_a_missing_seed_as_compress_does(monkeypatch, name):
    """No seed given: each chunk gets compress's next seed (replayable from the
    compressor's seed), never one the row encoder would make up."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    bounds = _chunks(4096, 4)
    by_chunk = [dsq.get_compressor(name, seed=5).compress_chunks(x, bounds, [None] * 4) for _ in range(2)]
    monkeypatch.setattr(type(dsq.get_compressor(name)), "encodes_rows", lambda self, device: True)
    batched = dsq.get_compressor(name, seed=5).compress_chunks(x, bounds, [None] * 4)
    for one, again, rows in zip(*by_chunk, batched):
        assert torch.equal(one, again) and torch.equal(one, rows)


def test_compress_chunks_refuses_bounds_that_do_not_cut_the_vector():
    q = dsq.get_compressor("fp16")
    x = torch.randn(10)
    with pytest.raises(ValueError, match="consecutive"):
        q.compress_chunks(x, [(0, 4), (5, 10)], [None, None])
    with pytest.raises(ValueError, match="consecutive"):
        q.compress_chunks(x, [(0, 4), (4, 9)], [None, None])
    with pytest.raises(ValueError, match="seeds"):
        q.compress_chunks(x, [(0, 4), (4, 10)], [None])


def test_lowrank_recovers_a_chunk_that_is_of_that_rank_exactly():
    """Power iteration from any start spans a rank-r matrix's column space: P P^T M = M
    (exactly with fp32 factors; bf16 factors, the default, to their 8 bits of mantissa)."""
    from dsq_plugins.compressors.lowrank import shape_of
    n, m = shape_of(900)
    gen = torch.Generator().manual_seed(3)
    matrix = torch.randn(n, 2, generator=gen) @ torch.randn(2, m, generator=gen)
    q = dsq.get_compressor("lowrank", rank=2, factors="fp32")
    out = q.decompress(q.compress(matrix.reshape(-1), seed=11))
    assert torch.allclose(out, matrix.reshape(-1), atol=1e-4)
    assert q.compress(matrix.reshape(-1), seed=11).nbytes == 4 * 2 * (n + m)
    default = dsq.get_compressor("lowrank", rank=2)
    payload = default.compress(matrix.reshape(-1), seed=11)
    assert payload.nbytes == 2 * 2 * (n + m)
    assert (default.decompress(payload) - matrix.reshape(-1)).norm() < 0.01 * matrix.norm()


def test_lowrank_with_error_feedback_trains_and_without_it_falls_behind():
    from examples.train_digits import train

    def run(**kw):
        return dsq.LocalGroup(4).run(lambda c: train(c, steps=300, lr=0.05, compressor="lowrank",
                                                      compressor_params={"rank": 4}, **kw))[0]
    ef, none = run(), run(error_feedback="none")
    assert ef.test_accuracy > 0.85 and ef.test_accuracy > none.test_accuracy + 0.1
    # a 64 x 64 and a 10 x 64 matrix at rank 4, each cut in 4 row blocks (one per owner), biases as values
    assert ef.bytes_per_step < ef.fp32_allreduce_bytes_per_step / 2.5


@pytest.mark.parametrize("factors", ["bf16", "fp16"])
def test_lowrank_half_precision_factors_halve_the_bytes_and_keep_the_approximation(factors):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    full, half = (dsq.get_compressor("lowrank", rank=3, factors="fp32"),
                  dsq.get_compressor("lowrank", rank=3, factors=factors))
    a, b = full.compress(x, seed=5), half.compress(x, seed=5)
    assert b.nbytes * 2 == a.nbytes == wire_formula("lowrank", 5000, rank=3, factors="fp32")
    assert b.nbytes == wire_formula("lowrank", 5000, rank=3, factors=factors) == half.payload_nbytes(5000)
    ya, yb = full.decompress(a), half.decompress(b)
    assert (ya - yb).norm() < 0.01 * ya.norm()
    with pytest.raises(dsq.PayloadError, match="must be 852 bytes, got 851"):
        half.decompress(dataclasses.replace(b, payload=b.payload[:-1]))


@pytest.mark.parametrize("params, message", [({"rank": 0}, "rank must be a positive integer"),
                                             ({"iterations": 0}, "iterations must be a positive integer"),
                                             ({"factors": "int4"}, "factors must be one of fp32, bf16, fp16"),
                                             ({"warm_start": "shared"}, "warm_start must be one of basis, served"),
                                             ])
def test_lowrank_refuses_bad_parameters(params, message):
    with pytest.raises(dsq.ConfigError, match=message):
        dsq.get_compressor("lowrank", **params)
