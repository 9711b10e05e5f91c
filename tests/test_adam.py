"""CompressedAdam: AdamW step for step during warm-up, the plain reference
of the algorithm bit for bit after the freeze, exact resume, and clean
failure on bad input."""
import copy
import importlib

import pytest
import torch

import dsq_plugins as dsq
from dsq_plugins.errors import AdamCompressionWarning
from dsq_plugins.optim import FlatMoments
from tests.helpers.reference_adam import ReferenceCompressedAdam
from tests.helpers.states import decoded

frozen_module = importlib.import_module("dsq_plugins.optim._frozen")

SHAPES = [("w", (5, 6)), ("b", (5,)), ("g", (7,))]
HYPER = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def init_params(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return [(name, torch.nn.Parameter(torch.randn(shape, generator=gen).to(device))) for name, shape in SHAPES]


def grads_for(rank, step, device="cpu"):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(shape, generator=gen).to(device) for _, shape in SHAPES]


def run_optimizer(comm, steps, freeze_step, make=None, device="cpu", **kw):
    params = init_params(device)
    opt = (make or dsq.CompressedAdam)(params, comm=comm, freeze_step=freeze_step, **HYPER, **kw)
    history = []
    for t in range(steps):
        for (_, p), g in zip(params, grads_for(comm.rank, t, device)):
            p.grad = g.clone()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for _, p in params]))
    return history, opt


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.5])
def test_warm_up_is_adamw_on_the_exact_average_bit_for_bit(max_grad_norm):
    n = 3
    got = dsq.LocalGroup(n).run(lambda comm: run_optimizer(comm, 5, freeze_step=10, max_grad_norm=max_grad_norm)[0])
    params = init_params()
    adamw = torch.optim.AdamW([p for _, p in params], **HYPER, foreach=False)
    for t in range(5):
        per_rank = [grads_for(r, t) for r in range(n)]
        for i, (_, p) in enumerate(params):
            p.grad = torch.stack([per_rank[r][i] for r in range(n)]).mean(0)
        if max_grad_norm:  # clipping applies to the average, as it would without compression
            assert float(torch.nn.utils.clip_grad_norm_([p for _, p in params], max_grad_norm)) > max_grad_norm
        adamw.step()
        expected = torch.cat([p.detach().reshape(-1) for _, p in params])
        for rank in range(n):
            assert torch.equal(got[rank][t], expected), f"step {t + 1} differs from AdamW on rank {rank}"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("compressor,params", [("sign", {}), ("sign", {"scale": "rms"}), ("topk", {"ratio": 0.2}),
                                               ("randomk", {"ratio": 0.3, "unbiased": False})])
def test_matches_the_plain_reference_across_the_freeze_bit_for_bit(n, compressor, params):
    steps, freeze = 7, 3
    # fp32 memories, as the reference keeps them
    results = dsq.LocalGroup(n).run(lambda comm: run_optimizer(comm, steps, freeze, compressor=compressor,
                                                               compressor_params=params, error_dtype="fp32"))
    opt = results[0][1]
    bucket = opt.compressed.layout([(name, shape) for name, shape in SHAPES])[0]
    reference = ReferenceCompressedAdam(
        torch.cat([p.detach().reshape(-1) for _, p in init_params()]), n, opt.compressed.compressor,
        opt.compressed.server_compressor, **HYPER, freeze_step=freeze,
        seed_of=lambda step, side, sender, chunk: opt.compressed.chunk_seed(bucket.name, step, side, sender, chunk),
        sizes=[p.numel() for _, p in init_params()])
    for t in range(steps):
        expected = reference.step([torch.cat([g.reshape(-1) for g in grads_for(r, t)]) for r in range(n)])
        for history, _ in results:
            assert torch.equal(history[t], expected), f"step {t + 1} differs from the reference"
    assert opt.exact.steps == {bucket.name: freeze} and opt.compressed.steps == {bucket.name: steps - freeze}


