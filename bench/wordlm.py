"""A second LM: the standard library's sources cut into words
(``examples.lm.load_words``, a vocabulary of 4,096 in which most embedding
rows are rare), the GPT of ``examples.lm`` with that vocabulary. AdamW on
the exact average, ``CompressedAdam`` with sign, and its frozen-variance
control (CompressedAdam with exact averaging), in process.

    python -m bench.wordlm [--seeds 1] [--steps 600] [--lr 1e-3] [--freeze-step 200]"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from bench.study import publish

#: name -> (label, CompressedAdam's momentum compressor, None for AdamW or "local" for LocalSteps, and its freeze
#: step, None for --freeze-step (LocalSteps: its exact_steps, None for its default))
METHODS = {
    "adamw": ("AdamW, exact average", None, None),
    "cadam-sign": ("CompressedAdam, sign", "sign", None),
    "cadam-sign-auto": ("CompressedAdam, sign, freeze_step='auto'", "sign", "auto"),
    "control": ("Frozen-variance control: CompressedAdam with exact averaging", "none", None),
    # LocalSteps as a user writes it: LocalSteps(model, AdamW, sync_every=20), nothing else set
    "local-defaults": ("LocalSteps(model, AdamW, sync_every=20), its defaults", "local", None),
    "local-no-warmup": ("LocalSteps, its defaults but exact_steps=0 (the default before)", "local", 0),
    "local-exact": ("Exact local steps: LocalSteps' defaults with exact averaging at each sync (the control)",
                    "local-exact", None),
}
VOCAB, CONTEXT, BATCH = 4096, 64, 16


def windows(tokens: torch.Tensor, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(tokens) - CONTEXT - 1, (size,), generator=gen)
    rows = torch.stack([tokens[s: s + CONTEXT + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def run(method: str, seed: int, args) -> dict:
    import dsq_plugins as dsq
    from examples.lm import GPT, GPTConfig, load_words, loss_of
    _, compressor, freeze = METHODS[method]
    train, test = load_words("train", VOCAB), load_words("test", VOCAB)
    held_out = [windows(test, 128, torch.Generator().manual_seed(12345 + i)) for i in range(4)]

    def per_rank(comm):
        model = GPT(GPTConfig(vocab=VOCAB, context=CONTEXT), seed=seed)
        if compressor is None:
            params = list(model.parameters())
            opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
            exact = dsq.DoubleSqueeze(comm, "none", error_feedback="none")
        elif compressor in ("local", "local-exact"):
            options = {} if freeze is None else {"exact_steps": freeze}  # (the freeze column: the warm-up here)
            if compressor == "local-exact":
                options.update(compressor="none", error_feedback="none")
            opt = dsq.LocalSteps(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0), comm,
                                 sync_every=20, **options)
        else:
            opt = dsq.CompressedAdam(model.named_parameters(), comm=comm, lr=args.lr, compressor=compressor,
                                     freeze_step=freeze or args.freeze_step)
        gen = torch.Generator().manual_seed(1_000_003 * seed + comm.rank)
        for _ in range(args.steps):
            x, y = windows(train, BATCH, gen)
            opt.zero_grad()
            loss_of(model, x, y).backward()
            if compressor is None:
                exact.reduce_many([(str(i), p.grad) for i, p in enumerate(params)], in_place=True)
            opt.step()
        if compressor in ("local", "local-exact"):
            opt.finish()
        with torch.no_grad():
            loss = sum(float(loss_of(model, x, y)) for x, y in held_out) / len(held_out)
        return {"test_loss": loss, "frozen_at": getattr(opt, "freeze_step", None),
                "synced": getattr(opt, "steps", args.steps) % 20 == 0 if str(compressor).startswith("local") else None}
    return dsq.LocalGroup(args.workers).run(per_rank)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", type=lambda v: v.split(","), default=list(METHODS))
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--freeze-step", type=int, default=200)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="runs/bench-wordlm")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for method in args.methods:
        results[method] = [run(method, s, args) for s in range(args.seeds)]
        print(f"{method}: {results[method]}", file=sys.stderr, flush=True)
    base = statistics.mean(r["test_loss"] for r in results.get("adamw", results[args.methods[0]]))
    lines = [f"word-level GPT (vocabulary {VOCAB}, context {CONTEXT}), {args.workers} workers, batch {BATCH} x "
             f"{CONTEXT} tokens per worker, {args.steps} steps, lr {args.lr}, freeze step {args.freeze_step}, "
             f"{args.seeds} seed(s)", "", "| method | test loss (nats/token) | vs AdamW | frozen at |",
             "|---|---:|---:|---|"]
    for method, runs in results.items():
        loss = statistics.mean(r["test_loss"] for r in runs)
        frozen = sorted({r["frozen_at"] for r in runs if r["frozen_at"] is not None})
        each = ", ".join(f"{r['test_loss']:.4f}" for r in runs)
        lines.append(f"| {METHODS[method][0]} | {each} | "
                     f"{100 * (loss / base - 1):+.1f}% | {frozen or '-'} |")
    publish(args.out, "wordlm", "\n".join(lines), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
