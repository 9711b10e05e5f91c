"""What a reducer keeps between steps: the error memories (stored as
``error_dtype`` by ``compact``), the step counters, what one exchange stages
for them, the checkpoint format, and ``reshard`` to another world size."""
from . import compact
from ._memory import ErrorMemory
from ._reducer_state import MEMORIES, STATE_VERSION, ReducerState, StagedUpdate
from .reshard import reshard

__all__ = ["MEMORIES", "STATE_VERSION", "ErrorMemory", "ReducerState", "StagedUpdate", "compact", "reshard"]
