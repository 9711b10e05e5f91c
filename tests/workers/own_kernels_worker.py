"""The library's own Triton kernels against torch's paths, run by Triton's interpreter on a CPU (the environment sets
``TRITON_INTERPRET=1`` before Triton is imported) or on a GPU: prints one line per case and ``matched N``.

Default: sign's codec (encode and decodes). ``--small-blocks``: the same with rows that span several programs.
``--through-sign``: ``SignCompressor``'s own calls with the codec taken on this device too. ``--with-residual``:
sign's payloads with their int8 residual. ``--mean``: an owner's u from its senders' payloads. ``--memory``: the
int8 memory's addition with its status. ``--reduce``: DoubleSqueeze on three ranks with all of them taken.
``--compile-for 80 90``: every kernel compiled for those GPUs, without one."""
from __future__ import annotations

import argparse
import importlib
import os

import torch

from dsq_plugins.compressors import kernels, sign_codec
from dsq_plugins.compressors.base import TRUSTED, columns_as
from dsq_plugins.compressors.own_kernels import own_kernels
from dsq_plugins.compressors.bitpack import sign_units
from dsq_plugins.compressors.sign import SignCompressor, checked_signs, signs_rows
from tests.helpers import triton_workers


SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 3e38, -3e38, -float("nan")]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (a NaN's sign and payload bits are the device's)."""
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0),
                                                                                        b.nan_to_num(0.0))


def encode_cases(device: torch.device, sizes: list[tuple[int, int]]):
    gen = torch.Generator().manual_seed(5)
    for count, size in sizes:
        rows = torch.randn(count, size, generator=gen)
        rows[:, : len(SPECIAL)] = torch.tensor(SPECIAL[: size])
        magnitudes = rows.abs().nan_to_num(0.0, 0.0).sum(dim=1)
        yield f"plain {count}x{size}", rows, magnitudes, float(size)
        odd = torch.tensor([float("inf"), float("nan"), 0.0, 3.3e38, 1e-45][:count] * count)[:count]
        yield f"odd magnitudes {count}x{size}", rows, odd, 0.1  # clamped, NaN kept, zero, overflowing
    wide = torch.randn(3, 8 * 40 + 24, generator=gen)
    yield "strided rows", wide[:, 8: 8 + 8 * 40], wide[:, :8].abs().sum(dim=1), 7.0


def decode_cases(payloads: torch.Tensor, size: int):
    """(name, payload rows, numel): whole rows, rows not whole bytes long, refused scales, unaligned rows."""
    yield "whole", payloads, size
    yield "short", payloads, max(0, size - 5)
    scales = torch.tensor([-1.0, float("nan"), float("inf"), -0.0, 0.0, 1e-45, 3.4028234663852886e38, -float("inf")])
    refused = payloads.clone()
    for row in range(refused.shape[0]):
        refused[row, :4] = scales[row % len(scales): row % len(scales) + 1].view(torch.uint8)
    yield "scales to refuse", refused, size
    buffer = torch.zeros(payloads.shape[0], payloads.shape[1] + 3, dtype=torch.uint8)
    buffer[:, 3:] = payloads
    yield "unaligned rows", buffer[:, 3:], size


def check_codec(device: torch.device, sizes: list[tuple[int, int]]) -> int:
    matched = 0
    for name, rows, magnitudes, divisor in encode_cases(device, sizes):
        rows, magnitudes = rows.to(device), magnitudes.to(device)
        divisor = torch.full((), divisor, device=device)
        with kernels.gpu_paths():  # a GPU's bits (a CPU's sweep reads a NaN's sign bit; a GPU compares it with 0)
            want = signs_rows(rows, magnitudes, divisor)
        got = sign_codec.encoded_rows(rows, magnitudes, divisor)
        scales = [columns_as(payloads, 0, 4, torch.float32) for payloads in (got, want)]
        same = torch.equal(got[:, 4:], want[:, 4:]) and same_values(*scales)  # a NaN scale's bits are the device's
        same = same and (torch.equal(got, want) or bool(scales[0].isnan().any()))
        print(f"encode {name} {'same' if same else 'DIFFERENT'}", flush=True)
        assert same, name
        matched += 1
        for case, payloads, numel in decode_cases(got, rows.shape[1]):
            want_values, want_bad = checked_signs(payloads, sign_units(device))
            out = torch.full((payloads.shape[0], numel), 7.0, device=device)
            values, bad = sign_codec.decoded_rows(payloads, numel, out=out)
            plain, none = sign_codec.decoded_rows(payloads, numel, flags=False)
            same = values is out and none is None and torch.equal(bad, want_bad) \
                and same_values(values, want_values[:, :numel]) and same_values(plain, values)
            print(f"  decode {case} numel={numel} {'same' if same else 'DIFFERENT'}", flush=True)
            assert same, (name, case)
            matched += 1
    return matched


def check_odd_rows(device: torch.device) -> int:
    """Rows that are not whole bytes (a bucket's chunks cut unevenly, an owner's chunk): the codec's payloads
    are ``SignCompressor``'s own on torch's path (its last byte's bits past the row 0), and decode back."""
    from dsq_plugins.compressors.sign import scale_divisor
    q, gen, matched = SignCompressor(), torch.Generator().manual_seed(23), 0
    for count, size in ((1, 1), (2, 13), (3, 1001), (1, 8 * sign_codec._BYTES + 3)):
        rows = torch.randn(count, size, generator=gen).to(device)
        rows[0, :2] = torch.tensor([-0.0, 0.0])[:size]
        got = sign_codec.encoded_rows(rows, q._row_magnitudes(rows), scale_divisor(size, "mean", device))
        os.environ["DSQ_OWN_KERNELS"] = "torch"
        with kernels.gpu_paths():
            want = q._encode_rows(rows, None)
            values = q.decode_rows(want, size, [None] * count)
        os.environ.pop("DSQ_OWN_KERNELS")
        same = torch.equal(got, want) and torch.equal(sign_codec.decoded_rows(got, size)[0], values)
        print(f"odd rows {count}x{size}: {'same' if same else 'DIFFERENT'}", flush=True)
        assert same, (count, size)
        matched += 1
    return matched


def check_through_sign(device: torch.device) -> int:
    """``SignCompressor``'s encodes and decodes with the codec taken, against the same calls on torch's path: a
    vector, a bucket's chunks as rows, received rows checked, trusted and into a buffer, a refused scale."""
    sign_codec._taken = lambda tensor, count: own_kernels() == "triton"  # this device too (the interpreter)
    launched = {"encode": 0, "decode": 0}
    encoded, decoded = sign_codec.encoded_rows, sign_codec.decoded_rows

    def counted_encode(*args):
        launched["encode"] += 1
        return encoded(*args)

    def counted_decode(*args, **kwargs):
        launched["decode"] += 1
        return decoded(*args, **kwargs)
    sign_codec.encoded_rows, sign_codec.decoded_rows = counted_encode, counted_decode
    q = SignCompressor()
    x = torch.randn(4096 + 8, generator=torch.Generator().manual_seed(9)).to(device)
    bounds = [(i * 1024, (i + 1) * 1024) for i in range(4)] + [(4096, 4104)]
    matched = 0
    with kernels.gpu_paths():
        results = {}
        for codec in ("torch", "triton"):
            os.environ["DSQ_OWN_KERNELS"] = codec
            before = dict(launched)
            payload = q.compress(x, seed=1).payload
            chunks = q.compress_chunks(x, bounds, [None] * 5)
            rows = torch.stack(chunks[:4])
            bad = rows.clone()
            bad[2, :4] = torch.tensor([-1.0]).view(torch.uint8)
            refusals: list = []
            results[codec] = [payload, q.decompress_flat(payload, x.numel()), *chunks,
                              q.decode(payload, x.numel(), into=torch.empty_like(x)).dense(),
                              q.decode_rows(rows, 1024, [None] * 4),
                              q.decode_rows(rows, 1024, [None] * 4, into=torch.empty(4, 1024, device=device)),
                              q.decode_rows(rows, 1024, [None] * 4, refusals=TRUSTED),
                              q.decode_rows(bad, 1024, [None] * 4, refusals=refusals), refusals[0][0]]
            try:
                q.decode_rows(bad, 1024, [None] * 4)
                results[codec].append("not refused")
            except Exception as refused:  # noqa: BLE001 - the words are what is compared
                results[codec].append(str(refused))
            ran = {step: launched[step] - before[step] for step in launched}
            print(f"{codec}: the codec encoded {ran['encode']} times, decoded {ran['decode']} times", flush=True)
            assert (codec == "triton") == (ran["encode"] == 3 and ran["decode"] == 7), ran
        for i, (a, b) in enumerate(zip(results["torch"], results["triton"], strict=True)):
            same = a == b if isinstance(a, str) else a.shape == b.shape and torch.equal(a, b)
            print(f"through sign, result {i} {'same' if same else 'DIFFERENT'}", flush=True)
            assert same, (i, a, b)
            matched += 1
    return matched


def residual_cases():
    """(name, rows, magnitudes, divisor): chunks ending inside an int8 block, a vector ending inside one, several
    programs, a chunk all zero, magnitudes that overflow or are zero, values over twelve orders of magnitude."""
    gen = torch.Generator().manual_seed(11)
    for count, size in [(1, 8), (1, 256), (2, 128), (3, 1000), (5, 8 * 41), (1, 8 * 256 * 9 + 8), (40, 16)]:
        rows = torch.randn(count, size, generator=gen) * torch.logspace(-6, 6, size)
        rows[0, : min(size, 4)] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])[: min(size, 4)]
        if count > 2:
            rows[1] = 0.0
        magnitudes = rows.abs().sum(dim=1)
        yield f"{count}x{size}", rows, magnitudes, float(size)
        odd = magnitudes.clone()
        odd[0] = float("inf")
        yield f"{count}x{size} a magnitude that overflows", rows, odd, 1e-3
        yield f"{count}x{size} zero magnitudes", rows, torch.zeros(count), 3.0


