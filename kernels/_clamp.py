"""``x = min(max(x, lo), hi)`` in place over a list of tensors (``clip_grad_value_``).

Computed in float32 (float64 for float64 tensors) with the bounds rounded to that type, as
torch's ``clamp_min_`` then ``clamp_max_``: NaN stays NaN, and ``lo > hi`` gives ``hi``.
One launch per chunk-table group.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _chunk_table as ct
from ._jit import CLAMP, as_f64, chunk_bounds, math_type, rewrite_chunk, tensor_ptr


@triton.jit(do_not_specialize=["chunk_base", "lo_bits", "hi_bits"])
def _clamp_kernel(
    addr_ptr,  # int64 per tensor: data addresses
    numel_ptr,  # int64 per tensor: element counts
    chunk_tensor_ptr,  # int64 per chunk: the tensor it belongs to
    chunk_index_ptr,  # int64 per chunk: its position inside that tensor
    chunk_base,  # first chunk of this launch's group
    lo_bits: tl.int64,  # lower bound as float64 bits
    hi_bits: tl.int64,  # upper bound as float64 bits
    CODE: tl.constexpr,  # dtype code of this group's tensors
    ALIGNED: tl.constexpr,  # this group's addresses are 16-byte aligned
    CHUNK: tl.constexpr,  # elements per chunk
    BLOCK: tl.constexpr,  # elements per loop step
    VEC: tl.constexpr,  # alignment unit of the body, in elements
):
    MT: tl.constexpr = math_type(CODE)
    lo = as_f64(lo_bits).to(MT)
    hi = as_f64(hi_bits).to(MT)
    chunk = chunk_base + tl.program_id(0).to(tl.int64)
    t, start, body_end, tail, numel = chunk_bounds(chunk, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, CHUNK, VEC)
    x_ptr = tensor_ptr(addr_ptr, t, CODE, ALIGNED)
    rewrite_chunk(x_ptr, start, body_end, tail, numel, lo, hi, CLAMP, MT, CHUNK, BLOCK, VEC)


def clamp_(table: ct.ChunkTable, lo: float, hi: float) -> None:
    """Clamps every tensor of ``table`` to ``[lo, hi]`` in place."""

    def make(g: ct.Group):
        return (table.addr_args[0], *table.args[:3], g.base, ct.SLOT, ct.SLOT), False, {"CODE": g.codes[0]}

    ct.run(table, _clamp_kernel, (), make, ct.f64_bits(float(lo)), ct.f64_bits(float(hi)))
