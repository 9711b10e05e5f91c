"""The counter-based noise behind QSGD's and TernGrad's stochastic rounding:
the same values however it is computed, uniform and unrelated from element
to element and from seed to seed, and what the quantiser actually uses."""
import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.compressors import kernels, noise

SEED = (1 << 40) + 3


@pytest.mark.parametrize("n,start", [(1, 0), (1000, 5), (kernels.CPU_BLOCK + 3, 77), (3 * kernels.CPU_BLOCK, 0),
                                     (kernels.CPU_BLOCK + 9, (1 << 30) - 1000)])  # across the 30-bit word's period
def test_blocked_one_shot_and_compiled_forms_give_the_same_bits(n, start):
    low, high = noise.seed_words(SEED)
    index = torch.arange(start, start + n)
    blocked = noise.uniform(n, SEED, start=start)
    assert torch.equal(blocked, noise.uniform_at(index, low, high))
    assert torch.equal(blocked, torch.compile(noise.uniform_at, dynamic=True)(index, low, high))
    assert torch.equal(blocked[1:], noise.uniform(n - 1, SEED, start=start + 1))  # element i is element i
    if noise.index_dtype(start, n) == torch.int32:  # the narrow index the compiled quantiser uses
        narrow = index.to(torch.int32)
        assert torch.equal(blocked, noise.uniform_at(narrow, low, high))
        assert torch.equal(blocked, torch.compile(noise.uniform_at, dynamic=True)(narrow, low, high))


def test_the_stream_is_pinned():
    """Changing the hash changes every QSGD and TernGrad payload: do it on purpose."""
    assert noise.uniform(4, 0).tolist() == [0.7283208966255188, 0.6792643666267395, 0.6050955653190613,
                                             0.6780442595481873]
    assert noise.uniform(2, SEED).tolist() == [0.3305153250694275, 0.5390361547470093]


def test_uniform_and_unrelated():
    n = 1 << 20
    u = noise.uniform(n, SEED).double()
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 120, chi2  # 63 degrees of freedom: the 99.99th percentile is about 116
    centred = u - 0.5
    for lag in (1, 2, 8, 64, 512, 1 << 16):  # neighbours, and elements a bucket or a block apart
        corr = float((centred[:-lag] * centred[lag:]).mean() / centred.var())
        assert abs(corr) < 5 / n ** 0.5, (lag, corr)
    for other in (SEED + 1, SEED + 2, SEED + (1 << 30), SEED + (1 << 32), 0):  # close seeds, and one far off
        v = noise.uniform(n, other).double() - 0.5
        assert abs(float((centred * v).mean() / centred.var())) < 5 / n ** 0.5, other


def test_qsgd_rounds_each_element_with_its_noise():
    """The quantiser's codes are floor(levels·|x|/norm + u_i), u_i this module's element i."""
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    q = dsq.get_compressor("qsgd", levels=7, bucket_size=None)
    payload = q.compress(x, seed=SEED).payload
    norm = x.norm()
    expected = (x.abs() / norm * 7 + noise.uniform(300, SEED)).floor().clamp(max=7).copysign(x)
    assert torch.equal(q.decompress_flat(payload, 300, SEED), expected * (norm / 7))
