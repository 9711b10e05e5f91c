"""Read error memories out of a state dict whatever their ``error_dtype``:
an int8 memory is stored as ``{"int8": codes, "scales": ...}``, so tests
that compare memories compare their decoded fp32 values."""
import torch
import torch.nn.functional as F

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


def memories(reducer) -> dict:
    """A reducer's worker and server error memories, decoded, under one dict (server ones prefixed ``s.``)."""
    out = decoded_all(reducer.worker_error.state_dict())
    out.update({f"s.{k}": v for k, v in decoded_all(reducer.server_error.state_dict()).items()})
    return out


def poisoned_step(engine, batch, snapshot) -> tuple:
    """One DeepSpeed step on ``batch`` (a NaN in it on some rank): (the class
    name of what it raised, or None, whether ``snapshot()``, a tuple of
    tensor lists, tensor dicts and plain values, is what it was before)."""
    before = snapshot()
    x, y = batch
    try:
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        error = None
    except Exception as exc:  # noqa: BLE001 - the result under test
        error = type(exc).__name__
    return error, all(_same(a, b) for a, b in zip(before, snapshot()))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return a == b


def what_raises(call) -> tuple | None:
    """(the exception's class name, its message) if ``call()`` raises, else None: a worker's result."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the result under test
        return type(exc).__name__, str(exc)
    return None
