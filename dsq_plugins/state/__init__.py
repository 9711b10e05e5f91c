"""What a reducer keeps between steps: the error memories (stored as
``error_dtype`` by ``state.compact``), the step counters, the policy for a
state saved by another rank, what one exchange stages
for them, the checkpoint format, and ``reshard`` to another world size."""
from . import compact
from ._memory import ErrorMemory
from ._policy import OTHER_RANK_POLICIES, check_policy, is_own_state
from ._reducer_state import MEMORIES, STATE_VERSION, ReducerState, StagedUpdate
from .reshard import reshard

__all__ = ["MEMORIES", "OTHER_RANK_POLICIES", "STATE_VERSION", "ErrorMemory", "ReducerState", "StagedUpdate",
           "check_policy", "compact", "is_own_state", "reshard"]
