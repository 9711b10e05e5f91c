"""Top-k's radix select against a stable sort (its positions, and its payloads: the values and positions side by
side), run by Triton's interpreter on a CPU (the environment sets
``TRITON_INTERPRET=1`` before Triton is imported) or on a GPU: prints one line per case and ``matched N``.

``--compile-for 80 90`` compiles the kernels for those GPUs instead, without one.

Small blocks (``--small-blocks``) make rows of a few thousand elements span more blocks than the writing
pass sums at a time, the loop a GPU's bucket of millions takes."""
from __future__ import annotations

import argparse

import torch

from dsq_plugins.compressors import radix_select


def first_of_largest(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |values| of each row, the first of equals, as increasing positions (NaN largest)."""
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=1).values


def cases(device: torch.device, sizes: list[tuple[int, int]], width: int):
    gen = torch.Generator().manual_seed(3)
    for count, n in sizes:
        plain = torch.randn(count, n, generator=gen)
        tied = plain.clone()
        tied[:, ::3] = 0.0
        tied[:, 1::7] = -0.0
        tied[:, 5::11] = 1.5
        tied[:, 6::11] = -1.5
        extreme = plain * torch.logspace(-40, 38, n)  # subnormals to near the largest float
        extreme[:, 2::13] = float("inf")
        extreme[:, 4::17] = float("-inf")
        for name, rows in (("plain", plain), ("tied", tied), ("extreme", extreme)):
            for k in sorted({1, max(1, n // 100), max(1, n // 3), n}):
                yield name, rows.to(device), k
    wide = torch.randn(2, width + 200, generator=gen)
    yield "strided", wide[:, 100:100 + width].to(device), width // 50  # rows of a wider tensor
    equal = torch.full((2, width + width // 2), 0.25)
    yield "all-equal", equal.to(device), width // 2 + 200


#: the kernels' pointer arguments by name (every other argument is an int32 size)
POINTERS = {"rows_ptr": "*fp32", "hist_ptr": "*i32", "kept_ptr": "*i32", "out_ptr": "*i64", "words_ptr": "*i32"}


def compile_for(capability: int) -> int:
    """Compiles every kernel as a GPU of this compute capability runs it, down to its machine code by Triton's
    own ptxas, with no GPU here: what the interpreter cannot check (the compiler's rules and limits)."""
    from triton import compile as compile_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launched = [(radix_select._count_digits, {"PASS": p, "BLOCK": radix_select._COUNT_BLOCK}) for p in range(4)]
    launched += [(radix_select._count_kept, {"BLOCK": radix_select.KEEP_BLOCK}),
                 (radix_select._write_kept, {"BLOCK": radix_select.KEEP_BLOCK, "SCAN": radix_select.SCAN}),
                 (radix_select._write_payload, {"BLOCK": radix_select.KEEP_BLOCK, "SCAN": radix_select.SCAN})]
    for fn, constants in launched:
        signature = {name: "constexpr" if name in constants else POINTERS.get(name, "i32") for name in fn.arg_names}
        warps = radix_select.PAYLOAD_WARPS if fn is radix_select._write_payload else 4
        compile_kernel(ASTSource(fn=fn, signature=signature, constexprs=constants),
                       target=GPUTarget("cuda", capability, 32), options={"num_warps": warps})
        print(f"{fn.__name__} {constants} compiled for sm_{capability}", flush=True)
    return len(launched)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--small-blocks", action="store_true")
    parser.add_argument("--compile-for", type=int, nargs="*", help="compute capabilities: compile only")
    args = parser.parse_args()
    if args.compile_for:
        print(f"compiled {sum(compile_for(c) for c in args.compile_for)}")
        return
    sizes = [(1, 1), (1, 10), (3, 1000), (2, 4097), (1, 9000), (2, 12289)]
    if args.small_blocks:  # (the interpreter's time is per program: fewer, shorter rows)
        radix_select._COUNT_BLOCK, radix_select.KEEP_BLOCK, radix_select.SCAN = 256, 16, 4
        sizes = [(2, 300)]
    width = 300 if args.small_blocks else 1000
    matched = 0
    for name, rows, k in cases(torch.device(args.device), sizes, width):
        counts, want = radix_select.counted(rows, k), first_of_largest(rows, k)
        got = radix_select.radix_positions(rows, k, counts)
        same = torch.equal(got.cpu(), want.cpu())
        if not args.small_blocks:  # (its places are the positions' pass's: the scan's rounds are checked there)
            payloads = torch.cat([rows.gather(1, want).view(torch.uint8), want.to(torch.int32).view(torch.uint8)], 1)
            same = same and torch.equal(radix_select.radix_payloads(rows, k, counts), payloads)
        print(f"{name} rows={tuple(rows.shape)} k={k} {'same' if same else 'DIFFERENT'}", flush=True)
        assert same, (name, rows.shape, k)
        matched += 1
    print(f"matched {matched}")


if __name__ == "__main__":
    main()
