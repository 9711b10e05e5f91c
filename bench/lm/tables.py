"""A study's Markdown table: every row against the study's exact baseline."""
from __future__ import annotations

import statistics

from examples.train_lm import LMResult


def mean_sd(values: list[float], fmt: str = "{:.4f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"


def table(runs: dict[str, list[LMResult]], baseline: str) -> list[str]:
    """The study's Markdown table, each row against ``baseline``'s mean."""
    exact = statistics.mean(r.test_loss for r in runs[baseline])
    lines = ["| method | test loss (nats/byte) | vs exact AdamW | bits/byte | bytes / worker / step, all steps "
             "| after the freeze | fp32 allreduce ÷ bytes after the freeze |", "|---|---|---|---|---|---|---|"]
    for label, results in runs.items():
        diverged = [r.diverged_at for r in results if r.diverged_at]
        if diverged:
            lines.append(f"| {label} | diverged in {len(diverged)} of {len(results)} seeds (at steps "
                         f"{', '.join(map(str, diverged))}) | | | | | |")
            continue
        losses = [r.test_loss for r in results]
        r0 = results[0]
        gap = 100 * (statistics.mean(losses) / exact - 1)
        lines.append(f"| {label} | {mean_sd(losses)} | {gap:+.1f}% | {statistics.mean(losses) / 0.6931:.3f} "
                     f"| {r0.bytes_per_step:,.0f} | {r0.bytes_per_step_after_freeze:,.0f} "
                     f"| {r0.fp32_allreduce_bytes_per_step / r0.bytes_per_step_after_freeze:.1f}× |")
    return lines


def ratio(r: LMResult) -> float:
    """How many times fewer bytes than an fp32 allreduce a step sends after the freeze."""
    return r.fp32_allreduce_bytes_per_step / r.bytes_per_step_after_freeze
