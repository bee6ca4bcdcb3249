"""Unit-wise norms and scaling for adaptive gradient clipping (AGC): each tensor split into
``units`` equal, consecutive units (its output rows), each with a norm and a factor of its own.

Every unit becomes an entry of a chunk table of its own (a *row plan*: the units' addresses and
sizes, no tensor objects), so that the norms are one launch of the multi-tensor norm kernel with
per-tensor results, and the scaling one launch of ``_scale_units_kernel``, which reads its
chunk's unit factor and rewrites the chunk (a unit whose factor is exactly 1 is not touched).
Row plans are cached by the tensors' memory and unit counts: building one costs a Python loop
over the units, once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _chunk_table as ct
from ._chunk_table import chunk_bounds, math_type, rewrite_chunk, tensor_ptr


class RowPlan:
    """The attributes of a ``_plan.Plan`` that a chunk table reads, for the units of a plan."""

    __slots__ = ("addrs", "codes", "device", "inplace", "name", "numels")

    def __init__(self, plan, units: list[int]):
        from .._plan import ELEMENT_SIZE

        self.device, self.inplace, self.name = plan.device, plan.inplace, f"units of {plan.name}"
        self.addrs, self.numels, codes = [], [], []
        for addr, numel, code, u in zip(plan.addrs, plan.numels, plan.codes, units, strict=True):
            n = numel // u if u else 0
            step = n * ELEMENT_SIZE[code]
            self.addrs.extend(addr + k * step for k in range(u))
            self.numels.extend([n] * u)
            codes.extend([code] * u)
        self.codes = bytes(codes)


_ROW_PLANS: dict[tuple, RowPlan] = {}


def row_plan(plan, units: list[int]) -> RowPlan:
    key = (plan.device, plan.inplace, tuple(plan.addrs), tuple(plan.numels), bytes(plan.codes), tuple(units))
    rows = _ROW_PLANS.get(key)
    if rows is None:
        if len(_ROW_PLANS) >= 16:
            _ROW_PLANS.clear()
        rows = _ROW_PLANS[key] = RowPlan(plan, units)
    return rows


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
    rewrite_chunk(x_ptr, start, body_end, tail, numel, f, f, ct.MUL, MT, CHUNK, BLOCK, VEC)


def scale_units_(table: ct.ChunkTable, factors: torch.Tensor) -> None:
    """``x *= factors[u]`` for every element of unit ``u`` of a row plan's table."""
    if factors.numel() != table.n_tensors:
        raise ValueError(f"gradfuse.kernels: {factors.numel()} factors for {table.n_tensors} units")
    for g in table.groups:
        ct.launch(
            _scale_units_kernel,
            g,
            table.addrs[0],
            table.numel,
            table.chunk_tensor,
            table.chunk_index,
            factors,
            g.base,
            CODE=g.codes[0],
        )
