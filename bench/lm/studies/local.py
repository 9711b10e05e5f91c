"""``local``: LocalSteps around AdamW, every row beside its exact control (the same local steps and
outer step, the pseudo-gradient averaged exactly)."""
from __future__ import annotations

import sys

from examples.train_lm import LMResult

from ..runner import chosen, run_in_process
from ..tables import table

def _local(h: int, compressor: str = "none", outer: dict | None = None, error_dtype: str | None = None,
           error_decay: float = 1.0, **params) -> dict:
    """train_lm's options for LocalSteps around AdamW, syncing every ``h`` steps after 40 exact ones,
    with the outer step ``outer`` and, compressed, the memories' ``error_decay`` (both always written out,
    so that a change of LocalSteps' defaults never reuses a cached run of the old ones)."""
    exact = compressor == "none"
    kw = dict(method="local-steps", compressor=compressor, compressor_params=params or None,
              feedback="none" if exact else "both", local=dict(sync_every=h, exact_steps=40, **(outer or DILOCO_OUTER)))
    if not exact:
        kw["local"]["error_decay"] = error_decay
    if error_dtype is not None:
        kw["error_dtype"] = error_dtype
    return kw


def _defaults(h: int, outer: dict) -> dict:
    """``_local`` with LocalSteps' default compressor and memories before block scales (sign with one RMS scale
    per chunk, int8) and ``outer``."""
    return _local(h, "sign", outer=outer, error_dtype="int8", scale="rms")


def _blocks(h: int, outer: dict, block: int = 128, decay: float = 1.0) -> dict:
    """``_defaults`` with a scale per block of ``block`` elements (128: LocalSteps' compressor since block
    scales) and the memories decayed by ``decay``."""
    return _local(h, "sign", outer=outer, error_dtype="int8", error_decay=decay, scale="rms", block=block)


def _two_hosts(kw: dict, inside_host: str) -> dict:
    """``kw`` (a ``_local`` row) on 2 hosts of 2 ranks, the host's ranks averaging exactly every step or alone."""
    return dict(kw, node_size=2, local=dict(kw["local"], inside_host=inside_host))


# outer steps: DiLoCo's Nesterov SGD; the average itself; twice and three times it; LocalSteps' default before
# decayed memories (Nesterov lr 1, momentum 0.5); LocalSteps' default
DILOCO_OUTER = dict(outer_lr=0.7, outer_momentum=0.9)
THE_AVERAGE = dict(outer_lr=1.0, outer_momentum=0.0)
TWICE_THE_AVERAGE = dict(outer_lr=2.0, outer_momentum=0.0)
THRICE_THE_AVERAGE = dict(outer_lr=3.0, outer_momentum=0.0)
OLD_DEFAULT_OUTER = dict(outer_lr=1.0, outer_momentum=0.5)
DEFAULT_OUTER = dict(outer_lr=0.7, outer_momentum=0.8)  # LocalSteps' default: Nesterov lr 0.7, momentum 0.8


DEFAULT_BLOCK_MARK = {128: " (LocalSteps' compressor)"}  # the block rows' label mark for LocalSteps' block
DEFAULTS_MARK = " (LocalSteps' defaults)"  # the label mark of the rows that run LocalSteps' defaults


