"""Gradient clipping: `clip_grad_norm_` on 2000 fp32 tensors of 4096 and on GPT-2 124M shapes (fp32 and
bf16), each active and inactive; on CUDA also a ~1B Llama, 10,000 tiny tensors and the
tensor-count sweep behind the chart.

Usage: python benches/clip.py [--device cpu|cuda] [--quick] [--reps N] [--out DIR]

Writes its records to benches/results/ (see benches/README.md); any other `gradfuse bench`
option may be added and wins over the defaults here.
"""

import sys
from pathlib import Path

from gradfuse.__main__ import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(["bench", "--workloads", "clip", "--out", str(RESULTS), *sys.argv[1:]]))
