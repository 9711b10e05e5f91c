"""The state a reducer keeps between steps, and its checkpoint format.

Everything that makes the next step depend on the last: the error memories
(``ErrorMemory``, one per role) and the step counters. It is written only
through ``write``, with what one bucket's exchange staged (``StagedUpdate``),
and only when the whole step succeeded (``step.StepScope``); ``state_dict`` is what a
checkpoint holds. Both reducers keep theirs here: the sharded
``DoubleSqueeze`` (all six memories) and ``ReplicatedDoubleSqueeze`` (worker
and server errors).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import StateError
from ._memory import ErrorMemory

log = logging.getLogger("dsq_plugins")

STATE_VERSION = 1
ERRORS = ("worker_error", "server_error")  # the memories ``error_dtype`` stores compactly

#: every memory a reducer may keep, by role
MEMORIES = (
    "worker_error",  # d_i: what this worker's compression dropped
    "server_error",  # d: what this owner's squeeze dropped, per served chunk
    "momentum",      # worker_momentum's running average
    "tracked",       # ef21: this worker's state h
    "replicas",      # ef21: each sender's state, replicated at the owners of a chunk
    "aggregates",    # a robust rule's last result per chunk (rules that start from it)
)


@dataclass
class StagedUpdate:
    """What one bucket's exchange will write when its step is applied."""

    name: str
    worker_error: torch.Tensor | None = None
    server_errors: dict[str, torch.Tensor] = field(default_factory=dict)  # by memory name (one per served chunk)
    momentum: torch.Tensor | None = None
    tracked: torch.Tensor | None = None                                    # ef21: this worker's state h
    replicas: dict[str, torch.Tensor] = field(default_factory=dict)       # ef21: the senders' states, as owner
    aggregates: dict[str, torch.Tensor] = field(default_factory=dict)     # rules that start from their last result
    operator: dict[str, torch.Tensor] = field(default_factory=dict)       # structured operators' warm starts


class ReducerState:
    """The memories named in ``memories`` (``MEMORIES`` by default) and the
    step counters. ``identity`` is what a saved state must match to be
    loaded here (``{"rank": r, "size": n}`` for a sharded reducer, since
    each rank owns its own chunks of the server error)."""

    def __init__(self, identity: dict[str, Any], memories: tuple[str, ...] = MEMORIES, owner: str = "DoubleSqueeze",
                 error_dtype: str = "fp32"):
        self.identity = dict(identity)
        self.error_dtype = error_dtype
        self.memories = {role: ErrorMemory(error_dtype if role in ERRORS else "fp32") for role in memories}
        #: structured operators' warm starts (``lowrank``'s last Q), by bucket, side and chunk
        self.operator: dict[str, torch.Tensor] = {}
        #: exchanges applied, by bucket name (the step number a payload's seed is drawn for)
        self.steps: dict[str, int] = {}
        self.skipped_steps = 0
        self._owner = owner

    def __getitem__(self, role: str) -> ErrorMemory:
        return self.memories[role]

    def nbytes(self) -> int:
        """Bytes the memories take as stored."""
        return sum(memory.nbytes() for memory in self.memories.values()) + sum(
            int(t.numel()) * t.element_size() for t in self.operator.values())

    def write(self, update: StagedUpdate) -> None:
        """Apply what one bucket of a successful step staged."""
        if update.momentum is not None:
            self["momentum"].set(update.name, update.momentum)
        if update.worker_error is not None:
            self["worker_error"].set(update.name, update.worker_error, private=True)  # residuals are fresh tensors
        for key, value in update.server_errors.items():
            self["server_error"].set(key, value, private=True)
        if update.tracked is not None:
            self["tracked"].set(update.name, update.tracked)
        for role in ("replicas", "aggregates"):
            for key, value in getattr(update, role).items():
                self[role].set(key, value)
        self.operator.update(update.operator)
        self.steps[update.name] = self.steps.get(update.name, 0) + 1

    def snapshot(self) -> Callable[[], None]:
        """A function that puts the memories and counters back as they are
        now (a step written before its verdict was read, then condemned)."""
        memories = {role: memory.snapshot() for role, memory in self.memories.items()}
        operator, steps, skipped = dict(self.operator), dict(self.steps), self.skipped_steps

        def restore() -> None:
            for role, saved in memories.items():
                self.memories[role].restore(saved)
            self.operator, self.steps, self.skipped_steps = dict(operator), dict(steps), skipped
        return restore

    def state_dict(self, **extra: Any) -> dict[str, Any]:
        """Memories and counters (and ``extra``, e.g. the operators used)."""
        out: dict[str, Any] = {"version": STATE_VERSION, **self.identity, **extra}
        out.update({role: memory.state_dict() for role, memory in self.memories.items()})
        out.update(steps=dict(self.steps), skipped_steps=self.skipped_steps,
                   operator={key: value.detach().cpu().clone() for key, value in self.operator.items()})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``: a ``StateError`` if it is incomplete, of
        another version, or saved by another rank or group size."""
        missing = {"version", *self.identity, "worker_error", "server_error", "steps"} - set(state)
        if missing:
            raise StateError(f"{self._owner} state_dict is missing {sorted(missing)}")
        if state["version"] != STATE_VERSION:
            raise StateError(f"{self._owner} state_dict version {state['version']} is not {STATE_VERSION}")
        if state.get("hosts") != self.identity.get("hosts"):
            raise StateError(f"{self._owner} state_dict was saved with the host layout {_layout(state)}; this "
                             f"reducer has {_layout(self.identity)} (the error memories are per host shard: load "
                             f"it at the same layout)")
        saved = {key: state[key] for key in self.identity}
        if saved != self.identity:
            raise StateError(f"{self._owner} state_dict was saved by {_describe(saved)}; this is "
                             f"{_describe(self.identity)} (server error is per chunk owner)")
        converted = set()
        for role, memory in self.memories.items():
            converted |= memory.load_state_dict(state.get(role, {}))
        if converted:
            log.warning("%s: error memories saved as %s were loaded as %s (converted)", self._owner,
                        "/".join(sorted(converted)), self.error_dtype)
        self.steps = {str(k): int(v) for k, v in state["steps"].items()}
        self.operator = {str(k): v.clone() for k, v in state.get("operator", {}).items()}
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _layout(identity: dict[str, Any]) -> str:
    hosts = identity.get("hosts")
    return "flat" if hosts is None else f"{hosts['hosts']} hosts x {hosts['per_host']} ranks (two-level)"


def _describe(identity: dict[str, Any]) -> str:
    if "size" in identity:
        return f"rank {identity.get('rank')} of {identity['size']}"
    return f"rank {identity.get('rank')}"
