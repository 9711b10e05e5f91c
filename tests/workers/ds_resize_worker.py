"""A DeepSpeed checkpoint (the doublesqueeze section, stage 0) saved at one
world size and loaded at another:

    deepspeed --num_gpus 2 tests/workers/ds_resize_worker.py OUT_DIR save --ckpt DIR
    deepspeed --num_gpus 3 tests/workers/ds_resize_worker.py OUT_DIR load --ckpt DIR

Each rank saves its results to OUT_DIR/rank{R}.pt."""
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.launchers import deepspeed_worker_parser, save_and_leave  # noqa: E402
from tests.workers.hvd_worker import params_of  # noqa: E402
from tests.workers.zero_worker import new_engine, train  # noqa: E402


def main(out_dir, mode, ckpt):
    import deepspeed_ext as dx
    torch.set_num_threads(1)
    section = {"compressor": "topk", "compressor_params": {"ratio": 0.1}, "overlap": False}
    engine, model = new_engine(dx, 0, section, {})
    rank = engine.global_rank
    results = {}
    if mode == "save":
        train(engine, rank, range(3))
        engine.save_checkpoint(ckpt, tag="three")
        results["state"] = engine.doublesqueeze.state_dict()
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.load_checkpoint(ckpt, tag="three")
        results["warnings"] = [str(w.message) for w in caught if "resharded" in str(w.message)]
        results["state"] = engine.doublesqueeze.state_dict()
        train(engine, rank, range(3, 5))
        results["params"] = params_of(model)
    save_and_leave(results, out_dir, rank)


if __name__ == "__main__":
    parser = deepspeed_worker_parser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--ckpt", required=True)
    cli = parser.parse_args()
    main(cli.out_dir, cli.mode, cli.ckpt)
