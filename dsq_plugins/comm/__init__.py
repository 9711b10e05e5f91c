"""Transports the reducer talks to: the ``Communicator`` protocol (headers
first, so one rank's problem is every rank's error), torch.distributed, and
in-process ranks for tests and examples. ``header`` is the wire protocol's
header: its fields and what its statuses mean. ``sparse_mean`` moves a
sparse gradient exactly, its rows as they are."""
from . import header
from ._agreement import agree_on_settings
from ._local import LocalComm, LocalGroup
from ._math_library import initialise_vector_math
from ._protocol import Communicator, DeferredVerdict, joined, rows
from ._sparse import sparse_mean
from ._torch import TorchDistributedComm

__all__ = ["agree_on_settings", "Communicator", "LocalComm", "LocalGroup", "DeferredVerdict", "TorchDistributedComm",
           "header", "initialise_vector_math", "joined", "rows", "sparse_mean"]
