"""The Adam studies on the LM workload (examples/lm.py: a byte-level GPT on
the standard library's sources), in-process workers unless said otherwise.

    python -m bench.lm adam     # AdamW exact / on DoubleSqueeze gradients / CompressedAdam / DeepSpeed 0.19.6
    python -m bench.lm zero     # CompressedAdam at ZeRO-2 (deepspeed launcher) vs DeepSpeed's own AdamW
    python -m bench.lm ddp      # the DDP paths (torchrun) vs DDP's own allreduce
    python -m bench.lm fsdp     # FSDP2 / HSDP (torchrun): dsq_plugins.fsdp vs FSDP's own exchange
    python -m bench.lm rq2      # 1, 2, 4, 8, 16 workers at a fixed per-worker batch
    python -m bench.lm front    # every method of adam and ddp: test loss against bytes per step
    python -m bench.lm local    # LocalSteps: every H and compressor beside its exact control

``adam`` also runs DeepSpeed 0.19.6's own OneBitAdam (bench/onebit_anchor.py,
4 processes under torchrun) unless ``--no-anchor``; the first run installs
0.19.6 into ~/.cache/dsq-plugins (a benchmark tool, never a dependency).
Each study prints a Markdown table and writes it, the raw results (JSON) and
plots to --out.

The package: ``runner`` (the cache and how runs are made), ``studies`` (one
module per study: its named rows and how it runs them), ``tables``,
``plots`` and ``cli``.
"""
from .runner import RUNS_MADE_AT, cached, code_version

__all__ = ["RUNS_MADE_AT", "cached", "code_version"]
