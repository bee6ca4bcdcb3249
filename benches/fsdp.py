"""Two ranks with FSDP2 (spawned, gloo on CPU; NCCL on two GPUs): gradfuse's clip on DTensor
gradients (the local shards' fused norm in one all-reduce, the clip folded into fused AdamW)
against torch's `clip_grad_norm_`, the FSDP2 `Trainer` step against a hand-written FSDP2 loop,
and the state each rank holds against DDP's.

Usage: python benches/fsdp.py [--device cpu|cuda] [--quick] [--reps N] [--out DIR]

Writes its records to benches/results/ (see benches/README.md); any other `gradfuse bench`
option may be added and wins over the defaults here.
"""

import sys
from pathlib import Path

from gradfuse.__main__ import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(["bench", "--workloads", "fsdp", "--out", str(RESULTS), *sys.argv[1:]]))
