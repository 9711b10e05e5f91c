"""What a frontend does with a per-rank state saved by another rank or at
another world size: one named policy, chosen by each frontend.

Error memories are per rank (each rank owns a chunk of the server error), so
a state saved by another rank is not this rank's to load. What to do about
it depends on how the frontend's checkpoints are written:

* ``"raise"``: a ``StateError`` (``DoubleSqueeze``: the caller loads each
  rank's own state, or reshards them with ``dsq_plugins.reshard``);
* ``"keep"``: this rank keeps its own error memories, with a warning (torch
  optimizers whose checkpoint one rank writes: ``CompressedAdam``, the
  Horovod drop-in);
* ``"reshard"``: this rank keeps its own for now, silently, because the
  frontend restores every rank's part from its own per-rank files,
  resharded to this world size where it differs (the DeepSpeed engine).
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

from ..errors import ConfigError, StateError

__all__ = ["OTHER_RANK_POLICIES", "check_policy", "is_own_state"]

OTHER_RANK_POLICIES = ("raise", "keep", "reshard")


def check_policy(policy: Any) -> str:
    """``policy`` if it is one of ``OTHER_RANK_POLICIES``; else a ``ConfigError``."""
    if policy not in OTHER_RANK_POLICIES:
        raise ConfigError(f"the policy for another rank's state must be one of {OTHER_RANK_POLICIES}, "
                          f"got {policy!r}")
    return policy


def is_own_state(saved: Mapping[str, Any], *, rank: int, size: int, policy: str, owner: str) -> bool:
    """Whether ``saved`` (a per-rank state with ``rank`` and ``size``) was
    saved by this rank of a world of this size, so that it is to be loaded;
    otherwise what ``policy`` says: a ``StateError``, or False after a
    warning (``"keep"``) or silently (``"reshard"``)."""
    if saved.get("rank") == rank and saved.get("size", size) == size:
        return True
    where = f"rank {saved.get('rank')} of {saved.get('size')}; this is rank {rank} of {size}"
    if check_policy(policy) == "raise":
        raise StateError(f"{owner} state was saved by {where} (error memories are per rank)")
    if policy == "keep":
        warnings.warn(f"{owner} state holds the error memories of {where}, which keeps its own (error state is "
                      f"per rank: load each rank's own state to restore it)", stacklevel=3)
    return False
