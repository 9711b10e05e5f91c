"""The one place a reducer's exchange is assembled from its passes: the
worker pass, the server pass, Algorithm 1 over them and, between hosts,
its two-level form."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._algorithm1 import Algorithm1
from ._server_pass import ServerPass
from ._two_level import TwoLevel
from ._worker_pass import WorkerPass

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..compressors import Compressor
    from ..layout import HostLayout


def build_exchange(comm: Communicator, algorithm_comm: Communicator, node_comm: Communicator | None, hosts: HostLayout,
                   compressors: tuple[Compressor, Compressor], pieces: tuple[Any, ...]
                   ) -> tuple[WorkerPass, ServerPass, Algorithm1, TwoLevel | None]:
    """(worker pass, server pass, Algorithm 1, the two-level exchange or
    None) of a reducer on ``comm``; Algorithm 1 runs on ``algorithm_comm``
    (among the hosts when two-level). ``pieces``: (config, state, seeds,
    fault hook, ownership)."""
    config, state, seeds, _, ownership = pieces
    worker = WorkerPass(algorithm_comm, compressors[0], *pieces)
    server = ServerPass(algorithm_comm, compressors, *pieces)
    algorithm = Algorithm1(algorithm_comm, worker, server, state, ownership, seeds, plans_agreed_on=comm)
    two_level = None if not hosts.two_level else TwoLevel(
        node_comm, algorithm if algorithm_comm.size > 1 else None, hosts, comm.rank, config.on_nonfinite)
    return worker, server, algorithm, two_level
