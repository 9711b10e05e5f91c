"""Lightning's ModelParallelStrategy (FSDP2) with dsq_plugins.fsdp, as a
Lightning user writes it (README, "FSDP2 and HSDP"): ``configure_model``
shards the blocks on the device mesh Lightning built, then wires the
compression; ``configure_optimizers`` returns any optimizer.

    torchrun --nproc_per_node 4 tests/workers/lightning_fsdp_worker.py OUT_DIR [hsdp|1d]

Each rank saves what it saw to OUT_DIR/rank{R}.pt for test_fsdp.py."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins.fsdp as dsq_fsdp  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402

STEPS = 8


def main(out_dir, kind):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 5))
            self.losses, self.compression = [], None

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]  # Lightning's (data_parallel, tensor_parallel) mesh
            if kind == "hsdp":  # 2 replicas x 2 shards, carved from the same ranks
                from torch.distributed.device_mesh import init_device_mesh
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
            self.compression = dsq_fsdp.compress(self.net, compressor="sign")

        def training_step(self, batch, _):
            self.losses.append(F.mse_loss(self.net(batch[0]), batch[1]))
            return self.losses[-1]

        def configure_optimizers(self):  # any optimizer: the exchange is in FSDP's backward
            return torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    data = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=g)
        data.append((x, x[:, :5] * 2))
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    strategy = ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1, process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    module = Regression()
    trainer.fit(module, train_dataloaders=loader)
    results = {"losses": [loss.item() for loss in module.losses], "backwards": module.compression.steps.applied,
               "bytes": module.compression.bytes_sent, "mesh": module.compression.roles.describe(),
               "locals": [p.to_local().detach().clone() for p in module.net.parameters()]}
    save_and_leave(results, out_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "hsdp")
