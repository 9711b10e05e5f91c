"""Adam's moments as two flat buffers: every parameter's ``exp_avg`` and
``exp_avg_sq`` are views of its part of one vector each, laid end to end
in the optimizer's order.

Why: after the freeze ``CompressedAdam`` forms u = (beta1·m + (1 - beta1)·g)
/ D, exchanges it and keeps m = u·D. Over a list of tensors each of those is
a multi-tensor op, which a GPU launches as a few kernels but a CPU still
runs tensor by tensor; and the exchange then reads the bucket tensor by
tensor too. Over one vector each is one op per param group, and the
exchange reads each bucket as one piece of it
(``DoubleSqueeze.reduce_flat``). torch's per-parameter ``state`` entries
stay where users and checkpoints look for them: they are the views.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Sequence

import torch

from ..layout import KeptBuffers


class FlatMoments:
    """The two moment vectors of ``params`` (one dtype and device), with the
    values ``state`` already held copied in and its entries made views."""

    def __init__(self, params: Sequence[torch.Tensor], state: dict[Any, dict[str, Any]]):
        first = params[0]
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        #: where each parameter starts, and the end
        self.offsets = list(itertools.accumulate([0] + self.numels))
        self.exp_avg = torch.zeros(self.offsets[-1], dtype=first.dtype, device=first.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.params = list(params)
        self._kept = KeptBuffers()
        self._kept_views: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for key, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            for p, view in zip(params, self.views(flat)):
                held = state[p].get(key)
                if held is not None:  # a resumed or earlier state: its values, now in the vector
                    view.copy_(held)
                state[p][key] = view
        self._marks = (state[params[0]]["exp_avg"], state[params[-1]]["exp_avg_sq"])

    @staticmethod
    def serves(params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` can share the vectors: dense, floating, of one dtype on one device."""
        if not params:
            return False
        first = params[0]
        return all(p.dtype == first.dtype and p.device == first.device and p.is_floating_point()
                   and p.layout == torch.strided for p in params)

    def holds(self, params: Sequence[torch.Tensor], state: dict[Any, dict[str, Any]]) -> bool:
        """Whether these vectors are ``params``' (the parameters that train
        may change: a layer frozen or unfrozen) and ``state``'s entries still
        their views (a ``load_state_dict`` replaces them); if not, the vectors
        are made again."""
        first, last = self._marks
        return (len(params) == len(self.params) and all(map(operator.is_, params, self.params))
                and state[params[0]].get("exp_avg") is first and state[params[-1]].get("exp_avg_sq") is last)

    def release(self, state: dict[Any, dict[str, Any]]) -> None:
        """Give every state entry that is still a view of these vectors a copy of its own (their
        parameters left them for new vectors), so that these can be freed, not held by a view."""
        for p in self.params:
            for key, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                held = state[p].get(key)
                if held is not None and held._base is flat:
                    state[p][key] = held.clone()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into the parameters' shapes (views, cut in one call: a
        hundred views cut in Python cost a GPU's host more than the step's
        launches); a kept ``scratch``'s are cut once (on a CPU)."""
        for buffer, views in self._kept_views.values():
            if buffer is flat:
                return views
        return self._cut(flat)

    def _cut(self, flat: torch.Tensor) -> list[torch.Tensor]:
        if 0 in self.numels:  # (torch's one call gives an empty parameter a fresh vector, not its shape)
            return [piece.view(shape) for piece, shape in zip(flat.split(self.numels), self.shapes)]
        return list(torch._C._nn.unflatten_dense_tensors(flat, self.params))

    def gathered(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``tensors`` (one per parameter, of its shape: the gradients) laid
        end to end in one vector of the moments' dtype, by one multi-tensor
        copy into a kept scratch's views, or one flattening call where there
        is no kept scratch (off a CPU), where a reshape per tensor cost the host
        a call each."""
        kept = self._kept.get("gradient", self.offsets[-1], self.exp_avg.device, self.exp_avg.dtype)
        if kept is None:  # (a gradient has its parameter's dtype, which is the moments')
            return torch._C._nn.flatten_dense_tensors(list(tensors))
        torch._foreach_copy_(self._views_of_kept("gradient", kept), list(tensors))
        return kept

    def span(self, at: slice) -> slice:
        """The elements of the parameters ``at`` (consecutive, as a param group's are)."""
        return slice(self.offsets[at.start or 0], self.offsets[at.stop])

    def scratch(self, role: str, dtype: torch.dtype) -> torch.Tensor:
        """A vector of the moments' size for ``role``, for what lives within
        one step: kept across steps on a CPU (a fresh one costs page faults
        worth several passes), fresh elsewhere (``layout.KeptBuffers``)."""
        numel, device = self.offsets[-1], self.exp_avg.device
        kept = self._kept.get(role, numel, device, dtype)
        if kept is None:
            return torch.empty(numel, dtype=dtype, device=device)
        self._views_of_kept(role, kept)
        return kept

    def _views_of_kept(self, role: str, kept: torch.Tensor) -> list[torch.Tensor]:
        """The parameters' views of ``role``'s kept scratch, cut when it was made."""
        held = self._kept_views.get(role)
        if held is None or held[0] is not kept:
            held = self._kept_views[role] = (kept, self._cut(kept))
        return held[1]