def check_with_residual(device: torch.device) -> int:
    from dsq_plugins.state.compact import LEVELS
    torchs = importlib.import_module("dsq_plugins.algorithm._payloads_and_residual")._signs_and_residual
    tritons = importlib.import_module("dsq_plugins.algorithm._sign_triton").signs_and_residual_rows
    levels = torch.full((), LEVELS, device=device)
    matched = 0
    for name, rows, magnitudes, divisor in residual_cases():
        rows, magnitudes, divisor = rows.to(device), magnitudes.to(device), torch.full((), divisor, device=device)
        got = tritons(rows, magnitudes, divisor, levels)
        with kernels.gpu_paths():  # a GPU's bits (a CPU's sweep reads a NaN's sign bit)
            want = torchs(rows, magnitudes, divisor, levels)
        same = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want, strict=True))
        print(f"with residual {name} {'same' if same else 'DIFFERENT'}", flush=True)
        assert same, name
        matched += 1
    return matched


def check_mean(device: torch.device) -> int:
    """An owner's u from its senders' payloads (1 to 9 senders: a power of two and not), with no memory, a
    memory of whole blocks written in place and one made new past the chunk's end; a refused sender (a negative
    scale, a NaN one), an overflowing mean; against ``_mean_of_signs`` eager."""
    from dsq_plugins.compressors.bitpack import sign_units
    from dsq_plugins.state.compact import BLOCK, LEVELS
    merged = importlib.import_module("dsq_plugins.algorithm._sign_triton")
    torchs = importlib.import_module("dsq_plugins.algorithm._mean_of_payloads")._mean_of_signs
    gen = torch.Generator().manual_seed(13)
    levels, table = torch.full((), LEVELS, device=device), sign_units(device)
    matched = 0
    for senders, size in ((1, 8), (2, 256), (3, 1000), (8, 512), (9, 8 * 256 * 2 + 64)):
        values = (torch.randn(senders + 1, size, generator=gen) * torch.logspace(-4, 4, size)).to(device)
        divisor = torch.full((), float(size), device=device)
        payloads = merged.signs_and_residual_rows(values[:-1], values[:-1].abs().sum(1), divisor, levels)[0]
        _, codes, scales = merged.signs_and_residual_rows(values[-1:], values[-1:].abs().sum(1), divisor, levels)
        count = torch.full((), float(senders), device=device)
        for case, scale, rows in (("plain", None, None), ("refused", -2.0, senders // 2),
                                  ("NaN scale", float("nan"), senders - 1), ("overflow", 3.4e38, slice(None))):
            sent = payloads.clone()
            if scale is not None:
                sent[rows, :4] = torch.tensor([scale]).view(torch.uint8).to(device)
            memories = {"no memory": (None, None, None), "new": (codes.view(-1, BLOCK), scales, None)}
            if codes.numel() == size:
                memories["in place"] = (codes.view(-1, BLOCK), scales, torch.full((size // BLOCK, BLOCK), 7.0,
                                                                                  device=device))
            for memory_case, memory in memories.items():
                got = merged.mean_of_signs_rows(sent, count, *memory)
                theirs = memory if memory[2] is None else (*memory[:2], torch.empty_like(memory[2]))
                want = torchs(sent, count, *theirs, table)
                same = same_values(got[0].view(-1)[:size], want[0].reshape(-1)[:size]) and \
                    all(torch.equal(a, b) for a, b in zip(got[1:], want[1:], strict=True)) and \
                    (memory[2] is None or got[0] is memory[2])
                print(f"mean {senders} senders x {size} {case}, {memory_case}: status {int(got[3])} "
                      f"{'same' if same else 'DIFFERENT'}", flush=True)
                assert same, (senders, size, case, memory_case)
                matched += 1
    return matched + check_mean_of_odd_chunks(device)


def check_mean_of_odd_chunks(device: torch.device) -> int:
    """Chunks whose last byte is part full (a bucket cut unevenly): u's values, the flags and a refused row's
    status as torch's kernel gives them for the whole bytes (its values past the chunk are the last byte's
    padding, which torch's path for such chunks never decodes: a status that only they could change is not
    compared)."""
    from dsq_plugins.compressors.bitpack import sign_units
    from dsq_plugins.compressors.sign import scale_divisor
    from dsq_plugins.state.compact import Int8Blocks
    merged = importlib.import_module("dsq_plugins.algorithm._sign_triton")
    torchs = importlib.import_module("dsq_plugins.algorithm._mean_of_payloads")._mean_of_signs
    gen, matched = torch.Generator().manual_seed(29), 0
    for senders, size in ((3, 333), (2, 13), (5, 2 * 256 * 8 + 3)):
        values = torch.randn(senders, size, generator=gen).to(device)
        payloads = sign_codec.encoded_rows(values, values.abs().sum(1), scale_divisor(size, "mean", device))
        memory = Int8Blocks.encode(torch.randn(size, generator=gen).to(device))
        codes = memory.code_rows()
        count = torch.full((), float(senders), device=device)
        for case, scale in (("plain", None), ("refused", -1.0)):
            sent = payloads.clone()
            if scale is not None:
                sent[senders - 1, :4] = torch.tensor([scale]).view(torch.uint8).to(device)
            for memory_case, rows in (("no memory", (None, None)), ("new", (codes, memory.scales))):
                got = merged.mean_of_signs_rows(sent, count, *rows, None, size)
                want = torchs(sent, count, *rows, None, sign_units(device))
                same = torch.equal(got[0].view(-1)[:size], want[0].reshape(-1)[:size]) and \
                    all(torch.equal(a, b) for a, b in zip(got[1:], want[1:], strict=True))
                assert got[0].numel() == (codes.numel() if rows[0] is not None else size)
                print(f"mean of odd chunks {senders} x {size} {case}, {memory_case}: status {int(got[3])} "
                      f"{'same' if same else 'DIFFERENT'}", flush=True)
                assert same, (senders, size, case, memory_case)
                matched += 1
    return matched


def check_memory(device: torch.device) -> int:
    """A worker's compensation: x plus an int8 memory and the sum's status, for vectors of whole blocks, ending
    inside a block, shorter than a block (a small memory's trimmed codes), several programs; into a new vector,
    another one and x itself, and without the status; sums that are finite, overflow, or meet a NaN; the
    memory's encode of a vector and of a difference; against torch's kernels."""
    compact = importlib.import_module("dsq_plugins.state.compact")
    int8 = importlib.import_module("dsq_plugins.state._int8_triton")
    added_rows = int8.added_rows
    gen = torch.Generator().manual_seed(17)
    matched = 0
    for n in (8, 256, 300, 3 * 256, 256 * 8 * 2 + 100):
        for case in ("finite", "overflow", "NaN"):
            values = torch.randn(n, generator=gen) * (1e38 if case == "overflow" else 1.0)
            x = torch.randn(n, generator=gen) * (1e38 if case == "overflow" else 1.0)
            if case == "NaN":
                x[n // 2] = float("nan")
            memory = compact.Int8Blocks.encode(values.to(device))
            x = x.to(device)
            with kernels.gpu_paths():
                want = compact._added_by_torch_of(x.clone(), memory.codes, memory.scales)
            for into in ("new", "another", "itself"):
                mine = x.clone()
                out = None if into == "new" else torch.full_like(x, 7.0) if into == "another" else mine
                got = added_rows(mine, memory.codes, memory.scales, compact.BLOCK, out)
                same = same_values(got[0], want[0]) and torch.equal(got[1], want[1]) and (out is None or got[0] is out)
                print(f"memory n={n} {case} into {into}: status {int(got[1])} {'same' if same else 'DIFFERENT'}",
                      flush=True)
                assert same, (n, case, into)
                matched += 1
            plain, none = int8.added_rows(x.clone(), memory.codes, memory.scales, compact.BLOCK, status=False)
            assert none is None and same_values(plain, want[0]), (n, case, "without status")
            matched += 1
            if case == "finite":  # the memory's encode of a vector and of a difference (v - Q(v))
                levels = torch.full((), 127.0, device=device)
                for b in (None, values.to(device)):
                    got = int8.int8_codes_rows(x, b, levels, compact.BLOCK)
                    want_codes = compact.int8_codes(x if b is None else x - b, levels)
                    same = all(torch.equal(p, q) for p, q in zip(got, want_codes, strict=True))
                    print(f"memory n={n} encode{' difference' if b is not None else ''}: "
                          f"{'same' if same else 'DIFFERENT'}", flush=True)
                    assert same, (n, b is None)
                    matched += 1
    return matched


def check_runs(device: torch.device) -> int:
    """Sign's payloads and residual of chunks that are not whole bytes: a bucket cut as ``chunk_bounds`` cuts it
    for 2 to 7 ranks (a longer run first), an owner's one chunk; against torch's path as a worker takes it
    (each chunk encoded, then v less its own decode, encoded as an int8 memory)."""
    from dsq_plugins.compressors.base import runs_of_equal_size
    from dsq_plugins.layout import chunk_bounds
    from dsq_plugins.state.compact import Int8Blocks
    merged = importlib.import_module("dsq_plugins.algorithm._payloads_and_residual").payloads_with_residual
    sign_codec._taken = lambda tensor, count: own_kernels() == "triton"  # this device too (the interpreter)
    importlib.import_module("dsq_plugins.algorithm._sign_triton")._taken = lambda rows: own_kernels() == "triton"
    gen = torch.Generator().manual_seed(19)
    q = SignCompressor()
    matched = 0
    for n, ranks in ((1003, 3), (4096 + 5, 2), (999, 1), (77, 7), (2 * 256 * 8 + 13, 5), (24, 3), (260, 4)):
        v = (torch.randn(n, generator=gen) * torch.logspace(-5, 5, n)).to(device)
        v[:4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
        bounds = chunk_bounds(n, ranks)
        with kernels.gpu_paths():
            os.environ["DSQ_OWN_KERNELS"] = "triton"
            got = merged(q, v, bounds)
            os.environ["DSQ_OWN_KERNELS"] = "torch"
            payloads = q.compress_chunks(v, bounds, [None] * ranks)
            decoded = torch.cat([q.decompress_flat(p, b - a) for p, (a, b) in zip(payloads, bounds)])
            want = Int8Blocks.encode(v - decoded)
        whole = len(runs_of_equal_size(bounds)) == 1 and bounds[0][1] % 8 == 0  # the merged kernel's, elsewhere
        same = got is not None and all(torch.equal(a, b) for a, b in zip(got[0], payloads, strict=True)) \
            and torch.equal(got[1].codes, want.codes) and torch.equal(got[1].scales, want.scales)
        print(f"runs n={n} ranks={ranks}{' (whole bytes)' if whole else ''}: {'same' if same else 'DIFFERENT'}",
              flush=True)
        assert same, (n, ranks)
        matched += 1
    os.environ.pop("DSQ_OWN_KERNELS")
    return matched


def check_reduce(device: torch.device) -> int:
    """Five steps of ``DoubleSqueeze`` with sign on three ranks (threads), on the GPU's paths, the third with a NaN
    in one rank's gradient: the averages, and so the worker and server memories they carry, and each rank's error
    at the third step are the same with our Triton kernels as with torch's."""
    import threading

    import dsq_plugins as dsq
    _sign_triton = importlib.import_module("dsq_plugins.algorithm._sign_triton")
    lock = threading.Lock()  # the interpreter is not for several threads at once
    launched = [0]
    by_kernel: dict[str, int] = {}

    def serialised(fn):
        def call(*args, **kwargs):
            with lock:
                launched[0] += 1
                by_kernel[fn.__name__] = by_kernel.get(fn.__name__, 0) + 1
                return fn(*args, **kwargs)
        return call
    sign_codec._taken = lambda tensor, count: own_kernels() == "triton"
    _sign_triton._taken = lambda rows: own_kernels() == "triton"
    _int8_triton = importlib.import_module("dsq_plugins.state._int8_triton")
    _int8_triton._taken = lambda x: own_kernels() == "triton"
    _int8_triton.added_rows = serialised(_int8_triton.added_rows)
    sign_codec.encoded_rows = serialised(sign_codec.encoded_rows)
    sign_codec.decoded_rows = serialised(sign_codec.decoded_rows)
    _sign_triton.signs_and_residual_rows = serialised(_sign_triton.signs_and_residual_rows)
    _sign_triton.mean_of_signs_rows = serialised(_sign_triton.mean_of_signs_rows)
    residual = importlib.import_module("dsq_plugins.algorithm._payloads_and_residual")
    residual.sign_residual_codes = serialised(residual.sign_residual_codes)

    results = {}
    with kernels.gpu_paths():
        for codec in ("torch", "triton"):
            os.environ["DSQ_OWN_KERNELS"] = codec
            before = launched[0]
            results[codec] = dsq.LocalGroup(3).run(triton_workers.reducing_with_a_nan("sign", device))
            print(f"reduce, {codec}: {launched[0] - before} Triton launches {sorted(by_kernel.items())}", flush=True)
            assert (launched[0] > before) == (codec == "triton")
    assert all(by_kernel.get(name) for name in ("signs_and_residual_rows", "decoded_rows", "mean_of_signs_rows",
                                                "added_rows", "sign_residual_codes")), \
        by_kernel
    assert triton_workers.same_reductions(results["torch"], results["triton"])
    return 1


#: the kernels' pointer arguments by name (every other argument but the constants is an int32 size)
POINTERS = {"rows_ptr": "*fp32", "magnitudes_ptr": "*fp32", "divisor_ptr": "*fp32", "out_ptr": "*u8",
            "payloads_ptr": "*u8", "bad_ptr": "*i1", "v_ptr": "*fp32", "levels_ptr": "*fp32", "codes_ptr": "*i8",
            "scales_ptr": "*fp32", "count_ptr": "*fp32", "u_ptr": "*fp32", "status_ptr": "*i64",
            "x_ptr": "*fp32", "long_magnitudes_ptr": "*fp32", "short_magnitudes_ptr": "*fp32",
            "long_divisor_ptr": "*fp32", "short_divisor_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*fp32"}
#: the sizes that a bucket's rows make multiples of 16, as Triton's launcher finds them and specialises on (a
#: payload row's stride, 4 + bytes, is not)
MULTIPLES_OF_16 = {"row_stride", "out_stride", "nbytes", "numel", "blocks", "written", "size"}


def compile_for(capability: int) -> int:
    """Compiles every kernel as a GPU of this compute capability runs it, down to its machine code by Triton's
    own ptxas, with no GPU here: what the interpreter cannot check (the compiler's rules and limits). Each is
    specialised as Triton's launcher specialises a bucket's call (pointers 16-byte aligned, sizes multiples of
    16), and its vector loads and stores are counted: a tile of whole rows read or written 16 bytes at a time.
    Its registers and spills are cuobjdump's, and the rounding's constant must survive the compiler."""
    merged = importlib.import_module("dsq_plugins.algorithm._sign_triton")
    memory = importlib.import_module("dsq_plugins.state._int8_triton")
    launched = [(sign_codec._encode, {"BYTES": sign_codec._BYTES}, "ld.global.v4", 8),
                (sign_codec._decode, {"BYTES": sign_codec._BYTES, "FLAGS": True}, "st.global.v4", 8),
                (sign_codec._decode, {"BYTES": sign_codec._BYTES, "FLAGS": False}, "st.global.v4", 8),
                (merged._signs_and_residual, {"BLOCKS": merged._BLOCKS, "BLOCK": 256}, "ld.global.v4", 4)]
    mean = {"BYTES": merged._MEAN_BYTES, "BLOCK": 256, "SENDERS": 8, "BAD_PAYLOAD": 3, "OVERFLOW": -1}
    launched += [(merged._mean_of_signs, {**mean, "MEMORY": True}, "st.global.v4", 4),
                 (merged._mean_of_signs, {**mean, "MEMORY": False}, "st.global.v4", 4),
                 (memory._added, {"NONFINITE": 1, "BLOCKS": memory._BLOCKS, "BLOCK": 256, "STATUS": True},
                  "ld.global.v4", 4),
                 (memory._added, {"NONFINITE": 1, "BLOCKS": memory._BLOCKS, "BLOCK": 256, "STATUS": False},
                  "ld.global.v4", 4),
                 (memory._codes, {"BLOCKS": memory._BLOCKS, "BLOCK": 256, "DIFFERENCE": True}, "ld.global.v4", 4),
                 (merged._sign_residual_codes, {"BLOCKS": merged._BLOCKS, "BLOCK": 256}, "ld.global.v4", 4)]
    for fn, constants, vectors, fewest in launched:
        kinds = {**POINTERS, **({"out_ptr": "*fp32"} if fn in (sign_codec._decode, memory._added) else {})}
        unfused = fn in (merged._mean_of_signs, memory._added)  # launched without fused multiply-adds
        ptx, usage = triton_workers.compiled(fn, constants, kinds, MULTIPLES_OF_16, capability,
                                             {"enable_fp_fusion": False} if unfused else None)
        count = ptx.count(vectors)
        print(f"{fn.__name__} {constants} compiled for sm_{capability}: {count} of {vectors}; {usage}", flush=True)
        assert count >= fewest, f"{fn.__name__}: a program's tile is not moved 16 bytes at a time"
        assert ".ftz" not in ptx, f"{fn.__name__}: subnormals flushed to zero, where torch keeps them"
        assert "fma.rn" not in ptx, f"{fn.__name__}: a multiply and an add fused into one rounding"
        if fn in (merged._signs_and_residual, merged._sign_residual_codes, memory._codes):
            assert ptx.count("0f4B400000") >= 2, "the rounding's 1.5 * 2^23 was folded away"
    return len(launched)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--small-blocks", action="store_true")
    parser.add_argument("--through-sign", action="store_true")
    parser.add_argument("--with-residual", action="store_true")
    parser.add_argument("--reduce", action="store_true")
    parser.add_argument("--mean", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--runs", action="store_true")
    parser.add_argument("--compile-for", type=int, nargs="*", help="compute capabilities: compile only")
    args = parser.parse_args()
    if args.compile_for:
        print(f"compiled {sum(compile_for(c) for c in args.compile_for)}")
        return
    device = torch.device(args.device)
    if args.through_sign:
        print(f"matched {check_through_sign(device)}")
        return
    if args.with_residual:
        print(f"matched {check_with_residual(device)}")
        return
    if args.runs:
        print(f"matched {check_runs(device)}")
        return
    if args.memory:
        print(f"matched {check_memory(device)}")
        return
    if args.mean:
        print(f"matched {check_mean(device)}")
        return
    if args.reduce:
        print(f"matched {check_reduce(device)}")
        return
    sizes = [(1, 8), (3, 64), (8, 24), (2, 8 * sign_codec._BYTES * 2 + 40)]
    if args.small_blocks:  # (the interpreter's time is per program: fewer, shorter rows)
        sign_codec._BYTES = 4
        sizes = [(2, 8 * 9), (1, 8 * 16)]
    print(f"first-call check {'passes' if sign_codec._agrees_with_torch(device) else 'FAILS'}")
    print(f"matched {check_codec(device, sizes) + check_odd_rows(device)}")


if __name__ == "__main__":
    main()