# (name, label, train_lm options): local steps; each H has its exact control (the same local steps, exact
# averaging of the pseudo-gradient), which separates the cost of the local steps from that of the compression
LOCAL_METHODS = [
    ("adamw", "AdamW, exact average every step", dict(method="adamw")),
    # the exact baseline at other learning rates (its best is the bar)
    *[(f"adamw-lr{lr:g}", f"AdamW, exact average every step, lr {lr:g}", dict(method="adamw", lr=lr))
      for lr in (1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3)],
    *[(f"exact-h{h}", f"local steps H={h}, exact averaging, DiLoCo's outer Nesterov (lr 0.7, momentum 0.9; control)",
       _local(h)) for h in (10, 20, 50)],
    *[(f"sign-h{h}", f"local steps H={h}, sign, DiLoCo's outer Nesterov", _local(h, "sign")) for h in (10, 20, 50)],
    *[(f"topk1-h{h}", f"local steps H={h}, top-k 1%, DiLoCo's outer Nesterov", _local(h, "topk", ratio=0.01))
      for h in (10, 20, 50)],
    *[(f"randomsign0.25-h{h}", f"local steps H={h}, randomsign 1/4, DiLoCo's outer Nesterov",
       _local(h, "randomsign", ratio=0.25)) for h in (10, 20, 50)],
    # error feedback in place of the outer momentum (SparseLoCo's finding): the plain average as the outer step
    ("exact-h20-plain", "local steps H=20, exact averaging, the average as the outer step (control)",
     _local(20, outer=THE_AVERAGE)),
    ("sign-h20-plain", "local steps H=20, sign, the average as the outer step", _local(20, "sign", outer=THE_AVERAGE)),
    ("exact-h10-plain", "local steps H=10, exact averaging, the average as the outer step (control)",
     _local(10, outer=THE_AVERAGE)),
    ("sign-h10-plain", "local steps H=10, sign, the average as the outer step", _local(10, "sign", outer=THE_AVERAGE)),
    ("sign-h20-plain-layerwise", "local steps H=20, sign, a scale per tensor (layerwise), the average",
     _local(20, "sign", outer=dict(THE_AVERAGE, layerwise=True))),
    ("sign-h20-plain-int8", "local steps H=20, sign, the average, int8 error memories",
     _local(20, "sign", outer=THE_AVERAGE, error_dtype="int8")),
    ("sign-h20-rms", "local steps H=20, sign with the RMS scale, the average", _local(20, "sign", outer=THE_AVERAGE,
                                                                                       scale="rms")),
    # a longer outer step: sign's mean-scaled average is shorter than the exact one
    ("exact-h20-olr2", "local steps H=20, exact averaging, twice the average (control)",
     _local(20, outer=TWICE_THE_AVERAGE)),
    ("sign-h20-olr2", "local steps H=20, sign, twice the average", _local(20, "sign", outer=TWICE_THE_AVERAGE)),
    ("sign-h20-olr3", "local steps H=20, sign, three times the average",
     _local(20, "sign", outer=THRICE_THE_AVERAGE)),
    # the exact control of every row with this outer step, at each H
    *[(f"exact-h{h}-m05", f"local steps H={h}, exact averaging, outer Nesterov lr 1 momentum 0.5 (control)",
       _local(h, outer=OLD_DEFAULT_OUTER)) for h in (10, 20, 50, 100)],
    *[(f"sign-h{h}-m05", f"local steps H={h}, sign, outer Nesterov lr 1 momentum 0.5",
       _local(h, "sign", outer=OLD_DEFAULT_OUTER))
      for h in (10, 20, 50)],
    ("sign-h20-m05-rms", "local steps H=20, sign with the RMS scale, outer Nesterov lr 1 momentum 0.5",
     _local(20, "sign", outer=OLD_DEFAULT_OUTER, scale="rms")),
    # LocalSteps' defaults before block scales (sign with one RMS scale per chunk, outer Nesterov lr 1 momentum 0.5,
    # int8 error memories): the defaults-* rows
    *[(f"defaults-h{h}", f"local steps H={h}, LocalSteps' old defaults (sign, one RMS scale per chunk; outer "
       "Nesterov lr 1, momentum 0.5; int8 error memories)", _defaults(h, OLD_DEFAULT_OUTER))
      for h in (10, 20, 50, 100)],
    ("randomsign0.5-h20-m05", "local steps H=20, randomsign 1/2, outer Nesterov lr 1 momentum 0.5",
     _local(20, "randomsign", outer=OLD_DEFAULT_OUTER, ratio=0.5)),
    # the grid of issue 45 with LocalSteps' default outer step and memories (sign is the defaults-h rows above,
    # the controls the exact-h rows): top-k 1% and randomsign 1/4 (H=100 reaches past 10,000x fewer bytes than DDP)
    *[(f"defaults-topk1-h{h}", f"local steps H={h}, top-k 1%, LocalSteps' default outer step and memories",
       _local(h, "topk", outer=OLD_DEFAULT_OUTER, error_dtype="int8", ratio=0.01)) for h in (10, 20, 50)],
    *[(f"defaults-randomsign0.25-h{h}", f"local steps H={h}, randomsign 1/4 (RMS scale), LocalSteps' default "
       "outer step and memories",
       _local(h, "randomsign", outer=OLD_DEFAULT_OUTER, error_dtype="int8", ratio=0.25, scale="rms"))
      for h in (10, 20, 50, 100)],
    # the sync overlapped with the next k inner steps (overlap_steps=k; k = H: a whole round late), and its control
    *[(f"defaults-h20-ov{k}", f"local steps H=20, LocalSteps' old defaults, the sync beside the next {k} inner steps",
       _defaults(20, dict(OLD_DEFAULT_OUTER, overlap_steps=k))) for k in (1, 5, 20)],
    *[(f"exact-h20-m05-ov{k}", f"local steps H=20, exact averaging, outer Nesterov lr 1 momentum 0.5, the sync "
       f"beside the next {k} inner steps (control)", _local(20, outer=dict(OLD_DEFAULT_OUTER, overlap_steps=k)))
      for k in (5, 20)],
    # Streaming DiLoCo's fragments: 4 groups of parameters synced in turn, every 5 steps one of them, each sync
    # blocking or beside the next 5 inner steps (so that a round's bytes hide behind all its steps)
    *[(f"defaults-h20-f4{ov}", f"local steps H=20, LocalSteps' old defaults, 4 fragments in turn"
       f"{', each sync beside the next 5 inner steps' if ov else ''}",
       _defaults(20, dict(OLD_DEFAULT_OUTER, fragments=4, overlap_steps=5 if ov else 0))) for ov in ("", "-ov5")],
    *[(f"exact-h20-m05-f4{ov}", f"local steps H=20, exact averaging, outer Nesterov lr 1 momentum 0.5, 4 fragments "
       f"in turn{', each sync beside the next 5 inner steps' if ov else ''} (control)",
       _local(20, outer=dict(OLD_DEFAULT_OUTER, fragments=4, overlap_steps=5 if ov else 0))) for ov in ("", "-ov5")],
    # more fragments, each less late: 10 in turn, one every 2 steps, each beside the next 2
    ("defaults-h20-f10-ov2", "local steps H=20, LocalSteps' old defaults, 10 fragments in turn, each sync beside the "
     "next 2 inner steps", _defaults(20, dict(OLD_DEFAULT_OUTER, fragments=10, overlap_steps=2))),
    ("exact-h20-m05-f10-ov2", "local steps H=20, exact averaging, outer Nesterov lr 1 momentum 0.5, 10 fragments in "
     "turn, each sync beside the next 2 inner steps (control)",
     _local(20, outer=dict(OLD_DEFAULT_OUTER, fragments=10, overlap_steps=2))),
    # a late outer step without the outer momentum, which would carry the staleness on
    *[(f"sign-h20-plain-ov{k}", f"local steps H=20, sign (RMS scale), the average as the outer step, int8 memories, "
       f"the sync beside the next {k} inner steps", _defaults(20, dict(THE_AVERAGE, overlap_steps=k)))
      for k in (0, 20)],
    ("exact-h20-plain-ov20", "local steps H=20, exact averaging, the average as the outer step, the sync beside the "
     "next 20 inner steps (control)", _local(20, outer=dict(THE_AVERAGE, overlap_steps=20))),
    # the outer step and the inner lr at H=20, seed 0: a grid of the exact control, and sign at its best point
    *[(f"exact-h20-o{lr:g}-{mu:g}", f"local steps H=20, exact averaging, outer Nesterov lr {lr:g} momentum {mu:g} "
       "(control)", _local(20, outer=dict(outer_lr=lr, outer_momentum=mu)))
      for lr, mu in ((1.0, 0.3), (1.0, 0.7), (1.4, 0.5), (0.5, 0.85), (0.6, 0.8), (0.7, 0.8), (0.8, 0.8), (0.7, 0.85),
                     (0.4, 0.9))],
    *[(f"defaults-h20-o{lr:g}-{mu:g}", f"local steps H=20, LocalSteps' old defaults but the outer Nesterov lr {lr:g} "
       f"momentum {mu:g}", _defaults(20, dict(outer_lr=lr, outer_momentum=mu)))
      for lr, mu in ((0.7, 0.8), (0.85, 0.65))],
    ("sign-mean-h20-o0.7-0.8", "local steps H=20, sign with the mean scale, int8 memories, outer Nesterov lr 0.7 "
     "momentum 0.8", _local(20, "sign", outer=DEFAULT_OUTER, error_dtype="int8",
                            scale="mean")),
    *[(f"exact-h20-{tag}-lr{lr:g}", f"local steps H=20, exact averaging, outer Nesterov lr {outer['outer_lr']:g} "
       f"momentum {outer['outer_momentum']:g}, inner lr {lr:g} (control)", dict(_local(20, outer=outer), lr=lr))
      for tag, outer, lrs in (("m05", OLD_DEFAULT_OUTER, (7e-4, 1.5e-3, 2e-3)),
                              ("o0.7-0.8", DEFAULT_OUTER, (7e-4,)))
      for lr in lrs],
    # the 4 workers as 2 hosts of 2 ranks: one DiLoCo worker per host (exact inside it, every step), or every rank
    # alone with the two-level sync
    ("exact-h20-m05-2hosts", "local steps H=20, 2 hosts x 2 ranks, exact inside a host every step, exact averaging "
     "between hosts, outer Nesterov lr 1 momentum 0.5 (control)",
     _two_hosts(_local(20, outer=OLD_DEFAULT_OUTER), "exact")),
    ("defaults-h20-2hosts", "local steps H=20, 2 hosts x 2 ranks, LocalSteps' old defaults (exact inside a host every "
     "step, sign with one RMS scale per chunk between hosts)", _two_hosts(_defaults(20, OLD_DEFAULT_OUTER), "exact")),
    ("defaults-h20-2hosts-alone", "local steps H=20, 2 hosts x 2 ranks, every rank alone, the two-level sync (sign "
     "between hosts)", _two_hosts(_defaults(20, OLD_DEFAULT_OUTER), "alone")),
    # sign with a scale per block (bfloat16) instead of one per chunk: LocalSteps' compressor at block 128, and with
    # the outer step (lr 1, momentum 0.5) and full memories, its defaults before decayed memories
    *[(f"block{b}-h{h}", f"local steps H={h}, sign with an RMS scale per block of {b}"
       f"{DEFAULT_BLOCK_MARK.get(b, '')}, outer Nesterov lr 1 momentum 0.5, int8 memories",
       _blocks(h, OLD_DEFAULT_OUTER, b)) for h in (10, 20, 50, 100) for b in (32, 64, 128, 256) if h < 100 or b == 128],
    *[(f"block128-h20-o{lr:g}-{mu:g}", f"local steps H=20, LocalSteps' defaults before decay but the outer "
       f"Nesterov lr {lr:g} momentum {mu:g}", _blocks(20, dict(outer_lr=lr, outer_momentum=mu)))
      for lr, mu in ((1.0, 0.6), (1.2, 0.4), (0.85, 0.65), (0.7, 0.8))],
    ("block128-h20-heavyball", "local steps H=20, LocalSteps' defaults before decay but heavy-ball momentum (lr 1, "
     "momentum 0.5, not Nesterov)", _blocks(20, dict(outer_lr=1.0, outer_momentum=0.5, nesterov=False))),
    ("exact-h20-heavyball", "local steps H=20, exact averaging, heavy-ball momentum (lr 1, momentum 0.5; control)",
     _local(20, outer=dict(outer_lr=1.0, outer_momentum=0.5, nesterov=False))),
    ("block128-h20-2hosts", "local steps H=20, 2 hosts x 2 ranks, LocalSteps' defaults before decay (exact inside a "
     "host every step, sign with a scale per block of 128 between hosts)",
     _two_hosts(_blocks(20, OLD_DEFAULT_OUTER), "exact")),
    # decayed error memories (error_decay): the inner steps correct part of what a sync did not send themselves
    *[(f"block128-h{h}-o{lr:g}-{mu:g}-d{d:g}", f"local steps H={h}, sign with an RMS scale per block of 128, int8 "
       f"memories decayed by {d:g} at each sync, outer Nesterov lr {lr:g} momentum {mu:g}"
       f"{DEFAULTS_MARK if (lr, mu, d) == (0.7, 0.8, 0.5) else ''}",
       _blocks(h, dict(outer_lr=lr, outer_momentum=mu), decay=d))
      for h, lr, mu, ds in ((20, 1.0, 0.5, (0.5,)), (20, 0.7, 0.8, (0.0, 0.25, 0.5, 0.75)), (40, 0.7, 0.8, (0.5,)))
      for d in ds],
    # H = 40 (past 1,000x fewer bytes with sign): the exact control at three outer steps
    *[(f"exact-h40-o{lr:g}-{mu:g}", f"local steps H=40, exact averaging, outer Nesterov lr {lr:g} momentum {mu:g} "
       "(control)", _local(40, outer=dict(outer_lr=lr, outer_momentum=mu)))
      for lr, mu in ((0.7, 0.8), (1.0, 0.5), (0.6, 0.85))],
    # 2 hosts of 2 ranks, one DiLoCo worker per host, at H = 25 (past 1,000x fewer bytes per host link with sign):
    # the defaults and their exact control
    ("exact-h25-o0.7-0.8-2hosts", "local steps H=25, 2 hosts x 2 ranks, exact inside a host every step, exact "
     "averaging between hosts, outer Nesterov lr 0.7 momentum 0.8 (control)",
     _two_hosts(_local(25, outer=DEFAULT_OUTER), "exact")),
    *[(f"block128-h25-o0.7-0.8-d{d:g}-2hosts", f"local steps H=25, 2 hosts x 2 ranks"
       f"{DEFAULTS_MARK if d == 0.5 else f', memories decayed by {d:g}'} (exact inside a host every step, sign with a "
       "scale per block of 128 between hosts)", _two_hosts(_blocks(25, DEFAULT_OUTER, decay=d), "exact"))
      for d in (0.5, 0.25, 0.75)],
    # top-k 1% (996x at H = 20) with SparseLoCo's error feedback: memories decayed only a little, the average as
    # the outer step (error feedback in place of the outer momentum), or the defaults' outer step
    *[(f"topk1-h20-{tag}-d{d:g}", f"local steps H=20, top-k 1%, int8 memories decayed by {d:g} at each sync, "
       f"{what}", _local(20, "topk", outer=outer, error_dtype="int8", error_decay=d, ratio=0.01))
      for tag, what, outer, d in (("plain", "the average as the outer step", THE_AVERAGE, 0.95),
                                  ("o0.7-0.8", "outer Nesterov lr 0.7 momentum 0.8", DEFAULT_OUTER, 0.9))],
]


def local(args) -> tuple[list[str], dict]:
    runs: dict[str, list[LMResult]] = {}
    for label, kw in chosen(LOCAL_METHODS, args.methods):
        runs[label] = [run_in_process(args.workers, seed, args, **kw) for seed in range(args.seeds)]
        print(f"{label}: {[round(r.test_loss, 4) for r in runs[label]]}", file=sys.stderr)
    lines = table(runs, LOCAL_METHODS[0][1])
    for label, results in runs.items():
        crossed = results[0].host_link_bytes_per_step_after_freeze
        if crossed:
            lines.append(f"- {label}: {crossed:,.0f} bytes per host across its link per step after the warm-up "
                         f"(DDP's fp32 ring allreduce per worker ÷ that: "
                         f"{results[0].fp32_allreduce_bytes_per_step / crossed:,.0f}×)")
    return lines, runs
