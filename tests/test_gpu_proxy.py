"""``bench.gpu``'s CPU proxy as a budget: what each compressed system adds
to DDP + AdamW(foreach) per bucket, in leaf ops (each a kernel launch on a
GPU) and host reads per step (each a sync on a GPU). Counts are exact, so
they can be tests; the budgets are where the code stands, so that a change
that adds launches or syncs to the hot path fails here and not only on a
GPU. (The GPU issue's target is 30 ops per bucket and one host read per
step; docs/results/gpu.md has the figures.)"""
import json
import os
import sys

import pytest
import torch

from tests.helpers.launchers import run_job
from tests.helpers.triton_workers import needs_triton

#: (system, most added ops per bucket, most added host reads per step), on one rank
BUDGETS = [("hook-sign", 12, 1), ("hook-topk", 15, 1), ("hook-blocksign", 11, 1), ("compressed-adam", 1, 1),
           ("local-steps", 2, 1)]
#: systems whose host reads per step are counted on two ranks too: more than one rank is where they were
#: read per bucket or per call (a plan agreed at each step, a module's verdict at each module)
TWO_RANKS = ("hook-sign", "hook-topk", "hook-blocksign", "compressed-adam", "local-steps", "fsdp-compress")
#: the hook on two ranks, where chunks travel: most added ops per bucket, and per step (its settle); the GPU
#: issue's target is 30 per bucket
TWO_RANK_HOOK_OPS = {"hook-sign": (12, 10), "hook-topk": (17, 10), "hook-blocksign": (13, 10)}
#: compiled calls on two ranks, per bucket (``compressed-adam``: per step, its one exchange): on a GPU each costs the
#: host more than its pass costs the device (dynamo's guards, the graph's wrappers, Triton's launcher)
TWO_RANK_COMPILED = {"hook-sign": 5, "hook-topk": 5, "hook-blocksign": 5, "compressed-adam": 6}
#: the same on one rank, what the GPU benchmark runs (one device)
ONE_RANK_COMPILED = {"hook-sign": 5, "hook-topk": 5, "hook-blocksign": 5, "compressed-adam": 6}


def _run(tmp_path_factory, systems, ranks):
    out = tmp_path_factory.mktemp("gpu") / f"proxy{ranks}.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    # two ranks on two busy cores, compiling every kernel where inductor's cache is cold: minutes
    done = run_job([*launcher, "-m", "bench.gpu", "--device", "cpu", "--steps", "2", "--counts-only",
                    "--systems", ",".join(systems), "--json", str(out)], timeout=1500)
    assert done.returncode == 0, f"bench.gpu on {ranks} rank(s) exited {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def proxy_run(tmp_path_factory):
    return _run(tmp_path_factory, [system for system, _, _ in BUDGETS], 1)


@pytest.fixture(scope="module")
def two_ranks_run(tmp_path_factory):
    return _run(tmp_path_factory, TWO_RANKS, 2)


@pytest.fixture(scope="module")
def proxy(proxy_run):
    return proxy_run["rows"]


@pytest.fixture(scope="module")
def two_ranks(two_ranks_run):
    return two_ranks_run["rows"]


def test_every_fused_kernel_of_the_proxy_compiles_on_every_rank(proxy_run, two_ranks_run):
    """A kernel whose compile fails runs eager for the rest of the run, with the same bits: the counts would
    then be of eager ops, and only a log line would say so (as for a compensation written over its own
    bucket, lost for a session)."""
    assert proxy_run["failed_compiles"] == [] and two_ranks_run["failed_compiles"] == []


def test_the_proxys_json_is_marked_complete_once_every_system_ran(proxy_run, two_ranks_run):
    """bench.gpu writes its JSON after each system, so that a run stopped at its time limit (the H200's was)
    keeps the rows it made; only the last write, after every system, says complete."""
    assert proxy_run["complete"] is True and two_ranks_run["complete"] is True
    assert set(proxy_run["rows"]) == {"ddp-adamw", *(system for system, _, _ in BUDGETS)}


@pytest.mark.parametrize("system,ops,reads", BUDGETS)
def test_each_compressed_system_stays_within_its_launch_and_sync_budget(proxy, system, ops, reads):
    base, row = proxy["ddp-adamw"], proxy[system]
    added_ops = (row["ops"] - base["ops"]) / row["buckets"]
    assert added_ops <= ops, f"{system} adds {added_ops:.0f} ops per bucket (budget {ops})"
    _within_one_read(base, row, system)


@pytest.mark.parametrize("system", TWO_RANKS)
def test_on_two_ranks_a_step_reads_the_host_once(two_ranks, system):
    _within_one_read(two_ranks["ddp-adamw"], two_ranks[system], system)


def test_on_two_ranks_a_bucket_moves_in_two_collectives_headers_included(two_ranks):
    """A deferred step's headers ride behind its payloads: the worker pass's all-to-all and the server pass's
    all-gather, and no header all-gather before each (there were four collectives per bucket)."""
    row = two_ranks["hook-sign"]
    assert row["collectives"] <= 2 * row["buckets"], f"{row['collectives']} collectives for {row['buckets']} buckets"


@pytest.mark.parametrize("system", sorted(TWO_RANK_HOOK_OPS))
def test_on_two_ranks_the_hook_stays_within_the_target(two_ranks, system):
    """Where chunks travel, each bucket's served rows are decoded in one call whose rows are the average
    itself, not copied into a buffer (a copy of the bucket per bucket back fails this); a sparse operator's
    checks are on its kept values, not a pass over each dense row, and come out of its decoder as one
    tensor, not stacked again; a device status joins its header in the payload's one concatenation."""
    base, row = two_ranks["ddp-adamw"], two_ranks[system]
    per_bucket, per_step = TWO_RANK_HOOK_OPS[system]
    added = row["ops"] - base["ops"]
    assert added <= per_bucket * row["buckets"] + per_step, f"{system} adds {added:.0f} ops per step on two ranks"


