"""Multi-tensor norms, optionally of the unscaled values ``x * inv_scale`` with an inf/NaN check.

One launch per group of the chunk table (one in the common single-dtype case), and no separate
finalize launch: each program reduces its chunk to one float64 *partial* (sum of |u|^p, or
max/min of |u|) and writes it to a scratch slot of its own; then

- when per-tensor results are needed (``per_tensor=True``, or order 0, whose total counts the
  tensors with a non-zero element), the last program of each tensor to finish (an int32 counter
  per tensor) reduces that tensor's partials, in chunk order, to the tensor's raw value;
- the last program of the whole call (an int32 counter over every launch of the call) reduces
  the per-tensor raw values, in tensor order, or else all partials, in chunk order, and writes
  the total (and the per-tensor norms).

Results are bitwise reproducible: every value is reduced in a fixed order by a fixed program
shape, whatever order the programs ran in; no floating-point atomics. The counters are reset by
the program that finishes with them, so consecutive calls (and CUDA-graph replays) start from
zero without a memset.

Accumulation: terms are formed and summed per lane in float32 (float64 for float64 tensors),
fp16/bf16 widened to float32 first (fp16 squares cannot overflow); partials and everything after
are float64, rounded once to the output dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import _chunk_table as ct
from ._jit import as_f64, chunk_bounds, is_finite, loop_bound, math_type, tail_mask, tensor_ptr
from ._launch import INTERPRET

# Norm kinds (compile-time constants), as the Rust core's NormKind.
ZERO, ONE, TWO, INF, NEG_INF, P = 0, 1, 2, 3, 4, 5

# found_inf handling of the unscaling variant.
FOUND_NONE = 0  # no check (plain norm)
FOUND_WRITE = 1  # write 0.0 or 1.0 (a fresh flag)
FOUND_SET = 2  # write 1.0 if found, else leave as is (the caller's flag, never reset)


def norm_kind(p: float) -> int:
    if p == 0:
        return ZERO
    if p == 1:
        return ONE
    if p == 2:
        return TWO
    if p == float("inf"):
        return INF
    if p == float("-inf"):
        return NEG_INF
    return P


@triton.jit
def _pow(a, e, LIBDEVICE: tl.constexpr):
    """``a ** e`` for float64 ``a >= 0`` (inf and NaN included)."""
    if LIBDEVICE:
        r = libdevice.pow(a, e)
    else:
        # The interpreter has no libdevice; numpy's float64 log2/exp2 are accurate to far below
        # the float32 rounding that follows for fp32 tensors.
        r = tl.exp2(e * tl.log2(a))
    return r


@triton.constexpr_function
def _identity(kind):
    """The value of a reduction over nothing (the fill of masked lanes)."""
    return float("inf") if kind == NEG_INF else 0.0


@triton.jit
def _term(u, mask, p, KIND: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The contribution of each element ``u`` (masked lanes: the identity), in ``u``'s dtype."""
    if KIND == 0:
        r = tl.where(u != 0, 1.0, 0.0).to(u.dtype)  # NaN counts: NaN != 0
    elif KIND == 2:
        r = u * u
    elif KIND == 5:
        # The power in float64, rounded once to the arithmetic type (as the Rust core does).
        r = _pow(tl.abs(u).to(tl.float64), p, LIBDEVICE).to(u.dtype)
    else:
        r = tl.abs(u)
    return tl.where(mask, r, _identity(KIND))


@triton.jit
def _combine(acc, v, KIND: tl.constexpr):
    """Lane-wise combine; max and min keep NaN (once a lane is NaN it stays NaN)."""
    if KIND == 3:
        r = tl.where((v > acc) | (v != v), v, acc)
    elif KIND == 4:
        r = tl.where((v < acc) | (v != v), v, acc)
    else:
        r = acc + v
    return r


@triton.jit
def _reduce(acc, KIND: tl.constexpr):
    """A vector of lanes to one float64 scalar, in a fixed order; NaN-propagating for max/min."""
    a = acc.to(tl.float64)
    if KIND == 3 or KIND == 4:
        nan = tl.max((a != a).to(tl.int32), axis=0)
        if KIND == 3:
            m = tl.max(tl.where(a != a, 0.0, a), axis=0)
        else:
            m = tl.min(tl.where(a != a, float("inf"), a), axis=0)
        r = tl.where(nan > 0, float("nan"), m)
    else:
        r = tl.sum(a, axis=0)
    return r


@triton.jit
def _reduce_range(ptr, first, count, KIND: tl.constexpr, FBLOCK: tl.constexpr):
    """Reduces float64 values ``ptr[first:first + count]`` written by other programs of this call.

    ``.cg`` loads go to L2, past this SM's L1, which may hold stale lines of the scratch buffers
    from an earlier call (the atomics that ordered the writes do not invalidate it).
    """
    acc = tl.full([FBLOCK], _identity(KIND), tl.float64)
    for j in range(0, loop_bound(count), FBLOCK):
        idx = j + tl.arange(0, FBLOCK)
        v = tl.load(ptr + first + idx, mask=idx < count, other=_identity(KIND), cache_modifier=".cg")
        acc = _combine(acc, v, KIND)
    return _reduce(acc, KIND)


