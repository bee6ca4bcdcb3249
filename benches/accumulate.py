"""Gradient accumulation: fp32 main gradients += bf16 gradients, `gradfuse.accumulate_` against a
per-parameter `add_` loop and `torch._foreach_add_`, on GPT-2 124M shapes (and the ~1B Llama on
CUDA).

Usage: python benches/accumulate.py [--device cpu|cuda] [--quick] [--reps N] [--out DIR]

Writes its records to benches/results/ (see benches/README.md); any other `gradfuse bench`
option may be added and wins over the defaults here.
"""

import sys
from pathlib import Path

from gradfuse.__main__ import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(["bench", "--workloads", "accumulate", "--out", str(RESULTS), *sys.argv[1:]]))
