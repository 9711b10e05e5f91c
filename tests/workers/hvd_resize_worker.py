"""The Horovod drop-in resumed at another world size (test_horovod_contract.py):

    horovodrun -np 2 -H localhost:2 python tests/workers/hvd_resize_worker.py OUT_DIR save CKPT
    horovodrun -np 3 -H localhost:3 python tests/workers/hvd_resize_worker.py OUT_DIR load CKPT

``save`` trains 3 steps and writes each rank's ``opt.state_dict()`` (and
the model) to CKPT/rank<r>.pt; ``load`` reads every rank's file, loads its
own part of ``dsq.reshard(old, hvd.size())`` and trains 2 more steps. Each
rank saves what it saw to OUT_DIR/rank<r>.pt."""
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins as dsq  # noqa: E402
from tests.workers.hvd_contract_worker import build, train  # noqa: E402
from tests.workers.hvd_worker import params_of  # noqa: E402


def main(out_dir, mode, ckpt):
    import horovod.torch as hvd

    import horovod_ext as hx
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    model, opt = build(hvd, hx)
    if mode == "save":
        train(model, opt, rank, range(3))
        os.makedirs(ckpt, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(ckpt, f"rank{rank}.pt"))
        results = {"state": opt.state_dict()["doublesqueeze"]}
    else:
        old = [torch.load(path) for path in sorted(glob.glob(os.path.join(ckpt, "rank*.pt")))]
        model.load_state_dict(old[0]["model"])
        opt.load_state_dict(dsq.reshard([o["optimizer"] for o in old], size)[rank])
        results = {"state": opt.state_dict()["doublesqueeze"]}
        train(model, opt, rank, range(3, 5))
        results["params"] = params_of(model)
    opt.close()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
