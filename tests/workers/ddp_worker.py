"""The DDP communication hook (dsq_plugins.ddp) on real processes:

    torchrun --nproc_per_node 2 tests/workers/ddp_worker.py OUT_DIR

(gloo.) Each rank saves its results to OUT_DIR/rank{R}.pt for test_ddp.py."""
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
import dsq_plugins.ddp as dsq_ddp  # noqa: E402
from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.helpers.states import decoded  # noqa: E402
from tests.workers.hvd_worker import batches, params_of, poisoned_batch  # noqa: E402

STEPS = 12


def wrapped(state=None):
    """The digits MLP (307K parameters, 1.2 MB) in DDP with small buckets: DDP's first bucket holds
    1 MB, the rest 20 KB each, and it lays them out again after the first iteration."""
    model = make_model(seed=1, hidden=4096)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    if state is not None:
        ddp.register_comm_hook(state, dsq_ddp.hook)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def train(ddp, opt, rank, steps):
    losses = []
    for step in steps:
        for x, y in batches(rank, step, 1):
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


class HostReads:
    """Counts the reads of tensor values to the host (each a sync on a GPU) that dsq_plugins' code makes,
    on any thread, while open."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.count, self._saved = 0, {name: getattr(torch.Tensor, name) for name in self.METHODS}
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, self._counting(original))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _counting(self, original):
        def read(tensor, *args, **kwargs):
            if any("dsq_plugins" in frame.filename for frame in traceback.extract_stack()[:-1]):
                self.count += 1
            return original(tensor, *args, **kwargs)
        return read


def scenario(rank, steps=STEPS, **options):
    state = dsq_ddp.HookState(**options) if options else None
    model, ddp, opt = wrapped(state)
    losses = train(ddp, opt, rank, range(steps - 6))
    sent = state.bytes_sent if state is not None else 0
    losses += train(ddp, opt, rank, range(steps - 6, steps - 1))
    with HostReads() as reads:  # the last iteration, DDP's layout long stable
        losses += train(ddp, opt, rank, [steps - 1])
    out = {"losses": losses, "params": params_of(model)}
    if state is not None:
        numel = sum(p.numel() for p in model.parameters())
        out.update(iterations=state.iteration, background=state._queue is not None,
                   bytes_per_step=(state.bytes_sent - sent) / 6,
                   fp32_allreduce=2 * (2 - 1) / 2 * 4 * numel, buckets=sorted(state.reducer.steps),
                   steps=state.reducer.steps)
        out["host_reads"] = reads.count
    return out


def resume_scenario(rank, out_dir):
    """Twelve iterations straight, against six, a checkpoint (model, optimizer, hook state), six more;
    and the same resumed without the hook state (its compensation dropped)."""
    straight = scenario(rank, compressor="sign")["params"]
    state = dsq_ddp.HookState(compressor="sign")
    model, ddp, opt = wrapped(state)
    train(ddp, opt, rank, range(6))
    path = os.path.join(out_dir, f"ckpt{rank}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, path)
    resumed = []
    for with_state in (True, False):
        ckpt = torch.load(path)
        state = dsq_ddp.HookState(compressor="sign")
        model, ddp, opt = wrapped(state)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        if with_state:
            state.load_state_dict(ckpt["hook"])
        train(ddp, opt, rank, range(6, STEPS))
        resumed.append(params_of(model))
    return straight, resumed[0], resumed[1]


def nan_scenario(rank, **options):
    """A NaN on rank 1: the same error on every rank, from backward(); the hook's state as it was."""
    state = dsq_ddp.HookState(compressor="sign", **options)
    model, ddp, opt = wrapped(state)
    train(ddp, opt, rank, range(3))
    before = {k: decoded(v) for k, v in state.reducer.worker_error.state_dict().items()}
    x, y = poisoned_batch(rank, 3)
    try:
        F.cross_entropy(ddp(x), y).backward()
        error = None
    except dsq.DSQError as exc:
        error = (type(exc).__name__, getattr(exc, "ranks", None), "on_nonfinite='skip'" in str(exc))
    after = state.reducer.worker_error.state_dict()
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], decoded(after[k])) for k in before)
    return error, unchanged, state.iteration


