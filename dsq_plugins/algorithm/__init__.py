"""Algorithm 1 of DoubleSqueeze (Tang et al., ICML 2019) on a sharded server.

``arithmetic`` holds its equations on one vector; ``Algorithm1`` runs one
bucket's exchange over the worker pass (``WorkerPass``) and the server pass
(``ServerPass``); ``TwoLevel`` runs it between hosts, exact inside each;
``build_exchange`` assembles them for a reducer; ``aggregation`` is the
owner's rule; ``reference`` is the
plain central-server statement the sharded one equals bit for bit."""
from . import aggregation, arithmetic
from ._algorithm1 import Algorithm1, ServedPayloads
from ._build import build_exchange
from ._seeds import SERVER, WORKER, Seeds, shared_draw
from ._server_pass import ServerPass
from ._two_level import TwoLevel, host_groups
from ._worker_pass import WorkerPass
from .arithmetic import SERVER_SIDE, WORKER_SIDE

__all__ = ["SERVER", "SERVER_SIDE", "WORKER", "WORKER_SIDE", "Algorithm1", "Seeds", "ServedPayloads", "ServerPass",
           "TwoLevel", "WorkerPass", "aggregation", "arithmetic", "build_exchange",
           "host_groups", "shared_draw"]
