"""Bytes of compression state per parameter per rank, for each way of
storing the error memories (``error_dtype``), against the optimizer state
the same engine keeps without compression.

    python -m bench.memory [-n 2] [--dtypes fp32 bf16 int8] [--node-size L]

The model is ``examples.lm``'s byte-level GPT (0.47M parameters). Each
frontend runs a few real steps on ``n`` in-process ranks and its state is
counted two ways: in memory (the error memories as stored), and on disk
(``torch.save`` of what that frontend checkpoints per rank, serialisation
overhead included). The rows:

* **DoubleSqueeze** (the Horovod drop-in, the DeepSpeed section at stage 0,
  ``reduce_many``): the worker error (the whole vector) and this rank's
  server-error chunk; peer: SGD with momentum, 4 bytes per parameter.
* **CompressedAdam** after the freeze: the same two memories of its
  momentum exchange (its variance and momentum are Adam's own, counted in
  the peer); peer: AdamW's two moments, 8 bytes per parameter.
* **CompressedAdam at ZeRO-2** (``deepspeed_ext.zero_adam``): see ``zero_adam``;
  peer: ZeRO-2 AdamW, 12/n bytes per parameter.
* **ZeRO-3, the gradient pass** (the DeepSpeed section at stage 3): the
  worker errors, flat the whole vector; with ``--node-size`` in two levels,
  this rank's host shard; peer: ZeRO-3 AdamW's partitioned state, 12/n.
* **ZeRO-3, both passes** (``--node-size`` rows): the gradient pass's state
  and each owner's bf16 copy of its partition's replica (1/n of the model).
* **CompressedAdam at ZeRO-3** (``deepspeed_ext.zero3_adam``): see ``zero3_adam``;
  peer: ZeRO-3 AdamW, 12/n bytes per parameter.
* **ZeRO-2 mapping** (the DeepSpeed section at stages 1 and 2): the worker
  error, and in the checkpoint this rank's bf16 replica partition too (the
  parameter pass keeps no server error); peer: ZeRO-2 AdamW's fp32 master
  and two moments, partitioned, 12/n bytes per parameter.
"""
from __future__ import annotations

import argparse
import io

import torch

import dsq_plugins as dsq
from dsq_plugins.layout import chunk_bounds
from examples.lm import GPT, GPTConfig


