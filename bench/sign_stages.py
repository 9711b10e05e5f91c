"""Where sign's compress + decompress spends its time: each stage of its
encode and decode on its own, against a clone of the same vector, and the
two ways of summing |v| for its scale (whether they give the same bits).

    python -m bench.sign_stages [--device cuda|cpu] [--sizes 1,16,64] [--trials 20]

``bench.kernels`` times the whole compress + decompress; this splits it,
so that a session with a GPU sees which pass is far from a clone's speed:
the scale's L1 as abs, then sum, against one reduction
(``torch.linalg.vector_norm(v, 1)``, what ``kernels.l1_norm`` runs on CUDA
from ``ONE_PASS_L1_FROM`` elements), the packed bits, the whole payload
(``_signs_rows_kernel``), the payloads with their int8 residual from one
kernel (``payloads_with_residual``, a GPU's paths) for one chunk and for
eight (a worker's chunks with eight ranks: a compiler may index the int8
blocks across rows far more slowly than along one), and the table decode,
alone and into a buffer.
The L1 row also compares the two sums' bits over ``--trials`` vectors of
each size: a one-pass scale may replace the two-pass one only where the
bits, and so the wire bytes, stay the same."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from bench.kernels import timed
from dsq_plugins.algorithm.arithmetic import payloads_with_residual
from dsq_plugins.compressors import bitpack, kernels, sign
from dsq_plugins.layout import chunk_bounds


def stages(v: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The passes of one sign compress + decompress of ``v`` (a multiple of 8 long), each a call."""
    rows = v.view(1, -1)
    magnitude = kernels.l1_norm(v).reshape(1)
    divisor = kernels.device_constant(float(v.numel()), v.device)
    payload = sign._signs_rows_kernel(rows, magnitude, divisor, numel=v.numel())[0]
    s = payload[:4].view(torch.float32)
    units = bitpack.sign_units(v.device)
    out = torch.empty_like(v)
    q = sign.SignCompressor()
    return {
        "clone": lambda: v.clone(),
        "l1 abs+sum": lambda: v.abs().sum(),
        "l1 vector_norm": lambda: torch.linalg.vector_norm(v, 1),
        "l1 (kernels.l1_norm)": lambda: kernels.l1_norm(v),
        "bits": lambda: bitpack.pack_nonnegative(v),
        "payload (scale bytes + bits)": lambda: sign._signs_rows_kernel(rows, magnitude, divisor, numel=v.numel()),
        "payload + int8 residual, 1 chunk": lambda: merged(q, v, 1),
        "payloads + int8 residual, 8 chunks": lambda: merged(q, v, 8),
        "decode": lambda: kernels.lookup(units, payload[4:], v.numel(), scale=s),
        "decode into": lambda: kernels.lookup(units, payload[4:], v.numel(), scale=s, out=out),
        "compress + decompress": lambda: q.decompress(q.compress(v, seed=1)),
    }


def merged(q: sign.SignCompressor, v: torch.Tensor, chunks: int) -> object:
    """``q``'s payloads of ``v`` in ``chunks`` chunks and their int8 residual, from the one kernel a GPU's
    paths take (a CPU's take it for one chunk only)."""
    with kernels.gpu_paths():
        return payloads_with_residual(q, v, chunk_bounds(v.numel(), chunks))


def same_l1_bits(numel: int, trials: int, device: torch.device) -> int:
    """Of ``trials`` random vectors of ``numel`` elements, how many sum |v| to the same bits both ways."""
    same = 0
    for t in range(trials):
        gen = torch.Generator(device=device).manual_seed(t)
        v = torch.randn(numel + t, device=device, generator=gen) * (10.0 ** (t % 7 - 3))
        same += bool(torch.equal(v.abs().sum(), torch.linalg.vector_norm(v, 1)))
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="1,16,64", help="millions of elements")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--trials", type=int, default=20)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print(f"sign's stages on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
          f"ms (fewest of {args.reps}) and x clone")
    print("| stage | " + " | ".join(f"{m}M ms | x clone" for m in args.sizes.split(",")) + " |")
    print("|---|" + "---:|---:|" * len(args.sizes.split(",")))
    table: dict[str, list[str]] = {}
    for m in args.sizes.split(","):
        v = torch.randn(int(m) << 20, device=device, generator=torch.Generator(device=device).manual_seed(0))
        calls = stages(v)
        clone = timed(calls["clone"], device, args.reps)
        for name, fn in calls.items():
            ms = timed(fn, device, args.reps)
            table.setdefault(name, []).append(f"{1000 * ms:.3f} | {ms / clone:.2f}")
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    for m in args.sizes.split(","):
        n = int(m) << 20
        print(f"L1 by abs+sum and by vector_norm, same bits: {same_l1_bits(n, args.trials, device)} of "
              f"{args.trials} vectors near {m}M elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
