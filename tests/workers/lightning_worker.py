"""Lightning's DDPStrategy with this library's hook, as a Lightning user
writes it (README, "PyTorch DDP"):

    torchrun --nproc_per_node 2 tests/workers/lightning_worker.py OUT_DIR

Lightning finds the ranks torchrun started and sets up gloo itself. Each
rank saves what it saw to OUT_DIR/rank{R}.pt for test_ddp.py."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsq_plugins.ddp as dsq_ddp  # noqa: E402
from examples.train_digits import make_model  # noqa: E402
from tests.helpers.launchers import save_and_leave  # noqa: E402
from tests.workers.hvd_worker import batches, params_of  # noqa: E402

STEPS = 12


def main(out_dir):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Digits(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(seed=1, hidden=32)
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    # each rank its own batches, as a distributed sampler gives (batch_size=None: as they are)
    data = torch.utils.data.DataLoader([batches(rank, step, 1)[0] for step in range(STEPS)], batch_size=None)
    state = dsq_ddp.HookState(compressor="sign", exact_steps=2)
    # on CPU ranks Lightning 2.6 ignores DDPStrategy(ddp_comm_hook=...): the callback registers the hook
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"),
                        callbacks=[dsq_ddp.lightning_callback(state)], max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    module = Digits()
    trainer.fit(module, train_dataloaders=data)
    results = {"iterations": state.iteration,
               "bytes": state.bytes_sent, "steps": dict(state.reducer.steps), "losses": module.losses,
               "params": params_of(module.net)}
    save_and_leave(results, out_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1])
