"""Unit-wise norms and scaling for adaptive gradient clipping (AGC): each tensor split into
``units`` equal, consecutive units (its output rows), each with a norm and a factor of its own.

Every unit becomes an entry of a chunk table of its own (:func:`unit_rows`: the units' addresses
and sizes, no tensor objects), so that the norms are one launch of the multi-tensor norm kernel
with per-tensor results, and the scaling one launch of ``_scale_units_kernel``, which reads its
chunk's unit factor and rewrites the chunk (a unit whose factor is exactly 1 is not touched).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _chunk_table as ct
from ._jit import MUL, chunk_bounds, math_type, rewrite_chunk, tensor_ptr


def unit_rows(addrs: list[int], numels: list[int], codes: bytes, itemsizes: list[int], units: list[int]):
    """``(addrs, numels, codes)`` of the units as int64 tensors, each unit a tensor of its own for
    a chunk table: tensor ``i`` (at ``addrs[i]``, ``numels[i]`` elements of ``itemsizes[i]``
    bytes) split into ``units[i]`` equal, consecutive units. Tensor ops: no loop over units."""
    u = torch.as_tensor(units, dtype=torch.int64)
    numel = torch.as_tensor(numels, dtype=torch.int64)
    per = torch.where(u > 0, numel // u.clamp_min(1), 0)
    step = per * torch.as_tensor(itemsizes, dtype=torch.int64)
    total = int(u.sum())
    starts = torch.cumsum(u, 0) - u
    k = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, u)
    base = torch.repeat_interleave(torch.as_tensor(addrs, dtype=torch.int64), u)
    code = torch.frombuffer(bytearray(codes), dtype=torch.uint8).to(torch.int64) if codes else u
    return (
        base + k * torch.repeat_interleave(step, u),
        torch.repeat_interleave(per, u),
        torch.repeat_interleave(code, u),
    )


@triton.jit(do_not_specialize=["chunk_base"])
def _scale_units_kernel(
    addr_ptr,  # int64 per unit: data addresses
    numel_ptr,  # int64 per unit: element counts
    chunk_tensor_ptr,  # int64 per chunk: the unit it belongs to
    chunk_index_ptr,  # int64 per chunk: its position inside that unit
    factor_ptr,  # float32/float64 per unit: the factors
    chunk_base,  # first chunk of this launch's group
    CODE: tl.constexpr,  # dtype code of this group's tensors
    ALIGNED: tl.constexpr,  # this group's addresses are 16-byte aligned
    CHUNK: tl.constexpr,  # elements per chunk
    BLOCK: tl.constexpr,  # elements per loop step
    VEC: tl.constexpr,  # alignment unit of the body, in elements
):
    chunk = chunk_base + tl.program_id(0).to(tl.int64)
    t, start, body_end, tail, numel = chunk_bounds(chunk, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, CHUNK, VEC)
    factor = tl.load(factor_ptr + t).to(tl.float64)
    if factor == 1.0:
        return
    MT: tl.constexpr = math_type(CODE)
    f = factor.to(MT)
    x_ptr = tensor_ptr(addr_ptr, t, CODE, ALIGNED)
    rewrite_chunk(x_ptr, start, body_end, tail, numel, f, f, MUL, MT, CHUNK, BLOCK, VEC)


def scale_units_(table: ct.ChunkTable, factors: torch.Tensor) -> None:
    """``x *= factors[u]`` for every element of unit ``u`` of a row plan's table."""
    if factors.numel() != table.n_tensors:
        raise ValueError(f"gradfuse.kernels: {factors.numel()} factors for {table.n_tensors} units")

    def make(g: ct.Group):
        return (table.addr_args[0], *table.args[:3], ct.SLOT, g.base), False, {"CODE": g.codes[0]}

    ct.run(table, _scale_units_kernel, (), make, factors)
