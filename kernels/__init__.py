"""gradfuse's Triton kernels: CUDA tensors (and, under ``TRITON_INTERPRET=1``, CPU tensors).

Self-contained: nothing here imports the rest of the package. A list of tensors reaches the
kernels as a :class:`ChunkTable` built from their addresses, sizes and dtype codes (codes 0-3:
float32, float64, float16, bfloat16, the Rust core's); one launch per dtype group of the table
covers every tensor, whatever their number. Each kernel family is a module:

- ``_norm``: multi-tensor norm (per-chunk partials, deterministic finalize by the last program),
  optionally of ``x * inv_scale`` with an inf/NaN check;
- ``_stats``: per-tensor norm, largest magnitude and inf/NaN count from the norm's one read;
- ``_scale``: ``x *= factor`` with the factor read or computed (clip coefficient) on the device;
- ``_unscale``: ``x *= inv_scale`` with an inf/NaN check (torch's AMP unscale);
- ``_accumulate``: ``dst += alpha * src`` over pairs of possibly different dtypes;
- ``_clamp``: ``clip_grad_value_``'s clamp;
- ``_unitwise``: per-unit (row) norms and scaling for adaptive gradient clipping.

``_chunk_table`` builds tables and launches a chunk kernel over a group, ``_launch`` holds each
kernel's compiled specializations and launches them directly, ``_jit`` the in-kernel helpers.
The package's Triton backend (``gradfuse._triton``) turns validated plans into these calls.
Nothing here waits for the device or reads a device value on the host.
"""

from __future__ import annotations

from . import _accumulate, _clamp, _launch, _norm, _scale, _stats, _unitwise, _unscale
from ._chunk_table import ChunkTable, f64_bits

__all__ = [
    "ChunkTable",
    "_accumulate",
    "_clamp",
    "_launch",
    "_norm",
    "_scale",
    "_stats",
    "_unitwise",
    "_unscale",
    "f64_bits",
]
