"""QSGD's and TernGrad's Triton codec (``compressors.levels_codec``) against torch's path, run by Triton's
interpreter on a CPU (``TRITON_INTERPRET=1`` set before Triton is imported) or on a GPU: prints one line per case
and ``matched N``.

Default: the codec's encode and decode against torch's kernels. ``--through-compressors``: QSGD's and TernGrad's
own calls with the codec taken on this device too. ``--reduce``: DoubleSqueeze with QSGD on three ranks.
``--compile-for 80 90``: the kernels compiled for those GPUs, without one."""
from __future__ import annotations

import argparse
import importlib
import os

import torch

from dsq_plugins.compressors import kernels, levels_codec
from dsq_plugins.compressors import levels as lv
from dsq_plugins.compressors.base import TRUSTED
from dsq_plugins.compressors.levels import code_bits
from dsq_plugins.compressors.own_kernels import TORCH_REFERENCES, own_kernels
from tests.helpers import triton_workers

#: (levels, width, size): every code width, buckets that end inside a byte, one-element buckets, a bucket wider than
#: the row, rows shorter than a byte, rows over several programs with a short last bucket
SHAPES = [(1, 1 << 20, 1001), (1, 96, 1003), (7, 512, 4101), (7, 7, 333), (127, 512, 3 * 2048 + 5), (127, 1, 50),
          (3, 5000, 4999), (15, 512, 3), (127, 2048, 2048), (1, 3, 4096 + 1)]
SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, float("inf"), -float("inf")]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (a refused scale decodes to NaNs)."""
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0),
                                                                                        b.nan_to_num(0.0))


def seed_words(count: int) -> list[tuple[int, int]]:
    return [((11 + 7919 * r) % (1 << 30), (1 << 30) - 1 - r) for r in range(count)]


def check_codec(device: torch.device) -> int:
    """Each shape's payloads from the same scales and seed words (against torch's eager reference and its compiled
    row kernel); then each payload decoded, as it is and with
    refused scales (negative, NaN, infinite; -0.0 and the largest float pass), codes above the top one (a last
    byte's padding too), at an odd offset in a receive buffer, into a buffer, without flags."""
    encode, decode = TORCH_REFERENCES["levels_payloads"], TORCH_REFERENCES["levels_decoded"]
    gen, matched = torch.Generator().manual_seed(3), 0
    for levels, width, size in SHAPES:
        bits = code_bits(levels)
        rows = torch.randn(4, size, generator=gen)
        rows[0, : len(SPECIAL)] = torch.tensor(SPECIAL[:size])
        rows[1, : min(width, size)] = 0.0  # an all-zero bucket: scale 0
        rows[2] *= 1e-40  # subnormal values and scales
        rows, words = rows.to(device), seed_words(4)
        scales, want = encode(rows, levels, bits, width, words)
        with kernels.gpu_paths():  # torch's row kernel, compiled where it pays, as a GPU runs it
            compiled = lv._payload_rows(rows, scales, width, words, levels, bits)
        got = levels_codec.encoded_rows(rows, scales, torch.tensor(words, dtype=torch.int32, device=device),
                                        levels, bits, width)
        same = torch.equal(got, want) and torch.equal(got, compiled)
        print(f"encode levels={levels} width={width} {rows.shape[0]}x{size}: {'same' if same else 'DIFFERENT'}",
              flush=True)
        assert same, (levels, width, size)
        matched += 1
        for case, payloads in decode_cases(got, levels, bits, 4 * scales.shape[1]):
            want_values, want_bad = decode(payloads, size, levels, bits, width)
            out = torch.full((payloads.shape[0], size), 7.0, device=device)
            values, bad = levels_codec.decoded_rows(payloads, size, levels, bits, width, out=out)
            plain, none = levels_codec.decoded_rows(payloads, size, levels, bits, width, flags=False)
            same = values is out and none is None and torch.equal(bad, want_bad) \
                and same_values(values, want_values) and same_values(plain, values)
            print(f"  decode {case}: flags {bad.int().tolist()} {'same' if same else 'DIFFERENT'}", flush=True)
            assert same, (levels, width, size, case)
            matched += 1
    return matched


def decode_cases(payloads: torch.Tensor, levels: int, bits: int, header: int):
    yield "as sent", payloads
    width = payloads.shape[1]
    refused = payloads.clone()
    for row, value in enumerate((-1.0, float("nan"), float("inf"), -0.0)):
        refused[row, :4] = torch.tensor([value]).view(torch.uint8).to(payloads.device)
    yield "scales refused", refused
    above = payloads.clone()
    above[0, -1] = 255  # the last byte: its padding codes where the row ends inside it
    above[3, header] = (2 * levels + 1) << (8 - bits)  # the first code just above the top one
    yield "codes above", above
    buffer = torch.zeros(payloads.shape[0], width + 3, dtype=torch.uint8, device=payloads.device)
    buffer[:, 3:] = above
    yield "unaligned rows", buffer[:, 3:]


def check_nan(device: torch.device) -> int:
    """A NaN in a row: its scale is NaN and every other value's code torch's (a NaN's own code is the device's
    conversion), and the decode refuses the scale."""
    encode = TORCH_REFERENCES["levels_payloads"]
    rows = torch.randn(2, 700, generator=torch.Generator().manual_seed(8)).to(device)
    rows[1, 5] = float("nan")
    scales, want = encode(rows, 127, 8, 512, seed_words(2))
    got = levels_codec.encoded_rows(rows, scales, torch.tensor(seed_words(2), dtype=torch.int32, device=device),
                                    127, 8, 512)
    codes = torch.ones(got.shape[1], dtype=torch.bool, device=device)
    codes[8 + 5] = False
    same = torch.equal(got[0], want[0]) and torch.equal(got[1, codes], want[1, codes])
    bad = levels_codec.decoded_rows(got, 700, 127, 8, 512)[1]
    same = same and bad[0].tolist() == [False, True]
    print(f"a NaN: {'same' if same else 'DIFFERENT'}", flush=True)
    assert same
    return 1


def check_through_compressors(device: torch.device) -> int:
    """QSGD's and TernGrad's own calls with the codec taken, against the same calls on torch's path: a vector and
    its decode (checked, into a buffer), a bucket's chunks as rows, received rows checked, trusted, into a buffer,
    a refused row deferred and raised; the codec ran for each, and only with ``DSQ_OWN_KERNELS=triton``."""
    import dsq_plugins as dsq
    levels_codec._taken = lambda tensor, count, size: own_kernels() == "triton"  # this device too (interpreter)
    levels_codec.runs_on = lambda device: own_kernels() == "triton"
    launched = {"encode": 0, "decode": 0}
    encoded, decoded = levels_codec.encoded_rows, levels_codec.decoded_rows

    def counted_encode(*args):
        launched["encode"] += 1
        return encoded(*args)

    def counted_decode(*args, **kwargs):
        launched["decode"] += 1
        return decoded(*args, **kwargs)
    levels_codec.encoded_rows, levels_codec.decoded_rows = counted_encode, counted_decode
    matched = 0
    for name, params in (("qsgd", {}), ("qsgd", {"levels": 7, "bucket_size": 100}), ("terngrad", {}),
                         ("terngrad", {"bucket_size": 256})):
        q = dsq.get_compressor(name, **params)
        x = torch.randn(4096 + 8, generator=torch.Generator().manual_seed(9)).to(device)
        bounds = [(i * 1024, (i + 1) * 1024) for i in range(4)] + [(4096, 4104)]
        seeds = list(range(5))
        results = {}
        with kernels.gpu_paths():
            for codec in ("torch", "triton"):
                os.environ["DSQ_OWN_KERNELS"] = codec
                before = dict(launched)
                payload = q.compress(x, seed=1).payload
                chunks = q.compress_chunks(x, bounds, seeds)
                rows = torch.stack(chunks[:4])
                bad = rows.clone()
                bad[2, :4] = torch.tensor([-1.0]).view(torch.uint8)
                refusals: list = []
                results[codec] = [payload, q.decompress_flat(payload, x.numel(), seed=1), *chunks,
                                  q.decode(payload, x.numel(), seed=1, into=torch.empty_like(x)).dense(),
                                  q.decode_rows(rows, 1024, seeds[:4]),
                                  q.decode_rows(rows, 1024, seeds[:4], into=torch.empty(4, 1024, device=device)),
                                  q.decode_rows(rows, 1024, seeds[:4], refusals=TRUSTED),
                                  q.decode_rows(bad, 1024, seeds[:4], refusals=refusals),
                                  *[flag for flag, _ in refusals]]
                results[codec] += [words for _, words in refusals]
                try:
                    q.decode_rows(bad, 1024, seeds[:4])
                    results[codec].append("not refused")
                except Exception as refused:  # noqa: BLE001 - the words are what is compared
                    results[codec].append(str(refused))
                ran = {step: launched[step] - before[step] for step in launched}
                print(f"{name} {params}, {codec}: the codec encoded {ran['encode']} times, decoded "
                      f"{ran['decode']} times", flush=True)
                assert (codec == "triton") == (ran["encode"] == 3 and ran["decode"] == 7), ran
        os.environ.pop("DSQ_OWN_KERNELS")
        for i, (a, b) in enumerate(zip(results["torch"], results["triton"], strict=True)):
            same = a == b if isinstance(a, str) else a.shape == b.shape and torch.equal(a, b)
            assert same, (name, params, i, a, b)
            matched += 1
        print(f"{name} {params}: {len(results['torch'])} results same", flush=True)
    return matched


def check_reduce(device: torch.device) -> int:
    """Five steps of ``DoubleSqueeze`` with QSGD (4-bit codes, buckets of 36) on three ranks (threads), on the
    GPU's paths, the third with a NaN in one rank's gradient: the averages, which carry both error memories, and
    each rank's error at the third step are the same with the codec (and the int8 memory's Triton encodes and
    additions) as with torch's kernels."""
    import threading

    import dsq_plugins as dsq
    lock = threading.Lock()  # the interpreter is not for several threads at once
    launched = [0]

    def serialised(fn):
        def call(*args, **kwargs):
            with lock:
                launched[0] += 1
                return fn(*args, **kwargs)
        return call
    levels_codec._taken = lambda tensor, count, size: own_kernels() == "triton"
    levels_codec.runs_on = lambda device: own_kernels() == "triton"
    levels_codec.encoded_rows = serialised(levels_codec.encoded_rows)
    levels_codec.decoded_rows = serialised(levels_codec.decoded_rows)
    int8 = importlib.import_module("dsq_plugins.state._int8_triton")  # the memory's kernels too: its encodes
    int8._taken = lambda x: own_kernels() == "triton"
    int8.added_rows, int8.int8_codes_rows = serialised(int8.added_rows), serialised(int8.int8_codes_rows)

    results = {}
    with kernels.gpu_paths():
        for codec in ("torch", "triton"):
            os.environ["DSQ_OWN_KERNELS"] = codec
            before = launched[0]
            results[codec] = dsq.LocalGroup(3).run(triton_workers.reducing_with_a_nan("qsgd", device, levels=7,
                                                                                       bucket_size=36))
            print(f"reduce, {codec}: {launched[0] - before} Triton launches", flush=True)
            assert (launched[0] > before) == (codec == "triton")
    assert triton_workers.same_reductions(results["torch"], results["triton"])
    return 1


#: the kernels' pointer arguments by name (every other argument but the constants is an int32 size)
POINTERS = {"rows_ptr": "*fp32", "scales_ptr": "*fp32", "words_ptr": "*i32", "out_ptr": "*u8", "payloads_ptr": "*u8",
            "bad_ptr": "*i1"}
#: the sizes a bucket's rows make multiples of 16, as Triton's launcher finds them and specialises on
MULTIPLES_OF_16 = {"row_stride", "out_stride", "size", "numel", "nbytes", "payload_stride"}


def compile_for(capability: int) -> int:
    """Both kernels for every code width, with buckets and one bucket per row, compiled as a GPU of this compute
    capability runs them, by Triton's own ptxas, with no GPU here: a program's values read (encode) or written
    (decode) 16 bytes at a time, no subnormal flushed to zero, no multiply and add fused into one rounding, the
    division correctly rounded."""
    compiled = 0
    for fn, extra, vectors in ((levels_codec._encode, {"HEADER": levels_codec._HEADER}, "ld.global.v4"),
                               (levels_codec._decode, {"FLAGS": True}, "st.global.v4")):
        for levels in (1, 7, 127):
            for width in (0, 512):
                constants = {"LEVELS": levels, "BITS": code_bits(levels), "WIDTH": width,
                             "ELEMENTS": levels_codec._ELEMENTS, **extra}
                kinds = {**POINTERS, **({"out_ptr": "*fp32"} if fn is levels_codec._decode else {})}
                ptx, usage = triton_workers.compiled(fn, constants, kinds, MULTIPLES_OF_16, capability,
                                                     {"enable_fp_fusion": False})
                count = ptx.count(vectors)
                print(f"{fn.__name__} levels={levels} width={width} for sm_{capability}: {count} of {vectors}; "
                      f"{usage}", flush=True)
                assert count >= 4, f"{fn.__name__}: a program's values are not moved 16 bytes at a time"
                assert ".ftz" not in ptx, f"{fn.__name__}: subnormals flushed to zero, where torch keeps them"
                assert "fma.rn" not in ptx, f"{fn.__name__}: a multiply and an add fused into one rounding"
                assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx, fn.__name__
                compiled += 1
    return compiled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--through-compressors", action="store_true")
    parser.add_argument("--reduce", action="store_true")
    parser.add_argument("--compile-for", type=int, nargs="*", help="compute capabilities: compile only")
    args = parser.parse_args()
    if args.compile_for:
        print(f"compiled {sum(compile_for(c) for c in args.compile_for)}")
        return
    device = torch.device(args.device)
    if args.through_compressors:
        print(f"matched {check_through_compressors(device)}")
    elif args.reduce:
        print(f"matched {check_reduce(device)}")
    else:
        print(f"first-call check {'passes' if levels_codec._agrees_with_torch(device) else 'FAILS'}")
        print(f"matched {check_codec(device) + check_nan(device)}")


if __name__ == "__main__":
    main()
