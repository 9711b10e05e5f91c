"""Per-step overhead of each compressed path against plain DDP, where users
run it: a GPU. The GPU's cost is kernel launches and host syncs more than
arithmetic, so besides time it counts both, per step, from torch's profiler.

    python -m bench.gpu [--device auto|cuda|cpu] [--steps 20] [--systems ...] [--json FILE] [--summary FILE]
        [--python-profile FILE] [--counts-only] [--own-kernels]
    torchrun --standalone --nproc_per_node N -m bench.gpu ...   # N ranks; rank 0 reports its own counts

On a GPU (``--device cuda``; nccl, one rank per GPU, one here): an 85M-parameter
GPT (12 layers, width 768, batch 8 x 512, DDP buckets of 25 MB), median ms
per step over ``--steps`` steps after a warm-up, x DDP + AdamW, the GPU's
busy time per step (its kernels', copies' and fills'; a step longer than it
is the GPU waiting for the host), the optimizer's ``step()`` alone where timed, and
``cudaLaunchKernel`` / ``cudaStreamSynchronize`` (and ``cudaEventSynchronize``) calls per step (over
``--profile-steps`` steps under the profiler). ``--summary FILE`` writes the
profiler's op tables per system there: which ops launch and take the host's time.

On a CPU (the proxy, the default without a GPU; one gloo rank): an 8-layer
GPT with DDP buckets of 0.05 MB, as many buckets as the large model has at
25 MB. It counts, per step, the leaf aten ops (ops with no aten op inside:
each would be a kernel launch on a GPU; views and allocations left out; a
multi-tensor op, ``torch._foreach_*``, and a ``cat`` count once, since CUDA launches one
kernel for many tensors where a CPU loops over them; a collective counts once, as
nccl's one kernel, and gloo's own copies on its threads not at all) and the host reads
(``.item()``, ``.tolist()``, ``bool(t)`` from Python, each a sync on a GPU),
and prints what each system adds to DDP + AdamW(foreach): ops per bucket and
host reads per step, and the median time of ``CompressedAdam.step()`` (the
momentum exchange included) against AdamW(foreach)'s ``step()``, on this model
(where a CPU's time is its arithmetic) and on a twin of it whose tensors are a
few elements wide, on the GPU's paths and kernels: the host's share, its
Python and calls, which is what a GPU's host pays for a step. Every
compressed system runs with ``verdict="step"``, what ``"auto"`` picks on a GPU, and
counts on the paths a GPU takes (``kernels.gpu_paths``: batched rows, one gather,
no cache-sized blocks). Timing a CPU says little about a GPU; counts carry over.
The proxy's CPU tensors take none of the library's Triton kernels, so its
counts are torch's paths; with ``--own-kernels`` (and ``TRITON_INTERPRET=1``)
Triton's interpreter runs those kernels where a GPU would take them, each
launch one op (and counted apart), as a GPU's step makes them.

Systems: ``ddp-adamw`` (the baseline), ``ddp-fused-adamw`` (GPU), ``powersgd4``
(torch's PowerSGD hook at rank 4; GPU), ``hook-sign``, ``hook-blocksign``,
``hook-topk`` (the DDP hook, 1%; inline on the CPU proxy, whose profiler
does not see the hook's thread), ``hook-sign-inline`` (GPU, asked for by name: the hook in
backward's own thread), ``hook-sign-fused`` (GPU, asked for by name: the hook before a fused
AdamW, against ``ddp-fused-adamw``: the step's one host read waits for the
GPU, which then idles while the host launches the optimizer's step, and a
fused one launches least), ``hook-sign-late`` (GPU: the hook handed that fused AdamW,
``HookState(optimizer=...)``, so that the verdict reaches it on the device and is read at the next
iteration, against ``ddp-fused-adamw``: no host read waits for the GPU), ``hook-sign-one-stream``
(GPU, asked for by name: ``hook-sign`` on backward's stream instead of the hook's side stream), ``hook-sign-hosts``
(four or more ranks: the ranks as two hosts, in two levels), ``compressed-adam`` (after its freeze),
``adamw-alone`` (AdamW without DDP: each rank on its own, LocalSteps' peer),
``local-steps`` (``LocalSteps`` without DDP, syncing every ``--sync-every``
steps; 1 on the proxy, so every step pays a sync), ``fsdp-compress`` (FSDP2
with ``dsq_fsdp.compress``)."""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, TextIO

