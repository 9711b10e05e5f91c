"""The language-model workload: a small byte-level GPT trained on text that
ships with Python itself, the standard library's own sources. Nothing is
downloaded.

Data: the files in ``TRAIN_FILES`` (1.9 MB with CPython 3.11) are the
training text, the files in ``TEST_FILES`` (80 kB) the held-out text; each
file's bytes end with a newline and are concatenated in the listed order. The
list holds modules present in every CPython from 3.9 to 3.13; their contents
change between Python versions, so figures reproduce exactly on the same
Python (the README's come from 3.11.7). A training batch is ``batch``
windows of ``context + 1`` bytes at offsets drawn from a generator seeded by
(seed, rank, step); the test set is a fixed set of windows of the held-out
text.

Model: a GPT (Radford et al. 2019) with learned position embeddings, pre-layer
norm blocks of causal self-attention and a 4x MLP, and an untied output
layer; the default (2 layers, width 128, 4 heads, context 64) has 470,784
parameters. Initialised from a private generator, so in-process ranks
(threads) get identical weights without touching the global RNG.
"""
from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

TEST_FILES = ("textwrap.py", "heapq.py", "csv.py", "queue.py", "shlex.py")
TRAIN_FILES = (
    "argparse.py", "typing.py", "inspect.py", "pathlib.py", "dataclasses.py", "functools.py", "enum.py",
    "subprocess.py", "tarfile.py", "zipfile.py", "logging/__init__.py", "collections/__init__.py", "shutil.py",
    "tempfile.py", "threading.py", "difflib.py", "datetime.py", "ipaddress.py", "statistics.py", "random.py",
    "configparser.py", "pickle.py", "calendar.py", "fractions.py", "string.py", "bisect.py", "copy.py",
    "contextlib.py", "json/encoder.py", "json/decoder.py", "glob.py", "fnmatch.py", "weakref.py", "uuid.py",
    "pprint.py", "tokenize.py", "operator.py", "base64.py", "gettext.py", "optparse.py", "ast.py",
)
VOCAB = 256  # bytes


@lru_cache(maxsize=None)
def load_text(split: str) -> torch.Tensor:
    """The split's bytes as a 1-D int64 tensor ("train" or "test")."""
    lib = sysconfig.get_paths()["stdlib"]
    files = TRAIN_FILES if split == "train" else TEST_FILES if split == "test" else None
    if files is None:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    chunks = []
    for name in files:
        with open(os.path.join(lib, name), "rb") as f:
            data = f.read()
        chunks.append(data if data.endswith(b"\n") else data + b"\n")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).to(torch.int64)


@lru_cache(maxsize=None)
def load_words(split: str, vocab: int = 4096) -> torch.Tensor:
    """The split's text as word ids (a second LM, whose embedding rows are
    mostly rare): the same files as ``load_text``, cut into words, numbers
    and single punctuation marks; the ``vocab - 1`` commonest tokens of the
    training text keep an id each (by count, then alphabetically), every
    other token is id ``vocab - 1``."""
    import collections
    import re
    pattern = re.compile(rb"[A-Za-z_][A-Za-z_0-9]*|[0-9]+|\S")

    def tokens(which: str) -> list[bytes]:
        return pattern.findall(bytes(load_text(which).to(torch.uint8).tolist()))
    counts = collections.Counter(tokens("train"))
    kept = sorted(counts, key=lambda t: (-counts[t], t))[: vocab - 1]
    ids = {t: i for i, t in enumerate(kept)}
    return torch.tensor([ids.get(t, vocab - 1) for t in tokens(split)], dtype=torch.int64)


def batch(text: torch.Tensor, size: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random windows: inputs (size, context) and next-byte targets."""
    starts = torch.randint(len(text) - context - 1, (size,), generator=generator)
    windows = torch.stack([text[s: s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def train_batch(seed: int, rank: int, step: int, size: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: the same on every engine and launcher."""
    gen = torch.Generator().manual_seed(1_000_003 * seed + 7919 * step + rank)
    return batch(load_text("train"), size, context, gen)


@lru_cache(maxsize=None)
def test_batches(context: int, windows: int = 512, size: int = 128) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The fixed held-out windows, in batches."""
    gen = torch.Generator().manual_seed(12345)
    text = load_text("test")
    return tuple(batch(text, size, context, gen) for _ in range(windows // size))


@dataclass(frozen=True)
class GPTConfig:
    context: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4
    vocab: int = VOCAB  # bytes; a word-level model (``load_words``) sets its vocabulary's size


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level GPT; ``forward(idx)`` gives logits (batch, time, 256)."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # GPT-2's initialisation, residual projections scaled by depth
            for name, p in self.named_parameters():
                if name.endswith("bias") or ".ln" in name or name.startswith("ln"):
                    p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
                else:
                    std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats per byte."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def test_loss(model: nn.Module) -> float:
    """Held-out loss in nats per byte (bits per byte: divide by ln 2)."""
    context = model.cfg.context
    losses = [float(loss_of(model, x, y)) for x, y in test_batches(context)]
    return sum(losses) / len(losses)
