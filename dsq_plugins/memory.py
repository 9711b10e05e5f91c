"""Error-feedback memory: what compression dropped, per named buffer, kept in
fp32 whatever the gradient dtype (an fp16 memory would itself round away the
small residuals error feedback exists to keep)."""
from __future__ import annotations

import torch

from .errors import StateError


class ErrorMemory:
    """A dict of fp32 error buffers, created as zeros on first use."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """The buffer for ``name`` (zeros if new). A stored buffer of another
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

    def set(self, name: str, value: torch.Tensor) -> None:
        self._buffers[name] = value.detach().to(torch.float32)

    def reset(self) -> None:
        self._buffers.clear()

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
