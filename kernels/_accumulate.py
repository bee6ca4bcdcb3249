"""``dst[i] += alpha * src[i]`` over pairs of tensors, dtypes possibly different per pair.

The chunk table walks both lists together (one address per side, shared sizes); its groups are
the distinct (dst dtype, src dtype, both aligned) combinations, one launch each. The arithmetic is
float64 if either side is float64, else float32, with ``alpha`` rounded to it; ``alpha == 1``
adds ``src`` without the multiply, as the Rust core does. Floating-point contraction is off, so
``d + alpha * s`` rounds the product and the sum separately, like the Rust core and torch's CPU
kernels (no fused multiply-add): results match the CPU backend bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _chunk_table as ct
from ._jit import as_f64, chunk_bounds, loop_bound, tail_mask, tensor_ptr, to_storage


@triton.constexpr_function
def _pair_math_type(dst_code, src_code):
    return tl.float64 if 1 in (dst_code, src_code) else tl.float32


@triton.jit
def _add(d, s, alpha, ALPHA_ONE: tl.constexpr):
    if ALPHA_ONE:
        r = d + s
    else:
        r = d + alpha * s
    return r


@triton.jit(do_not_specialize=["chunk_base", "alpha_bits"])
def _accumulate_kernel(
    dst_addr_ptr,  # int64 per pair: dst data addresses
    src_addr_ptr,  # int64 per pair: src data addresses
    numel_ptr,  # int64 per pair: element counts (equal on both sides)
    chunk_tensor_ptr,  # int64 per chunk: the pair it belongs to
    chunk_index_ptr,  # int64 per chunk: its position inside that pair
    chunk_base,  # first chunk of this launch's group
    alpha_bits: tl.int64,  # alpha as float64 bits
    DST_CODE: tl.constexpr,  # dtype code of this group's dst tensors
    SRC_CODE: tl.constexpr,  # dtype code of this group's src tensors
    ALIGNED: tl.constexpr,  # both sides' addresses are 16-byte aligned
    ALPHA_ONE: tl.constexpr,  # alpha == 1: plain addition
    CHUNK: tl.constexpr,  # elements per chunk
    BLOCK: tl.constexpr,  # elements per loop step
    VEC: tl.constexpr,  # alignment unit of the body, in elements
):
    MT: tl.constexpr = _pair_math_type(DST_CODE, SRC_CODE)
    alpha = as_f64(alpha_bits).to(MT)
    chunk = chunk_base + tl.program_id(0).to(tl.int64)
    t, start, body_end, tail, numel = chunk_bounds(chunk, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, CHUNK, VEC)
    d_ptr = tensor_ptr(dst_addr_ptr, t, DST_CODE, ALIGNED)
    s_ptr = tensor_ptr(src_addr_ptr, t, SRC_CODE, ALIGNED)
    for k in range(loop_bound(start), loop_bound(body_end), BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < body_end
        d = tl.load(d_ptr + offs, mask=mask, other=0.0)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0)
        tl.store(d_ptr + offs, to_storage(_add(d.to(MT), s.to(MT), alpha, ALPHA_ONE), d.dtype), mask=mask)
    offs = tail + tl.arange(0, VEC)
    mask = tail_mask(offs, start, numel, CHUNK)
    d = tl.load(d_ptr + offs, mask=mask, other=0.0)
    s = tl.load(s_ptr + offs, mask=mask, other=0.0)
    tl.store(d_ptr + offs, to_storage(_add(d.to(MT), s.to(MT), alpha, ALPHA_ONE), d.dtype), mask=mask)


def accumulate_(table: ct.ChunkTable, alpha: float) -> None:
    """``dst[i] += alpha * src[i]`` for a two-sided table (``chunk_table([dst_plan, src_plan])``)."""
    if len(table.addrs) != 2:
        raise ValueError("gradfuse.kernels: accumulate_ needs a (dst, src) chunk table")
    alpha = float(alpha)
    one = alpha == 1.0

    def make(g: ct.Group):
        args = (*table.addr_args, *table.args[:3], g.base, ct.SLOT)
        # fp_fusion off: d + alpha * s rounded twice, as on the CPU (module docstring).
        return args, False, {"DST_CODE": g.codes[0], "SRC_CODE": g.codes[1], "ALPHA_ONE": one}

    ct.run(table, _accumulate_kernel, (one,), make, ct.f64_bits(alpha))
