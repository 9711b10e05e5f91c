"""Horovod Elastic with the drop-in: after a reset the world has another
size, and the error memories follow it.

    opt = hx.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                  compression=hx.Compression.doublesqueeze("sign"))
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
    state.register_reset_callbacks([opt.on_reset])

    @hvd.elastic.run
    def train(state): ...

A reset (a host left or came, a rank failed) re-initialises Horovod; the
drop-in's communicator, reducer and exchange thread belong to the old
world. ``on_reset`` (local, run by the surviving ranks) marks them stale;
a rank that joins afterwards starts stale too (``HOROVOD_ELASTIC``). At the
next step, before any gradient moves, every rank of the new world calls
``join_world``: one ``allgather_object`` of each rank's error state, then
a new communicator (named by the new world's number, the same on every
rank), a new reducer, and the state:

* the same ranks at the same size: each keeps its own;
* otherwise the states of the ranks that were there are resharded for the
  new size (``dsq_plugins.reshard(..., survivors=True)``): the mean of
  their worker errors, the server-error chunks of their owners. What a
  rank that left still owed leaves with it (a warning says which).

Horovod's own ``state.restore()`` after a failure loads the last committed
``opt.state_dict()``, which holds the error state too, before this runs.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from dsq_plugins import DoubleSqueeze
from dsq_plugins.errors import ConfigError
from dsq_plugins.state.reshard import reshard

from .comm import HorovodComm


def elastic_job() -> bool:
    """Whether this process is a worker of ``horovodrun --min-np/--max-np``."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def join_world(opt: Any) -> None:
    """Rebuild ``opt``'s exchange for the world Horovod is in now and carry
    the error state over; a collective of every rank (see the module)."""
    import horovod.torch as hvd
    if opt.transport != "horovod" or opt.process_set is not hvd.global_process_set:
        raise ConfigError("Horovod Elastic needs the drop-in on the global process set with transport='horovod'")
    old = opt.reducer.state_dict() if opt.reducer.steps else None
    gathered = hvd.allgather_object((old, opt.worlds))
    opt.worlds = max(worlds for _, worlds in gathered) + 1
    comm = HorovodComm(hvd.global_process_set, prefix=f"dsq.elastic.w{opt.worlds}")
    reducer = DoubleSqueeze(comm, config=opt.compression.config)
    states = [state for state, _ in gathered if state is not None]
    if states:
        same = all(state is not None and (state["rank"], state["size"]) == (rank, comm.size)
                   for rank, (state, _) in enumerate(gathered))
        if same:
            reducer.load_state_dict(gathered[comm.rank][0])
        else:
            size = states[0]["size"]
            lost = sorted(set(range(size)) - {state["rank"] for state in states})
            warnings.warn(f"Horovod Elastic: DoubleSqueeze error state of {len(states)} of {size} ranks resharded "
                          f"for {comm.size}" + (f"; what rank(s) {lost} still owed is lost" if lost else ""),
                          stacklevel=2)
            reducer.load_state_dict(reshard(states, comm.size, survivors=True)[comm.rank])
    opt.install(comm, reducer)
