"""``front``: every method of the adam and ddp studies, test loss against bytes per step."""
from __future__ import annotations

import math


from ..runner import _run_ddp, chosen, launched, run_in_process
from ..tables import ratio, table
from .adam import ADAM_METHODS
from .ddp import DDP_METHODS

def front(args) -> tuple[list[str], dict]:
    """Test loss against bytes per step after the freeze, every method of the
    adam and ddp studies (their cached runs; any missing one is run): the
    loss-per-byte front, and where torch's PowerSGD sits on it."""
    runs = {f"{label} (in process)": [run_in_process(args.workers, seed, args, **kw) for seed in range(args.seeds)]
            for label, kw in chosen(ADAM_METHODS, args.methods)}
    runs.update(launched(args, DDP_METHODS, "ddp", _run_ddp)[1])  # every DDP row (--methods picks adam's)
    order = sorted(runs, key=lambda k: (math.isnan(ratio(runs[k][0])), ratio(runs[k][0])))  # diverged last
    baseline = next(k for k in runs if k.startswith("AdamW, exact"))
    return table({k: runs[k] for k in order}, baseline), runs
