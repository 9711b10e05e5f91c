"""The dsq communicator protocol over Horovod: int64 headers and uint8
payloads with ``hvd.allgather`` and ``hvd.alltoall`` (Horovod's allreduce
refuses uint8; these two accept it).

Horovod matches collectives across ranks by name; names here are a per-comm
prefix plus a sequence number, and every rank issues the same sequence (the
protocol makes every rank take the same branch), so names always agree."""
from __future__ import annotations

import itertools

import torch

from dsq_plugins.comm import Communicator

_instances = itertools.count()


class HorovodComm(Communicator):
    """A ``Communicator`` on a Horovod process set (the global one by default).

    Create it in the same order on every rank (the prefix is a counter)."""

    def __init__(self, process_set=None, prefix: str | None = None):
        super().__init__()
        import horovod.torch as hvd
        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self.device = torch.device("cpu")
        self.prefix = prefix or f"dsq{next(_instances)}"
        self._seq = itertools.count()

    def _name(self, kind: str) -> str:
        return f"{self.prefix}.{next(self._seq)}.{kind}"

    def _gather_headers(self, header):
        return self._hvd.allgather(header.unsqueeze(0), name=self._name("hdr"), process_set=self.process_set)

    def _alltoallv(self, send, recv_lens):
        splits = torch.tensor([int(p.numel()) for p in send], dtype=torch.int32)
        out, _ = self._hvd.alltoall(torch.cat(send), splits=splits, name=self._name("a2a"),
                                    process_set=self.process_set)
        return list(out.split(recv_lens))

    def _allgather_equal(self, buf):
        out = self._hvd.allgather(buf, name=self._name("ag"), process_set=self.process_set)
        return list(out.split(buf.numel()))
