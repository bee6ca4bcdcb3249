"""The write pass of scaling and clipping: ``x *= factor`` for every tensor of a chunk table, with
the factor read or computed on the device by every program (no host sync):

- SCALE: ``factor = scale`` (a one-element tensor of any floating dtype);
- CLIP: ``factor = clip_coef(total_norm)``, torch's ``min(max_norm / (total_norm + 1e-6), 1)``;
- UNSCALE_CLIP: ``factor = inv_scale * clip_coef(total_norm)`` (one write pass for both).

The factor is formed in float64 (as the Rust core's ``f64`` argument) and rounded once to the
tensor's arithmetic type. When it is exactly 1 every program returns before touching the tensors:
``x * 1 == x`` bit for bit, and the common, inactive clipping step costs no memory traffic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _chunk_table as ct
from ._jit import MUL, as_f64, chunk_bounds, math_type, rewrite_chunk, tensor_ptr, to_storage

SCALE, CLIP, UNSCALE_CLIP = 0, 1, 2


@triton.jit
def _round(v, CODE: tl.constexpr):
    """A float32 value rounded to the dtype ``CODE`` (to nearest even), back in float32."""
    if CODE == 2:
        r = to_storage(v, tl.float16).to(tl.float32)
    elif CODE == 3:
        r = to_storage(v, tl.bfloat16).to(tl.float32)
    else:
        r = v
    return r


@triton.jit
def clip_coef(total_ptr, max_norm_bits, eps_bits, CODE: tl.constexpr):
    """torch's clip coefficient from the total norm at ``total_ptr`` (dtype code CODE), as a float64
    scalar, exactly as the Rust core's ``clip_coef``: torch evaluates ``max_norm / (t + 1e-6)`` as
    ``(t + 1e-6).reciprocal() * max_norm``, each op in float32 (float64 for a float64 total) with
    the Python scalars in that precision, each result rounded to the total's dtype; then
    ``clamp(max=1)``, NaN kept. ``max_norm`` and ``1e-6`` arrive as float64 bits."""
    max_norm = as_f64(max_norm_bits)
    eps = as_f64(eps_bits)
    t = tl.load(total_ptr)
    if CODE == 1:
        coef = (1.0 / (t.to(tl.float64) + eps)) * max_norm  # float64 division is IEEE-rounded
    else:
        denom = _round(t.to(tl.float32) + eps.to(tl.float32), CODE)
        # Plain float32 `/` may compile to an approximate division; div_rn is IEEE-rounded.
        recip = _round(tl.div_rn(tl.full([], 1.0, tl.float32), denom), CODE)
        coef = _round(recip * max_norm.to(tl.float32), CODE)
    coef = tl.where(coef > 1.0, 1.0, coef)
    return coef.to(tl.float64)


@triton.jit(do_not_specialize=["chunk_base", "max_norm_bits", "eps_bits"])
def _scale_kernel(
    addr_ptr,  # int64 per tensor: data addresses
    numel_ptr,  # int64 per tensor: element counts
    chunk_tensor_ptr,  # int64 per chunk: the tensor it belongs to
    chunk_index_ptr,  # int64 per chunk: its position inside that tensor
    factor_ptr,  # [1]: the scale (SCALE) or the total norm (CLIP, UNSCALE_CLIP), dtype code FACTOR_CODE
    inv_scale_ptr,  # float32 [1]: unscale factor (UNSCALE_CLIP)
    chunk_base,  # first chunk of this launch's group
    max_norm_bits: tl.int64,  # max_norm as float64 bits (CLIP modes)
    eps_bits: tl.int64,  # torch's 1e-6 as float64 bits (CLIP modes)
    CODE: tl.constexpr,  # dtype code of this group's tensors
    ALIGNED: tl.constexpr,  # this group's addresses are 16-byte aligned
    MODE: tl.constexpr,  # SCALE, CLIP or UNSCALE_CLIP
    FACTOR_CODE: tl.constexpr,  # dtype code of factor_ptr
    CHUNK: tl.constexpr,  # elements per chunk
    BLOCK: tl.constexpr,  # elements per loop step
    VEC: tl.constexpr,  # alignment unit of the body, in elements
):
    if MODE == 0:
        factor = tl.load(factor_ptr).to(tl.float64)
    else:
        factor = clip_coef(factor_ptr, max_norm_bits, eps_bits, FACTOR_CODE)
        if MODE == 2:
            factor = tl.load(inv_scale_ptr).to(tl.float64) * factor
    if factor == 1.0:
        return
    MT: tl.constexpr = math_type(CODE)
    f = factor.to(MT)
    chunk = chunk_base + tl.program_id(0).to(tl.int64)
    t, start, body_end, tail, numel = chunk_bounds(chunk, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, CHUNK, VEC)
    x_ptr = tensor_ptr(addr_ptr, t, CODE, ALIGNED)
    rewrite_chunk(x_ptr, start, body_end, tail, numel, f, f, MUL, MT, CHUNK, BLOCK, VEC)


def scale_launches(table: ct.ChunkTable, mode: int, code: int):
    """The launches of ``x *= factor`` in place over every tensor of ``table`` in ``mode`` (see
    the module docstring; nothing is touched when the factor is exactly 1), for a one-element
    ``factor`` of dtype code ``code`` (as the table's codes): one per group, in order (see
    ``_chunk_table.launches``), each taking ``(factor, inv_scale, max_norm_bits)``, ``inv_scale``
    (float32, one element) only in UNSCALE_CLIP mode, ``max_norm_bits`` the float64 bits of
    ``max_norm`` (``_chunk_table.f64_bits``; 0 in SCALE mode). The caller keeps them with its
    table, and checks the arguments."""
    eps_bits = ct.f64_bits(1e-6) if mode != SCALE else 0
    unscales = mode == UNSCALE_CLIP

    def make(g: ct.Group):
        # Without UNSCALE_CLIP the kernel leaves inv_scale_ptr alone: the address table stands in
        # for it (one address fewer to bind at every call).
        unscale = ct.SLOT if unscales else table.addr_args[0]
        args = (table.addr_args[0], *table.args[:3], ct.SLOT, unscale, g.base, ct.SLOT, eps_bits)
        return args, False, {"CODE": g.codes[0], "MODE": mode, "FACTOR_CODE": code}

    return ct.launches(table, _scale_kernel, (mode, code), make)