def test_after_the_freeze_bytes_shrink_like_the_compressor():
    """200k parameters: the warm-up moves an fp32 ring allreduce's worth,
    after the freeze sign moves 1/30 of it or less."""
    def per_rank(comm):
        p = torch.nn.Parameter(torch.zeros(200_000))
        opt = dsq.CompressedAdam([("p", p)], comm=comm, freeze_step=1)
        sent = []
        for t in range(3):
            p.grad = torch.randn(200_000, generator=torch.Generator().manual_seed(10 * t + comm.rank))
            comm.reset_counters()
            opt.step()
            sent.append(comm.bytes_sent)
        return sent
    ring = 2 * 3 / 4 * 4 * 200_000
    for warmup, *after in dsq.LocalGroup(4).run(per_rank):
        assert ring <= warmup <= 1.001 * ring
        assert all(s <= ring / 30 for s in after)


def test_with_deferred_verdicts_a_step_reads_the_host_once_and_the_plan_is_agreed_once():
    """The parameters are the same at every step: the momentum's plan is
    agreed at the first step after the freeze only, and every step after
    the freeze reads the device once, when it settles."""
    def per_rank(comm):
        params = init_params()
        opt = dsq.CompressedAdam(params, comm=comm, freeze_step=2, verdict="step", **HYPER)
        sent, reads = [], []
        for t in range(5):
            for (_, p), g in zip(params, grads_for(comm.rank, t)):
                p.grad = g
            comm.reset_counters()
            opt.step()
            sent.append(comm.bytes_sent)
            if t >= 2:
                reads.append(opt.compressed.last_step.verdict.host_reads)
        return sent, reads
    header = 24 * 2  # a plan's agreement: a 3-int header to each of 2 peers
    for sent, reads in dsq.LocalGroup(3).run(per_rank):
        assert reads == [1] * 3
        assert sent[2] - sent[3] == header and sent[3] == sent[4]


@pytest.mark.parametrize("stop", [2, 5])  # before and after the freeze at 3
def test_resume_from_saved_state_is_bit_for_bit(stop, tmp_path):
    def uninterrupted(comm):
        return run_optimizer(comm, 8, 3)[0][-1]

    def interrupted(comm):
        history, opt = run_optimizer(comm, stop, 3)
        torch.save({"opt": opt.state_dict(), "params": history[-1]}, tmp_path / f"rank{comm.rank}.pt")
        ckpt = torch.load(tmp_path / f"rank{comm.rank}.pt")
        params = init_params()
        with torch.no_grad():
            offset = 0
            for _, p in params:
                p.copy_(ckpt["params"][offset: offset + p.numel()].reshape(p.shape))
                offset += p.numel()
        fresh = dsq.CompressedAdam(params, comm=comm, freeze_step=3, **HYPER)
        fresh.load_state_dict(ckpt["opt"])
        for t in range(stop, 8):
            for (_, p), g in zip(params, grads_for(comm.rank, t)):
                p.grad = g.clone()
            fresh.step()
        return torch.cat([p.detach().reshape(-1) for _, p in params])

    straight = dsq.LocalGroup(3).run(uninterrupted)
    resumed = dsq.LocalGroup(3).run(interrupted)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@pytest.mark.parametrize("freeze_step", [3, "auto"])
def test_a_version_1_checkpoint_loads_in_its_warm_up_and_is_refused_after_its_freeze(freeze_step):
    """Version 1 kept the momentum m in the error memories, version 2 keeps m / D: a checkpoint saved
    after the freeze cannot be read as the other; one saved in the warm-up has no such memories."""
    def per_rank(comm):
        out = []
        for steps in (2, 5):
            _, opt = run_optimizer(comm, steps, freeze_step)
            saved = opt.state_dict()
            saved["compressed"]["version"] = 1
            fresh = dsq.CompressedAdam(init_params(), comm=comm, freeze_step=freeze_step, **HYPER)
            try:
                fresh.load_state_dict(saved)
                out.append("loaded")
            except dsq.StateError as exc:
                out.append(str(exc))
        return out
    for warm, after in dsq.LocalGroup(2).run(per_rank):
        assert warm == "loaded"
        assert after == "loaded" if freeze_step == "auto" else "saved after the freeze" in after


