"""dsq_plugins: DoubleSqueeze, error-compensated gradient compression on both
passes of a sharded parameter-server exchange, for any torch collective.

    import dsq_plugins as dsq
    q = dsq.get_compressor("sign")
    r = dsq.DoubleSqueeze(comm, compressor="sign")
    avg = r.reduce("grad", tensor)
"""
from . import math_library
from .adam import CompressedAdam
from .aggregation import AGGREGATORS, get_aggregator, is_robust, register_aggregator
from .bucketing import Bucket, plan_buckets
from .comm import Communicator
from .compressors import COMPRESSORS, Compressor, Packet, get_compressor
from .config import ReducerConfig
from .errors import (AdamCompressionWarning, CollectiveMismatchError, ConfigError, DSQError, ErrorFeedbackWarning,
                     LayoutError, NonFiniteGradientError, PayloadError, PeerFailedError, PeerStatusError, StateError)
from .faults import FaultSpec
from .local_group import LocalComm, LocalGroup
from .memory import ErrorMemory
from .reducer import DoubleSqueeze, chunk_bounds
from .replicated import ReplicatedDoubleSqueeze
from .reshard import reshard
from .step import Step
from .torch_comm import TorchDistributedComm

__version__ = "0.2.0"

math_library.initialise_vector_math()  # before any thread of ours uses it: see math_library

__all__ = [
    "AGGREGATORS", "AdamCompressionWarning", "Bucket", "COMPRESSORS", "CollectiveMismatchError", "Communicator",
    "CompressedAdam", "Compressor", "ConfigError",
    "DSQError", "DoubleSqueeze", "ErrorFeedbackWarning", "ErrorMemory", "FaultSpec", "LayoutError", "LocalComm",
    "LocalGroup", "NonFiniteGradientError", "Packet", "PayloadError", "PeerFailedError", "PeerStatusError",
    "ReducerConfig", "ReplicatedDoubleSqueeze", "StateError", "Step", "TorchDistributedComm", "chunk_bounds",
    "get_aggregator", "get_compressor", "is_robust", "plan_buckets", "register_aggregator", "reshard",
]
