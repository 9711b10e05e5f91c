"""Set up torch's vector math library (MKL VML on x86 CPU builds) once,
from one thread, before several threads use it.

MKL VML initialises itself on first use. When several threads make that
first call at the same moment, a thread can be left with a low-accuracy
kernel for the rest of its life: measured here, ``torch.sqrt`` on float32
then returns values off by up to 1e-4 relative, in about 1 run in 30 with
16 threads starting together on a loaded CPU, and in none of 150 runs once
one call had been made first. Such a thread silently breaks "every rank
computes the same bits" (``LocalGroup``'s rank threads, an engine's
exchange thread beside the training loop), so every place that starts
threads of ours (``LocalGroup.run``, the background runners) makes that
first call before it starts them."""
from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_ready = False


def initialise_vector_math() -> None:
    """Make the math library's first calls here, once per process (cheap:
    a few operations on 64 elements). Idempotent and thread-safe."""
    global _ready
    if _ready:
        return
    with _lock:
        if _ready:
            return
        for dtype in (torch.float32, torch.float64):
            x = torch.linspace(0.5, 2.0, 64, dtype=dtype)
            x.sqrt(), x.exp(), x.log()
        _ready = True