@pytest.mark.parametrize("at_step", [1, 4])  # during warm-up, after the freeze at 3
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_nan_on_one_rank_changes_nothing_on_any_rank(at_step, mode):
    def per_rank(comm):
        history, opt = run_optimizer(comm, at_step, 3, on_nonfinite=mode)
        before = opt.state_dict()
        params = [p for group in opt.param_groups for p in group["params"]]
        for p, g in zip(params, grads_for(comm.rank, at_step)):
            p.grad = g.clone()
            if comm.rank == 1:
                p.grad.view(-1)[0] = float("nan")
        try:
            opt.step()
            outcome = "skipped" if opt.skipped_steps else "applied"
        except dsq.NonFiniteGradientError as exc:
            outcome = ("raised", exc.ranks)
        after = opt.state_dict()
        return outcome, same_state(before, after), torch.equal(history[-1], torch.cat([p.detach().reshape(-1)
                                                                                        for p in params]))
    expected = ("raised", [1]) if mode == "raise" else "skipped"
    assert dsq.LocalGroup(3).run(per_rank) == [(expected, True, True)] * 3


def same_state(a, b):
    """Moments, error memories and step counters equal."""
    def tensors(sd):
        out = {(pid, k): v for pid, st in sd["state"].items() for k, v in st.items() if torch.is_tensor(v)}
        for part in ("exact", "momentum"):
            for kind in ("worker_error", "server_error"):
                out.update({(part, kind, k): decoded(v) for k, v in sd["compressed"][part][kind].items()})
        return out
    ta, tb = tensors(a), tensors(b)
    return (ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
            and a["compressed"]["global_step"] == b["compressed"]["global_step"]
            and a["compressed"]["momentum"]["steps"] == b["compressed"]["momentum"]["steps"])


def test_state_from_another_world_size_or_model_is_refused_and_from_another_rank_kept_apart():
    states = dsq.LocalGroup(2).run(lambda comm: run_optimizer(comm, 4, 2)[1].state_dict())

    def load(comm, state, shapes=SHAPES):
        params = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in shapes]
        opt = dsq.CompressedAdam(params, comm=comm, freeze_step=2, **HYPER)
        opt.load_state_dict(state)
        return opt

    with pytest.raises(dsq.StateError, match="saved with 2 workers; this run has 3"):
        dsq.LocalGroup(3).run(lambda comm: load(comm, states[0]))
    with pytest.raises(dsq.StateError, match="other parameters"):
        dsq.LocalGroup(2).run(lambda comm: load(comm, states[comm.rank], [("w", (5, 6))]))

    def other_rank(comm):
        opt = load(comm, states[1 - comm.rank])
        return opt.global_step, opt.compressed.state_dict()["worker_error"]
    with pytest.warns(UserWarning, match="keeps its own"):  # (warnings are process-wide: caught out here)
        loaded = dsq.LocalGroup(2).run(other_rank)
    for step, memory in loaded:
        assert step == 4 and memory == {}


@pytest.mark.parametrize("kwargs,message", [
    ({"freeze_step": -1}, "freeze_step must be a positive integer"),
    ({"freeze_step": 0}, "freeze_step must be a positive integer"),
    ({"betas": (0.9, 1.5)}, "betas must be two numbers in"),
    ({"lr": -1.0}, "lr must be a non-negative number"),
    ({"compressor": "sgn"}, "unknown compressor 'sgn'"),
    ({"compressor": "topk", "compressor_params": {"rate": 0.1}}, "no parameter 'rate'"),
])
def test_bad_settings_are_config_errors(kwargs, message):
    comm = dsq.LocalGroup(1).run(lambda c: c)[0]
    with pytest.raises(dsq.ConfigError, match=message):
        dsq.CompressedAdam(init_params(), comm=comm, **{"freeze_step": 2, **kwargs})


