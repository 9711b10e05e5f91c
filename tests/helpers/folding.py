"""What the tests of an owner's folded mean (``algorithm._mean_of_payloads``) share: counting the
owners that fold, and a rank whose encoder writes NaN into its payloads' first word."""
from __future__ import annotations

import importlib

import torch

_NAN = torch.tensor([float("nan")]).view(torch.uint8)


def count_folds(monkeypatch) -> list:
    """A list that gets an entry for every ``mean_of_payloads`` an owner calls from now on."""
    server_pass = importlib.import_module("dsq_plugins.algorithm._server_pass")
    folded: list = []
    monkeypatch.setattr(server_pass, "mean_of_payloads",
                        lambda *a, _f=server_pass.mean_of_payloads: folded.append(1) or _f(*a))
    return folded


def write_nan_first(reducer) -> None:
    """``reducer``'s worker encodes as before, then writes NaN into each payload's first word
    (a scale; top-k's first value): what its owners must refuse."""
    q, encode = reducer.worker.q, reducer.worker.q.compress_chunks
    q.compress_chunks = lambda *a, **k: [p.index_copy_(0, torch.arange(4), _NAN) for p in encode(*a, **k)]
