"""Ranks that must run with the same settings check that they do, once.

A setting that differs between ranks (one rank's compressor is sign, the
other's top-k; top-k keeping one element in a hundred against one in ten)
shows otherwise only as payloads of the wrong length, or not at all. So before its first exchange a reducer
gathers every rank's settings, written out as text, in one small
all-gather; every rank then holds the same table and raises the same
``ConfigError``, naming each setting that differs and each rank's value.

This once-per-run exchange is control traffic, not the gradient's: it is
left out of ``bytes_sent`` and ``bytes_received``, which count what a step
moves.
"""
from __future__ import annotations

import json

import torch

from ..errors import ConfigError
from ._protocol import Communicator

__all__ = ["agree_on_settings"]

#: the header tag of the settings' all-gather
SETTINGS_TAG = 0x5E77


def agree_on_settings(comm: Communicator, settings: dict[str, str], what: str) -> None:
    """Raise the same ``ConfigError`` on every rank of ``comm`` unless every
    rank passed the same ``settings`` (name -> value as text). ``what``
    names the owner of the settings in the message."""
    if comm.size == 1:
        return
    text = json.dumps(settings, sort_keys=True).encode()
    payload = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(comm.device)
    with comm.uncounted():
        gathered = comm.allgather(payload, tag=SETTINGS_TAG)
    tables = [json.loads(bytes(g.cpu().tolist()).decode()) for g in gathered]
    differing = sorted({name for table in tables for name in table if any(t.get(name) != tables[0].get(name)
                                                                           for t in tables)})
    if differing:
        lines = "; ".join(f"{name}: " + ", ".join(f"rank {r} has {t.get(name, '(unset)')}"
                                                  for r, t in enumerate(tables)) for name in differing)
        raise ConfigError(f"the ranks' {what} settings differ, and every rank must run the same: {lines}")