def fused_adamw(handed, **options):
    """The digits MLP in DDP with the hook (sign, verdict="step") before AdamW(fused=True), the optimizer
    handed to the hook (its verdict reaches it on the device) or not."""
    model = make_model(seed=1, hidden=4096)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
    state = dsq_ddp.HookState(compressor="sign", verdict="step", optimizer=opt if handed else None, **options)
    ddp.register_comm_hook(state, dsq_ddp.hook)
    return model, ddp, opt, state


def late_scenario(rank):
    """Eight iterations with the verdict read at the last bucket, and with it left on the device: the same
    model; with it left, no iteration reads its own verdict before backward() returns."""
    out = {}
    for handed in (False, True):
        model, ddp, opt, state = fused_adamw(handed)
        losses = train(ddp, opt, rank, range(7))
        with HostReads() as reads:
            for x, y in batches(rank, 7, 1):
                opt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                unjudged = state.reducer.scope.pending is not None
                opt.step()
        state.settle()
        out[handed] = {"losses": losses, "params": params_of(model), "unjudged": unjudged,
                       "host_reads": reads.count, "iterations": state.iteration}
    return out


def nan_late_scenario(rank):
    """A NaN on rank 1 with the verdict on the device: backward() returns, the optimizer skips the step on
    the device, and the error is raised at settle(), the same on every rank, the memories put back."""
    model, ddp, opt, state = fused_adamw(True)
    train(ddp, opt, rank, range(3))
    state.settle()
    memories = {k: decoded(v) for k, v in state.reducer.worker_error.state_dict().items()}
    params, moments = params_of(model), [s["exp_avg"].clone() for s in opt.state.values()]
    steps = [float(s["step"]) for s in opt.state.values()]
    x, y = poisoned_batch(rank, 3)
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()  # does not raise: the verdict is still on the device
    opt.step()
    try:
        state.settle()
        error = None
    except dsq.DSQError as exc:
        error = (type(exc).__name__, getattr(exc, "ranks", None))
    after = state.reducer.worker_error.state_dict()
    unchanged = (memories.keys() == after.keys() and all(torch.equal(memories[k], decoded(after[k])) for k in after)
                 and same(params, params_of(model))
                 and all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, opt.state.values()))
                 and steps == [float(s["step"]) for s in opt.state.values()])
    return error, unchanged, state.iteration


def skip_late_scenario(rank, poison):
    """on_nonfinite="skip" with the optimizer handed over: iterations 0-2, 3 poisoned on rank 1 (or left
    out), 4-5; a skipped iteration changes nothing anywhere, so both end with the same model."""
    model, ddp, opt, state = fused_adamw(True, on_nonfinite="skip")
    train(ddp, opt, rank, range(3))
    if poison:
        x, y = poisoned_batch(rank, 3)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    train(ddp, opt, rank, range(4, 6))
    state.settle()
    return {"params": params_of(model), "skipped": state.reducer.skipped_steps, "iterations": state.iteration}


def scaled_run(rank, poison_at=None, leave_out=None, finite=True, bad_rank=1):
    """Six iterations under torch.amp.GradScaler, the hook handed the fused AdamW (on_nonfinite="skip");
    ``finite``: the script makes the gradients finite before the scaler's step, so that the scaler finds no
    overflow and only the hook's flag can skip a condemned iteration; ``bad_rank`` None: every rank's batch
    poisoned, as an overflow of the scaled loss poisons every rank's gradients."""
    model, ddp, opt, state = fused_adamw(True, on_nonfinite="skip")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    for step in range(6):
        if step == leave_out:
            continue
        x, y = poisoned_batch(rank, step, rank if bad_rank is None else bad_rank) if step == poison_at \
            else batches(rank, step, 1)[0]
        opt.zero_grad()
        scaler.scale(F.cross_entropy(ddp(x), y)).backward()
        if finite:
            for p in ddp.parameters():
                p.grad.nan_to_num_(0.0, 0.0, 0.0)
        scaler.step(opt)
        scaler.update()
    state.settle()
    return {"params": params_of(model), "skipped": state.reducer.skipped_steps, "scale": scaler.get_scale()}


