"""Training steps: clip + fused AdamW under loss scaling (`GradScaler.unscale_and_clip_` + `step`
against torch's `unscale_` + `clip_grad_norm_` + `step`) on GPT-2 124M shapes, and one
`gradfuse.Trainer` step against the same step written by hand with torch on a small GPT-2-shaped
model, with the gradient-management share of each.

Usage: python benches/training.py [--device cpu|cuda] [--quick] [--reps N] [--out DIR]

Writes its records to benches/results/ (see benches/README.md); any other `gradfuse bench`
option may be added and wins over the defaults here.
"""

import sys
from pathlib import Path

from gradfuse.__main__ import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(["bench", "--workloads", "step", "trainer", "--out", str(RESULTS), *sys.argv[1:]]))