def model_grads(seed: int, rank: int, step: int) -> tuple[list[tuple[str, torch.Tensor]], int]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    gen = torch.Generator().manual_seed(1000 * step + rank)
    named = [(n, torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]
    return named, sum(p.numel() for p in model.parameters())


def padded_gradient(comm, step: int) -> tuple[torch.Tensor, int]:
    """(this rank's gradient of the model at ``step`` as one flat vector, zero-padded to a multiple of the
    ranks as ZeRO pads its groups; the model's parameter count)."""
    named, numel = model_grads(0, comm.rank, step)
    flat = torch.zeros(-(-numel // comm.size) * comm.size)
    flat[:numel] = torch.cat([g.reshape(-1) for _, g in named])
    return flat, numel


def on_disk(state: object) -> int:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getbuffer().nbytes


def double_squeeze(comm, dtype: str) -> tuple[float, float, int]:
    r = dsq.DoubleSqueeze(comm, "sign", error_dtype=dtype)
    for step in range(3):
        named, numel = model_grads(0, comm.rank, step)
        r.reduce_many(named)
    return r.state.nbytes() / numel, on_disk(r.state_dict()) / numel, numel


def compressed_adam(comm, dtype: str) -> tuple[float, float, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = dsq.CompressedAdam(model.named_parameters(), comm=comm, lr=1e-3, freeze_step=1, error_dtype=dtype)
    numel = sum(p.numel() for p in model.parameters())
    for step in range(3):
        for (_, g), p in zip(model_grads(0, comm.rank, step)[0], model.parameters()):
            p.grad = g
        opt.step()
    state = opt.compressed.state.nbytes() + opt.exact.state.nbytes()
    return state / numel, on_disk(opt.compressed_state_dict()) / numel, numel


def zero_mapping(comm, dtype: str) -> tuple[float, float, int]:
    r = dsq.DoubleSqueeze(comm, "sign", error_dtype=dtype)
    named, numel = model_grads(0, comm.rank, 0)
    padded = -(-numel // comm.size) * comm.size
    flat = torch.zeros(padded)
    flat[:numel] = torch.cat([g.reshape(-1) for _, g in named])
    a, b = chunk_bounds(padded, comm.size)[comm.rank]
    replica = torch.zeros(b - a, dtype=torch.bfloat16)
    for _ in range(3):
        with r.step():
            average = r.reduce_scatter("zero.group0.grads", flat)
            r.all_gather("zero.group0.params", average, padded, error_feedback=False)
    state = {"reducer": r.state_dict(), "replicas": [replica]}
    return r.state.nbytes() / numel, on_disk(state) / numel, numel


def one_bit_exchange(comm, dtype: str, node_size: int | None, name: str):
    """Three steps of a OneBitAdam momentum exchange as the ZeRO mappings run
    it (a reduce-scatter, then a server pass that keeps its payloads): the
    reducer, the last payloads, the padded vector's and the model's sizes,
    and the frozen denominators' bytes on this rank's host shard (fp32, bf16
    when compact; not checkpointed: a load gathers them again)."""
    hierarchy = "flat" if node_size is None else "node"
    r = dsq.DoubleSqueeze(comm, "sign", compressor_params={"scale": "rms"}, error_dtype=dtype,
                          hierarchy=hierarchy, node_size=node_size)
    for step in range(3):
        local, numel = padded_gradient(comm, step)
        padded = local.numel()
        with r.step():
            average = r.reduce_scatter(name, local)
            _, served = r.all_gather(f"{name}.served", average, padded, keep_payloads=True)
    _, per_host, _, _ = r.hosts.position(comm.rank)
    return r, served, padded, numel, padded // per_host * (4 if dtype == "fp32" else 2)


def zero_adam(comm, dtype: str, node_size: int | None = None) -> tuple[float, float, int]:
    """deepspeed_ext.zero_adam's state after the freeze, as it keeps it: the
    momentum exchange's worker and server errors (``error_dtype``), the
    momentum on this rank's host shard (the whole vector when flat) as the
    server pass's payloads, the frozen denominators on the same shard, and on
    disk the bf16 replica partition too."""
    r, served, padded, numel, denominators = one_bit_exchange(comm, dtype, node_size, "zero.group0.momentum")
    a, b = chunk_bounds(padded, comm.size)[comm.rank]
    state = {"reducer": r.state_dict(), "momentum": {0: vars(served)},
             "replicas": [torch.zeros(b - a, dtype=torch.bfloat16)]}
    return (r.state.nbytes() + served.nbytes() + denominators) / numel, on_disk(state) / numel, numel


def zero3_gradients(comm, dtype: str, node_size: int | None = None) -> tuple[float, float, int]:
    """deepspeed_ext.zero3's state: the gradient pass's worker errors (one
    per bucket, here one bucket of the whole model laid out by rank), flat,
    or in two levels on this rank's host shard; its checkpoint is the
    reducer's state alone (the parameters are DeepSpeed's own)."""
    hierarchy = "flat" if node_size is None else "node"
    r = dsq.DoubleSqueeze(comm, "sign", error_dtype=dtype, hierarchy=hierarchy, node_size=node_size)
    for step in range(3):
        flat, numel = padded_gradient(comm, step)
        with r.step():
            r.reduce_scatter("zero3.bucket", flat)
    return r.state.nbytes() / numel, on_disk({"reducer": r.state_dict()}) / numel, numel


def zero3_both_passes(comm, dtype: str, node_size: int | None = None) -> tuple[float, float, int]:
    """``zero3_gradients`` with the parameter pass across hosts
    (``deepspeed_ext.zero3_params``): its error memory is the gap between
    master and replica, so it keeps no reducer state, and each owner adds a
    bf16 copy of its own partition's replica (1/n of the model), held in
    memory and not checkpointed (a save restarts the replicas). The host's
    sharded copy of the weights is hpZ's own memory, not counted here.
    Flat (no ``node_size``) the parameters stay DeepSpeed's exact gather."""
    memory, disk, numel = zero3_gradients(comm, dtype, node_size)
    return memory + own_replica(comm, numel, node_size) / numel, disk, numel


def own_replica(comm, numel: int, node_size: int | None) -> int:
    """Bytes of an owner's bf16 copy of its partition's replica: across hosts
    only (flat, the parameters are DeepSpeed's exact gather)."""
    return 0 if node_size is None else 2 * -(-numel // comm.size)


def zero3_adam(comm, dtype: str, node_size: int | None = None) -> tuple[float, float, int]:
    """deepspeed_ext.zero3_adam's state after the freeze: ``zero_adam``'s
    exchange state on this rank's host shard (the worker and server errors,
    m as the server pass's payloads, the denominators), and across hosts each
    owner's bf16 replica partition (the parameter pass, as in
    ``zero3_both_passes``); on disk the reducer's state and the payloads."""
    r, served, _, numel, denominators = one_bit_exchange(comm, dtype, node_size, "zero3.bucket")
    state = {"reducer": r.state_dict(), "kept": {"zero3.bucket": vars(served)}}
    memory = r.state.nbytes() + served.nbytes() + denominators + own_replica(comm, numel, node_size)
    return memory / numel, on_disk(state) / numel, numel


FRONTENDS = {  # name: (run, the peer's optimizer-state bytes per parameter per rank at n ranks)
    "DoubleSqueeze (Horovod drop-in, DeepSpeed stage 0)": (double_squeeze, lambda n: 4.0),
    "CompressedAdam, after the freeze": (compressed_adam, lambda n: 8.0),
    "ZeRO-2 mapping (DeepSpeed section, stages 1-2)": (zero_mapping, lambda n: 12.0 / n),
    "CompressedAdam at ZeRO-2 (OneBitAdam config), after the freeze": (zero_adam, lambda n: 12.0 / n),
    "ZeRO-3, the gradient pass (DeepSpeed section, stage 3)": (zero3_gradients, lambda n: 12.0 / n),
    "CompressedAdam at ZeRO-3 (OneBitAdam config), after the freeze": (zero3_adam, lambda n: 12.0 / n),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=2, help="ranks")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "int8"])
    p.add_argument("--node-size", type=int, default=None,
                   help="CompressedAdam at ZeRO-2 in two levels, hosts of this many ranks (that row alone)")
    args = p.parse_args(argv)
    if args.node_size is not None:
        return two_level_rows(args)
    torch.set_num_threads(1)
    print(f"Compression state, bytes per parameter per rank, {args.n} ranks (python -m bench.memory -n {args.n})\n")
    print("| frontend | error_dtype | in memory | on disk | the engine's own optimizer state | state / optimizer |")
    print("|---|---|---|---|---|---|")
    for name, (run, peer) in FRONTENDS.items():
        for dtype in args.dtypes:
            memory, disk, numel = dsq.LocalGroup(args.n).run(lambda comm: run(comm, dtype))[0]
            print(f"| {name} | {dtype} | {memory:.3f} | {disk:.3f} | {peer(args.n):.2f} | "
                  f"{memory / peer(args.n):.2f} |")
    print(f"\n({numel:,} parameters: examples.lm's byte-level GPT)")
    return 0


def two_level_rows(args) -> int:
    """CompressedAdam at ZeRO-2 and ZeRO-3's gradient pass, flat and in two levels, side by side, at the same
    ranks."""
    hosts = args.n // args.node_size
    print(f"Bytes per parameter per rank, {args.n} ranks, flat and as {hosts} hosts of {args.node_size} "
          f"(python -m bench.memory -n {args.n} --node-size {args.node_size})\n")
    print("| frontend | error_dtype | flat, in memory | two levels, in memory | ratio | flat, on disk | "
          "two levels, on disk |")
    print("|---|---|---|---|---|---|---|")
    for name, run in (("CompressedAdam at ZeRO-2", zero_adam), ("ZeRO-3, the gradient pass", zero3_gradients),
                      ("ZeRO-3, both passes (the parameter pass across hosts)", zero3_both_passes),
                      ("CompressedAdam at ZeRO-3 (OneBitAdam config)", zero3_adam)):
        for dtype in args.dtypes:
            flat, two = (dsq.LocalGroup(args.n).run(lambda comm: run(comm, dtype, size))[0]
                         for size in (None, args.node_size))
            print(f"| {name} | {dtype} | {flat[0]:.3f} | {two[0]:.3f} | {two[0] / flat[0]:.2f} | {flat[1]:.3f} | "
                  f"{two[1]:.3f} |")
    print(f"\n({flat[2]:,} parameters: examples.lm's byte-level GPT)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