import torch
import torch.distributed as dist

from dsq_plugins.compressors.kernels import failed_compiles, gpu_paths

SYSTEMS = ("ddp-adamw", "ddp-fused-adamw", "hook-sign-late", "adamw-alone", "powersgd4", "hook-sign",
           "hook-sign-inline", "hook-sign-hosts", "hook-blocksign", "hook-topk",
           "compressed-adam", "local-steps", "fsdp-compress", "hook-sign-fused", "hook-sign-one-stream")
#: ops that launch no kernel: views, reshapes and allocations
NOT_KERNELS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::view",
               "aten::as_strided", "aten::reshape", "aten::_reshape_alias", "aten::expand", "aten::slice",
               "aten::select", "aten::t", "aten::transpose", "aten::permute", "aten::unsqueeze", "aten::squeeze",
               "aten::detach", "aten::alias", "aten::resize_", "aten::set_", "aten::split", "aten::split_with_sizes",
               "aten::narrow", "aten::unflatten", "aten::flatten", "aten::unbind", "aten::chunk",
               "aten::view_as", "aten::lift_fresh", "aten::_unsafe_view", "aten::contiguous", "aten::result_type",
               "aten::is_nonzero", "aten::size", "aten::stride", "aten::numel", "aten::dim",
               # with no op beneath them, conversions to what the tensor already is: they return it
               "aten::to", "aten::type_as", "aten::resolve_conj", "aten::resolve_neg"}
HOST_READ = "aten::_local_scalar_dense"
#: a call of a graph torch.compile made (the library's fused kernels): one op
COMPILED = "## Call CompiledFxGraph"
#: a collective: one op (nccl launches one kernel; gloo's copies on its own threads are not counted)
COLLECTIVE = "c10d::"
#: ops over many tensors that are one op each: a CPU runs them tensor by tensor, where CUDA launches one
#: kernel for many tensors (multi-tensor ops; a cat's batched copy)
ONE_KERNEL = ("aten::_foreach_", "aten::cat")
#: a launch of one of the library's Triton kernels, run by Triton's interpreter on the CPU proxy (``--own-kernels``):
#: one op, whatever the interpreter does to run it on a CPU
TRITON = "triton::"
#: systems whose optimizer's ``step()`` is timed on its own against AdamW(foreach)'s (on the CPU proxy)
OPTIMIZER_ROWS = ("ddp-adamw", "compressed-adam")


