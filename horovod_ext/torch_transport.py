"""The drop-in's payloads on a torch.distributed group of their own
(``DistributedOptimizer(..., transport="torch")``).

Why: every Horovod collective is negotiated by Horovod's background thread,
one coordination round per cycle, and the drop-in issues two per bucket. On
a loaded host those rounds, not the bytes, set the step time (the results
page measures it). A gloo group (NCCL for CUDA parameters) moves the same
payloads with no negotiation: the reducer already makes every rank issue
the same collectives in the same order.

The group is made beside Horovod, never instead of it: Horovod keeps its
own collectives (``broadcast_parameters``, ``broadcast_optimizer_state``,
the user's allreduces). If torch.distributed has no default group yet, one
is initialised over Horovod's ranks, through a store whose address rank 0
broadcasts over Horovod; the address is ``DSQ_RENDEZVOUS_ADDR`` where set,
else the host name horovodrun reached rank 0 by (``HOROVOD_HOSTNAME``),
else this host's name. ``torch.distributed.new_group`` is collective over
the default group, so every Horovod rank makes the optimizer, ranks outside
its process set too (they get the pass-through optimizer, as with
Horovod's transport)."""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

from dsq_plugins.errors import ConfigError

TRANSPORTS = ("horovod", "torch")


def rendezvous_address() -> str:
    """Where rank 0's store listens, as the other ranks should reach it."""
    return os.environ.get("DSQ_RENDEZVOUS_ADDR") or os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def _init_default_group(hvd) -> None:
    """torch.distributed's default group over Horovod's ranks (gloo)."""
    store, where = None, None
    if hvd.rank() == 0:  # port 0: the store picks a free port, which the broadcast then tells the others
        host = rendezvous_address()
        store = dist.TCPStore(host, 0, hvd.size(), is_master=True, wait_for_workers=False)
        where = (host, store.port)
    host, port = hvd.broadcast_object(where, root_rank=0, name="dsq.torch_transport.rendezvous")
    if store is None:
        store = dist.TCPStore(host, port, hvd.size(), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("dsq", store), rank=hvd.rank(), world_size=hvd.size())


def payload_group(process_set, cuda: bool) -> dist.ProcessGroup | None:
    """A new group of ``process_set``'s ranks for one optimizer's payloads
    (NCCL for CUDA parameters, else gloo); None on a rank outside the set.
    Collective: every Horovod rank calls it, in the same order."""
    import horovod.torch as hvd
    if not dist.is_available():
        raise ConfigError('transport="torch" needs torch.distributed, which this torch build lacks')
    # agreed over Horovod first, so that a rank whose torch.distributed disagrees fails every rank, not hangs them
    seen = hvd.allgather_object((dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None,
                                name="dsq.torch_transport.check")
    wrong = {rank: state for rank, state in enumerate(seen) if state != (rank, hvd.size())}
    if all(state is None for state in seen):
        _init_default_group(hvd)
    elif wrong:
        raise ConfigError(f'transport="torch": torch.distributed must be initialised on every Horovod rank with '
                          f"Horovod's rank and size, or on none (the optimizer then does it); Horovod ranks "
                          f"whose (torch rank, world size) differ: {wrong}")
    if process_set.ranks is None:
        raise ConfigError(f"{process_set} is not registered with Horovod (hvd.init(process_sets=...) or "
                          f"hvd.add_process_set), so its ranks are unknown")
    group = dist.new_group(ranks=sorted(process_set.ranks), backend="nccl" if cuda else "gloo")
    return group if process_set.included() else None
