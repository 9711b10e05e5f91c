"""A DeepSpeed checkpoint saved at 2 ranks loads at 3: the per-rank
DoubleSqueeze files are resharded as they are read, keeping what the error
memories owe (the deepspeed launcher, CPU, gloo)."""
import torch

from tests.conftest import require
from tests.helpers.launchers import launch
from tests.test_reshard import owed


def test_a_checkpoint_saved_at_2_ranks_loads_at_3_with_its_compensation(tmp_path):
    require("deepspeed")
    ckpt = str(tmp_path / "ckpt")
    saved = launch("deepspeed", 2, "ds_resize_worker.py", "save", "--ckpt", ckpt, out_dir=str(tmp_path / "save"),
                   timeout=600)
    loaded = launch("deepspeed", 3, "ds_resize_worker.py", "load", "--ckpt", ckpt, out_dir=str(tmp_path / "load"),
                    timeout=600)
    before, after = owed([r["state"] for r in saved]), owed([r["state"] for r in loaded])
    assert before.keys() == after.keys() and before
    # within one rounding of the int8 memories (the default) they are loaded into
    assert all((after[k] - v).abs().max() <= 1e-2 * v.abs().max() for k, v in before.items())
    assert all(len(r["warnings"]) == 1 and "saved at 2 ranks, resharded for 3" in r["warnings"][0] for r in loaded)
    assert all(r["state"]["size"] == 3 for r in loaded)
    assert all(torch.equal(a, b) for a, b in zip(loaded[0]["params"], loaded[2]["params"]))