@triton.jit
def _finish(raw, p, KIND: tl.constexpr, LIBDEVICE: tl.constexpr):
    """A raw float64 reduction to its norm."""
    if KIND == 2:
        r = tl.sqrt(raw)  # float64 sqrt is IEEE-rounded
    elif KIND == 5:
        r = _pow(raw, 1.0 / p, LIBDEVICE)
    else:
        r = raw
    return r


@triton.jit(do_not_specialize=["chunk_base", "n_tensors", "n_chunks", "p_bits"])
def _norm_kernel(
    addr_ptr,  # int64 per tensor: data addresses
    numel_ptr,  # int64 per tensor: element counts
    chunk_tensor_ptr,  # int64 per chunk: the tensor it belongs to
    chunk_index_ptr,  # int64 per chunk: its position inside that tensor
    first_chunk_ptr,  # int64 per tensor: its first chunk
    chunk_count_ptr,  # int64 per tensor: its number of chunks
    partial_ptr,  # float64 per chunk (scratch): each program's partial reduction
    raw_ptr,  # float64 per tensor (scratch): per-tensor reductions (PER_TENSOR)
    counter_ptr,  # int32 [2 + n] (scratch, zero between calls): programs done, found flag, chunks done per tensor
    total_ptr,  # out, 0-d float32/float64: the total norm
    per_ptr,  # out, float32/float64 per tensor: per-tensor norms (WRITE_PER)
    inv_scale_ptr,  # float32 [1]: unscale factor (FOUND != 0)
    found_ptr,  # float32 [1]: found_inf flag (FOUND != 0)
    chunk_base,  # first chunk of this launch's group
    n_tensors,  # tensors in the table
    n_chunks,  # chunks in the table, over all launches of this call
    p_bits: tl.int64,  # the norm order p as float64 bits (KIND == P)
    CODE: tl.constexpr,  # dtype code of this group's tensors
    ALIGNED: tl.constexpr,  # this group's addresses are 16-byte aligned
    KIND: tl.constexpr,  # ZERO, ONE, TWO, INF, NEG_INF or P
    PER_TENSOR: tl.constexpr,  # reduce per tensor first (order 0, or WRITE_PER)
    WRITE_PER: tl.constexpr,  # write per-tensor norms to per_ptr
    FOUND: tl.constexpr,  # FOUND_NONE: plain norm; else norm of x * inv_scale, found_inf per FOUND_WRITE/SET
    LIBDEVICE: tl.constexpr,  # libdevice.pow available (not under the interpreter)
    CHUNK: tl.constexpr,  # elements per chunk
    BLOCK: tl.constexpr,  # elements per loop step
    FBLOCK: tl.constexpr,  # partials per loop step when finalizing
    VEC: tl.constexpr,  # alignment unit of the body, in elements
):
    MT: tl.constexpr = math_type(CODE)
    chunk = chunk_base + tl.program_id(0).to(tl.int64)
    t, start, body_end, tail, numel = chunk_bounds(chunk, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, CHUNK, VEC)
    x_ptr = tensor_ptr(addr_ptr, t, CODE, ALIGNED)
    p = as_f64(p_bits)
    if FOUND != 0:
        inv = tl.load(inv_scale_ptr).to(MT)

    acc = tl.full([BLOCK], _identity(KIND), MT)
    bad = tl.zeros([BLOCK], tl.int32)
    for k in range(loop_bound(start), loop_bound(body_end), BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < body_end
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(MT)
        if FOUND != 0:
            bad = bad | (~is_finite(x) & mask).to(tl.int32)
            x = x * inv
        acc = _combine(acc, _term(x, mask, p, KIND, LIBDEVICE), KIND)
    partial = _reduce(acc, KIND)

    offs = tail + tl.arange(0, VEC)
    mask = tail_mask(offs, start, numel, CHUNK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(MT)
    if FOUND != 0:
        tail_bad = (~is_finite(x) & mask).to(tl.int32)
        x = x * inv
    partial = _combine(partial, _reduce(_term(x, mask, p, KIND, LIBDEVICE), KIND), KIND)
    tl.store(partial_ptr + chunk, partial)
    if FOUND != 0:
        any_bad = tl.maximum(tl.max(bad, axis=0), tl.max(tail_bad, axis=0))
        tl.atomic_or(counter_ptr + 1, 1, mask=any_bad > 0)

    if PER_TENSOR:
        # Every thread's writes above happen before the counter increment (barrier, then a
        # release); the program that sees the tensor's last count acquires them.
        tl.debug_barrier()
        seen = tl.atomic_add(counter_ptr + 2 + t, 1, sem="acq_rel")
        count = tl.load(chunk_count_ptr + t)
        if seen == count - 1:
            tl.debug_barrier()
            raw = _reduce_range(partial_ptr, tl.load(first_chunk_ptr + t), count, KIND, FBLOCK)
            tl.store(raw_ptr + t, raw)
            tl.store(counter_ptr + 2 + t, 0)

    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if done == n_chunks - 1:
        # Last program of the call: every partial (and every per-tensor raw value) is written.
        tl.debug_barrier()
        if PER_TENSOR:
            acc_t = tl.full([FBLOCK], _identity(KIND), tl.float64)
            for j in range(0, loop_bound(n_tensors), FBLOCK):
                idx = j + tl.arange(0, FBLOCK)
                m = idx < n_tensors
                r = tl.load(raw_ptr + idx, mask=m, other=_identity(KIND), cache_modifier=".cg")
                if WRITE_PER:
                    tl.store(per_ptr + idx, _finish(r, p, KIND, LIBDEVICE).to(per_ptr.dtype.element_ty), mask=m)
                if KIND == 0:
                    # As torch's get_total_norm: the order-0 norm of the per-tensor counts, i.e.
                    # the number of tensors with a non-zero element.
                    acc_t = acc_t + tl.where(r != 0, 1.0, 0.0)
                else:
                    acc_t = _combine(acc_t, r, KIND)
            total = _reduce(acc_t, KIND)
        else:
            total = _reduce_range(partial_ptr, 0, n_chunks, KIND, FBLOCK)
        total = _finish(total, p, KIND, LIBDEVICE)
        tl.store(total_ptr, total.to(total_ptr.dtype.element_ty))
        if FOUND != 0:
            flag = tl.atomic_xchg(counter_ptr + 1, 0)
            if FOUND == 1:
                tl.store(found_ptr, flag.to(tl.float32))
            else:
                tl.store(found_ptr, 1.0, mask=flag != 0)
        tl.store(counter_ptr, 0)


def multi_tensor_norm(
    table: ct.ChunkTable,
    norm_type: float,
    total: torch.Tensor,
    per: torch.Tensor | None = None,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    found_mode: int = FOUND_NONE,
) -> None:
    """Writes the ``norm_type``-norm of the table's tensors to ``total`` (0-d, float32 or float64)
    and, when ``per`` is given, each tensor's norm to ``per``. With ``found_mode`` other than
    FOUND_NONE, the norm is that of ``x * inv_scale`` (formed in the arithmetic type, never
    rounded to the storage dtype) and ``found_inf`` records whether any ``x`` was inf or NaN.

    One launch per table group; the last program of the last launch finalizes.
    """
    if total.dtype not in (torch.float32, torch.float64) or total.numel() != 1:
        raise TypeError(f"gradfuse.kernels: the total must be a float32/float64 scalar, got {total.dtype}")
    if per is not None and per.numel() != table.n_tensors:
        raise ValueError(f"gradfuse.kernels: per-tensor output has {per.numel()} elements for {table.n_tensors}")
    if found_mode != FOUND_NONE and (inv_scale is None or found_inf is None):
        raise ValueError("gradfuse.kernels: the unscaling norm needs inv_scale and found_inf")
    values = (total,) if per is None else (total, per)
    if found_mode != FOUND_NONE:
        values += (inv_scale, found_inf)
    for launch in norm_launches(table, norm_type, per is not None, found_mode):
        launch(*values)


def norm_launches(table: ct.ChunkTable, norm_type: float, write_per: bool = False, found_mode: int = FOUND_NONE):
    """The launches of :func:`multi_tensor_norm` on ``table`` (one per group, in order; see
    ``_chunk_table.launches``), each taking ``(total, per, inv_scale, found_inf)`` as that function
    takes them, ``per`` only when ``write_per``, ``inv_scale`` and ``found_inf`` only with a
    ``found_mode`` other than FOUND_NONE: for a caller that keeps them (and checks them itself)."""
    kind = norm_kind(norm_type)
    found = found_mode != FOUND_NONE
    p_bits = ct.f64_bits(norm_type)

    def make(g: ct.Group):
        scratch = table.scratch_args()
        # An output the flags leave unused gets a scratch buffer, never touched, in place of a
        # slot: one address fewer to bind at every call.
        unused = scratch[0]
        outs = (ct.SLOT, ct.SLOT if write_per else unused, *((ct.SLOT, ct.SLOT) if found else (unused, unused)))
        args = (table.addr_args[0], *table.args, *scratch, *outs, g.base, table.n_tensors, table.n_chunks, p_bits)
        meta = dict(
            CODE=g.codes[0], KIND=kind, PER_TENSOR=write_per or kind == ZERO, WRITE_PER=write_per, FOUND=found_mode,
            LIBDEVICE=not INTERPRET, FBLOCK=ct.FBLOCK,
        )  # fmt: skip
        return args, True, meta  # acc + u * u may become one FMA (more accurate, never less)

    return ct.launches(table, _norm_kernel, (p_bits, write_per, found_mode), make)
