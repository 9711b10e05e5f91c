"""The communicator over torch.distributed: gloo on CPU, nccl on GPUs (or any
backend with all_gather and all_to_all_single)."""
from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import torch
import torch.distributed as dist

from ..errors import PeerFailedError
from ._protocol import Communicator, joined


class TorchDistributedComm(Communicator):
    """Runs the protocol of ``comm.Communicator`` on a process group.

    Payloads move with ``all_to_all_single`` (variable splits) and
    ``all_gather``. On nccl every buffer lives on the current CUDA device;
    on other backends on the payload's device."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedComm needs torch.distributed.init_process_group() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._seq = itertools.count()
        #: the collective this comm is in, or last was in (named in an exchange's timeout error)
        self.current_collective: str | None = None

    @contextlib.contextmanager
    def _collective(self, kind: str) -> Iterator[None]:
        """Name the collective (for the exchange's timeout error) and turn the
        backend's failure of it (gloo's "connection closed by peer" when a
        rank died, NCCL's watchdog error) into a ``PeerFailedError`` naming it;
        the reducer's step then writes nothing."""
        self.current_collective = f"torch.distributed {kind} #{next(self._seq)} on {self.size} ranks"
        try:
            yield
        except RuntimeError as exc:  # torch.distributed.DistError is one
            first_line = (str(exc).splitlines() or [""])[0]
            raise PeerFailedError(f"{self.current_collective} failed on rank {self.rank}: another rank stopped or "
                                  f"the group broke ({type(exc).__name__}: {first_line})") from exc

    def _split(self, groups):
        """A torch.distributed group per entry of ``groups`` (every rank makes
        every group, in order, as ``new_group`` requires); this rank's."""
        to_global = (lambda r: r) if self.group is None else (lambda r: dist.get_global_rank(self.group, r))
        mine = None
        for members in groups:
            group = dist.new_group([to_global(r) for r in members])
            if self.rank in members:
                mine = group
        return TorchDistributedComm(mine)

    def _gather_headers(self, header):
        header = header.to(self.device)
        with self._collective("all_gather (headers)"):
            return _gather_into(header, self.size, self.group).cpu()

    def _alltoallv(self, send, recv_lens):
        send_lens = [int(p.numel()) for p in send]
        inp = joined([p.to(self.device) for p in send])  # rows of one batched encode move uncopied
        out = torch.empty(sum(recv_lens), dtype=torch.uint8, device=self.device)
        with self._collective("all_to_all_single"):
            dist.all_to_all_single(out, inp, output_split_sizes=recv_lens, input_split_sizes=send_lens,
                                   group=self.group)
        return list(out.split(recv_lens))

    def _allgather_equal(self, buf):
        buf = buf.to(self.device)
        with self._collective("all_gather"):
            return list(_gather_into(buf, self.size, self.group).unbind(0))  # each rank's payload, a row of one buffer


def _gather_into(tensor: torch.Tensor, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's 1-D ``tensor`` as the rows of one (size, numel) buffer,
    with no list of outputs to copy out of or stack. On nccl one collective
    into the buffer (torch's newer name for it where it has one); gloo's
    all-gather writes straight into the buffer's rows."""
    tensor = tensor.contiguous().reshape(-1)
    out = torch.empty(size, tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    if dist.get_backend(group) == "nccl":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), tensor, group=group)
    else:
        dist.all_gather(list(out.unbind(0)), tensor, group=group)
    return out
