"""The Horovod drop-in under Horovod Elastic (test_horovod_elastic.py):

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script DISCOVER --gloo --network-interface lo \
        python tests/workers/hvd_elastic_worker.py OUT_DIR SHRINK_FILE

``hvd.elastic.run`` with ``hvd.elastic.TorchState(model, optimizer)`` around
the drop-in, ``opt.on_reset`` registered. At step 6 rank 0 creates
SHRINK_FILE, after which the discovery script offers 2 slots instead of 3:
Horovod removes rank 2 at a commit and resets the others, whose next step
joins the new world (horovod_ext.elastic). Each remaining rank saves what
it saw to OUT_DIR/rank<r>.pt."""
import os
import signal
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.workers.hvd_contract_worker import build  # noqa: E402
from tests.workers.hvd_worker import local_backward, params_of  # noqa: E402

STEPS, SHRINK_AT = 20, 6


def die_inside(comm):
    """SIGKILL this worker at its second alltoall from now (inside a step)."""
    calls, original = {"n": 0}, comm._fused_alltoall

    def alltoall(header, payloads):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(header, payloads)
    comm._fused_alltoall = alltoall


def main(out_dir, shrink_file, mode="shrink"):
    import horovod.torch as hvd

    import horovod_ext as hx
    hvd.init()
    torch.set_num_threads(1)
    model, opt = build(hvd, hx)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    state.register_reset_callbacks([opt.on_reset])
    seen = []

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            if state.step == SHRINK_AT and mode == "shrink" and hvd.rank() == 0:
                open(shrink_file, "w").close()
            if state.step == SHRINK_AT and mode == "kill" and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
                die_inside(opt.comm)
            opt.zero_grad()
            local_backward(model, hvd.rank(), state.step, 1)
            opt.step()
            state.step += 1
            seen.append((state.step, hvd.size()))
            if mode == "shrink" and state.step >= SHRINK_AT and hvd.size() == 3:
                time.sleep(0.5)  # time for the discovery script to be asked again
            state.commit()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(state)
    results = {"rank": hvd.rank(), "size": hvd.size(), "seen": seen, "params": params_of(model),
               "steps": dict(opt.reducer.steps), "worlds": opt.worlds,
               "warnings": [str(w.message) for w in caught if "Horovod Elastic" in str(w.message)]}
    opt.close()
    torch.save(results, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