def accumulated_scenario(rank):
    """Two backward passes into one step, the first condemned (a NaN on rank 1; the script makes the
    gradients finite): the step is skipped, parameters and step counts as they were."""
    model, ddp, opt, state = fused_adamw(True, on_nonfinite="skip")
    train(ddp, opt, rank, range(3))
    before, steps = params_of(model), [float(s["step"]) for s in opt.state.values()]
    opt.zero_grad()
    for x, y in (poisoned_batch(rank, 3), batches(rank, 4, 1)[0]):
        F.cross_entropy(ddp(x), y).backward()
        for p in ddp.parameters():
            p.grad.nan_to_num_(0.0, 0.0, 0.0)
    opt.step()
    unchanged = same(before, params_of(model)) and steps == [float(s["step"]) for s in opt.state.values()]
    state.settle()
    return unchanged, state.reducer.skipped_steps


def scaler_scenario(rank):
    return {"poisoned": scaled_run(rank, poison_at=3), "left-out": scaled_run(rank, leave_out=3),
            "overflow": scaled_run(rank, poison_at=3, finite=False, bad_rank=None),
            "accumulated": accumulated_scenario(rank)}


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


class WithUnused(torch.nn.Module):
    """The digits MLP and a layer no forward uses (DDP's find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.net, self.unused = make_model(seed=1, hidden=32), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.net(x)


def adam_scenario(rank, **ddp_options):
    """compressed_adam on a DDP model, against CompressedAdam on the plain module (same batches)."""
    out = []
    for via_ddp in (True, False):
        torch.manual_seed(0)
        model = WithUnused() if ddp_options.get("find_unused_parameters") else make_model(seed=1, hidden=32)
        if via_ddp:
            ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_options)
            opt = dsq_ddp.compressed_adam(ddp, lr=3e-3, freeze_step=3)
        else:
            ddp, opt = model, dsq.CompressedAdam(model.named_parameters(), comm=dsq.TorchDistributedComm(), lr=3e-3,
                                                 freeze_step=3)
        train(ddp, opt, rank, range(8))
        out.append(params_of(model))
    return out


def accelerate_scenario(rank):
    """Accelerate: the hook registered on what accelerator.prepare returns (DDP on CPU ranks)."""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = make_model(seed=1, hidden=32)
    prepared, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    state = dsq_ddp.HookState(compressor="sign")
    prepared.register_comm_hook(state, dsq_ddp.hook)
    losses = []
    for step in range(STEPS):
        for x, y in batches(rank, step, 1):
            opt.zero_grad()
            loss = F.cross_entropy(prepared(x), y)
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
    return type(prepared).__name__, state.iteration, state.bytes_sent, losses, params_of(model)


def accelerate_skip_scenario(rank):
    """Accelerate's wrapped optimizer handed to the hook (it takes the fused AdamW inside): a NaN on rank 1
    whose gradients the script makes finite is skipped, parameters and step counts as they were."""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = make_model(seed=1, hidden=32)
    prepared, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    state = dsq_ddp.HookState(compressor="sign", verdict="step", optimizer=opt, on_nonfinite="skip")
    prepared.register_comm_hook(state, dsq_ddp.hook)
    for step in range(4):
        before = params_of(model)
        x, y = poisoned_batch(rank, step) if step == 3 else batches(rank, step, 1)[0]
        opt.zero_grad()
        accelerator.backward(F.cross_entropy(prepared(x), y))
        for p in prepared.parameters():
            p.grad.nan_to_num_(0.0, 0.0, 0.0)
        opt.step()
    state.settle()
    inner = opt.optimizer
    return (state.optimizer is inner, same(before, params_of(model)),
            sorted({float(s["step"]) for s in inner.state.values()}), state.reducer.skipped_steps)


class SparseBag(torch.nn.Module):
    """Token ids -> a digit: an embedding bag with sparse gradients (only the rows a batch touched), then a
    dense layer, as a recommender or word model with nn.Embedding(sparse=True) is built."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.EmbeddingBag(64, 16, mode="mean", sparse=True)
        self.out = torch.nn.Linear(16, 10)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def sparse_batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(64, (8, 5), generator=gen)
    return tokens, tokens[:, 0] % 10


