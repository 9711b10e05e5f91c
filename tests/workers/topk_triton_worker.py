"""Top-k's payloads written by the radix select's last launch, with and without the int8 residual
(``radix_select.radix_payloads``, ``algorithm._topk_triton``), against torch's path, run by Triton's interpreter on
a CPU (``TRITON_INTERPRET=1`` set before Triton is imported) or on a GPU: prints one line per case and ``matched N``.

Default: the kernel against torch's. ``--small-blocks``: blocks of 256 and a scan of 4, so that rows of a few
thousand span several scan rounds. ``--through-topk``: the compressor's chunks and ``payloads_with_residual`` with
the kernels taken on this device too. ``--mean``: an owner's u from its senders' payloads. ``--decode``: the codec's
decode of received rows (``compressors.topk_codec``), and top-k's own decodes with it. ``--runs``: rows of any
length in one run or two (``payloads_and_residual_runs``), alone and through ``payloads_with_residual``. ``--reduce``:
DoubleSqueeze with top-k on three ranks.
``--compile-for 80 90``: the kernel compiled for those GPUs, without one."""
from __future__ import annotations

import argparse
import importlib
import os
import threading

import torch

from dsq_plugins.compressors import kernels, radix_select, topk_codec
from dsq_plugins.compressors.own_kernels import TORCH_REFERENCES
from tests.helpers import triton_workers

_topk_triton = importlib.import_module("dsq_plugins.algorithm._topk_triton")
_payloads_and_residual = importlib.import_module("dsq_plugins.algorithm._payloads_and_residual")


def cases(device: torch.device, sizes: list[tuple[int, int, int]]):
    gen = torch.Generator().manual_seed(4)
    for count, n, k in sizes:
        rows = torch.randn(count, n, generator=gen)
        yield f"plain {count}x{n} k={k}", rows.to(device), k
        special = rows.clone()
        special[:, ::5] = 0.0
        special[:, 1::7] = -0.0
        special[:, 3::11] = 1.5  # ties at the k-th place, of either sign
        special[:, 4::11] = -1.5
        special[0, 2] = float("nan")  # kept (the largest key), its residual +0.0
        special[-1, -1] = float("inf")
        special[:, 6::13] *= 1e-40  # subnormal
        yield f"special {count}x{n} k={k}", special.to(device), k


def check_kernel(device: torch.device, sizes: list[tuple[int, int, int]]) -> int:
    reference = TORCH_REFERENCES["topk_and_residual"]
    levels = torch.full((), 127.0, device=device)
    matched = 0
    for name, rows, k in cases(device, sizes):
        positions = radix_select.radix_positions(rows, k)
        want = reference(rows, positions, levels)
        got = _topk_triton.payloads_and_residual_rows(rows, k, levels)
        same = all(a.shape == b.shape and torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                                      b.view(torch.int32) if b.dtype == torch.float32 else b)
                   for a, b in zip(got, want))  # the scales' bits, a NaN's too
        same = same and torch.equal(radix_select.radix_payloads(rows, k), want[0])
        print(f"{name}: {'same' if same else 'DIFFERENT'}", flush=True)
        assert same, name
        matched += 1
    return matched


RUNS = [((3, 1001, 50), (2, 1000, 50)), ((3, 700, 7),), ((2, 4096 + 300, 40),), ((2, 3, 3), (1, 2, 2)),
        ((1, 1000, 17),)]


