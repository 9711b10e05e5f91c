"""Error-feedback memory: what compression dropped, per named buffer, in
fp32 whatever the gradient dtype, or stored compactly (``dtype`` "bf16" or
"int8", see ``state.compact``) where its size matters more than its last bits.
Callers always read and write fp32.

Each step builds a buffer's next value in a new tensor and writes it only
when the whole step succeeded, so old and new coexist during a step. On a
CPU a fresh tensor of a gradient's size costs a page fault per 4 KiB on
first touch (several times what overwriting one costs), so the buffer a
successful step replaced is kept as ``scratch`` for the next step to build
in. Only buffers the memory alone holds
(``set(..., private=True)``) are kept, and only on a CPU: on an accelerator
the caching allocator makes a fresh tensor cheap, and a kept one would take
memory from activations. A compact memory keeps no spare per buffer: one
would undo what storing it compactly saves. It keeps one fp32 vector per
size instead (``set`` hands it the vector it just encoded): a bucket's size
recurs at every step, so its next step builds in that vector, and the spares
come to one bucket of each size, not one per buffer."""
from __future__ import annotations

import torch

from ..errors import ConfigError, StateError
from .compact import ERROR_DTYPES, Int8Blocks, Stored, dtype_of, from_state, load, nbytes, store, to_state


class ErrorMemory:
    """A dict of error buffers (fp32 to callers), created as zeros on first use."""

    def __init__(self, dtype: str = "fp32") -> None:
        if dtype not in ERROR_DTYPES:
            raise ConfigError(f"error_dtype must be one of {', '.join(ERROR_DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self._buffers: dict = {}
        self._private: set[str] = set()         # names whose buffer nothing outside holds
        self._spare: dict[str, torch.Tensor] = {}  # the buffer the last ``set`` replaced, to build in
        self._by_size: dict[int, torch.Tensor] = {}  # compact: a vector ``set`` encoded, by size, to build in

    def get(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """The buffer for ``name`` (zeros if new), to read during one step:
        once a later ``set`` replaced it, it may be recycled. A stored buffer of another
        size means the layout changed under the same name: refuse, rather than
        add a stale residual to the wrong elements."""
        return load(self.to_add(name, numel, device))

    def to_add(self, name: str, numel: int, device: torch.device) -> Stored:
        """``name``'s buffer as it is stored (fp32, bf16 or int8, ``state.compact``), or fp32
        zeros if new, for a caller that adds it to a vector: ``compact.added`` decodes an int8
        memory in the addition's own pass. Checked as ``get``."""
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

    def set(self, name: str, value: torch.Tensor | Stored, *, private: bool = False) -> None:
        """Store ``value`` for ``name``; ``private``: nothing else holds it,
        so once replaced it may be recycled by ``scratch``. A value already
        encoded (``compact.Int8Blocks``, a residual encoded as it was
        subtracted) is kept as it is by an int8 memory."""
        if isinstance(value, Int8Blocks):
            self._buffers[name] = value if self.dtype == "int8" else store(value.decode(), self.dtype)
            return
        if self.dtype != "fp32":
            self._buffers[name] = store(value, self.dtype)
            if private:
                self.recycle(value)
            return
        old = self._buffers.get(name)
        if old is not None and name in self._private and old.device.type == "cpu" \
                and old.data_ptr() != value.data_ptr():
            self._spare[name] = old
        self._buffers[name] = value.detach().to(torch.float32)
        if private:
            self._private.add(name)
        else:
            self._private.discard(name)

    def recycle(self, vector: torch.Tensor) -> None:
        """``vector`` is free (nothing reads it any more): a compact memory on a
        CPU keeps it to build in, as ``set`` keeps the vectors it encodes."""
        if self.dtype != "fp32" and _whole_cpu_vector(vector):
            self._by_size[vector.numel()] = vector

    def scratch(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """An uninitialised fp32 buffer of ``numel`` elements to build
        ``name``'s next value in: the one the last ``set`` replaced when it
        fits (a compact memory: a vector of that size it was handed), else a
        new one. Taking it hands it over (it is not kept twice)."""
        device = torch.device(device)
        spare = self._spare.pop(name, None) if self.dtype == "fp32" else self._by_size.pop(numel, None)
        if spare is not None and spare.numel() == numel and spare.device == device:
            return spare
        return torch.empty(numel, dtype=torch.float32, device=device)

    def snapshot(self) -> tuple:
        """What ``restore`` needs to put every buffer back as it is now: the
        buffers themselves, not copies (a step builds new ones; nothing
        writes a stored buffer in place), and the spares, which must not be
        built in while a snapshot may still be restored."""
        return dict(self._buffers), set(self._private), dict(self._spare), dict(self._by_size)

    def restore(self, snapshot: tuple) -> None:
        """Every buffer as it was at ``snapshot()``."""
        buffers, private, spare, by_size = snapshot
        self._buffers, self._private, self._spare, self._by_size = dict(buffers), set(private), dict(spare), \
            dict(by_size)

    def numel_of(self, name: str) -> int:
        return self._buffers[name].numel()

    def drop(self, name: str) -> None:
        """Forget ``name`` (its tensors' layout is gone)."""
        self._buffers.pop(name, None)
        self._private.discard(name)
        self._spare.pop(name, None)

    def reset(self) -> None:
        self._buffers.clear()
        self._private.clear()
        self._spare.clear()
        self._by_size.clear()

    def norm(self) -> float:
        """L2 norm over all buffers (a health signal to log)."""
        return float(sum(float(load(b).double().pow(2).sum()) for b in self._buffers.values()) ** 0.5)

    def nbytes(self) -> int:
        """Bytes the buffers take as stored (spares not counted)."""
        return sum(nbytes(b) for b in self._buffers.values())

    def numel(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def state_dict(self) -> dict:
        """Each buffer as stored: a tensor (fp32 or bf16) or an int8 entry (``state.compact.to_state``)."""
        return {k: to_state(v) for k, v in self._buffers.items()}

    def load_state_dict(self, state: dict) -> set[str]:
        """Restore ``state_dict()``, saved in any dtype; entries of another
        dtype are converted to this memory's. Returns the dtypes converted from."""
        stored = {name: from_state(name, value) for name, value in state.items()}
        converted = {dtype_of(v) for v in stored.values()} - {self.dtype}
        self._buffers = {k: v if dtype_of(v) == self.dtype else store(load(v), self.dtype) for k, v in stored.items()}
        self._private = set(self._buffers)  # clones of the state: nobody else holds them
        self._spare.clear()
        self._by_size.clear()
        return converted


def _whole_cpu_vector(t: torch.Tensor) -> bool:
    """Whether ``t`` is an fp32 CPU vector that is its whole storage (a view of a
    larger one could still be read through it elsewhere)."""
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())