def sparse_scenario(rank, poison_at=None, **options):
    """The bag in DDP, with the hook (``options``) or DDP's own allreduce: the first iteration's averaged
    gradients, the losses and final weights; with ``poison_at``, rank 1's sparse gradient holds a NaN at
    that iteration (what each rank raised, and whether the hook's memories stayed as they were)."""
    model = SparseBag()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = dsq_ddp.HookState(**options) if options else None
    if state is not None:
        ddp.register_comm_hook(state, dsq_ddp.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    out = {"losses": [], "error": None}
    for step in range(8):
        tokens, y = sparse_batch(rank, step)
        opt.zero_grad()
        handle = None
        if step == poison_at:
            before = {k: decoded(v) for k, v in state.reducer.worker_error.state_dict().items()}
            if rank == 1:
                handle = model.emb.weight.register_hook(lambda g: g * float("nan"))
        loss = F.cross_entropy(ddp(tokens), y)
        try:
            loss.backward()
        except dsq.DSQError as exc:
            after = state.reducer.worker_error.state_dict()
            out["error"] = (type(exc).__name__, getattr(exc, "ranks", None), state.iteration,
                            all(torch.equal(before[k], decoded(after[k])) for k in before))
            break
        finally:
            if handle is not None:
                handle.remove()
        if step == 0:
            out["grads"] = [p.grad.to_dense().clone() for p in model.parameters()]
            out["sparse"] = model.emb.weight.grad.is_sparse
        opt.step()
        out["losses"].append(loss.item())
    out["params"] = params_of(model)
    if state is not None:
        state.settle()
    return out


def main(out_dir):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results = {"plain": scenario(rank), "exact": scenario(rank, compressor="none", error_feedback="none"),
               "sign": scenario(rank, compressor="sign"),
               "sign-inline": scenario(rank, compressor="sign", overlap=False),
               "topk-int8": scenario(rank, compressor="topk", compressor_params={"ratio": 0.05}, error_dtype="int8"),
               "lowrank": scenario(rank, compressor="lowrank", compressor_params={"rank": 2}),
               "warm": scenario(rank, compressor="sign", exact_steps=4),
               "resume": resume_scenario(rank, out_dir),
               "sign-step": scenario(rank, compressor="sign", verdict="step"),
               "nan": nan_scenario(rank), "nan-inline": nan_scenario(rank, overlap=False),
               "nan-step": nan_scenario(rank, verdict="step"),
               "late": late_scenario(rank), "nan-late": nan_late_scenario(rank),
               "skip-late": [skip_late_scenario(rank, poison) for poison in (True, False)],
               "scaler": scaler_scenario(rank), "accelerate-skip": accelerate_skip_scenario(rank),
               "adam": adam_scenario(rank), "adam-views": adam_scenario(rank, gradient_as_bucket_view=True),
               "adam-static": adam_scenario(rank, static_graph=True),
               "adam-unused": adam_scenario(rank, find_unused_parameters=True),
               "accelerate": accelerate_scenario(rank),
               "sparse-plain": sparse_scenario(rank), "sparse-sign": sparse_scenario(rank, compressor="sign"),
               "sparse-step": sparse_scenario(rank, compressor="sign", verdict="step"),
               "sparse-nan": sparse_scenario(rank, poison_at=3, compressor="sign")}
    save_and_leave(results, out_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1])
