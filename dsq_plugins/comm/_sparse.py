"""The exact mean of a sparse gradient (``nn.Embedding(sparse=True)``'s),
its rows as they are.

A sparse gradient holds only the rows a batch touched, so it is small
already, and a compressor would first have to make it as large as the
whole table. So it travels as DDP's own allreduce moves it: every rank's
rows (indices and values) to every rank, in one all-gather whose headers
carry the sizes (which only the data decides: one host read, as any
sparse exchange has). Every rank sums the same payloads in rank order, so
the mean is the same on every rank; a rank whose values hold NaN or Inf
says so in its header's status, and a payload that cannot be read is the
same error on every rank."""
from __future__ import annotations

import math

import torch

from . import header
from ..errors import PayloadError
from ._protocol import Communicator

__all__ = ["sparse_mean"]


def sparse_mean(comm: Communicator, tensor: torch.Tensor, *, name: str) -> torch.Tensor:
    """The mean over ``comm``'s ranks of ``tensor``, a sparse COO tensor of
    the same size and dtype on every rank, as a coalesced sparse tensor of
    that size and dtype (summed in fp32). ``name`` tags the collective (a
    rank reducing another tensor is refused). Raises ``PeerStatusError``
    where a rank's values are not finite."""
    mine = tensor.coalesce()
    indices, values = mine.indices(), mine.values()
    status = header.OK if bool(torch.isfinite(values).all()) else header.NONFINITE
    payload = torch.cat([indices.contiguous().view(-1).view(torch.uint8),
                         values.contiguous().view(-1).view(torch.uint8)])
    tag = header.make_tag(f"{name}/sparse:{tuple(tensor.shape)}:{tensor.dtype}", tensor.shape[0])
    gathered = comm.allgather(payload.to(comm.device), tag=tag, status=status)
    parts = [_rows_of(piece.to(tensor.device), tensor, sender) for sender, piece in enumerate(gathered)]
    # (indices checked in _rows_of: torch's own check of them would be a second pass)
    summed = torch.sparse_coo_tensor(torch.cat([i for i, _ in parts], dim=1), torch.cat([v for _, v in parts]),
                                     tensor.shape, check_invariants=False).coalesce()
    return torch.sparse_coo_tensor(summed.indices(), (summed.values() / comm.size).to(tensor.dtype),
                                   tensor.shape, check_invariants=False, is_coalesced=True)


def _rows_of(payload: torch.Tensor, like: torch.Tensor, sender: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sender's (indices, fp32 values), checked: a whole number of rows, indices inside the table."""
    sparse_dim = like.sparse_dim()
    dense_shape = tuple(like.shape[sparse_dim:])
    row_bytes = 8 * sparse_dim + like.element_size() * math.prod(dense_shape)
    if payload.numel() % row_bytes:
        raise PayloadError(f"sparse gradient: rank {sender} sent {payload.numel()} bytes, not a whole number of "
                           f"{row_bytes}-byte rows", rank=sender)
    rows = payload.numel() // row_bytes
    indices = payload[:8 * sparse_dim * rows].clone().view(torch.int64).view(sparse_dim, rows)
    values = payload[8 * sparse_dim * rows:].clone().view(like.dtype).view(rows, *dense_shape).float()
    bounds = torch.tensor(like.shape[:sparse_dim], device=indices.device).view(-1, 1)
    if rows and bool(((indices < 0) | (indices >= bounds)).any()):
        raise PayloadError(f"sparse gradient: rank {sender} sent row indices outside {tuple(like.shape)}",
                           rank=sender)
    return indices, values
