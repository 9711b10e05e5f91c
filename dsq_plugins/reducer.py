"""DoubleSqueeze on a sharded server: error-compensated compression on the
worker pass and again on the server pass (Tang et al., ICML 2019, Alg. 1).

The flat gradient is cut into ``size`` contiguous chunks; rank k serves chunk
k and keeps that chunk's server error. One step, per bucket:

1. worker: v = g + d_worker; each chunk of v is compressed on its own;
2. all-to-all: chunk k's payload goes to rank k;
3. owner: decompress the ``size`` contributions, aggregate (mean, or a robust
   rule), add the server error, compress again, keep what was lost;
4. all-gather: each owner's payload goes to every rank;
5. every rank decompresses the ``size`` results into the averaged gradient.

State changes are transactional: worker error, server error and the step
counter are written only after the whole exchange succeeded, so an error
raised anywhere in a step (non-finite gradient, a peer's malformed payload,
mismatched tensors) leaves every rank's state as it was before the step.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Iterable, Sequence

import torch

from .aggregation import AggregatorSpec, get_aggregator, is_robust
from .bucketing import DEFAULT_BUCKET_MB, Bucket, plan_buckets
from .comm import Communicator, PeerStatusError, make_tag
from .compressors import Compressor, derive_seed, get_compressor
from .compressors.base import check_float_tensor
from .errors import (CollectiveMismatchError, ConfigError, ErrorFeedbackWarning, NonFiniteGradientError,
                     PayloadError)
from .finite import all_finite
from .memory import ErrorMemory

log = logging.getLogger("dsq_plugins")

ERROR_FEEDBACK_MODES = ("both", "worker", "none")
ON_NONFINITE = ("raise", "skip")
STATE_VERSION = 1

# statuses a rank announces in a collective's header
_NONFINITE = 1
_BAD_PAYLOAD_BASE = 2  # + rank whose payload could not be decoded


def chunk_bounds(numel: int, size: int) -> list[tuple[int, int]]:
    """Contiguous chunks, the first ``numel % size`` one element longer."""
    base, extra = divmod(numel, size)
    bounds, start = [], 0
    for k in range(size):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def resolve_compressors(compressor: str | Compressor, server_compressor: str | Compressor | None,
                        error_feedback: str, compressor_params: dict[str, Any] | None = None,
                        server_compressor_params: dict[str, Any] | None = None) -> tuple[Compressor, Compressor]:
    """The (worker, server) operators. No server operator means the worker's,
    except with ``error_feedback="worker"``: the exact fp32 mean, the paper's
    single-pass baseline."""
    if error_feedback not in ERROR_FEEDBACK_MODES:
        raise ConfigError(f"error_feedback must be one of {ERROR_FEEDBACK_MODES}, got {error_feedback!r}")
    worker = get_compressor(compressor, **(compressor_params or {}))
    if server_compressor is None and server_compressor_params is None:
        server = get_compressor("none") if error_feedback == "worker" else \
            get_compressor(type(worker).name, **worker.params())
    else:
        server = get_compressor(server_compressor or type(worker).name, **(server_compressor_params or {}))
    compensated = [("worker", worker)] if error_feedback in ("worker", "both") else []
    compensated += [("server", server)] if error_feedback == "both" else []
    for side, q in compensated:
        if not q.is_contraction():
            warnings.warn(
                f"{q!r} on the {side} pass is not a contraction (E||x - Q(x)||² can exceed ||x||²), so with "
                f"error_feedback={error_feedback!r} its residual can grow until training diverges (README, "
                f"RQ4). Use error_feedback='none' with it, or a contraction on that pass: sign, topk, "
                f"randomk with unbiased=False, qsgd with levels >= sqrt(bucket_size).",
                ErrorFeedbackWarning, stacklevel=3)
    return worker, server


class DoubleSqueeze:
    """Averages gradients across the ranks of ``comm`` with double-pass
    error-compensated compression.

    Args:
        comm: a ``Communicator`` (``LocalGroup`` rank, ``TorchDistributedComm``,
            or an engine adapter).
        compressor: worker-side operator, a name or a ``Compressor``.
        server_compressor: server-side operator; ``None`` means the same as the
            worker's, except with ``error_feedback="worker"``, where it means
            the exact fp32 mean (the paper's single-pass baseline).
        error_feedback: ``"both"`` (DoubleSqueeze), ``"worker"``, or ``"none"``.
        aggregator: ``"mean"``, a registered name (``import robust`` adds
            median, trimmed_mean, krum, centered_clip, majority), or a function
            over the stacked contributions of a chunk; ``aggregator_params``
            are the named rule's parameters (``{"f": 2}``).
        compressor_params / server_compressor_params: keyword parameters of
            the named compressors (``{"ratio": 0.01}`` for top-k).
        bucket_mb: bucket size for ``reduce_many``; ``layerwise`` gives each
            tensor its own bucket.
        on_nonfinite: ``"raise"`` (default) raises ``NonFiniteGradientError``
            on every rank; ``"skip"`` returns zeros for the step, leaves the
            state untouched and sets ``last_step_skipped``.
        strict_payloads: a malformed peer payload (or a peer's non-finite
            gradient) is an error on every rank (True), or is left out of the
            aggregation and counted in ``rejected`` (False). ``None`` (default):
            False for robust aggregators, True otherwise.
        worker_momentum: beta of a worker-side momentum applied before
            compression (Signum with sign and majority vote); 0 disables it.
        seed: base of every derived seed of the randomized compressors.
    """

    def __init__(self, comm: Communicator, compressor: str | Compressor = "sign",
                 server_compressor: str | Compressor | None = None, error_feedback: str = "both",
                 aggregator: AggregatorSpec = "mean", *, compressor_params: dict[str, Any] | None = None,
                 server_compressor_params: dict[str, Any] | None = None, bucket_mb: float = DEFAULT_BUCKET_MB,
                 layerwise: bool = False, on_nonfinite: str = "raise", strict_payloads: bool | None = None,
                 aggregator_params: dict[str, Any] | None = None, worker_momentum: float = 0.0,
                 seed: int = 0):
        if on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        if bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be positive, got {bucket_mb!r}")
        self.comm = comm
        self.compressor, self.server_compressor = resolve_compressors(
            compressor, server_compressor, error_feedback, compressor_params, server_compressor_params)
        self.error_feedback = error_feedback
        if not 0.0 <= worker_momentum < 1.0:
            raise ConfigError(f"worker_momentum must be in [0, 1), got {worker_momentum!r}")
        self.aggregator = get_aggregator(aggregator, **(aggregator_params or {}))
        self.worker_momentum = float(worker_momentum)
        self.momentum = ErrorMemory()
        #: payloads left out of aggregation (strict_payloads=False), by sender rank
        self.rejected: dict[int, int] = {}
        self.bucket_mb = float(bucket_mb)
        self.layerwise = bool(layerwise)
        self.on_nonfinite = on_nonfinite
        self.strict_payloads = (not is_robust(aggregator)) if strict_payloads is None else bool(strict_payloads)
        self.seed = int(seed)
        self.worker_error = ErrorMemory()
        self.server_error = ErrorMemory()
        self.steps: dict[str, int] = {}
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._layouts: dict[tuple, list[Bucket]] = {}
        self._staged: list[tuple[str, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]] | None = None

    # -- public API -------------------------------------------------------
    def reduce(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The average of ``tensor`` over all ranks (compressed both ways),
        same shape and dtype. ``name`` keys the error memory: use the same
        name for the same tensor at every step, on every rank."""
        check_float_tensor(tensor, f"reduce({name!r})")
        self.last_step_skipped = False
        flat = self._reduce_flat(name, tensor.detach().reshape(-1).to(torch.float32))
        return flat.reshape(tensor.shape).to(tensor.dtype)

    def reduce_many(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Average many tensors at once, fused into buckets; results in the
        order given. The order must be the same on every rank."""
        named = list(named_tensors)
        for name, t in named:
            check_float_tensor(t, f"reduce_many({name!r})")
        self.last_step_skipped = False
        by_name = dict(named)
        out: list[torch.Tensor] = []
        for bucket in self.layout([(n, tuple(t.shape)) for n, t in named]):
            out.extend(self.reduce_bucket(bucket, [by_name[slot.name] for slot in bucket.slots]))
        return out

    def reduce_bucket(self, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Average one bucket of a ``layout`` (the engine adapters exchange
        buckets one at a time, as their gradients become ready)."""
        return bucket.unflatten(self._reduce_flat(bucket.name, bucket.flatten(tensors)), tensors)

    # -- staged commits ---------------------------------------------------
    def begin(self) -> None:
        """Hold back state changes until ``commit()``: an optimizer step that
        exchanges several buckets then changes the error memories of all of
        them or of none (``abort()``), even if a later bucket fails."""
        self._staged = []

    def commit(self) -> None:
        """Write every state change held back since ``begin()``."""
        staged, self._staged = self._staged or [], None
        for entry in staged:
            self._write(*entry)

    def abort(self) -> None:
        """Drop every state change held back since ``begin()``."""
        self._staged = None

    def _write(self, name: str, werr: torch.Tensor | None, serr: torch.Tensor | None,
               mom: torch.Tensor | None = None) -> None:
        if mom is not None:
            self.momentum.set(name, mom)
        if werr is not None:
            self.worker_error.set(name, werr)
        if serr is not None:
            self.server_error.set(name, serr)
        self.steps[name] = self.steps.get(name, 0) + 1

    def layout(self, entries: Sequence[tuple[str, Sequence[int]]]) -> list[Bucket]:
        """The (cached) bucket layout for these names and shapes."""
        key = tuple((n, tuple(s)) for n, s in entries)
        if key not in self._layouts:
            self._layouts[key] = plan_buckets(key, self.bucket_mb, self.layerwise)
        return self._layouts[key]

    def state_dict(self) -> dict[str, Any]:
        """Error memories and step counters: everything needed to continue
        bit for bit. Each rank saves its own (server error is per rank)."""
        return {
            "version": STATE_VERSION,
            "rank": self.comm.rank,
            "size": self.comm.size,
            "compressor": [type(self.compressor).name, self.compressor.params()],
            "server_compressor": [type(self.server_compressor).name, self.server_compressor.params()],
            "error_feedback": self.error_feedback,
            "worker_error": self.worker_error.state_dict(),
            "server_error": self.server_error.state_dict(),
            "momentum": self.momentum.state_dict(),
            "steps": dict(self.steps),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"version", "rank", "size", "worker_error", "server_error", "steps"} - set(state)
        if missing:
            raise ValueError(f"DoubleSqueeze state_dict is missing {sorted(missing)}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"DoubleSqueeze state_dict version {state['version']} is not {STATE_VERSION}")
        if state["size"] != self.comm.size or state["rank"] != self.comm.rank:
            raise ValueError(f"DoubleSqueeze state_dict was saved by rank {state['rank']} of {state['size']}; "
                             f"this is rank {self.comm.rank} of {self.comm.size} (server error is per chunk owner)")
        self.worker_error.load_state_dict(state["worker_error"])
        self.server_error.load_state_dict(state["server_error"])
        self.momentum.load_state_dict(state.get("momentum", {}))
        self.steps = {str(k): int(v) for k, v in state["steps"].items()}
        self.skipped_steps = int(state.get("skipped_steps", 0))

    # -- one exchange -----------------------------------------------------
    def chunk_seed(self, name: str, step: int, side: str, sender: int, chunk: int) -> int:
        """Seed of the payload ``sender`` makes for ``chunk`` of ``name`` at
        ``step`` on ``side`` "w" (worker pass) or "s" (server pass); every rank
        derives the same value, so seeds never travel."""
        return derive_seed(self.seed, name, step, side, sender, chunk)

    def _reduce_flat(self, name: str, g: torch.Tensor) -> torch.Tensor:
        comm, q, qs = self.comm, self.compressor, self.server_compressor
        n, rank, device = comm.size, comm.rank, g.device
        numel = g.numel()
        bounds = chunk_bounds(numel, n)
        tag = make_tag(name, numel)
        step = self.steps.get(name, 0)
        worker_ef = self.error_feedback in ("both", "worker")
        server_ef = self.error_feedback == "both"

        # 1. (momentum,) compensate and compress every chunk (nothing stored yet)
        mom = None
        if self.worker_momentum:
            beta = self.worker_momentum
            mom = beta * self.momentum.get(name, numel, device) + (1 - beta) * g
            g = mom
        v = g + self.worker_error.get(name, numel, device) if worker_ef else g
        finite = all_finite(v)
        shared = q.prepare(v) if finite else None
        payloads = []
        for k, (s, e) in enumerate(bounds):
            if finite:
                payloads.append(q.compress(v[s:e], seed=self.chunk_seed(name, step, "w", rank, k),
                                           shared=shared).payload)
            else:
                payloads.append(torch.empty(0, dtype=torch.uint8, device=device))

        # 2. all-to-all (headers first: a non-finite rank stops everyone here)
        try:
            # robust mode: a non-finite rank sends nothing and is left out like a malformed peer
            status = 0 if finite or not self.strict_payloads else _NONFINITE
            received = comm.alltoall(payloads, tag=tag, status=status,
                                     expected=[q.payload_nbytes(e - s) for s, e in bounds],
                                     strict=self.strict_payloads)
        except PeerStatusError as exc:
            return self._on_status(name, exc, numel, device)
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(f"reducing {name!r} ({numel} elements): {exc}") from None

        # 3. own chunk: decompress, aggregate, add server error, squeeze again
        s, e = bounds[rank]
        contributions, bad = [], []
        own = None  # this rank's own chunk as decoded here, reused for its worker error below
        for j, payload in enumerate(received):
            if payload is None:
                bad.append((j, "wrong length"))
                continue
            try:
                c = q.decompress_flat(payload.to(device), e - s, self.chunk_seed(name, step, "w", j, rank))
                if not all_finite(c):
                    raise PayloadError("decodes to non-finite values")
                contributions.append(c)
                if j == rank:
                    own = c
            except PayloadError as exc:
                bad.append((j, str(exc)))
        status = _BAD_PAYLOAD_BASE + bad[0][0] if bad and self.strict_payloads else 0
        for j, why in bad if not self.strict_payloads else []:
            self.rejected[j] = self.rejected.get(j, 0) + 1
            log.warning("rank %d: left out rank %d's payload for %r at step %d: %s", rank, j, name, step, why)
        if contributions:
            stacked = torch.stack(contributions)
            if getattr(self.aggregator, "takes_seed", False):
                u = self.aggregator(stacked, seed=self.chunk_seed(name, step, "a", rank, rank))
            else:
                u = self.aggregator(stacked)
        else:
            u = torch.zeros(e - s, dtype=torch.float32, device=device)
        if server_ef:
            u = u + self.server_error.get(name, e - s, device)
        result = qs.compress(u, seed=self.chunk_seed(name, step, "s", rank, rank))

        # 4. all-gather the squeezed chunks
        try:
            gathered = comm.allgather(result.payload, tag=tag, status=status,
                                      expected=[qs.payload_nbytes(b - a) for a, b in bounds], strict=True)
        except PeerStatusError as exc:
            return self._on_status(name, exc, numel, device, bad[0][1] if bad else "")

        # 5. decode everything; only then commit the state
        pieces = [qs.decompress_flat(p.to(device), b - a, self.chunk_seed(name, step, "s", j, j))
                  for j, (p, (a, b)) in enumerate(zip(gathered, bounds))]
        out = torch.cat(pieces)
        if not all_finite(out):
            raise PayloadError(f"the averaged {name!r} decodes to non-finite values")
        werr = serr = None
        if not finite:
            # robust mode: this rank's own gradient was left out, so its worker memories stay as they
            # were; it still served its chunk, so its server error and step counter move on like everyone's
            mom = None
        elif worker_ef:
            werr = v  # g + memory: a fresh tensor of ours, so the residual is formed in place
            for k, (p, (a, b)) in enumerate(zip(payloads, bounds)):
                sent = own if k == rank and own is not None else \
                    q.decompress_flat(p, b - a, self.chunk_seed(name, step, "w", rank, k))
                werr[a:b].sub_(sent)
        if server_ef:
            serr = u - pieces[rank]
        if self._staged is None:
            self._write(name, werr, serr, mom)
        else:
            self._staged.append((name, werr, serr, mom))
        return out

    def _on_status(self, name: str, exc: PeerStatusError, numel: int, device: torch.device,
                   my_refusal: str = "") -> torch.Tensor:
        """Every rank saw the same statuses: skip, or raise the same error.
        ``my_refusal`` is why this rank, as an owner, refused a payload."""
        nonfinite = sorted(j for j, st in exc.statuses.items() if st == _NONFINITE)
        if nonfinite:
            if self.on_nonfinite == "skip":
                self.last_step_skipped = True
                self.skipped_steps += 1
                return torch.zeros(numel, dtype=torch.float32, device=device)
            raise NonFiniteGradientError(
                f"gradient {name!r} holds NaN or Inf on rank(s) {nonfinite}; the step was not applied and "
                f"error-feedback state is unchanged on every rank", nonfinite) from None
        owner, st = min(exc.statuses.items())
        sender = st - _BAD_PAYLOAD_BASE
        detail = f": {my_refusal}" if owner == self.comm.rank and my_refusal else ""
        raise PayloadError(f"rank {owner} could not decode the payload rank {sender} sent for {name!r}{detail}; "
                           f"the step was not applied and error-feedback state is unchanged", rank=sender) from None
