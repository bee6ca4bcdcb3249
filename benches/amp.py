"""AMP: unscale + inf/NaN check + norm + clip, `gradfuse.unscale_and_clip_` against
`torch._amp_foreach_non_finite_check_and_unscale_` + `torch.nn.utils.clip_grad_norm_`, active and
inactive, on GPT-2 124M shapes (and the ~1B Llama on CUDA).

Usage: python benches/amp.py [--device cpu|cuda] [--quick] [--reps N] [--out DIR]

Writes its records to benches/results/ (see benches/README.md); any other `gradfuse bench`
option may be added and wins over the defaults here.
"""

import sys
from pathlib import Path

from gradfuse.__main__ import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(["bench", "--workloads", "amp", "--out", str(RESULTS), *sys.argv[1:]]))
