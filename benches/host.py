"""Host time per call: the drop-in clip, `GradBuckets.clip_grad_norm_` and
`GradScaler.unscale_and_clip_` on the same list again (16-element fp32 gradients, an inactive
clip) at 1, 148, 2000 and 10,000 tensors, beside torch's, with the per-tensor slope; on the CPU
without a GPU, also the Triton path's host work through a stand-in launcher (see
`gradfuse/bench/host.py`).

Usage: python benches/host.py [--device cpu|cuda] [--reps N] [--out DIR]

Writes its records to benches/results/ (see benches/README.md); any other `gradfuse bench`
option may be added and wins over the defaults here. `benches/host_time.py` times the same calls
through the public API alone, to compare versions of gradfuse.
"""

import sys
from pathlib import Path

from gradfuse.__main__ import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(["bench", "--workloads", "host", "--out", str(RESULTS), *sys.argv[1:]]))