def check_runs(device: torch.device, layouts: list[tuple[tuple[int, int, int], ...]]) -> int:
    """A vector cut into rows of any length, in one run or two (``payloads_and_residual_runs``): each run's
    payloads are torch's, the vector becomes itself with the kept elements less themselves, and the codes and
    scales are ``compact.int8_codes``' of that; finite values with signed zeros, ties at the k-th place and
    subnormals, and plain ones. A NaN and an Inf, both kept, stay non-finite in the vector."""
    encode = TORCH_REFERENCES["int8_codes"]
    levels = torch.full((), 127.0, device=device)
    gen, matched = torch.Generator().manual_seed(5), 0
    for layout in layouts:
        for kind in ("plain", "special", "nonfinite"):
            v = torch.randn(sum(count * n for count, n, _ in layout), generator=gen)
            if kind != "plain":
                v[::5], v[1::7], v[3::11], v[4::11] = 0.0, -0.0, 1.5, -1.5
                v[6::13] *= 1e-40
            if kind == "nonfinite":
                v[1], v[-2] = float("nan"), float("inf")
            v = v.to(device)
            want, runs, residual = _topk_triton._runs_by_torch(v, layout, levels)
            payloads, codes, scales = _topk_triton.payloads_and_residual_runs(v, runs, levels)
            same = all(torch.equal(a, b) for a, b in zip(payloads, want, strict=True)) and same_bits(v, residual)
            if kind != "nonfinite":  # (a NaN's codes are not compared: its step fails before they are stored)
                same = same and all(torch.equal(a, b) for a, b in zip((codes, scales), encode(residual, levels)))
            else:
                same = same and not bool(torch.isfinite(v[1])) and not bool(torch.isfinite(v[-2]))
            print(f"runs {layout} {kind}: {'same' if same else 'DIFFERENT'}", flush=True)
            assert same, (layout, kind)
            matched += 1
    return matched


def check_runs_through_topk(device: torch.device) -> int:
    """``payloads_with_residual`` of a bucket cut for 2 to 5 ranks into chunks that are not whole int8 blocks (one
    run, two), with ``v`` its scratch: the payloads are ``compress_chunks``' with torch's selection, and the
    residual's codes those of v less each chunk's decode; without ``scratch`` it leaves the cut to the caller."""
    import dsq_plugins as dsq
    from dsq_plugins.layout import chunk_bounds
    from dsq_plugins.state.compact import int8_codes
    take_on_this_device()
    launched = [0]
    runs_of = _topk_triton.payloads_and_residual_runs

    def counted(*args, **kwargs):
        launched[0] += 1
        return runs_of(*args, **kwargs)
    _topk_triton.payloads_and_residual_runs = counted
    gen, matched = torch.Generator().manual_seed(8), 0
    levels = torch.full((), 127.0, device=device)
    for ranks, numel in ((2, 1000), (3, 1000), (5, 4099), (3, 24)):
        v = torch.randn(numel, generator=gen).to(device)
        q = dsq.get_compressor("topk", ratio=0.05)
        bounds = chunk_bounds(numel, ranks)
        with kernels.gpu_paths():
            os.environ["DSQ_TOPK_SELECT"] = "torch"
            want = q.compress_chunks(v, bounds, [None] * ranks)
            residual = v.clone()
            for (a, b), payload in zip(bounds, want):
                residual[a:b] -= q.decode(payload, b - a, None).dense()
            os.environ["DSQ_TOPK_SELECT"] = "radix"
            before = launched[0]
            _payloads_and_residual.payloads_with_residual(q, v, bounds)
            assert launched[0] == before, "a vector not given as scratch was cut by the runs' kernels"
            payloads, memory = _payloads_and_residual.payloads_with_residual(q, v, bounds, scratch=True)
            os.environ.pop("DSQ_TOPK_SELECT")
        codes, scales = int8_codes(residual, levels)
        same = launched[0] == before + 1 and all(torch.equal(a, b) for a, b in zip(payloads, want, strict=True)) \
            and torch.equal(memory.code_rows().reshape(-1), codes) and torch.equal(memory.scales, scales)
        print(f"runs through top-k, {numel} over {ranks} ranks {[b - a for a, b in bounds]}: "
              f"{'same' if same else 'DIFFERENT'}", flush=True)
        assert same, (ranks, numel)
        matched += 1
    return matched


ALL_SPOILS = ("none", "outside", "unordered", "repeated", "nan", "several", "overflow")
MEAN_SHAPES = [(1, 2560, 25, ("overflow",)), (3, 2560, 256, ALL_SPOILS), (9, 1000, 100, ("none", "overflow")),
               (2, 256 * 8, 256 * 8, ("none", "overflow")), (4, 777, 1, ("none", "overflow")),
               (2, 30000, 3000, ("none", "overflow"))]


