"""Error-feedback memory: what compression dropped, per named buffer, kept in
fp32 whatever the gradient dtype (an fp16 memory would itself round away the
small residuals error feedback exists to keep).

Each step builds a buffer's next value in a new tensor and writes it only
when the whole step succeeded, so old and new coexist during a step. On a
CPU a fresh tensor of a gradient's size costs a page fault per 4 KiB on
first touch (48 MB: 15 ms against 2.5 ms to overwrite one, on this project's
machine), so the buffer a successful step replaced is kept as ``scratch``
for the next step to build in. Only buffers the memory alone holds
(``set(..., private=True)``) are kept, and only on a CPU: on an accelerator
the caching allocator makes a fresh tensor cheap, and a kept one would take
memory from activations."""
from __future__ import annotations

import torch

from .errors import StateError


class ErrorMemory:
    """A dict of fp32 error buffers, created as zeros on first use."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._private: set[str] = set()         # names whose buffer nothing outside holds
        self._spare: dict[str, torch.Tensor] = {}  # the buffer the last ``set`` replaced, to build in

    def get(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """The buffer for ``name`` (zeros if new), to read during one step:
        once a later ``set`` replaced it, it may be recycled. A stored buffer of another
        size means the layout changed under the same name: refuse, rather than
        add a stale residual to the wrong elements."""
        buf = self._buffers.get(name)
        if buf is None:
            return torch.zeros(numel, dtype=torch.float32, device=device)
        if buf.numel() != numel:
            raise StateError(f"error memory {name!r} holds {buf.numel()} elements but the tensor now has {numel}; "
                             f"the bucket layout changed (load a matching checkpoint or call reset())")
        if buf.device != device:
            buf = self._buffers[name] = buf.to(device)
        return buf

    def __contains__(self, name: str) -> bool:
        return name in self._buffers

    def set(self, name: str, value: torch.Tensor, *, private: bool = False) -> None:
        """Store ``value`` for ``name``; ``private``: nothing else holds it,
        so once replaced it may be recycled by ``scratch``."""
        old = self._buffers.get(name)
        if old is not None and name in self._private and old.device.type == "cpu" \
                and old.data_ptr() != value.data_ptr():
            self._spare[name] = old
        self._buffers[name] = value.detach().to(torch.float32)
        if private:
            self._private.add(name)
        else:
            self._private.discard(name)

    def scratch(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """An uninitialised fp32 buffer of ``numel`` elements to build
        ``name``'s next value in: the one the last ``set`` replaced when it
        fits, else a new one. Taking it hands it over (it is not kept twice)."""
        device = torch.device(device)
        spare = self._spare.pop(name, None)
        if spare is not None and spare.numel() == numel and spare.device == device:
            return spare
        return torch.empty(numel, dtype=torch.float32, device=device)

    def reset(self) -> None:
        self._buffers.clear()
        self._private.clear()
        self._spare.clear()

    def norm(self) -> float:
        """L2 norm over all buffers (a health signal to log)."""
        return float(sum(float(b.double().pow(2).sum()) for b in self._buffers.values()) ** 0.5)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self._buffers.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise StateError(f"error memory {name!r}: expected a tensor, got {type(value).__name__}")
        self._buffers = {k: v.detach().to(torch.float32).clone() for k, v in state.items()}
        self._private = set(self._buffers)  # clones of the state: nobody else holds them
        self._spare.clear()
