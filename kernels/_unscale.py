"""``x *= inv_scale`` with an inf/NaN check, as ``torch._amp_foreach_non_finite_check_and_unscale_``.

One launch per chunk-table group. Every program that saw an inf or NaN (in ``x``, before scaling)
stores 1.0 to ``found_inf``; nothing ever stores 0.0, so a flag already set stays set. The
product is formed in float32 (float64 for float64 tensors). With ``inv_scale == 1`` the values
would not change, so nothing is written (the check still runs), as in the Rust core.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _chunk_table as ct
from ._jit import chunk_bounds, is_finite, loop_bound, math_type, tail_mask, tensor_ptr, to_storage
from ._launch import SLOT, Prepared, launcher


@triton.jit(do_not_specialize=["chunk_base"])
def _unscale_kernel(
    addr_ptr,  # int64 per tensor: data addresses
    numel_ptr,  # int64 per tensor: element counts
    chunk_tensor_ptr,  # int64 per chunk: the tensor it belongs to
    chunk_index_ptr,  # int64 per chunk: its position inside that tensor
    inv_scale_ptr,  # float32 [1]: the factor
    found_ptr,  # float32 [1]: set to 1.0 when an inf/NaN is seen
    chunk_base,  # first chunk of this launch's group
    CODE: tl.constexpr,  # dtype code of this group's tensors
    ALIGNED: tl.constexpr,  # this group's addresses are 16-byte aligned
    CHUNK: tl.constexpr,  # elements per chunk
    BLOCK: tl.constexpr,  # elements per loop step
    VEC: tl.constexpr,  # alignment unit of the body, in elements
):
    MT: tl.constexpr = math_type(CODE)
    inv32 = tl.load(inv_scale_ptr)
    write = inv32 != 1.0
    inv = inv32.to(MT)
    chunk = chunk_base + tl.program_id(0).to(tl.int64)
    t, start, body_end, tail, numel = chunk_bounds(chunk, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, CHUNK, VEC)
    x_ptr = tensor_ptr(addr_ptr, t, CODE, ALIGNED)
    bad = tl.zeros([BLOCK], tl.int32)
    for k in range(loop_bound(start), loop_bound(body_end), BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < body_end
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        v = x.to(MT)
        bad = bad | (~is_finite(v) & mask).to(tl.int32)
        tl.store(x_ptr + offs, to_storage(v * inv, x.dtype), mask=tl.where(write, mask, False))
    offs = tail + tl.arange(0, VEC)
    mask = tail_mask(offs, start, numel, CHUNK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    v = x.to(MT)
    tail_bad = (~is_finite(v) & mask).to(tl.int32)
    tl.store(x_ptr + offs, to_storage(v * inv, x.dtype), mask=tl.where(write, mask, False))
    any_bad = tl.maximum(tl.max(bad, axis=0), tl.max(tail_bad, axis=0))
    tl.store(found_ptr, 1.0, mask=any_bad > 0)


def unscale_and_check_(table: ct.ChunkTable, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``x *= inv_scale`` in place for every tensor of ``table``; ``found_inf = 1.0`` if any ``x``
    was inf or NaN. ``inv_scale`` and ``found_inf`` are one-element float32 tensors."""
    if inv_scale.dtype != torch.float32 or found_inf.dtype != torch.float32:
        raise TypeError("gradfuse.kernels: inv_scale and found_inf must be float32")

    def make(g: ct.Group):
        return (table.addr_args[0], *table.args[:3], ct.SLOT, ct.SLOT, g.base), False, {"CODE": g.codes[0]}

    ct.run(table, _unscale_kernel, (), make, inv_scale, found_inf)


@triton.jit
def _inverse_scale_kernel(scale_ptr, inv_scale_ptr, found_ptr):
    """``inv_scale = float32(1 / float64(scale))`` (torch's ``unscale_``:
    ``scale.double().reciprocal().float()``) and ``found = 0``."""
    s = tl.load(scale_ptr).to(tl.float64)
    tl.store(inv_scale_ptr, (1.0 / s).to(tl.float32))  # float64 division is IEEE-rounded
    tl.store(found_ptr, 0.0)


#: The prepared launch of the inverse scale per device index (-1: CPU tensors, interpreter).
_INVERSE: dict[int, Prepared] = {}


def inverse_scale(scale: torch.Tensor, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """The two scalars an unscale needs, in one launch where torch's ``unscale_`` makes four:
    ``inv_scale`` as torch computes it from ``scale`` (bit for bit) and ``found_inf`` zeroed. All
    three are one-element float32 tensors on one device, the current one."""
    for name, t in (("scale", scale), ("inv_scale", inv_scale), ("found_inf", found_inf)):
        if t.dtype != torch.float32 or t.numel() != 1:
            raise TypeError(f"gradfuse.kernels: {name} must be a one-element float32 tensor")
    device = scale.device.index if scale.is_cuda else -1
    prepared = _INVERSE.get(device)
    if prepared is None:
        meta = {"num_warps": 1, "enable_fp_fusion": False}
        prepared = _INVERSE[device] = Prepared(launcher(_inverse_scale_kernel), 1, (SLOT, SLOT, SLOT), meta, device)
    prepared(scale, inv_scale, found_inf)