def check_mean(device: torch.device, shapes: list[tuple[int, int, int, tuple[str, ...]]]) -> int:
    """An owner's u from 1 to 9 senders' top-k payloads, with no memory, one written in place and one made new
    past the chunk's end; k from 1 to the chunk's length; a refused sender (a position outside, two positions out
    of order, one repeated, a NaN value, several refused: the first one's status) and a mean that overflows: the
    same u, flags, row flags and status as torch's kernel (u compared where no sender is refused)."""
    reference = TORCH_REFERENCES["mean_of_topk"]
    encode = TORCH_REFERENCES["topk_and_residual"]
    gen, matched = torch.Generator().manual_seed(7), 0
    levels = torch.full((), 127.0, device=device)
    for senders, size, k, spoils in shapes:
        for spoil in spoils:
            rows = torch.randn(senders + 1, size, generator=gen).to(device)
            payloads = encode(rows[:senders], radix_select.radix_positions(rows[:senders], k), levels)[0]
            _, codes, scales = encode(rows[senders:], radix_select.radix_positions(rows[senders:], k), levels)
            positions = payloads[:, 4 * k:].view(senders, k, 4)
            if spoil == "outside":
                positions[1, -1] = torch.tensor([size], dtype=torch.int32).view(torch.uint8)
            if spoil == "unordered" and k > 1:
                positions[2, :2] = positions[2, :2].flip(0).clone()
            if spoil == "repeated":
                positions[2, 1] = positions[2, 0].clone()
            if spoil == "nan":
                payloads[1, 4: 8] = torch.tensor([float("nan")]).view(torch.uint8)
            if spoil == "several":
                payloads[2, 4: 8] = torch.tensor([float("inf")]).view(torch.uint8)
                positions[1, 0] = torch.tensor([-1], dtype=torch.int32).view(torch.uint8)
            if spoil == "overflow":
                payloads[:, : 4 * k] = torch.tensor([3e38]).view(torch.uint8).repeat(senders, k)
            count = torch.full((), float(senders), device=device)
            memories = {"none": (None, None, None), "new": (codes.view(-1, 256), scales, None)}
            if codes.numel() == size:
                memories["into"] = (codes.view(-1, 256), scales, torch.full((size // 256, 256), 7.0, device=device))
            for kind, memory in memories.items():
                got = _topk_triton.mean_of_topk_rows(payloads, count, *memory, size)
                theirs = memory if memory[2] is None else (*memory[:2], torch.empty_like(memory[2]))
                want = reference(payloads, count, *theirs, size, size)
                refused = bool(want[2].any())
                same = (refused or same_bits(got[0].view(-1)[:size], want[0].reshape(-1)[:size])) \
                    and all(torch.equal(a, b) for a, b in zip(got[1:], want[1:])) \
                    and (memory[2] is None or got[0] is memory[2])
                print(f"mean {senders} senders, {size} of k={k}, {spoil}, memory {kind}: status "
                      f"{int(got[3])} {'same' if same else 'DIFFERENT'}", flush=True)
                assert same, (senders, size, k, spoil, kind)
                matched += 1
    return matched


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def take_on_this_device() -> None:
    """The kernels taken on this device too (the interpreter's CPU), one thread at a time."""
    lock = threading.RLock()  # the interpreter is not for several threads at once; the select calls its counts

    def serialised(fn):
        def call(*args, **kwargs):
            with lock:
                return fn(*args, **kwargs)
        return call
    radix_select.taken = lambda rows: radix_select.selection() == "radix"
    _topk_triton._taken = lambda rows: radix_select.selection() == "radix"
    _topk_triton.on_a_gpu = lambda tensor: radix_select.selection() == "radix"
    _topk_triton._mean_works_on = lambda index: True
    _topk_triton._runs_work_on = lambda index: True
    _topk_triton.device_index = lambda tensor: 0
    for module, name in ((radix_select, "counted"), (radix_select, "radix_positions"),
                         (radix_select, "radix_payloads"), (_topk_triton, "payloads_and_residual_rows"),
                         (_topk_triton, "payloads_and_residual_runs"),
                         (_topk_triton, "mean_of_topk_rows"), (topk_codec, "decoded_rows")):
        setattr(module, name, serialised(getattr(module, name)))


def check_through_topk(device: torch.device) -> int:
    """``compress_chunks`` (payloads by the select) and ``payloads_with_residual`` (payloads and the int8
    residual by the select) of a bucket cut for 1 to 4 ranks, each chunk whole int8 blocks or one chunk ending
    inside one, against the same calls with ``DSQ_TOPK_SELECT=torch``."""
    import dsq_plugins as dsq
    take_on_this_device()
    launched = {"payloads": 0, "with residual": 0}
    payloads_of, with_residual = radix_select.radix_payloads, _topk_triton.payloads_and_residual_rows

    def counted_payloads(*args, **kwargs):
        launched["payloads"] += 1
        return payloads_of(*args, **kwargs)

    def counted_with_residual(*args, **kwargs):
        launched["with residual"] += 1
        return with_residual(*args, **kwargs)
    radix_select.radix_payloads, _topk_triton.payloads_and_residual_rows = counted_payloads, counted_with_residual
    gen, matched = torch.Generator().manual_seed(6), 0
    for ranks, size in ((1, 1000), (2, 512), (4, 768), (3, 256)):
        v = torch.randn(ranks * size, generator=gen).to(device)
        q = dsq.get_compressor("topk", ratio=0.05)
        bounds = [(r * size, (r + 1) * size) for r in range(ranks)]
        results = {}
        with kernels.gpu_paths():
            for selection in ("torch", "radix"):
                os.environ["DSQ_TOPK_SELECT"] = selection
                before = dict(launched)
                payloads, memory = _payloads_and_residual.payloads_with_residual(q, v, bounds)
                results[selection] = [*q.compress_chunks(v, bounds, [None] * ranks), *payloads, memory.codes,
                                      memory.scales]
                ran = [launched[name] - before[name] for name in launched]
                assert ran == ([1, 1] if selection == "radix" else [0, 0]), (selection, ran)
        os.environ.pop("DSQ_TOPK_SELECT")
        same = all(torch.equal(a, b) for a, b in zip(results["torch"], results["radix"], strict=True))
        print(f"through top-k, {ranks} chunks of {size}: {'same' if same else 'DIFFERENT'}", flush=True)
        assert same, (ranks, size)
        matched += 1
    return matched


def check_decode(device: torch.device, shapes: list[tuple[int, int, int]]) -> int:
    """The codec's decode of each shape's payloads (as sent; a position outside, positions out of order and a NaN
    in three rows; unaligned in a receive buffer; into a buffer; without flags) against torch's eager decode: the
    flags of every row, the values of every row that passes, NaN where NaN."""
    decode, encode = TORCH_REFERENCES["topk_decoded"], TORCH_REFERENCES["topk_and_residual"]
    gen, matched = torch.Generator().manual_seed(8), 0
    for count, numel, k in shapes:
        rows = torch.randn(count, numel, generator=gen).to(device)
        sent = encode(rows, radix_select.torch_positions(rows, k), torch.full((), 127.0, device=device))[0]
        spoiled = sent.clone()
        spoiled[0, 8 * k - 4: 8 * k] = torch.tensor([numel], dtype=torch.int32).view(torch.uint8)  # past the end
        if k > 1:  # the first two positions swapped
            spoiled[1 % count, 4 * k: 4 * k + 8] = spoiled[1 % count, 4 * k: 4 * k + 8].view(2, 4).flip(0).reshape(-1)
        spoiled[2 % count, :4] = torch.tensor([float("nan")]).view(torch.uint8)
        buffer = torch.zeros(count, 8 * k + 3, dtype=torch.uint8, device=device)
        buffer[:, 3:] = spoiled
        for case, payloads in (("as sent", sent), ("spoiled", spoiled), ("unaligned", buffer[:, 3:])):
            want, want_bad = decode(payloads, numel)
            out = torch.full((count, numel), 7.0, device=device)
            got, bad = topk_codec.decoded_rows(payloads, numel, out=out)
            plain, none = topk_codec.decoded_rows(payloads, numel, flags=False)
            passed = ~want_bad[:2].any(0)  # a NaN's row decodes as torch's; a refused position's does not
            same = got is out and none is None and torch.equal(bad, want_bad) \
                and torch.equal(got[passed].nan_to_num(5.0), want[passed].nan_to_num(5.0)) \
                and torch.equal(plain.nan_to_num(5.0), got.nan_to_num(5.0))
            print(f"decode {count}x{numel} k={k} {case}: flags {bad.int().tolist()} {'same' if same else 'DIFFERENT'}",
                  flush=True)
            assert same, (count, numel, k, case)
            matched += 1
    return matched


def check_through_decode(device: torch.device) -> int:
    """Top-k's own decodes with the codec taken (a vector; received rows checked, into a buffer, trusted, a refused
    row deferred and raised) against the same calls on torch's path; the codec ran for each, and only with
    ``DSQ_OWN_KERNELS=triton``."""
    import dsq_plugins as dsq
    from dsq_plugins.compressors.base import TRUSTED
    from dsq_plugins.compressors.own_kernels import own_kernels
    topk_codec._taken = lambda tensor, rows, numel, k: own_kernels() == "triton"
    launched, decoded = [0], topk_codec.decoded_rows

    def counted(*args, **kwargs):
        launched[0] += 1
        return decoded(*args, **kwargs)
    topk_codec.decoded_rows = counted
    q = dsq.get_compressor("topk", ratio=0.01)
    x = torch.randn(4 * 9000, generator=torch.Generator().manual_seed(9)).to(device)
    results = {}
    with kernels.gpu_paths():
        payload = q.compress(x).payload
        rows = torch.stack(q.compress_chunks(x, [(i * 9000, (i + 1) * 9000) for i in range(4)], [None] * 4))
        bad = rows.clone()
        bad[2, -4:] = torch.tensor([9000], dtype=torch.int32).view(torch.uint8)
        for codec in ("torch", "triton"):
            os.environ["DSQ_OWN_KERNELS"] = codec
            before = launched[0]
            refusals: list = []
            results[codec] = [q.decompress_flat(payload, x.numel()), q.decode_rows(rows, 9000, [None] * 4),
                              q.decode_rows(rows, 9000, [None] * 4, into=torch.empty(4, 9000, device=device)),
                              q.decode_rows(rows, 9000, [None] * 4, refusals=TRUSTED),
                              q.decode_rows(bad, 9000, [None] * 4, refusals=refusals)[:2],
                              *[flag for flag, _ in refusals]]
            results[codec] += [words for _, words in refusals]
            for refused in (lambda: q.decode_rows(bad, 9000, [None] * 4), lambda: q.decompress_flat(bad[2], 9000)):
                try:
                    refused()
                    results[codec].append("not refused")
                except Exception as error:  # noqa: BLE001 - the words are what is compared
                    results[codec].append(str(error))
            print(f"decode through top-k, {codec}: the codec decoded {launched[0] - before} times", flush=True)
            assert (launched[0] - before == 7) == (codec == "triton"), launched[0] - before
    os.environ.pop("DSQ_OWN_KERNELS")
    for a, b in zip(results["torch"], results["triton"], strict=True):
        assert a == b if isinstance(a, str) else torch.equal(a, b), (a, b)
    print(f"decode through top-k: {len(results['torch'])} results same", flush=True)
    return len(results["torch"])


def check_reduce(device: torch.device) -> int:
    """Five steps of ``DoubleSqueeze`` with top-k on three ranks (threads), on the GPU's paths, the third with a NaN
    in one rank's gradient: the averages, which carry both error memories (int8), and each rank's error at the
    third step are the same with the select's kernels as with torch's selection and kernels; buckets cut into
    chunks of whole int8 blocks and into chunks of other lengths (``payloads_and_residual_runs``)."""
    import dsq_plugins as dsq
    take_on_this_device()
    launched = [0, 0, 0, 0]
    written, folded = _topk_triton.payloads_and_residual_rows, _topk_triton.mean_of_topk_rows
    written_by_runs = _topk_triton.payloads_and_residual_runs

    def counted_runs(*args, **kwargs):
        launched[3] += 1
        return written_by_runs(*args, **kwargs)
    _topk_triton.payloads_and_residual_runs = counted_runs

    def counted(*args, **kwargs):
        launched[0] += 1
        return written(*args, **kwargs)

    def counted_mean(*args, **kwargs):
        launched[1] += 1
        return folded(*args, **kwargs)
    _topk_triton.payloads_and_residual_rows, _topk_triton.mean_of_topk_rows = counted, counted_mean
    decoded = topk_codec.decoded_rows
    topk_codec._taken = lambda tensor, rows, numel, k: radix_select.selection() == "radix"  # all ours, or none

    def counted_decode(*args, **kwargs):
        launched[2] += 1
        return decoded(*args, **kwargs)
    topk_codec.decoded_rows = counted_decode

    results = {}
    with kernels.gpu_paths():
        for selection in ("torch", "radix"):
            os.environ["DSQ_TOPK_SELECT"] = selection
            before = list(launched)
            # the last tensor: a bucket cut into chunks of whole int8 blocks
            results[selection] = dsq.LocalGroup(3).run(triton_workers.reducing_with_a_nan(
                "topk", device, (600, 24, 1000, 1536), ratio=0.05))
            ran = [now - then for now, then in zip(launched, before)]
            print(f"reduce, {selection}: {ran[0]} launches of the payloads with their residual, {ran[3]} of them "
                  f"in runs, {ran[1]} of the owner's mean, {ran[2]} of the decode", flush=True)
            assert all(ran) == (selection == "radix") and any(ran) == (selection == "radix")
    assert triton_workers.same_reductions(results["torch"], results["radix"])
    return 1


def compile_for(capability: int) -> int:
    """The kernels compiled as a GPU of this compute capability runs them, down to their machine code by Triton's
    own ptxas, with no GPU here: the payloads with their residual read their values 16 bytes at a time, with the
    rounding's constant kept; the runs' last pass keeps a kept value's x - x (a NaN's stays NaN); the mean writes
    u 16 bytes at a time, with its division correctly rounded and no multiply and add fused; the decode writes a
    row's zeros 16 bytes at a time, its values after them; none flushes subnormals."""
    pointers = {"rows_ptr": "*fp32", "hist_ptr": "*i32", "kept_ptr": "*i32", "words_ptr": "*i32",
                "levels_ptr": "*fp32", "codes_ptr": "*i8", "scales_ptr": "*fp32", "payloads_ptr": "*u8",
                "partial_ptr": "*i8", "count_ptr": "*fp32", "u_ptr": "*fp32", "flags_ptr": "*i1", "bad_ptr": "*i1",
                "status_ptr": "*i64", "out_ptr": "*fp32"}
    mean = {"SENDERS": 8, "STRETCHES": 16, "TILE": _topk_triton._TILE, "ENTRIES": _topk_triton._ENTRIES,
            "BLOCK": 256, "BAD_PAYLOAD": 3, "OVERFLOW": -1}
    launched = [(_topk_triton._payloads_and_residual, {"BLOCK": radix_select.KEEP_BLOCK, "SCAN": radix_select.SCAN,
                                                       "INT8": 256}, {"num_warps": _topk_triton.WARPS}),
                (_topk_triton._payloads_and_kept_emptied, {"BLOCK": radix_select.KEEP_BLOCK,
                                                           "SCAN": radix_select.SCAN},
                 {"num_warps": radix_select.PAYLOAD_WARPS}),
                (topk_codec._check, {"ENTRIES": topk_codec.ENTRIES}, {}),
                (topk_codec._decode, {"FLAGS": True, "STRETCHES": 16, "TILE": 8192, "ENTRIES": topk_codec.ENTRIES},
                 {"num_warps": 8}),
                (_topk_triton._mean_of_topk, {**mean, "MEMORY": True}, {"enable_fp_fusion": False}),
                (_topk_triton._mean_of_topk, {**mean, "MEMORY": False}, {"enable_fp_fusion": False})]
    for fn, constants, options in launched:
        aligned = {"stride", "n", "numel", "written", "out_stride"}
        ptx, usage = triton_workers.compiled(fn, constants, pointers, aligned, capability, options)
        print(f"{fn.__name__} {constants.get('MEMORY', '')} for sm_{capability}: {ptx.count('ld.global.v4')} of "
              f"ld.global.v4, {ptx.count('st.global.v4')} of st.global.v4; {usage}", flush=True)
        assert ".ftz" not in ptx, f"{fn.__name__}: subnormals flushed to zero, where torch keeps them"
        if fn is _topk_triton._payloads_and_residual:
            assert ptx.count("ld.global.v4") >= 2, "a program's values are not read 16 bytes at a time"
            assert "0f4B400000" in ptx, "the rounding's constant folded away"
        if fn is _topk_triton._payloads_and_kept_emptied:
            assert "sub.f32" in ptx or "sub.rn.f32" in ptx, "a kept x less itself folded to a constant"
        if fn is _topk_triton._mean_of_topk:
            assert ptx.count("st.global.v4") >= 1, "u is not written 16 bytes at a time"
            assert "div.rn.f32" in ptx and "fma.rn" not in ptx, "the mean's division or its memory's addition"
            assert ptx.count("bar.sync") + ptx.count("barrier.sync") >= 3, "the senders' additions are not ordered"
        if fn is topk_codec._decode:
            assert ptx.count("st.global.v4") >= 1, "a row's zeros are not written 16 bytes at a time"
            assert ptx.count("bar.sync") + ptx.count("barrier.sync") >= 1, "the values may land before the zeros"
    return len(launched)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--small-blocks", action="store_true")
    parser.add_argument("--through-topk", action="store_true")
    parser.add_argument("--reduce", action="store_true")
    parser.add_argument("--mean", action="store_true")
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--runs", action="store_true")
    parser.add_argument("--compile-for", type=int, nargs="*", help="compute capabilities: compile only")
    args = parser.parse_args()
    if args.compile_for:
        print(f"compiled {sum(compile_for(c) for c in args.compile_for)}")
        return
    device = torch.device(args.device)
    if args.through_topk:
        print(f"matched {check_through_topk(device)}")
    elif args.reduce:
        print(f"matched {check_reduce(device)}")
    elif args.runs:
        print(f"first-call check {'passes' if _topk_triton._runs_agree_with_torch(device) else 'FAILS'}")
        print(f"matched {check_runs(device, RUNS) + check_runs_through_topk(device)}")
    elif args.mean:
        print(f"matched {check_mean(device, MEAN_SHAPES)}")
    elif args.decode:
        print(f"first-call check {'passes' if topk_codec._agrees_with_torch(device) else 'FAILS'}")
        matched = check_decode(device, [(3, 20000, 300), (2, 1000, 1000), (3, 70, 1)]) + check_through_decode(device)
        topk_codec._TILE, topk_codec.ENTRIES = 64, 4  # searches over stretches of several rounds, several tiles
        print(f"matched {matched + check_decode(device, [(3, 500, 90)])}")
    elif args.small_blocks:  # (the interpreter's time is per program: fewer, shorter rows)
        radix_select.KEEP_BLOCK, radix_select.SCAN = 256, 4
        _topk_triton._ENTRIES, _topk_triton._TILE = 4, 64  # searches over stretches of several rounds
        matched = check_kernel(device, [(2, 1536, 300)])
        matched += check_mean(device, [(3, 512, 50, ("none", "unordered", "several")), (2, 300, 300, ("none",))])
        print(f"matched {matched}")
    else:
        print(f"first-call check {'passes' if _topk_triton._agrees_with_torch(device) else 'FAILS'}")
        print(f"matched {check_kernel(device, [(1, 1000, 17), (3, 2 * 4096 + 256, 300), (2, 256, 256), (1, 5, 5)])}")


if __name__ == "__main__":
    main()
