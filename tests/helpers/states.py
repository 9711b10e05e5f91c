"""Read error memories out of a state dict whatever their ``error_dtype``:
an int8 memory is stored as ``{"int8": codes, "scales": ...}``, so tests
that compare memories compare their decoded fp32 values."""
import torch

import dsq_plugins as dsq
from dsq_plugins.state import compact


def decoded(entry) -> torch.Tensor:
    """One memory's fp32 values (a tensor, or an int8 entry)."""
    return compact.load(compact.from_state("memory", entry)).clone()


def decoded_all(section: dict) -> dict:
    """``{name: fp32 values}`` of a ``worker_error``/``server_error`` section."""
    return {k: decoded(v) for k, v in section.items()}


def exact_reducer(comm, *args, **kw):
    """A ``DoubleSqueeze`` with fp32 memories, for the tests that compare it
    bit for bit with plain re-implementations of Algorithm 1 (which keep
    fp32 memories); the compact default rounds what they owe."""
    kw.setdefault("error_dtype", "fp32")
    return dsq.DoubleSqueeze(comm, *args, **kw)
