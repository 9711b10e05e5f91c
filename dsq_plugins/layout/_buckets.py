"""Fusing many named tensors into flat buckets for one exchange each.

The layout depends only on the names, shapes and the order they are given
in, so it is the same on every rank and the same at every step; a bucket's
name is derived from its contents, so error memory follows the layout and a
changed layout can never inherit a stale residual. ``layerwise=True`` gives
every tensor its own bucket: compression per layer rather than over the
whole model, which behaves differently (Dutta et al., AAAI 2020)."""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..compressors.base import check_float_tensor
from ..compressors.decoded import Decoded
from ..compressors.kernels import launch_bound
from ..errors import ConfigError, LayoutError

DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class Slot:
    """Where one named tensor sits in its bucket's flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """Tensors exchanged together; ``name`` keys their error memory."""

    name: str
    slots: tuple[Slot, ...]
    numel: int

    @functools.cached_property
    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each tensor, in order: what ``DoubleSqueeze.describe`` takes."""
        return [(slot.name, slot.shape) for slot in self.slots]

    def flatten(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's tensors as one flat fp32 vector (a view of a lone
        tensor when it can be; ``out``: a buffer of ``numel`` fp32 to fill)."""
        if len(self.slots) == 1:
            return tensors[0].detach().reshape(-1).to(torch.float32)
        return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors], out=out)

    def unflatten(self, flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Split a flat vector back into tensors shaped and typed as ``like``."""
        return [flat[s.offset: s.offset + s.numel].reshape(s.shape).to(t.dtype) for s, t in zip(self.slots, like)]

    def unflatten_into(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy a flat vector into the bucket's tensors (cast to their dtype); returns them.
        Where launches are the price (a GPU), one multi-tensor copy for them all."""
        pieces = [flat[s.offset: s.offset + s.numel].view(s.shape) for s in self.slots]
        if launch_bound(flat.device):
            torch._foreach_copy_(list(tensors), pieces)
        else:
            for t, piece in zip(tensors, pieces):
                t.copy_(piece)
        return list(tensors)


@dataclass(frozen=True)
class Pieces:
    """A bucket's tensors standing in for their flat vector. What the worker
    pass does first is g + error, into a buffer of its own; summed from the
    pieces, that pass reads each gradient once, where flattening first would
    read and write the whole bucket once more. ``flat()`` builds the vector
    for everything else. As the target of an in-place average, ``write``
    puts decoded chunks straight into them."""

    bucket: Bucket
    tensors: Sequence[torch.Tensor]

    def numel(self) -> int:
        return self.bucket.numel

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def flat(self) -> torch.Tensor:
        return self.bucket.flatten(self.tensors)

    def writable(self) -> bool:
        """Whether ``write`` can reach every element (contiguous tensors: views, not copies)."""
        return all(t.is_contiguous() for t in self.tensors)

    def write(self, decoded: Decoded, start: int) -> None:
        """Elements ``[start, start + decoded.numel)`` of the flat vector,
        written straight into the tensors (cast to their dtype): an in-place
        average needs no flat buffer and no copy out of it. Dense values where
        launches are the price (a GPU): one multi-tensor copy for every tensor
        the range covers."""
        covered = self._covered(start, start + decoded.numel)
        if decoded.positions is None and launch_bound(self.device):
            if covered:
                torch._foreach_copy_([target for target, _, _ in covered],
                                     [decoded.values[a: b] for _, a, b in covered])
            return
        for target, a, b in covered:
            if (a, b) == (0, decoded.numel):
                decoded.write_to_(target)
            else:
                decoded.write_range_to_(target, a)

    def _covered(self, start: int, end: int) -> list[tuple[torch.Tensor, int, int]]:
        """Each tensor's part of the flat range ``[start, end)``: (its elements there as a flat view,
        where they begin and end within the range)."""
        parts = []
        for s, t in zip(self.bucket.slots, self.tensors):
            lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
            if lo < hi:
                parts.append((t.detach().view(-1)[lo - s.offset: hi - s.offset], lo - start, hi - start))
        return parts

    def add(self, other: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``out = flat() + alpha · other`` (fp32). On a CPU slot by slot: the
        same values without the flat vector. Where launches are the price (a
        GPU), one batched copy of the tensors into ``out`` and one add: two
        launches however many tensors, for one more pass over the bucket."""
        if launch_bound(self.device):
            torch.cat([t.detach().reshape(-1) for t in self.tensors], out=out)
            return out.add_(other, alpha=alpha)
        for s, t in zip(self.bucket.slots, self.tensors):
            torch.add(t.detach().reshape(-1), other[s.offset: s.offset + s.numel], alpha=alpha,
                      out=out[s.offset: s.offset + s.numel])
        return out


