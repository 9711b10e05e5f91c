"""ZeRO stage 3's parameter pass between hosts, compressed: hpZ's secondary
partition is the replica that persists between steps.

With ``zero_hpz_partition_size`` = the ranks per host, DeepSpeed keeps a
second copy of the weights on each host, sharded over its ranks (local rank
l holds elements ``[l·A/L, (l+1)·A/L)`` of each parameter, A its aligned
size, L the ranks per host), and gathers from it inside the host. It
throws that copy away after every optimizer step, so the next forward
gathers every parameter across all hosts again.

Here the copy is kept and moved forward instead: after the step the owner
of each primary partition sends ``Q(master - replica)`` of it
(``DoubleSqueeze.all_gather``: exact inside a host, compressed between
hosts), and every rank adds what it decodes to the pieces of its
secondary partition, and the owner to its own copy of its partition's
replica.
The replica is then the same on every rank that holds it, the fp32
masters stay exact, and the gap between them is the owner's error memory,
carried by construction, as in the ZeRO-1/2 mapping. Forward and backward
compute with the replica. Parameters DeepSpeed keeps whole between uses
(``stage3_param_persistence_threshold``: small ones), which it gathers
again after each step from the primary partitions across all hosts, are
gathered from the moved secondary partitions instead, inside each host.

A pass is one reducer step: its updates are staged and written only when
it went through on every rank; a failure is the same error everywhere and
leaves the replicas as they were. Each group moves in pieces of about the
reducer's ``bucket_mb``, so a rank holds one piece's decoded rows at a time
and stages only the rows it adds (its own and its secondary partition's:
1/L of the model in fp32), not every group's whole vector. DeepSpeed
dropping the copy outside a step (loading a checkpoint) is left to
DeepSpeed: its next forward gathers the weights exactly and the replicas
start again from them.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from dsq_plugins import DoubleSqueeze
from dsq_plugins.step import Plan

from . import patches
from .zero import SECTION
from .zero3_layout import Zero3Layout, layout_of, names_of

log = logging.getLogger("dsq_plugins")


class SecondaryReplicas:
    """The compressed parameter pass of a stage-3 optimizer whose hpZ groups
    are its hosts (``Zero3Compression`` builds it where they are)."""

    def __init__(self, optimizer: Any, reducer: DoubleSqueeze, names: dict[int, str]):
        self.optimizer, self.reducer = optimizer, reducer
        self.size, self.rank = reducer.comm.size, reducer.comm.rank
        self.per_host = int(optimizer.zero_hpz_partition_size)
        self.hosts = self.size // self.per_host
        #: the primary partitions this rank's secondary partition is made of: rows [first, first + hosts)
        self.first = (self.rank % self.per_host) * self.hosts
        self.layouts = [self._layout(group, names) for group in optimizer.fp16_groups]
        #: what one all-gather moves: a run of one group's parameters of about the reducer's bucket size, so that
        #: the decoded rows held at once are a bucket's, not a whole sub-group's
        self.pieces = [piece for i, group in enumerate(optimizer.fp16_groups)
                       for piece in self._pieces(i, group, names, reducer.config.bucket_mb)]
        self.plan = Plan([(piece.layout.name, piece.layout.size * piece.layout.width) for piece in self.pieces])
        #: this rank's replica of its own primary partitions, per group (None: taken at the next step)
        self.replicas: list[torch.Tensor] | None = None
        self._due = False  # inside an optimizer step: its end moves the replicas
        self._moved = False  # this step's pass went through: DeepSpeed's drop of the copy is skipped
        self._said_missing = False
        step = patches.on(optimizer, "step", lambda *a, **kw: self._step(step.previous, *a, **kw))
        post = patches.on(optimizer, "_post_step", lambda *a, **kw: self._post_step(post.previous, *a, **kw))
        drop = patches.on(optimizer, "invalidate_secondary_tensor", lambda: self._after_step(drop.previous))

    def _layout(self, params: list, names: dict[int, str]) -> Zero3Layout:
        """Parameters' primary partitions laid out by rank, as the gradients' buckets are."""
        return layout_of(params, names_of(params, names), self.size, kind="params")

    def _pieces(self, i: int, group: list, names: dict[int, str], bucket_mb: float) -> list["Piece"]:
        """Group ``i`` cut at parameter boundaries into runs whose gathered
        vector is at most ``bucket_mb`` of fp32 (a larger parameter alone)."""
        limit, offsets = max(1, int(bucket_mb * 2**20 / 4)), self.layouts[i].offsets() + [self.layouts[i].width]
        pieces, first = [], 0
        for end in range(1, len(group) + 1):
            if end == len(group) or (offsets[end + 1] - offsets[first]) * self.size > limit:
                pieces.append(Piece(i, group[first:end], self._layout(group[first:end], names), offsets[first]))
                first = end
        return pieces

    def _step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        opt = self.optimizer
        if self.replicas is None:  # the weights every secondary partition was last built from
            self.replicas = [flat.detach().clone() for flat in opt.fp16_partitioned_groups_flat]
        self._due = True
        try:
            return original(*args, **kwargs)
        finally:
            self._due = False

    def _post_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """The end of a step that went through: the replicas move, and the
        parameters kept whole are gathered from them inside each host before
        DeepSpeed would gather them across hosts (it skips what is gathered)."""
        if self._due and self._all_have_a_replica():
            self.move_replicas()
            self._moved = True
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
            kept = [p for p in self.optimizer.persistent_parameters if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            if kept:
                kept[0].all_gather_coalesced(kept).wait()
        return original(*args, **kwargs)

    def _after_step(self, drop: Any) -> None:
        """DeepSpeed drops the secondary copy at a step's end, where ours has
        moved it instead. Elsewhere (a step whose pass could not run, a
        checkpoint's save or load) it drops it, and the replicas restart from
        the exact weights it gathers next."""
        if self._moved:
            self._moved = False
            return
        drop()
        self.replicas = None

    def _all_have_a_replica(self) -> bool:
        """Whether every parameter has its secondary partition (the same on
        every rank: DeepSpeed makes it when it first releases a parameter);
        if not, this step's pass is DeepSpeed's, exact, said once."""
        missing = [p.ds_id for group in self.optimizer.fp16_groups for p in group if p.ds_secondary_tensor is None]
        if missing and not self._said_missing:
            log.warning("%s: parameters %s have no hpZ secondary partition yet; their replicas restart from the "
                        "weights DeepSpeed gathers next, exactly", SECTION, missing[:8])
            self._said_missing = True
        return not missing

    def move_replicas(self) -> None:
        """The parameter pass: every piece's ``Q(master - replica)``, gathered;
        then, once it went through on every rank, every copy moved by it."""
        opt, staged = self.optimizer, []
        with self.reducer.step(self.plan):  # a reducer that defers verdicts judges the pass once, at its end
            for piece in self.pieces:
                layout, columns = piece.layout, slice(piece.start, piece.stop)
                master = opt.fp32_partitioned_groups_flat[piece.group].detach()[columns]
                delta = master.float() - self.replicas[piece.group][columns].float()
                padding = piece.padding = None if piece.padding is None else piece.padding.to(delta.device)
                if padding is not None:  # DeepSpeed leaves a last partition's padding unwritten: none of it is sent
                    delta.masked_fill_(padding[self.rank], 0.0)
                rows = self.reducer.all_gather(layout.name, delta, layout.size * layout.width,
                                               error_feedback=False).view(layout.size, layout.width)
                if padding is not None:  # and what decodes there (sign(0) is not 0) is not added
                    rows.masked_fill_(padding, 0.0)
                staged.append(self._rows_used(piece, rows))
        for piece, (own, secondary) in zip(self.pieces, staged):
            _add_(self.replicas[piece.group][piece.start:piece.stop], own)
            for param, update in secondary:
                _add_(param.ds_secondary_tensor, update)

    def _rows_used(self, piece: "Piece", rows: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Of a piece's gathered update (a row per owner), what this rank adds:
        its own row, and each parameter's part of this rank's secondary
        partition (copies: the whole gathered rows are not kept)."""
        block = rows[self.first: self.first + self.hosts]
        secondary = [(param, block[:, at:at + part].reshape(-1).clone())
                     for param, part, at in zip(piece.params, piece.layout.partitions, piece.layout.offsets())]
        return rows[self.rank].clone(), secondary


class Piece:
    """A run of one group's parameters that one all-gather moves: their
    layout by rank, where their partitions lie in the group's flat partition
    (``start``, ``stop``), and where each owner's row holds no element."""

    def __init__(self, group: int, params: list, layout: Zero3Layout, start: int):
        self.group, self.params, self.layout = group, params, layout
        self.start, self.stop = start, start + layout.width
        self.padding = _padding_rows(layout)


def _add_(replica: torch.Tensor, update: torch.Tensor) -> None:
    """``replica += update`` in fp32, rounded to the replica's dtype: the same
    bits wherever the same replica takes the same update."""
    replica.copy_(replica.float().add_(update).to(replica.dtype))


def _padding_rows(layout: Zero3Layout) -> torch.Tensor | None:
    """(ranks, width) bool: where each owner's row holds no element of a
    parameter (its last partition's padding), or None if nowhere."""
    rows = [layout.padding(rank, torch.device("cpu")) for rank in range(layout.size)]
    if all(row is None for row in rows):
        return None
    return torch.stack([torch.zeros(layout.width, dtype=torch.bool) if row is None else row for row in rows])
