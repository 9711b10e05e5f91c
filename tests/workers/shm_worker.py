"""DeepSpeed's start on the CPU accelerator and nothing else, for test_launchers.py:

    deepspeed --num_gpus 2 --master_port PORT tests/workers/shm_worker.py OUT_DIR

Each rank records which of DeepSpeed's shared-memory buffers for this job's port
exist once it has started, in OUT_DIR/rank{R}.pt."""
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.launchers import DEEPSPEED_SHM, deepspeed_worker_parser, save_and_leave  # noqa: E402

if __name__ == "__main__":
    args = deepspeed_worker_parser().parse_args()
    import deepspeed
    deepspeed.init_distributed("gloo")
    torch.distributed.barrier()  # every rank's buffer is made before any rank looks
    port = os.environ["MASTER_PORT"]
    seen = sorted(path for path in glob.glob(f"{DEEPSPEED_SHM}*") if path.rsplit("_", 2)[-2] == port)
    save_and_leave({"seen": seen}, args.out_dir, torch.distributed.get_rank())
