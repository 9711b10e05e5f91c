"""Fault injection at the communication boundary.

``FaultyComm`` wraps any communicator and alters what a faulty rank sends in
the worker pass (the all-to-all), after the reducer's honest code has built
it; everything else, the reducer included, is the shipped code path.

One spec configures it, as a string (the ``DSQ_FAULTS`` environment variable,
``Compression.doublesqueeze(faults=...)``) or as a dict (the ``faults`` object
of the DeepSpeed JSON section), with the same fields:

    attack=signflip;count=3;seed=0;from_step=0       # 3 ranks chosen with seed 0
    attack=alie;ranks=1,2;z=-1.5
    {"attack": "scaled", "ranks": [0], "scale": 10}

Attacks (parameters): ``signflip`` (scale: -scale*g; with a sign compressor
scale > 1 is a flipped vote that also claims a larger scale), ``randomsign`` (random signs, same
magnitudes), ``scaled`` (scale), ``zero``, ``crash`` (sends nothing: an empty,
wrong-length payload), ``gaussian`` (sigma: g + sigma*N(0,1)), ``alie`` (z:
mean + z*std of the honest gradients, Baruch et al. 2019), ``ipm`` (eps:
-eps*mean of the honest gradients, Xie et al. 2020), ``nan``, ``inf``,
``short`` (one byte short), ``garbage`` (random bytes of the right length).

ALIE and IPM need the honest statistics; here the attackers are omniscient
and collude: before each worker pass all ranks share their honest payloads on
a side exchange whose bytes are not counted. That is the strongest form of
both attacks, not an estimate. Faults hit the worker pass only: the sharded
server trusts each chunk's owner (a Byzantine owner would corrupt its chunk
for everyone; tolerating that needs replicated owners, which this does not do).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from dsq_plugins.comm import Communicator, tag_numel
from dsq_plugins.compressors import Compressor, derive_seed
from dsq_plugins.errors import ConfigError
from dsq_plugins.reducer import chunk_bounds

ENV = "DSQ_FAULTS"
ATTACKS: dict[str, dict[str, float]] = {
    "signflip": {"scale": 1.0}, "randomsign": {}, "scaled": {"scale": 10.0}, "zero": {}, "crash": {},
    "gaussian": {"sigma": 1.0}, "alie": {"z": -1.5}, "ipm": {"eps": 0.5}, "nan": {}, "inf": {},
    "short": {}, "garbage": {},
}
_NEEDS_HONEST_STATS = {"alie", "ipm"}


@dataclass
class FaultSpec:
    """Which ranks misbehave, how, and from which step."""

    attack: str
    ranks: list[int] | None = None
    count: int | None = None
    seed: int = 0
    from_step: int = 0
    params: dict[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: "str | dict | FaultSpec") -> "FaultSpec":
        """From ``"attack=alie;count=2;z=-1"`` or the equivalent dict."""
        if isinstance(spec, FaultSpec):
            return spec
        if isinstance(spec, str):
            fields: dict[str, Any] = {}
            for part in filter(None, (p.strip() for p in spec.replace(";", " ").split())):
                if "=" not in part:
                    raise ConfigError(f"fault spec: {part!r} is not key=value (spec {spec!r})")
                key, value = part.split("=", 1)
                fields[key.strip()] = value.strip()
            return cls._from_fields(fields, spec)
        if isinstance(spec, dict):
            return cls._from_fields(dict(spec), spec)
        raise ConfigError(f"fault spec must be a string or an object, got {type(spec).__name__}")

    @classmethod
    def _from_fields(cls, fields: dict[str, Any], raw: Any) -> "FaultSpec":
        attack = fields.pop("attack", None)
        if attack not in ATTACKS:
            raise ConfigError(f"fault spec {raw!r}: attack must be one of {', '.join(ATTACKS)}, got {attack!r}")
        ranks = fields.pop("ranks", None)
        if isinstance(ranks, str):
            try:
                ranks = [int(r) for r in ranks.split(",") if r.strip()]
            except ValueError:
                raise ConfigError(f"fault spec {raw!r}: ranks must be integers, got {ranks!r}") from None
        count = fields.pop("count", None)
        if (ranks is None) == (count is None):
            raise ConfigError(f"fault spec {raw!r}: give exactly one of ranks (which) or count (how many)")
        try:
            count = None if count is None else int(count)
            seed = int(fields.pop("seed", 0))
            from_step = int(fields.pop("from_step", 0))
            params = {k: float(fields.pop(k)) for k in list(fields) if k in ATTACKS[attack]}
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"fault spec {raw!r}: {exc}") from None
        if fields:
            allowed = ["attack", "ranks", "count", "seed", "from_step", *ATTACKS[attack]]
            raise ConfigError(f"fault spec {raw!r}: unknown field(s) {sorted(fields)}; "
                              f"valid for {attack}: {', '.join(allowed)}")
        return cls(attack, list(ranks) if ranks is not None else None, count, seed, from_step,
                   {**ATTACKS[attack], **params})

    def faulty_ranks(self, size: int) -> list[int]:
        """The faulty ranks in a group of ``size`` (a seeded choice for ``count``)."""
        if self.ranks is not None:
            bad = [r for r in self.ranks if not 0 <= r < size]
            if bad:
                raise ConfigError(f"fault spec: ranks {bad} do not exist in a group of {size}")
            return sorted(self.ranks)
        if not 0 <= self.count <= size:
            raise ConfigError(f"fault spec: count {self.count} is not between 0 and the group size {size}")
        return sorted(random.Random(self.seed).sample(range(size), self.count))


def spec_from_env() -> FaultSpec | None:
    """The spec in ``DSQ_FAULTS``, or None when it is unset or empty."""
    text = os.environ.get(ENV, "").strip()
    return FaultSpec.parse(text) if text else None


class FaultyComm:
    """``inner`` with the worker-pass payloads of the faulty ranks altered.

    ``compressor`` is the reducer's worker compressor (to decode the honest
    payload and encode the attack). Everything but ``alltoall`` is the inner
    communicator's own, byte counts and rejections included."""

    def __init__(self, inner: Communicator, spec: "FaultSpec | str | dict", compressor: Compressor):
        self.inner = inner
        self.spec = FaultSpec.parse(spec)
        self.compressor = compressor
        self.faulty = self.spec.faulty_ranks(inner.size)
        self.is_faulty = inner.rank in self.faulty
        self._steps: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:  # rank, size, allgather, bytes_sent, ...
        return getattr(self.inner, name)

    def alltoall(self, payloads, *, tag=0, **kw):
        step = self._steps.get(tag, 0)
        self._steps[tag] = step + 1
        active = step >= self.spec.from_step
        payloads = list(payloads)
        stats = self._honest_statistics(payloads, tag) \
            if active and self.spec.attack in _NEEDS_HONEST_STATS else None  # every rank joins the side exchange
        if active and self.is_faulty:
            payloads = self._attack(payloads, tag, step, stats)
        return self.inner.alltoall(payloads, tag=tag, **kw)

    # -- the attacks -------------------------------------------------------
    def _chunk_sizes(self, tag: int) -> list[int]:
        return [b - a for a, b in chunk_bounds(tag_numel(tag), self.inner.size)]

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        seed = 0 if self.compressor.randomized else None
        return self.compressor.decompress_flat(payload, numel, seed)

    def _encode(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        return self.compressor.compress(x, seed=seed).payload

    def _honest_statistics(self, payloads: list[torch.Tensor], tag: int):
        """Mean and std, per chunk, of the honest ranks' worker payloads
        (a side exchange among colluding omniscient attackers, not counted)."""
        sent, received = self.inner.bytes_sent, self.inner.bytes_received
        everyone = self.inner.allgather(torch.cat(payloads), tag=tag)
        self.inner.bytes_sent, self.inner.bytes_received = sent, received
        sizes = self._chunk_sizes(tag)
        lengths = [self.compressor.payload_nbytes(m) for m in sizes]
        stats = []
        for k, m in enumerate(sizes):
            start = sum(lengths[:k])
            honest = [self._decode(everyone[j][start: start + lengths[k]], m)
                      for j in range(self.size) if j not in self.faulty]
            stack = torch.stack(honest) if honest else torch.zeros(1, m)
            stats.append((stack.mean(0), stack.std(0, unbiased=False)))
        return stats

    def _attack(self, payloads, tag, step, stats):
        attack, p = self.spec.attack, self.spec.params
        sizes = self._chunk_sizes(tag)
        out = []
        for k, (payload, m) in enumerate(zip(payloads, sizes)):
            seed = derive_seed("fault", self.spec.seed, self.rank, tag, step, k)
            gen = torch.Generator().manual_seed(seed)
            if attack == "crash":
                out.append(payload[:0])
                continue
            if attack == "short":
                out.append(payload[:-1] if payload.numel() else payload)
                continue
            if attack == "garbage":
                out.append(torch.randint(0, 256, payload.shape, generator=gen, dtype=torch.uint8))
                continue
            if m == 0 or payload.numel() != self.compressor.payload_nbytes(m):
                out.append(payload)  # nothing honest to corrupt (e.g. this rank's gradient was not finite)
                continue
            x = self._decode(payload, m)
            if attack == "signflip":
                y = -p["scale"] * x
            elif attack == "randomsign":
                y = x.abs() * (torch.randint(0, 2, x.shape, generator=gen).float() * 2 - 1)
            elif attack == "scaled":
                y = p["scale"] * x
            elif attack == "zero":
                y = torch.zeros_like(x)
            elif attack == "gaussian":
                y = x + p["sigma"] * torch.randn(x.shape, generator=gen)
            elif attack == "alie":
                y = stats[k][0] + p["z"] * stats[k][1]
            elif attack == "ipm":
                y = -p["eps"] * stats[k][0]
            else:  # nan, inf
                y = x.clone()
                y[0] = float("nan") if attack == "nan" else float("inf")
            out.append(self._encode(y, seed))
        return out


def maybe_inject(comm: Communicator, compressor: Compressor, spec: Any = None) -> Communicator:
    """``comm`` wrapped by ``FaultyComm`` if a spec is given or ``DSQ_FAULTS``
    is set; otherwise ``comm`` itself."""
    spec = FaultSpec.parse(spec) if spec else spec_from_env()
    return FaultyComm(comm, spec, compressor) if spec is not None else comm