class KeptBuffers:
    """Buffers kept across steps, by key, on a CPU (a fresh one costs page
    faults worth several passes, see ``memory``), for what lives within one
    step; elsewhere None (the caching allocator already recycles)."""

    def __init__(self) -> None:
        self._buffers: dict = {}

    def get(self, key: object, numel: int, device: torch.device, dtype: torch.dtype = torch.float32
            ) -> torch.Tensor | None:
        """The buffer kept for ``key`` (uninitialised; a new one when its size or dtype changed), or None off a CPU."""
        if device.type != "cpu":
            return None
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype)
        return buf


def write_decoded(out: torch.Tensor | Pieces, decoded: Decoded, start: int) -> None:
    """Elements ``[start, start + decoded.numel)`` of an average: into a flat buffer, or a bucket's tensors."""
    if isinstance(out, Pieces):
        out.write(decoded, start)
    else:
        decoded.write_to_(out[start: start + decoded.numel])


class Layouts:
    """``plan_buckets`` for one reducer's settings, each layout made once,
    found again by its names and shapes. Entries given as a tuple of
    (name, tuple of ints) pairs, as an optimizer keeps them, are looked up
    as they are, in one hash; any other form is normalised to that first,
    a pass in Python over every tensor's name and shape."""

    def __init__(self, bucket_mb: float, layerwise: bool):
        self.bucket_mb, self.layerwise = bucket_mb, layerwise
        self._made: dict[tuple, list[Bucket]] = {}

    def __call__(self, entries: Sequence[tuple[str, Sequence[int]]]) -> list[Bucket]:
        if type(entries) is tuple:
            try:
                found = self._made.get(entries)
            except TypeError:  # a shape given as a list: normalised below
                found = None
            if found is not None:
                return found
        key = tuple((n, tuple(s)) for n, s in entries)
        buckets = self._made.get(key)
        if buckets is None:
            buckets = self._made[key] = plan_buckets(key, self.bucket_mb, self.layerwise)
        return buckets


def plan_buckets(entries: Sequence[tuple[str, Sequence[int]]], bucket_mb: float = DEFAULT_BUCKET_MB,
                 layerwise: bool = False) -> list[Bucket]:
    """Greedy, order-preserving buckets of at most ``bucket_mb`` MiB of fp32
    (a larger tensor gets a bucket of its own)."""
    if bucket_mb <= 0:
        raise ConfigError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
    limit = max(1, int(bucket_mb * 2**20 / 4))
    groups: list[list[tuple[str, tuple[int, ...], int]]] = []
    size = 0
    seen: set[str] = set()
    for name, shape in entries:
        if name in seen:
            raise LayoutError(f"tensor name {name!r} appears twice in one bucketed reduction")
        seen.add(name)
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        if layerwise or not groups or size + numel > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape, numel))
        size += numel
    buckets = []
    for i, group in enumerate(groups):
        slots, offset = [], 0
        for name, shape, numel in group:
            slots.append(Slot(name, shape, offset, numel))
            offset += numel
        fingerprint = zlib.crc32(repr([(s.name, s.shape) for s in slots]).encode())
        span = slots[0].name if len(slots) == 1 else f"{slots[0].name}..{slots[-1].name}"
        label = slots[0].name if layerwise else f"bucket{i}[{span}]"
        buckets.append(Bucket(f"{label}#{fingerprint:08x}", tuple(slots), offset))
    return buckets


def input_problem(tensor: Any, where: str) -> Exception | None:
    """Why ``tensor`` cannot be reduced (a TypeError, to announce to every
    rank before it is raised), or None; what is not a tensor at all has no
    shape to announce, and is raised here, before any collective."""
    try:
        check_float_tensor(tensor, where)
    except TypeError as exc:
        if not isinstance(tensor, torch.Tensor):
            raise
        return exc
    return None


def length_problem(where: str, total: int, vector: torch.Tensor, out: torch.Tensor) -> Exception | None:
    """Why ``vector`` (the input) or ``out`` (an fp32 result) cannot hold a layout's ``total`` elements, or None."""
    for what, x in (("the vector", vector), ("out", out)):
        if x.numel() != total or (x is out and x.dtype != torch.float32):
            return ValueError(f"{where}: the entries hold {total} elements, {what} {x.numel()} {x.dtype}")
    return None


def flat_input(tensor: torch.Tensor, problem: Exception | None) -> torch.Tensor:
    """``tensor`` as a flat fp32 vector (a view where it can be), or zeros of its size when it has a problem."""
    return (tensor.detach().reshape(-1).to(torch.float32) if problem is None else
            torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device))