def model_for(device: str, tiny: bool = False
              ) -> tuple[torch.nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]], float]:
    """(model, batch(), DDP's bucket_cap_mb) for the device. ``tiny``: the CPU proxy's model with
    its tensors (as many, of the same kinds) a few elements wide, so that a step's arithmetic is
    negligible and what it costs is the host's calls, which is what a GPU's host pays for."""
    from examples.lm import GPT, GPTConfig
    if device == "cuda":
        cfg, batch, bucket_mb = GPTConfig(context=512, width=768, layers=12, heads=12), 8, 25.0
    elif tiny:
        cfg, batch, bucket_mb = GPTConfig(context=8, width=8, layers=8, heads=2), 2, 0.05
    else:
        cfg, batch, bucket_mb = GPTConfig(context=64, width=128, layers=8, heads=4), 8, 0.05
    model = GPT(cfg, seed=0).to(device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(cfg.vocab, (batch, cfg.context + 1), generator=gen).to(device)
    return model, (lambda: (idx[:, :-1], idx[:, 1:])), bucket_mb


def build(system: str, device: str, sync_every: int, tiny: bool = False) -> tuple[Callable[[], None], int]:
    """(one training step, DDP's bucket count) for ``system`` (on ``model_for``'s ``tiny`` model)."""
    import dsq_plugins as dsq
    import dsq_plugins.ddp as dsq_ddp
    from examples.lm import loss_of
    model, batch, bucket_mb = model_for(device, tiny)
    if system == "fsdp-compress":
        import dsq_plugins.fsdp as dsq_fsdp
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        dsq_fsdp.compress(model, compressor="sign", verdict="step")
        net, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        buckets = len(model.blocks) + 1
    elif system in ("adamw-alone", "local-steps"):  # no DDP: each rank steps its own model
        net, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        if system == "local-steps":
            opt = dsq.LocalSteps(model, opt, sync_every=sync_every, exact_steps=0, verdict="step")
        buckets = 0
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        fused = system in ("ddp-fused-adamw", "hook-sign-fused", "hook-sign-late")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=not fused, fused=fused or None)
        if system == "powersgd4":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
            net.register_comm_hook(powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                          start_powerSGD_iter=2), powersgd.powerSGD_hook)
        elif system.startswith("hook-"):
            compressor = {"hook-sign": ("sign", None), "hook-sign-inline": ("sign", None),
                          "hook-sign-fused": ("sign", None), "hook-sign-late": ("sign", None),
                          "hook-sign-one-stream": ("sign", None),
                          "hook-sign-hosts": ("sign", None), "hook-blocksign": ("blocksign", None),
                          "hook-topk": ("topk", {"ratio": 0.01})}[system]
            # on the CPU proxy inline: the profiler does not see the background thread's ops (the same arithmetic);
            # on a GPU "-inline" runs the hook in backward's own thread, launching without waiting (no host read
            # before the step's end), against the background thread of the default
            overlap = device == "cuda" and not system.endswith("-inline")
            hosts = dict(hierarchy="node", node_size=max(dist.get_world_size() // 2, 1)) \
                if system.endswith("-hosts") else {}  # the ranks as two hosts, in two levels
            late = dict(optimizer=opt) if system == "hook-sign-late" else {}  # the verdict to it on the device
            if system == "hook-sign-one-stream":  # on backward's stream, where the others take the hook's side stream
                late["side_stream"] = False
            net.register_comm_hook(dsq_ddp.HookState(compressor=compressor[0], compressor_params=compressor[1],
                                                     overlap=overlap, verdict="step", **hosts, **late), dsq_ddp.hook)
        elif system == "compressed-adam":
            # AdamW's default weight decay, so that both optimizers do the same work (without it each skips its decay)
            opt = dsq_ddp.compressed_adam(net, lr=1e-4, weight_decay=0.01, freeze_step=1, verdict="step")
        buckets = 0

    def backward() -> None:
        x, y = batch()
        opt.zero_grad(set_to_none=True)
        loss_of(net, x, y).backward()

    def step() -> None:
        backward()
        opt.step()
    for _ in range(4):  # DDP lays its buckets out again after the first iteration; compressed_adam freezes
        step()
    step.backward, step.optimizer = backward, opt  # for ``optimizer_ms``
    return step, buckets or ddp_buckets(device)


def optimizer_ms(step: Callable[[], None], device: str, steps: int) -> float:
    """Median ms of the optimizer's ``step()`` alone (after a backward each time)."""
    times = []
    for _ in range(steps):
        step.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step.optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def host_ms(systems: list[str], sync_every: int, steps: int = 200) -> dict[str, float]:
    """Median ms of each system's optimizer ``step()`` on the CPU proxy's ``tiny`` twin, on the GPU's
    paths and kernels, the systems' steps taken in turn (so that the machine's drift reaches all alike)."""
    with gpu_paths():
        built = {system: build(system, "cpu", sync_every, tiny=True)[0] for system in systems}
        times: dict[str, list[float]] = {system: [] for system in systems}
        for _ in range(steps):
            for system, step in built.items():
                step.backward()
                start = time.perf_counter()
                step.optimizer.step()
                times[system].append(1000 * (time.perf_counter() - start))
    return {system: statistics.median(t) for system, t in times.items()}


def ddp_buckets(device: str) -> int:
    """How many buckets DDP hands a hook per iteration on this device's model, once laid out."""
    model, batch, bucket_mb = model_for(device)
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    calls = []

    def counting(state, bucket):  # (no annotations: DDP checks them as objects, and this module's are strings)
        calls.append(bucket.index())
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
    net.register_comm_hook(None, counting)
    from examples.lm import loss_of
    for _ in range(2):
        calls.clear()
        loss_of(net, *batch()).backward()
    return len(calls)


class HostReads:
    """Counts reads of tensor values to the host from Python (``.item()``,
    ``.tolist()``, ``bool(t)`` ...; each a sync on a GPU), on any thread,
    while open: the profiler sees ``.item()`` as an op, but not a
    ``.tolist()`` of a whole tensor."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    #: per thread, open ``paused`` blocks: reads there are not the step's (the interpreter's own)
    _paused = threading.local()

    @classmethod
    @contextlib.contextmanager
    def paused(cls) -> Any:
        cls._paused.depth = getattr(cls._paused, "depth", 0) + 1
        try:
            yield
        finally:
            cls._paused.depth -= 1

    def __enter__(self) -> "HostReads":
        self.count, self._saved = 0, {name: getattr(torch.Tensor, name) for name in self.METHODS}
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, self._counting(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _counting(self, original: Callable) -> Callable:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count += getattr(self._paused, "depth", 0) == 0
            return original(tensor, *args, **kwargs)
        return read


def count(step: Callable[[], None], device: str, steps: int, summary: Optional[TextIO] = None,
          title: str = "") -> dict[str, float]:
    """Per step: leaf aten ops, host reads and collectives (CPU), or kernel launches and stream syncs (CUDA).
    With ``summary``, the profiler's ops by count and by CPU time (and by GPU time on CUDA) are written to it
    under ``title``: where the launches, the host's time and the GPU's come from."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof, HostReads() as reads:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    if summary is not None:
        averages = prof.key_averages()
        for key in ("count", "self_cpu_time_total") + (("self_device_time_total",) if device == "cuda" else ()):
            summary.write(f"== {title}: {steps} steps, by {key}\n")
            summary.write(averages.table(sort_by=key, row_limit=40, max_name_column_width=70) + "\n")
        summary.flush()
    events = prof.events()
    stepping = _stepping_thread(events)
    # the GPU's own work: the time its kernels, copies and fills covered (the step's time less this is the GPU
    # waiting); not the ranges a ``record_function`` marks on the GPU (DDP's forward, the optimizer's step), which
    # cover the kernels inside them again
    gpu_us = busy_us([(e.time_range.start, e.time_range.end) for e in events
                      if e.device_type == torch.autograd.DeviceType.CUDA
                      and not getattr(e, "is_user_annotation", False)])
    leaves = launches = syncs = collectives = compiled = triton = 0
    for e in events:
        name = e.name
        if name == "cudaLaunchKernel" or name == "cuLaunchKernel" or name == "cudaLaunchKernelExC":
            launches += 1
        elif name in ("cudaStreamSynchronize", "cudaEventSynchronize"):  # the host waiting on the device's queue
            syncs += 1
        if e.thread != stepping:  # a transport's own threads (gloo's copies): the collective is counted below
            continue
        if name.startswith(COLLECTIVE) and not _inside(e, COLLECTIVE):  # one kernel, as nccl's
            leaves += 1
            collectives += 1
            continue
        if name.startswith(COMPILED):  # one fused kernel (on CUDA, Triton's one or two)
            leaves += 1
            compiled += 1
            continue
        if name.startswith(TRITON) and not _inside(e, TRITON):  # one of the library's own kernels
            leaves += 1
            triton += 1
            continue
        if not name.startswith("aten::") or any(_inside(e, prefix) for prefix in (*ONE_KERNEL, COLLECTIVE, TRITON)):
            continue
        kernel = name not in NOT_KERNELS and name != HOST_READ  # (a host read is counted by HostReads)
        if kernel and (name.startswith(ONE_KERNEL) or not any(c.name.startswith("aten::") for c in e.cpu_children)):
            leaves += 1
    return {"ops": leaves / steps, "host_reads": reads.count / steps, "launches": launches / steps,
            "gpu_ms": gpu_us / 1000 / steps,
            "syncs": syncs / steps, "collectives": collectives / steps, "compiled": compiled / steps,
            "triton": triton / steps}


def busy_us(spans: list[tuple[float, float]]) -> float:
    """How long at least one of ``spans`` (start, end) runs: kernels on two streams at once count once."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


@contextlib.contextmanager
def _compile_mode(mode: str) -> Any:
    """``DSQ_COMPILE`` set to ``mode`` inside the block."""
    before = os.environ.get("DSQ_COMPILE")
    os.environ["DSQ_COMPILE"] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DSQ_COMPILE", None)
        else:
            os.environ["DSQ_COMPILE"] = before


@contextlib.contextmanager
def interpreted_launches() -> Any:
    """While open, the library's kernels take the proxy's CPU tensors as a GPU's, run by Triton's interpreter
    (``own_kernels.interpreted_on_cpu``), and each launch is one profiler range named ``TRITON`` and the kernel's
    name, whose copies and reads (the interpreter's, to run it on a CPU) are not the step's."""
    from triton.runtime.interpreter import InterpretedFunction
    from dsq_plugins.compressors.own_kernels import interpreted_on_cpu
    run = InterpretedFunction.run

    def launch(fn: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(TRITON + fn.__name__), HostReads.paused():
            return run(fn, *args, **kwargs)
    InterpretedFunction.run = launch
    try:
        with interpreted_on_cpu():
            yield
    finally:
        InterpretedFunction.run = run


def _stepping_thread(events: Any) -> int:
    """The thread that ran the steps: the one with the most aten ops."""
    threads = collections.Counter(e.thread for e in events if e.name.startswith("aten::"))
    return threads.most_common(1)[0][0] if threads else -1


def _inside(event: Any, prefix: str) -> bool:
    """Whether ``event`` runs inside an op whose name starts with ``prefix``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def python_profile(step: Callable[[], None], device: str, steps: int, out: TextIO, title: str) -> None:
    """``steps`` steps under cProfile (this thread's: the DDP hook's own thread is not seen), its 35
    costliest functions by their own and by their cumulative time written to ``out``: the host's Python,
    which the profiler's op tables do not break down."""
    import io
    import pstats
    profiler = profiled(step, device, steps)
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(35)
        out.write(f"== {title}: {steps} steps under cProfile, by {key}\n{text.getvalue()}\n")
    out.flush()


def profiled(step: Callable[[], None], device: str, steps: int) -> Any:
    """A ``cProfile.Profile`` of ``steps`` of ``step`` (this thread's Python), the device's queue drained."""
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    return profiler


def timed(step: Callable[[], None], device: str, steps: int) -> float:
    """Median ms per step."""
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--steps", type=int, default=None, help="timed and profiled steps (20 on a GPU, 3 on a CPU)")
    p.add_argument("--systems", type=lambda v: v.split(","), default=None)
    p.add_argument("--sync-every", type=int, default=None, help="LocalSteps' H (20 on a GPU, 1 on the CPU proxy)")
    p.add_argument("--json", default=None,
                   help="a file for the rows, written again after each system (\"complete\": false until the end)")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="steps under the profiler (5 on a GPU, whose traces are large; --steps on a CPU)")
    p.add_argument("--summary", default=None, help="a file for the profiler's op tables of every system")
    p.add_argument("--python-profile", default=None, help="a file for each system's Python costs (cProfile)")
    p.add_argument("--counts-only", action="store_true",
                   help="the CPU proxy's counts alone, without its timings (what tests/test_gpu_proxy.py asserts)")
    p.add_argument("--own-kernels", action="store_true",
                   help="the CPU proxy with the library's Triton kernels taken as a GPU takes them, run by Triton's "
                        "interpreter (needs TRITON_INTERPRET=1 in the environment): each launch one op")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.counts_only and device == "cuda":
        p.error("--counts-only is the CPU proxy's: a GPU's rows are its timings")
    if args.own_kernels and (device == "cuda" or os.environ.get("TRITON_INTERPRET") != "1"):
        p.error("--own-kernels is the CPU proxy's, run with TRITON_INTERPRET=1 (a GPU takes its kernels anyway)")
    steps = args.steps or (20 if device == "cuda" else 3)
    sync_every = args.sync_every or (20 if device == "cuda" else 1)
    profiled = args.profile_steps or (5 if device == "cuda" else steps)
    # (torch's PowerSGD hook hangs at its first compressed step on one gloo rank: a GPU peer only; the proxy runs
    # every hook inline, so "-inline" is a GPU row)
    gpu_only = ("ddp-fused-adamw", "powersgd4", "hook-sign-inline", "hook-sign-fused", "hook-sign-late",
                "hook-sign-one-stream")
    # questions of their own (gpu_check's diagnostics), not the table
    asked_for_only = ("hook-sign-fused", "hook-sign-inline", "hook-sign-one-stream")
    systems = args.systems or [s for s in SYSTEMS
                               if s not in asked_for_only and (device == "cuda" or s not in gpu_only)]
    if int(os.environ.get("WORLD_SIZE", 1)) < 4:  # two hosts of one rank each stay flat: two levels need four
        systems = [s for s in systems if not s.endswith("-hosts")]
    users_compile = os.environ.get("DSQ_COMPILE", "auto")  # what the CPU's own timing runs with
    if device == "cpu":  # the fused kernels a GPU runs at the large model's sizes, compiled at the proxy's small ones
        os.environ["DSQ_COMPILE"] = "always"
    if "ddp-adamw" not in systems:
        systems = ["ddp-adamw", *systems]
    torch.set_num_threads(1 if device == "cpu" else torch.get_num_threads())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    launched = "WORLD_SIZE" in os.environ  # under torchrun: every rank measures itself, rank 0 reports
    with tempfile.NamedTemporaryFile() as store:
        backend = "nccl" if device == "cuda" else "gloo"
        if launched:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        ranks, rank = dist.get_world_size(), dist.get_rank()
        rows: dict[str, dict[str, Any]] = {}
        compiles = contextlib.ExitStack()
        failures = compiles.enter_context(failed_compiles())
        summary = open(args.summary, "w") if args.summary and rank == 0 else None
        pythons = open(args.python_profile, "w") if args.python_profile and rank == 0 else None
        for system in systems:
            with gpu_paths() if device == "cpu" else contextlib.nullcontext(), \
                    interpreted_launches() if args.own_kernels else contextlib.nullcontext():  # what a GPU takes
                step, buckets = build(system, device, sync_every)
                row = count(step, device, profiled, summary, system)
                if pythons is not None:
                    python_profile(step, device, profiled, pythons, system)
            row.update(buckets=buckets, ms=timed(step, device, steps) if device == "cuda" else None)
            # timed on the device's own paths and kernels, as its users run them
            if system in OPTIMIZER_ROWS and not args.counts_only:
                with _compile_mode(users_compile):
                    row["optimizer_ms"] = optimizer_ms(step, device, max(steps, 15))
            rows[system] = row
            if rank == 0:
                print(f"{system}: {row}", file=sys.stderr, flush=True)
                if args.json:  # the rows so far, and this rank's failed compiles: a run stopped at its limit keeps them
                    _write_json(args.json, device, ranks, steps, rows, sorted(set(failures)), complete=False)
        if device == "cpu" and not args.counts_only:  # the host's share: a GPU's calls, on tensors too small to matter
            for system, ms in host_ms([s for s in systems if s in OPTIMIZER_ROWS], sync_every).items():
                rows[system]["host_ms"] = ms
        for file in (summary, pythons):
            if file is not None:
                file.close()
        every_rank: list[list[str]] = [[] for _ in range(ranks)]
        compiles.close()
        dist.all_gather_object(every_rank, failures)
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return 0
    print("\n".join(table(rows, device, steps, ranks)))
    failed = sorted({message for messages in every_rank for message in messages})
    for message in failed:  # such a kernel ran eager: the rows are not the compiled paths' for it
        print(f"FAILED COMPILE: {message}", flush=True)
    if args.json:
        _write_json(args.json, device, ranks, steps, rows, failed, complete=True)
    return 0


def _write_json(path: str, device: str, ranks: int, steps: int, rows: dict[str, dict[str, Any]], failed: list[str],
                complete: bool) -> None:
    """The run's rows as JSON; ``complete`` False while systems are still to come (and for the failed compiles of
    rank 0 alone: every rank's are gathered at the end)."""
    with open(path, "w") as f:
        json.dump({"device": device, "ranks": ranks, "steps": steps, "rows": rows, "failed_compiles": failed,
                   "complete": complete}, f, indent=1)


def table(rows: dict[str, dict[str, Any]], device: str, steps: int, ranks: int) -> list[str]:
    """The Markdown table of ``rows``, each against DDP + AdamW's."""
    base = rows["ddp-adamw"]
    on = f"{ranks} ranks" if ranks > 1 else "one rank"
    what = (f"85M-parameter GPT, {on} over nccl" if device == "cuda" else
            f"CPU proxy: 8-layer GPT, DDP buckets of 0.05 MB, {on} over gloo, rank 0's counts")
    lines = [f"bench.gpu on {device} ({what}), {steps} steps", ""]
    if device == "cuda":
        lines += ["| system | ms/step | x DDP + AdamW | GPU busy ms/step | kernel launches / step | "
                  "stream syncs / step | compiled calls / step | optimizer step() ms |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for system, r in rows.items():
            optimizer = f"{r['optimizer_ms']:.1f}" if "optimizer_ms" in r else ""
            lines.append(f"| {system} | {r['ms']:.1f} | {r['ms'] / base['ms']:.2f} | {r['gpu_ms']:.1f} | "
                         f"{r['launches']:.0f} | {r['syncs']:.0f} | {r['compiled']:.0f} | {optimizer} |")
        if "local-steps" in rows and "adamw-alone" in rows:  # LocalSteps' own peer: a step without DDP
            ratio = rows["local-steps"]["ms"] / rows["adamw-alone"]["ms"]
            lines += ["", f"LocalSteps against AdamW alone: {ratio:.2f}x"]
        if "hook-sign-fused" in rows and "ddp-fused-adamw" in rows:  # the hook's peer with the same optimizer
            ratio = rows["hook-sign-fused"]["ms"] / rows["ddp-fused-adamw"]["ms"]
            lines += ["", f"The hook (sign) before a fused AdamW against DDP + fused AdamW: {ratio:.2f}x"]
        if "hook-sign-late" in rows and "ddp-fused-adamw" in rows:
            ratio = rows["hook-sign-late"]["ms"] / rows["ddp-fused-adamw"]["ms"]
            lines += ["", f"The hook (sign) handing its verdict to a fused AdamW on the device, against DDP + fused "
                          f"AdamW: {ratio:.2f}x"]
    else:
        lines += ["| system | buckets | leaf ops / step | added ops / bucket | host reads / step | added / step | "
                  "collectives / step | compiled calls / step | our Triton launches / step | optimizer step() x AdamW "
                  "| its host share x AdamW's |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for system, r in rows.items():
            added = (r["ops"] - base["ops"]) / max(r["buckets"], 1)
            ratio = f"{r['optimizer_ms'] / base['optimizer_ms']:.2f}" if "optimizer_ms" in r else ""
            host = f"{r['host_ms'] / base['host_ms']:.2f}" if "host_ms" in r else ""
            lines.append(f"| {system} | {r['buckets']} | {r['ops']:.0f} | {added:.0f} | {r['host_reads']:.0f} | "
                         f"{r['host_reads'] - base['host_reads']:+.0f} | {r['collectives']:.0f} | "
                         f"{r['compiled']:.0f} | {r.get('triton', 0):.0f} | {ratio} | {host} |")
    return lines


if __name__ == "__main__":
    code = main()
    if "LOCAL_RANK" in os.environ:  # one of a launcher's ranks: its group is left, its output written
        # end without the interpreter's teardown, where gloo's threads abort a rank now and then ("terminate
        # called without an active exception") after its work succeeded (tests/helpers/launchers.py)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