@pytest.mark.parametrize("system", sorted(TWO_RANK_COMPILED))
def test_on_two_ranks_a_bucket_makes_few_compiled_calls(two_ranks, system):
    """Sign's, blocksign's and top-k's payloads and their int8 residual come from one call on each side, a
    server's u from its senders' payloads in one (their decode and checks, the mean, the memory and the owner's
    status: three calls before), every rank's decode of what the owners served in one (each was two or more;
    top-k's worker decoded its own chunk for its residual too); blocksign's block codes come from the pass
    before its encode on each side (the worker's compensation, the owner's fold), not from a call of their own."""
    row = two_ranks[system]
    per = row["buckets"] if system.startswith("hook-") else 1
    assert row["compiled"] <= TWO_RANK_COMPILED[system] * per, f"{system}: {row['compiled']:.0f} compiled calls"


@pytest.mark.parametrize("system", sorted(ONE_RANK_COMPILED))
def test_on_one_rank_a_bucket_makes_few_compiled_calls(proxy, system):
    """One rank, as the GPU benchmark runs: the owner's u from its own payload and its memory in one call."""
    row = proxy[system]
    per = row["buckets"] if system.startswith("hook-") else 1
    assert row["compiled"] <= ONE_RANK_COMPILED[system] * per, f"{system}: {row['compiled']:.0f} compiled calls"


def _within_one_read(base, row, system):
    if system == "compressed-adam":  # it replaces AdamW, whose host reads are its step counters on a CPU
        assert row["host_reads"] <= 1
    else:
        assert row["host_reads"] - base["host_reads"] <= 1, f"{system}: {row['host_reads']} host reads per step"


def test_the_bucket_host_bench_counts_a_buckets_compiled_calls():
    """``bench.bucket_host`` (the host's time per extra bucket; its times are not asserted) runs, and its
    count of compiled calls per bucket is the proxy's: sign's five on one rank, for a bucket of one
    tensor and of two, each call run compiled (a kernel whose compile failed runs eager: fewer)."""
    done = run_job([sys.executable, "-m", "bench.bucket_host", "--device", "cpu", "--compressors", "sign",
                    "--buckets", "2", "--steps", "2", "--profile"], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| sign |"))
    assert row.split("|")[-3].strip() == "5.0", done.stdout
    assert row.split("|")[-2].strip() == "5", done.stdout  # a bucket of both tensors: the calls of one
    # --profile: the same step by whose code spends it, the library's modules each on a row of its own
    owners = {line.split("|")[2].strip() for line in done.stdout.splitlines() if line.startswith("| sign |")}
    assert {"dsq_plugins/algorithm/_algorithm1.py", "dsq_plugins/compressors/kernels.py", "torch's Python",
            "all"} <= owners, done.stdout


def test_the_gpus_busy_time_counts_overlapping_kernels_once():
    """bench.gpu's "GPU busy" is the time at least one kernel, copy or fill runs: two streams' kernels at once,
    and a range that covers others (the H200's rows summed DDP's forward range with the kernels inside it, more
    busy time than the step took), count once."""
    from bench.gpu import busy_us
    assert busy_us([(20, 25), (0, 10), (5, 15), (21, 22)]) == 20
    assert busy_us([(0, 100), (10, 20), (30, 40)]) == 100
    assert busy_us([]) == 0


def test_the_adam_step_bench_splits_a_step_into_its_fused_stages_and_the_rest():
    """``bench.adam_step --stages`` (its times are not asserted): after the freeze, the step's fused kernels are
    the momentum's preconditioning, the worker's compensation and sign's payloads with their residual (the
    worker's and the server's), each timed inside the step, whose whole is timed around them."""
    import dsq_plugins as dsq
    from bench.adam_step import stages
    r = dsq.LocalGroup(1).run(lambda comm: stages(comm, "deep-narrow", 2))[0]
    assert {"preconditioned_momentum", "added_rows_with_status", "_signs_and_residual"} <= set(r["fused"]), r
    assert 0 < sum(r["fused"].values()) < r["step"] and r["adamw"] > 0 and r["clone"] > 0, r


@needs_triton
def test_with_our_kernels_the_proxy_counts_each_interpreted_launch_as_one_op():
    """``bench.gpu --own-kernels``: under Triton's interpreter a CPU's tensors take the library's kernels where a
    GPU's would (``own_kernels.interpreted_on_cpu``), and each launch is one op of its own, counted apart, with
    none of the interpreter's copies and reads counted; outside the block a CPU's tensors take torch's path."""
    code = """
import torch
from bench.gpu import count, interpreted_launches
from dsq_plugins.compressors import sign_codec
rows = torch.randn(3, 64)
step = lambda: sign_codec.signs_encoded(rows, rows.abs().sum(1), torch.ones(()))
with interpreted_launches():
    assert step() is not None  # (the first call's check, before the count)
    print(count(step, "cpu", 2))
assert step() is None
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = run_job([sys.executable, "-c", code], timeout=600, cwd=root,
                   env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root))
    assert done.returncode == 0, done.stderr[-4000:]
    row = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 - the dict the snippet printed
    assert row["triton"] == 1 and row["ops"] == 4 and row["host_reads"] == 0, row


def test_without_the_interpreter_a_cpu_takes_no_triton_kernel():
    from dsq_plugins.compressors import own_kernels
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with own_kernels.interpreted_on_cpu():
            pass
    assert not own_kernels.on_a_gpu(torch.zeros(1)) and own_kernels.device_index(torch.device("cpu")) == -1