def test_a_sparse_gradient_is_a_config_error_naming_the_parameter():
    def per_rank(comm):
        embedding = torch.nn.Embedding(10, 4, sparse=True)
        opt = dsq.CompressedAdam(list(embedding.named_parameters()), comm=comm, freeze_step=1)
        embedding(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(dsq.ConfigError, match="sparse gradients \\('weight'\\)"):
            opt.step()
        return True
    assert all(dsq.LocalGroup(2).run(per_rank))


def test_param_groups_plain_tensors_and_per_group_learning_rates():
    def per_rank(comm):
        a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
        opt = dsq.CompressedAdam([{"params": [a]}, {"params": [b], "lr": 0.0}], comm=comm, lr=0.1, freeze_step=1)
        for _ in range(3):
            a.grad, b.grad = torch.ones(4), torch.ones(4)
            opt.step()
            opt.zero_grad()
        return a.detach().clone(), b.detach().clone(), a.grad
    for a, b, grad in dsq.LocalGroup(2).run(per_rank):
        assert bool((a < 1).all()) and torch.equal(b, torch.ones(4)) and grad is None


def run_with_frozen(comm, steps, frozen_at, only=None, **kw):
    """``run_optimizer``'s run where ``frozen_at(t)`` names the parameters frozen (``requires_grad``
    off, no gradient) at step t; ``only``: the optimizer is given just these names. Returns each
    step's parameters, by name."""
    params = init_params()
    opt = dsq.CompressedAdam([(n, p) for n, p in params if only is None or n in only], comm=comm, **HYPER, **kw)
    history = []
    for t in range(steps):
        frozen = frozen_at(t)
        for (name, p), g in zip(params, grads_for(comm.rank, t)):
            p.requires_grad_(name not in frozen)
            p.grad = None if name in frozen else g.clone()
        opt.step()
        history.append({n: p.detach().clone() for n, p in params})
    return history


def adam_warnings(run):
    """(``run()``, the messages of the AdamCompressionWarnings it raised, on any rank's thread)."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AdamCompressionWarning)
        result = run()
    return result, [str(w.message) for w in caught if issubclass(w.category, AdamCompressionWarning)]


@pytest.mark.parametrize("flat", [True, False])
def test_a_frozen_parameter_stays_as_it_was_and_the_others_step_as_without_it(monkeypatch, flat):
    """A layer whose ``requires_grad`` is off is left alone, as torch's AdamW leaves it (no weight
    decay, no momentum), before the freeze and after; the others take exactly the steps of an
    optimizer that was never given it."""
    if not flat:
        monkeypatch.setattr(FlatMoments, "serves", staticmethod(lambda params: False))
    options = dict(freeze_step=3, error_dtype="int8")
    with_it, warned = adam_warnings(
        lambda: dsq.LocalGroup(2).run(lambda comm: run_with_frozen(comm, 7, lambda t: {"b"}, **options)))
    without = dsq.LocalGroup(2).run(lambda comm: run_with_frozen(comm, 7, lambda t: {"b"}, only={"w", "g"},
                                                                 **options))
    start = dict(init_params())["b"]
    assert not warned
    for h1, h2 in zip(with_it, without):
        for t, (a, b) in enumerate(zip(h1, h2)):
            assert torch.equal(a["b"], start), f"the frozen parameter moved at step {t + 1}"
            assert torch.equal(a["w"], b["w"]) and torch.equal(a["g"], b["g"]), f"step {t + 1} differs"
        assert not torch.equal(h1[-1]["w"], h1[0]["w"])


def test_a_layer_unfrozen_in_the_warm_up_trains_and_one_unfrozen_after_the_freeze_is_named_in_a_warning():
    """Unfreezing before the freeze: the layer trains from then on. After it, a layer that never
    trained has no variance to step by: its momentum stays zero, it only decays, and a warning
    names it (once)."""
    def run(comm, unfrozen_at):
        return run_with_frozen(comm, 8, lambda t: {"b"} if t < unfrozen_at else set(), freeze_step=4)
    start = dict(init_params())["b"]
    early, warned = adam_warnings(lambda: dsq.LocalGroup(2).run(lambda comm: run(comm, 2)))
    assert not warned
    for history in early:
        assert torch.equal(history[1]["b"], start) and not torch.equal(history[2]["b"], start)
    late, warned = adam_warnings(lambda: dsq.LocalGroup(2).run(lambda comm: run(comm, 6)))
    # one warning per rank, each naming the parameter
    assert len(warned) == 2 and all(w.startswith("CompressedAdam: b began to train after") for w in warned)
    for history in late:
        decay = 1 - HYPER["lr"] * HYPER["weight_decay"]
        assert torch.equal(history[5]["b"], start) and torch.equal(history[-1]["b"], start.mul(decay).mul(decay))
        assert not torch.equal(history[-1]["w"], history[4]["w"])


def test_a_layer_frozen_mid_run_keeps_its_moments_in_tensors_of_its_own():
    """The flat moment vectors are made again for the parameters that still train; the frozen one's
    moments become copies of their own, so that no view of them holds the old vectors (twice the
    moments' memory), and they are its moments as they were."""
    def fn(comm):
        params = dict(init_params())
        opt = dsq.CompressedAdam(list(params.items()), comm=comm, **HYPER, freeze_step=5)
        for t in range(4):
            if t == 2:
                kept = {k: opt.state[params["b"]][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                params["b"].requires_grad_(False)
            for (name, p), g in zip(params.items(), grads_for(comm.rank, t)):
                p.grad = g.clone() if p.requires_grad else None
            opt.step()
        state = opt.state[params["b"]]
        return (all(state[k]._base is None and torch.equal(state[k], kept[k]) for k in kept),
                all(opt.state[params[n]]["exp_avg"]._base is opt._moments.exp_avg for n in ("w", "g")),
                opt._moments.exp_avg.numel())
    for own, flat, numel in dsq.LocalGroup(2).run(fn):
        assert own and flat and numel == 30 + 7


def test_steps_with_every_parameter_frozen_change_nothing_and_training_goes_on_after_them():
    names = {name for name, _ in SHAPES}
    runs = dsq.LocalGroup(2).run(lambda comm: run_with_frozen(comm, 6, lambda t: names if t in (0, 1, 4) else set(),
                                                               freeze_step="auto", freeze_window=1))
    start = dict(init_params())
    for history in runs:
        assert all(torch.equal(history[t][n], start[n]) for t in (0, 1) for n in names)
        assert all(torch.equal(history[4][n], history[3][n]) for n in names)
        assert not torch.equal(history[5]["w"], history[4]["w"]) and not torch.equal(history[2]["w"], start["w"])


@pytest.mark.parametrize("error_dtype,zeroing", [("fp32", "index"), ("int8", "index"), ("int8", "mask")])
def test_flat_moments_take_the_per_tensor_path_s_steps_bit_for_bit(monkeypatch, error_dtype, zeroing, tmp_path):
    """Parameters of one dtype and device keep their moments in two flat
    vectors (``FlatMoments``), and after the freeze the momentum exchange
    reads u as one vector (``reduce_flat``). With two param groups of their
    own lr and betas, clipping, and a coordinate without a gradient in the
    warm-up (masked after the freeze, by index or by the whole mask), the steps, moments and error memories
    must be those of the tensor-by-tensor path; a state_dict loaded mid-run goes back
    into the vectors."""
    monkeypatch.setattr(frozen_module, "SPARSE_FROM", 1 if zeroing == "index" else 10**12)

    def run(comm, tmp):
        params = init_params()
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.02, "betas": (0.8, 0.95)}]
        opt = dsq.CompressedAdam(groups, comm=comm, freeze_step=3, max_grad_norm=2.0, error_dtype=error_dtype,
                                 **HYPER)
        history = []
        for t in range(9):
            for (_, p), g in zip(params, grads_for(comm.rank, t)):
                p.grad = g.clone()
            if t < 3:  # no gradient here in the warm-up: its frozen variance is zero, and it is masked after
                params[0][1].grad[0, 0] = 0.0
            opt.step()
            history.append(torch.cat([p.detach().reshape(-1).clone() for _, p in params]))
            if t == 5:  # through a checkpoint: the loaded moments must go back into the vectors
                saved = opt.state_dict()
                torch.save(saved, tmp / f"rank{comm.rank}.pt")
                opt.load_state_dict(torch.load(tmp / f"rank{comm.rank}.pt"))
        moments = [opt.state[p][k] for _, p in params for k in ("exp_avg", "exp_avg_sq")]
        flat = all(m._base is not None for m in moments)
        if flat:  # the zeroing the test asked for is the one that ran
            assert (opt._frozen.flat()[1].index is not None) == (zeroing == "index")
        return history, moments, decoded(opt.state_dict()["compressed"]["momentum"]["worker_error"]
                                         [next(iter(opt.compressed.steps))]), flat, opt.frozen

    flat = dsq.LocalGroup(3).run(lambda comm: run(comm, tmp_path))
    monkeypatch.setattr(FlatMoments, "serves", staticmethod(lambda params: False))
    per_tensor = dsq.LocalGroup(3).run(lambda comm: run(comm, tmp_path))
    for (h1, m1, e1, is_flat, frozen), (h2, m2, e2, was_flat, _) in zip(flat, per_tensor):
        assert is_flat and not was_flat and frozen
        assert all(torch.equal(a, b) for a, b in zip(h1, h2))
        assert all(torch.equal(a, b) for a, b in zip(m1, m2)) and torch.equal(e1, e2)


def test_zero_variance_by_index_is_the_mask_s_product_bit_for_bit(monkeypatch):
    """A CPU zeroes the few coordinates without variance by index; the bits
    must be the whole mask's product's: a zero keeps its sign, NaN and Inf
    stay NaN, every other coordinate is untouched."""
    mask = torch.ones(1024)
    mask[[3, 7, 8, 40, 63]] = 0.0
    x = torch.randn(1024)
    x[[3, 40]] = torch.tensor([-2.5, -0.0])
    x[[7, 8, 10]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    expected = x.clone().mul_(mask)
    by_index = frozen_module.ZeroVariance(mask)
    monkeypatch.setattr(frozen_module, "SPARSE_FROM", 10**12)
    by_mask = frozen_module.ZeroVariance(mask)
    assert by_index.index is not None and by_mask.index is None
    for zeroing in (by_index, by_mask):
        got = zeroing.apply_(x.clone())
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bits, NaN and -0.0 included


def test_compressing_gradients_in_front_of_adam_warns_once_with_the_alternative():
    adam = importlib.import_module("dsq_plugins.optim._adam")  # its warn-once registry
    adam._warned.clear()
    sign, exact = dsq.ReducerConfig(compressor="sign"), dsq.ReducerConfig(compressor="fp16")
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.warns(AdamCompressionWarning, match="CompressedAdam"):
        assert adam.warn_if_adam(torch.optim.AdamW(p), sign, "here")
    assert not adam.warn_if_adam(torch.optim.AdamW(p), sign, "here")  # once
    with pytest.warns(AdamCompressionWarning):
        assert adam.warn_if_adam("Adam", sign, "the doublesqueeze section")  # DeepSpeed names its optimizers
    assert not adam.warn_if_adam(torch.optim.SGD(p, lr=0.1), sign, "here")
    assert not adam.warn_if_adam(torch.optim.Adam(p), exact, "elsewhere")  # an fp16 cast is no harm
    assert not adam.warn_if_adam(torch.optim.Adam(p), sign.replace(error_feedback="none"), "elsewhere")


def test_a_coordinate_with_rare_gradients_takes_an_adam_sized_step_after_the_freeze():
    """One coordinate had a gradient once, tiny, in the warm-up; after the
    freeze it gets a real one. Dividing by its frozen denominator (near eps)
    moved it by thousands; floored, it moves about as far as the others."""
    def per_rank(comm):
        p = torch.nn.Parameter(torch.zeros(64))
        opt = dsq.CompressedAdam([("p", p)], comm=comm, lr=1e-2, freeze_step=5)
        gen = torch.Generator().manual_seed(comm.rank)
        for t in range(8):
            g = torch.randn(64, generator=gen)
            g[0] = 1e-6 if t == 0 else (1.0 if t >= 5 else 0.0)
            p.grad = g
            before = p.detach().clone()
            opt.step()
        return (p.detach() - before).abs()
    for moved in dsq.LocalGroup(2).run(per_rank):
        assert torch.isfinite(moved).all()
        assert moved[0] <= 10 * moved[1:].max(), f"the rare coordinate moved {float(moved[0])}"


def _digits_mlp_accuracy(optimizer: str, steps: int = 300, lr: float = 3e-3, freeze_step: int = 50) -> list[float]:
    """A 3-layer ReLU MLP (64-128-128-10) on sklearn's digits, 2 ranks of
    batch 32: AdamW on the exact average, or CompressedAdam with sign.
    Returns every rank's test accuracy; raises if the run does."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    x, y = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]

    torch.manual_seed(0)  # once, here: the ranks are threads, and torch's seed is the process's
    initial = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                  torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def per_rank(comm):
        model = copy.deepcopy(initial)
        exact = dsq.DoubleSqueeze(comm, "none", error_feedback="none")
        params = list(model.parameters())
        opt = (torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw" else
               dsq.CompressedAdam(model.named_parameters(), comm=comm, lr=lr, freeze_step=freeze_step))
        gen = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            batch = train[torch.randint(len(train), (32,), generator=gen)]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            if optimizer == "adamw":
                exact.reduce_many([(str(i), p.grad) for i, p in enumerate(params)], in_place=True)
            opt.step()
        with torch.no_grad():
            return float((model(x[test]).argmax(1) == y[test]).float().mean())
    return dsq.LocalGroup(2).run(per_rank)


def test_a_relu_mlp_with_rare_features_trains_through_the_freeze_as_adamw_does():
    """The newcomer's model: digits' border pixels are almost always zero
    and ReLU units die, so some frozen variances are tiny. Before the floor
    it diverged within five steps of the freeze."""
    adamw = _digits_mlp_accuracy("adamw")
    compressed = _digits_mlp_accuracy("compressed_adam")
    assert compressed[0] == compressed[1]
    assert compressed[0] >= adamw[0] - 0.02, f"CompressedAdam {compressed[0]:.3f} against AdamW {adamw[0]:.3f}"


def test_a_step_derives_its_layout_once_while_the_same_parameters_train():
    """What a step derives from which parameters train (names, shapes, group slices, plans, the
    exchange's buckets) is made once and reused; freezing a layer makes it again."""
    def run(comm):
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        opt = dsq.CompressedAdam(list(model.named_parameters()), comm=comm, freeze_step=1)
        seen = []
        for step in range(5):
            if step == 3:
                model[0].bias.requires_grad_(False)
            for p in model.parameters():
                p.grad = torch.ones_like(p) if p.requires_grad else None
            opt.step()
            seen.append((opt._training, opt.compressed.layout(opt._training.shapes)))
        return seen
    seen = dsq.LocalGroup(1).run(run)[0]
    assert seen[1][0] is seen[2][0] and seen[1][1] is seen[2][1]  # after the freeze: the same objects
    assert seen[3][0] is not seen[2][0] and len(seen[3][0].params) == 3 and seen[3][0] is seen[4][0]


def test_a_list_of_entries_edited_in_place_gets_its_own_layout():
    """``layout`` finds a layout again by its names and shapes, not by the list that holds them: a pair
    replaced in that same list (another shape) is seen, and so is a pair whose shape is a list."""
    def run(comm):
        r = dsq.DoubleSqueeze(comm, "sign", layerwise=True)
        entries = [("a", (3,)), ("b", (2, 2))]
        first = r.layout(entries)
        again = r.layout(entries)
        entries[1] = ("b", (5,))
        edited = r.layout(entries)
        shape = [4]
        listed = [("a", shape)]
        before = r.layout(listed)
        shape[0] = 7
        return first, again, edited, before, r.layout(listed)
    first, again, edited, before, after = dsq.LocalGroup(1).run(run)[0]
    assert again is first
    assert [b.numel for b in edited] == [3, 5] and [b.numel for b in first] == [3, 4]
    assert before[0].numel == 4 and after[0].numel == 7


def test_a_state_loaded_after_steps_brings_its_own_hyperparameters_into_the_next_step():
    """torch's ``load_state_dict`` gives the optimizer new param-group dicts, with the saved lr: a step
    after it reads those, not the groups it had before (their lr, here ten times smaller)."""
    def run(comm):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        start = copy.deepcopy(model.state_dict())

        def grads(t):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, 0.1 * (t + 1 + i))

        def train(opt, steps, first=0):
            for t in range(first, first + steps):
                grads(t)
                opt.step()
        saver = dsq.CompressedAdam(list(model.named_parameters()), comm=comm, lr=1e-2, freeze_step=2)
        train(saver, 3)
        saved, at = copy.deepcopy(saver.state_dict()), copy.deepcopy(model.state_dict())
        train(saver, 2, 3)
        expected = [p.detach().clone() for p in model.parameters()]
        model.load_state_dict(start)
        loader = dsq.CompressedAdam(list(model.named_parameters()), comm=comm, lr=1e-3, freeze_step=2)
        train(loader, 3)  # its own steps first, at its own lr
        model.load_state_dict(at)
        loader.load_state_dict(saved)
        train(loader, 2, 3)
        return expected, [p.detach().clone() for p in model.parameters()]
    expected, got = dsq.LocalGroup(1).run(run)[0]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
