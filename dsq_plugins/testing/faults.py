"""Fault injection inside the reducer: what a faulty rank sends instead of
its honest payloads, on the worker pass, the server pass, or both.

One spec configures it, as a string (the ``DSQ_FAULTS`` environment variable,
``DoubleSqueeze(faults=...)``, ``Compression.doublesqueeze(faults=...)``) or
as a dict (the ``faults`` object of the DeepSpeed section), same fields:

    attack=signflip;count=3;seed=0;from_step=0       # 3 ranks chosen with seed 0
    attack=alie;ranks=1,2;z=-1.5
    attack=signflip;ranks=5,6,7;pass=both             # also corrupt the chunks they serve
    {"attack": "scaled", "ranks": [0], "scale": 10}

Attacks (parameters): ``signflip`` (scale: -scale*x), ``randomsign`` (random
signs, same magnitudes), ``scaled`` (scale), ``zero``, ``crash`` (sends
nothing: an empty, wrong-length payload), ``gaussian`` (sigma: x +
sigma*N(0,1)), ``alie`` (z: mean + z*std of the honest values, Baruch et al.
2019), ``ipm`` (eps: -eps*mean of the honest values, Xie et al. 2020), ``nan``,
``inf``, ``short`` (one byte short), ``garbage`` (random bytes of the right
length).

``pass``: ``worker`` (default) alters the payloads a faulty rank sends as a
worker; ``server`` alters the chunk results it serves as an owner; ``both``
does both. The honest code builds every payload first and the attack
replaces it, so everything else is the shipped code path.

ALIE and IPM need honest statistics. On the worker pass the attackers are
omniscient and collude: before each worker pass all ranks share their honest
payloads on a side exchange whose bytes are not counted (the strongest form
of both attacks). On the server pass an owner already holds every
contribution to its chunk and uses those.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..compressors import Compressor, derive_seed
from ..compressors.shapes import without_warm
from ..errors import ConfigError, PayloadError

__all__ = ["ATTACKS", "ENV", "fault_hook", "FaultInjector", "FaultSpec", "NEEDS_HONEST_STATS", "NoFaults", "PASSES",
    "spec_from_env"]

ENV = "DSQ_FAULTS"
ATTACKS: dict[str, dict[str, float]] = {
    "signflip": {"scale": 1.0}, "randomsign": {}, "scaled": {"scale": 10.0}, "zero": {}, "crash": {},
    "gaussian": {"sigma": 1.0}, "alie": {"z": -1.5}, "ipm": {"eps": 0.5}, "nan": {}, "inf": {},
    "short": {}, "garbage": {},
}
PASSES = ("worker", "server", "both")
NEEDS_HONEST_STATS = frozenset({"alie", "ipm"})


@dataclass
class FaultSpec:
    """Which ranks misbehave, how, on which pass, and from which step."""

    attack: str
    ranks: list[int] | None = None
    count: int | None = None
    seed: int = 0
    from_step: int = 0
    params: dict[str, float] = field(default_factory=dict)
    passes: str = "worker"

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
        passes = fields.pop("pass", "worker")
        if passes not in PASSES:
            raise ConfigError(f"fault spec {raw!r}: pass must be one of {', '.join(PASSES)}, got {passes!r}")
        try:
            count = None if count is None else int(count)
            seed = int(fields.pop("seed", 0))
            from_step = int(fields.pop("from_step", 0))
            params = {k: float(fields.pop(k)) for k in list(fields) if k in ATTACKS[attack]}
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"fault spec {raw!r}: {exc}") from None
        if fields:
            allowed = ["attack", "ranks", "count", "pass", "seed", "from_step", *ATTACKS[attack]]
            raise ConfigError(f"fault spec {raw!r}: unknown field(s) {sorted(fields)}; "
                              f"valid for {attack}: {', '.join(allowed)}")
        return cls(attack, list(ranks) if ranks is not None else None, count, seed, from_step,
                   {**ATTACKS[attack], **params}, passes)

    def to_dict(self) -> dict[str, Any]:
        """The spec as the dict ``parse`` reads."""
        out: dict[str, Any] = {"attack": self.attack, "seed": self.seed, "from_step": self.from_step,
                               "pass": self.passes, **self.params}
        out["ranks" if self.ranks is not None else "count"] = self.ranks if self.ranks is not None else self.count
        return out

    def hits(self, side: str) -> bool:
        """Whether the attack alters the ``side`` ("worker" or "server") pass."""
        return self.passes in (side, "both")

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


# what every rank shares before a worker pass under ALIE/IPM: all payloads, all ranks
SideExchange = Callable[[torch.Tensor], Sequence[torch.Tensor]]


class NoFaults:
    """The fault hook of a reducer without fault injection: every payload
    goes out as the honest code built it."""

    faulty: list[int] = []

    def worker_payloads(self, payloads: list[torch.Tensor], **_: Any) -> list[torch.Tensor]:
        return payloads

    def server_payload(self, payload: torch.Tensor, **_: Any) -> torch.Tensor:
        return payload


def fault_hook(spec: FaultSpec | None, rank: int, size: int) -> "FaultInjector | NoFaults":
    """The hook a reducer hands its payloads to: ``spec`` bound to this rank, or ``NoFaults``."""
    return NoFaults() if spec is None else FaultInjector(spec, rank, size)


class FaultInjector:
    """A spec bound to one rank of a group of ``size``: the reducer hands it
    every honest payload and sends what it returns."""

    def __init__(self, spec: FaultSpec, rank: int, size: int):
        self.spec = spec
        self.rank = rank
        self.faulty = spec.faulty_ranks(size)
        self.is_faulty = rank in self.faulty

    def active(self, step: int) -> bool:
        return step >= self.spec.from_step

    def needs_side_exchange(self, step: int) -> bool:
        """ALIE/IPM on the worker pass: every rank, faulty or not, must join
        the side exchange (it is a collective)."""
        return self.spec.hits("worker") and self.active(step) and self.spec.attack in NEEDS_HONEST_STATS

    def worker_payloads(self, payloads: list[torch.Tensor], *, sizes: Sequence[int], compressor: Compressor,
                        step: int, seed_of: Callable[[int, int], int], side_exchange: SideExchange | None = None
                        ) -> list[torch.Tensor]:
        """What this rank sends as a worker: ``payloads`` (one per chunk),
        or the attack's replacement. ``seed_of(sender, k)`` is the seed
        ``sender`` encodes chunk k with."""
        everyone = side_exchange(torch.cat(payloads)) if self.needs_side_exchange(step) else None  # a collective
        if not (self.is_faulty and self.spec.hits("worker") and self.active(step)):
            return payloads  # (an honest rank joins the side exchange, and need not decode what it brought)
        stats = None if everyone is None else self._honest_statistics(everyone, sizes, compressor, seed_of)
        return [self._corrupt(p, m, compressor, seed_of(self.rank, k), ("w", step, k),
                              None if stats is None else stats[k])
                for k, (p, m) in enumerate(zip(payloads, sizes))]

    def server_payload(self, payload: torch.Tensor, *, numel: int, compressor: Compressor, step: int, seed: int,
                       contributions: Callable[[], torch.Tensor | None] = lambda: None) -> torch.Tensor:
        """What this rank serves for its chunk: ``payload``, or the attack's
        replacement. ``contributions()`` (stacked, decoded; asked for only
        when needed) feed ALIE/IPM."""
        if not (self.is_faulty and self.spec.hits("server") and self.active(step)):
            return payload
        stats = None
        if self.spec.attack in NEEDS_HONEST_STATS:
            c = contributions()
            if c is None or not c.numel():
                c = torch.zeros(1, numel, device=payload.device)
            stats = (c.mean(0), c.std(0, unbiased=False))
        return self._corrupt(payload, numel, compressor, seed, ("s", step, seed), stats)

    # -- the attacks -------------------------------------------------------
    def _honest_statistics(self, everyone, sizes, compressor, seed_of):
        """Mean and std, per chunk, of the honest ranks' worker payloads (``everyone``: each rank's, side-exchanged)."""
        lengths = [compressor.payload_nbytes(m) for m in sizes]
        stats, start = [], 0
        for k, m in enumerate(sizes):
            honest = [x for x in (_try_decode(compressor, everyone[j][start: start + lengths[k]], m, seed_of(j, k))
                                  for j in range(len(everyone))
                                  if j not in self.faulty and everyone[j].numel() == sum(lengths)) if x is not None]
            stack = torch.stack(honest) if honest else torch.zeros(1, m)
            stats.append((stack.mean(0), stack.std(0, unbiased=False)))
            start += lengths[k]
        return stats

    def _corrupt(self, payload: torch.Tensor, m: int, compressor: Compressor, seed: int, where: tuple,
                 stats: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        attack, p = self.spec.attack, self.spec.params
        gen = torch.Generator().manual_seed(derive_seed("fault", self.spec.seed, self.rank, *where))
        if attack == "crash":
            return payload[:0]
        if attack == "short":
            return payload[:-1] if payload.numel() else payload
        if attack == "garbage":
            return torch.randint(0, 256, payload.shape, generator=gen, dtype=torch.uint8).to(payload.device)
        if m == 0 or payload.numel() != compressor.payload_nbytes(m):
            return payload  # nothing honest to corrupt (e.g. this rank's gradient was not finite)
        try:
            x = _decode(compressor, payload, m, seed)
        except PayloadError:
            return payload  # its honest payload does not decode (a diverged run): nothing to corrupt
        if not bool(torch.isfinite(x).all()):
            return payload
        if attack == "signflip":
            y = -p["scale"] * x
        elif attack == "randomsign":
            y = x.abs() * (torch.randint(0, 2, x.shape, generator=gen).to(x) * 2 - 1)
        elif attack == "scaled":
            y = p["scale"] * x
        elif attack == "zero":
            y = torch.zeros_like(x)
        elif attack == "gaussian":
            y = x + p["sigma"] * torch.randn(x.shape, generator=gen).to(x)
        elif attack == "alie":
            y = stats[0] + p["z"] * stats[1]
        elif attack == "ipm":
            y = -p["eps"] * stats[0]
        else:  # nan, inf
            y = x.clone()
            y[0] = float("nan") if attack == "nan" else float("inf")
        # told the chunk's layout, not its warm start: an attack's encoding must not stage the honest one's state
        return compressor.compress(y.to(x), seed=seed, size=without_warm(m)).payload


def _decode(compressor: Compressor, payload: torch.Tensor, numel: int, seed: int) -> torch.Tensor:
    return compressor.decompress_flat(payload, numel, seed)


def _try_decode(compressor: Compressor, payload: torch.Tensor, numel: int, seed: int) -> torch.Tensor | None:
    try:
        x = _decode(compressor, payload, numel, seed)
    except PayloadError:
        return None
    return x if bool(torch.isfinite(x).all()) else None
