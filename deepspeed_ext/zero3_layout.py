"""One ZeRO-3 bucket's parameters laid out by rank, as both stage-3 passes
exchange them: rank k's partitions of every parameter form chunk k."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["Zero3Layout", "layout_of", "names_of"]


@dataclass(frozen=True)
class Zero3Layout:
    """One bucket's parameters laid out by rank: rank k's partitions of every
    parameter, in bucket order, form chunk k of a vector of ``size`` chunks
    of ``width`` elements. Partition k of a parameter of ``numel`` elements
    is its elements ``[k·p, (k+1)·p)``, p = its partition size, padded with
    zeros past its end (DeepSpeed's partitioning)."""

    name: str                      # the bucket's error memory
    numels: tuple[int, ...]
    partitions: tuple[int, ...]    # each parameter's partition size
    size: int

    @property
    def width(self) -> int:
        """A chunk's elements: one partition of every parameter."""
        return sum(self.partitions)

    def offsets(self) -> list[int]:
        """Where each parameter's partition starts in a chunk."""
        out, at = [], 0
        for p in self.partitions:
            out.append(at)
            at += p
        return out

    def flatten(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The bucket's gradients as the (size · width) fp32 vector the exchange
        compresses: each parameter's whole partitions copied in as rows, its
        last, shorter one after them, and zeros past its end."""
        rows = torch.zeros(self.size, self.width, dtype=torch.float32, device=grads[0].device)
        for g, numel, part, at in zip(grads, self.numels, self.partitions, self.offsets()):
            if part == 0:  # an empty parameter
                continue
            g, whole = g.detach().reshape(-1), numel // part
            rows[:whole, at:at + part] = g[:whole * part].view(whole, part)
            if whole * part < numel:
                rows[whole, at:at + numel - whole * part] = g[whole * part:]
        return rows.reshape(-1)

    def padding(self, rank: int, device: torch.device) -> torch.Tensor | None:
        """Where rank ``rank``'s chunk holds no element of a parameter (a
        last partition's padding), or None: compression puts values there
        (sign(0) is not 0), which are zeroed so the masters' padding stays
        zero. Known from the sizes alone: nothing is read from the device."""
        real = [max(0, min(part, numel - rank * part)) for numel, part in zip(self.numels, self.partitions)]
        if real == list(self.partitions):
            return None
        mask = torch.zeros(self.width, dtype=torch.bool, device=device)
        for filled, part, at in zip(real, self.partitions, self.offsets()):
            mask[at + filled: at + part] = True
        return mask

    def partitions_of(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Rank k's chunk cut into its partition of each parameter."""
        return [chunk[at:at + part] for part, at in zip(self.partitions, self.offsets())]


def layout_of(params: Sequence[Any], names: Sequence[str], size: int, kind: str = "bucket") -> Zero3Layout:
    """The layout of a bucket of stage-3 parameters (``ds_numel``,
    ``partition_numel()``), named ``zero3.<kind>.<digest>`` by the
    parameters' names in the model: the same bucket keeps the same error
    memory every step, and in a run resumed from a checkpoint (DeepSpeed's
    ``ds_id`` counts parameters per process, not per model)."""
    digest = hashlib.blake2b(",".join(names).encode(), digest_size=6).hexdigest()
    return Zero3Layout(f"zero3.{kind}.{digest}", tuple(int(p.ds_numel) for p in params),
                       tuple(int(p.partition_numel()) for p in params), size)


def names_of(params: Sequence[Any], names: dict[int, str]) -> list[str]:
    """Each stage-3 parameter's name in the model (``names``: id -> name), or
    its ``ds_id`` where the model does not name it."""
    return [names.get(id(p), f"ds_id{p.ds_id}") for p in params]
