"""dsq_plugins: DoubleSqueeze, error-compensated gradient compression on both
passes of a sharded parameter-server exchange, for any torch collective.

    import dsq_plugins as dsq
    q = dsq.get_compressor("sign")
    r = dsq.DoubleSqueeze(comm, compressor="sign")
    avg = r.reduce("grad", tensor)

The engine's rooms, each a sub-package with its own ``__all__``:
``compressors`` (the operators and their wire formats), ``comm`` (transports),
``layout`` (buckets and chunks), ``state`` (error memories, checkpoints,
reshard), ``step`` (how a step ends), ``algorithm`` (Algorithm 1, its passes
and its reference), ``optim`` (CompressedAdam, LocalSteps), ``testing`` (fault
injection). Frontends: ``reducer`` (DoubleSqueeze), ``replicated`` (for
dense-allreduce engines), ``overlap`` (exchanges beside backward), ``ddp``,
``fsdp`` (FSDP2 and HSDP).
"""
from .comm import Communicator, LocalGroup, TorchDistributedComm
from .compressors import COMPRESSORS, Compressor, Packet, get_compressor
from .config import ReducerConfig
from .errors import (
                     CollectiveMismatchError,
                     ConfigError,
                     DSQError,
                     NonFiniteGradientError,
                     PayloadError,
                     PeerFailedError,
                     StateError,
)
from .optim import CompressedAdam, LocalSteps
from .reducer import DoubleSqueeze
from .state import reshard

__version__ = "0.2.0"

__all__ = [
    "COMPRESSORS", "CollectiveMismatchError", "Communicator", "CompressedAdam", "Compressor", "ConfigError",
    "DSQError", "DoubleSqueeze", "LocalGroup", "LocalSteps", "NonFiniteGradientError", "Packet", "PayloadError",
    "PeerFailedError", "ReducerConfig", "StateError", "TorchDistributedComm", "get_compressor", "reshard",
]
