"""Gradient-health statistics from the norm's one read: per tensor its norm, its largest
magnitude and its count of inf/NaN elements, and the total norm.

Two launches (plus one per extra dtype group of the table):

- ``_stats_kernel``, one program per chunk, reads the chunk once and writes three partials to
  scratch: the norm's partial, formed as ``_norm._norm_kernel`` forms it but over smaller
  blocks (registers: see the launch), so the norms equal the norm kernel's within rounding;
  the largest ``|x|`` (NaN-propagating); and the count of elements that are inf or NaN;
- ``_stats_finish_kernel``, one program per tensor, reduces that tensor's partials in chunk
  order (as the norm kernel does) and writes its norm, largest magnitude and count; the last
  program to finish (an int32 counter, reset by that program) reduces the per-tensor raw
  values, in tensor order, to the total.

Bitwise reproducible (fixed reduction orders, no floating-point atomics); no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _chunk_table as ct
from ._jit import as_f64, chunk_bounds, is_finite, loop_bound, math_type, tail_mask, tensor_ptr
from ._launch import INTERPRET
from ._norm import INF, _combine, _finish, _identity, _reduce, _reduce_range, _term, norm_kind

#: The norm kind whose combine is a max of |x|, for the largest magnitudes. A global read inside a
#: kernel must be a ``tl.constexpr`` object: the interpreter accepts a plain int, the compiler
#: refuses it (found by tests/test_compile.py).
AMAX_KIND = tl.constexpr(INF)
F64_CODE = 1  # float64's storage code (gradfuse._plan.DTYPE_CODES)


@triton.jit(do_not_specialize=["chunk_base", "p_bits"])
def _stats_kernel(
    addr_ptr,  # int64 per tensor: data addresses
    numel_ptr,  # int64 per tensor: element counts
    chunk_tensor_ptr,  # int64 per chunk: the tensor it belongs to
    chunk_index_ptr,  # int64 per chunk: its position inside that tensor
    partial_ptr,  # float64 per chunk (scratch): the norm's partial reduction
    amax_ptr,  # float64 per chunk (scratch): largest |x|, NaN if any x is NaN
    bad_ptr,  # int64 per chunk (scratch): elements that are inf or NaN
    chunk_base,  # first chunk of this launch's group
    p_bits: tl.int64,  # the norm order p as float64 bits (KIND == P)
    CODE: tl.constexpr,  # dtype code of this group's tensors
    ALIGNED: tl.constexpr,  # this group's addresses are 16-byte aligned
    KIND: tl.constexpr,  # ZERO, ONE, TWO, INF, NEG_INF or P
    LIBDEVICE: tl.constexpr,  # libdevice.pow available (not under the interpreter)
    CHUNK: tl.constexpr,  # elements per chunk
    BLOCK: tl.constexpr,  # elements per loop step
    VEC: tl.constexpr,  # alignment unit of the body, in elements
):
    MT: tl.constexpr = math_type(CODE)
    chunk = chunk_base + tl.program_id(0).to(tl.int64)
    t, start, body_end, tail, numel = chunk_bounds(chunk, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, CHUNK, VEC)
    x_ptr = tensor_ptr(addr_ptr, t, CODE, ALIGNED)
    p = as_f64(p_bits)

    acc = tl.full([BLOCK], _identity(KIND), MT)
    big = tl.zeros([BLOCK], MT)
    bad = tl.zeros([BLOCK], tl.int32)
    for k in range(loop_bound(start), loop_bound(body_end), BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < body_end
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(MT)
        acc = _combine(acc, _term(x, mask, p, KIND, LIBDEVICE), KIND)
        big = _combine(big, tl.abs(x), AMAX_KIND)  # masked lanes loaded 0: no effect on a max of |x|
        bad += (~is_finite(x) & mask).to(tl.int32)
    partial = _reduce(acc, KIND)
    amax = _reduce(big, AMAX_KIND)
    count = tl.sum(bad, axis=0).to(tl.int64)

    offs = tail + tl.arange(0, VEC)
    mask = tail_mask(offs, start, numel, CHUNK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(MT)
    partial = _combine(partial, _reduce(_term(x, mask, p, KIND, LIBDEVICE), KIND), KIND)
    amax = _combine(amax, _reduce(tl.abs(x), AMAX_KIND), AMAX_KIND)
    count += tl.sum((~is_finite(x) & mask).to(tl.int32), axis=0).to(tl.int64)
    tl.store(partial_ptr + chunk, partial)
    tl.store(amax_ptr + chunk, amax)
    tl.store(bad_ptr + chunk, count)


@triton.jit(do_not_specialize=["n_tensors", "p_bits"])
def _stats_finish_kernel(
    first_chunk_ptr,  # int64 per tensor: its first chunk
    chunk_count_ptr,  # int64 per tensor: its number of chunks
    partial_ptr,  # float64 per chunk: the norm's partials (from _stats_kernel)
    amax_ptr,  # float64 per chunk: largest |x| per chunk
    bad_ptr,  # int64 per chunk: inf/NaN counts per chunk
    raw_ptr,  # float64 per tensor (scratch): per-tensor raw reductions
    counter_ptr,  # int32 [1] (scratch, zero between calls): programs done
    total_ptr,  # out, 0-d float32/float64: the total norm
    norms_ptr,  # out, float32/float64 per tensor: norms
    out_amax_ptr,  # out, float32/float64 per tensor: largest magnitudes
    out_bad_ptr,  # out, int64 per tensor: inf/NaN counts
    n_tensors,  # tensors in the table
    p_bits: tl.int64,  # the norm order p as float64 bits (KIND == P)
    KIND: tl.constexpr,  # ZERO, ONE, TWO, INF, NEG_INF or P
    LIBDEVICE: tl.constexpr,  # libdevice.pow available (not under the interpreter)
    FBLOCK: tl.constexpr,  # partials per loop step
):
    t = tl.program_id(0).to(tl.int64)
    p = as_f64(p_bits)
    first = tl.load(first_chunk_ptr + t)
    count = tl.load(chunk_count_ptr + t)
    raw = _reduce_range(partial_ptr, first, count, KIND, FBLOCK)
    amax = _reduce_range(amax_ptr, first, count, AMAX_KIND, FBLOCK)
    bad = tl.zeros([FBLOCK], tl.int64)
    for j in range(0, loop_bound(count), FBLOCK):
        idx = j + tl.arange(0, FBLOCK)
        bad += tl.load(bad_ptr + first + idx, mask=idx < count, other=0, cache_modifier=".cg")
    tl.store(raw_ptr + t, raw)
    tl.store(norms_ptr + t, _finish(raw, p, KIND, LIBDEVICE).to(norms_ptr.dtype.element_ty))
    tl.store(out_amax_ptr + t, amax.to(out_amax_ptr.dtype.element_ty))
    tl.store(out_bad_ptr + t, tl.sum(bad, axis=0))

    # Every thread's writes above happen before the increment; the last program acquires them.
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if done == n_tensors - 1:
        tl.debug_barrier()
        # As the norm kernel with per-tensor results: tensor raws, in order, FBLOCK lanes.
        acc_t = tl.full([FBLOCK], _identity(KIND), tl.float64)
        # Names of their own: Triton refuses a name whose type changes (j above is int64).
        for k in range(0, loop_bound(n_tensors), FBLOCK):
            kdx = k + tl.arange(0, FBLOCK)
            r = tl.load(raw_ptr + kdx, mask=kdx < n_tensors, other=_identity(KIND), cache_modifier=".cg")
            if KIND == 0:
                acc_t = acc_t + tl.where(r != 0, 1.0, 0.0)  # torch: the tensors with a non-zero
            else:
                acc_t = _combine(acc_t, r, KIND)
        total = _finish(_reduce(acc_t, KIND), p, KIND, LIBDEVICE)
        tl.store(total_ptr, total.to(total_ptr.dtype.element_ty))
        tl.store(counter_ptr, 0)


def multi_tensor_stats(
    table: ct.ChunkTable,
    norm_type: float,
    total: torch.Tensor,
    norms: torch.Tensor,
    amax: torch.Tensor,
    nonfinite: torch.Tensor,
) -> None:
    """Writes the ``norm_type``-norm of the table's tensors to ``total`` (0-d) and, per tensor,
    its norm to ``norms``, its largest magnitude to ``amax`` (both float32 or float64) and its
    count of inf/NaN elements to ``nonfinite`` (int64), from one read of the tensors."""
    n = table.n_tensors
    if total.dtype not in (torch.float32, torch.float64) or total.numel() != 1:
        raise TypeError(f"gradfuse.kernels: the total must be a float32/float64 scalar, got {total.dtype}")
    for name, out in (("norms", norms), ("amax", amax), ("nonfinite", nonfinite)):
        if out.numel() != n:
            raise ValueError(f"gradfuse.kernels: {name} has {out.numel()} elements for {n} tensors")
    if nonfinite.dtype != torch.int64:
        raise TypeError(f"gradfuse.kernels: nonfinite must be int64, got {nonfinite.dtype}")
    kind = norm_kind(norm_type)
    chunk_amax = torch.empty(table.n_chunks, dtype=torch.float64, device=table.device)
    chunk_bad = torch.empty(table.n_chunks, dtype=torch.int64, device=table.device)
    p_bits = ct.f64_bits(norm_type)

    def make(g: ct.Group):
        partials = table.scratch_args()[0]
        args = (table.addr_args[0], *table.args[:3], partials, ct.SLOT, ct.SLOT, g.base, p_bits)
        meta = dict(
            # Smaller blocks than the norm kernel's: three accumulators per lane (sum, max,
            # count) at 2048 took 133-158 registers for float64 inputs and spilled 8 bytes for
            # float16 max norms on sm_80; at 1024 float64 max norms still spilled 8 bytes on sm_80
            # (tests/test_compile.py). 1024, and 512 for float64, fit its limits.
            BLOCK=ct.BLOCK // 4 if g.codes[0] == F64_CODE else ct.BLOCK // 2,
            CODE=g.codes[0],
            KIND=kind,
            LIBDEVICE=not INTERPRET,
        )
        return args, True, meta  # fp_fusion as the norm kernel: the same partials, bit for bit

    ct.run(table, _stats_kernel, (p_bits,), make, chunk_amax, chunk_bad)

    def make_finish():
        # counters[0] is the norm kernel's "programs finished", zero between calls of either kernel.
        partials, raws, counters = table.scratch_args()
        args = (table.args[3], table.args[4], partials, ct.SLOT, ct.SLOT, raws, counters)
        args += (ct.SLOT, ct.SLOT, ct.SLOT, ct.SLOT, n, p_bits)
        meta = {"KIND": kind, "LIBDEVICE": not INTERPRET, "FBLOCK": ct.FBLOCK, "num_warps": ct.NUM_WARPS}
        # FP fusion stated, as the norm kernel's finalizing program has it (Triton 3.9 warns when it
        # is unset, and 3.10 changes its default).
        return args, {**meta, "enable_fp_fusion": True}

    outputs = (total, norms, amax, nonfinite)
    ct.run_once(table, _stats_finish_kernel, n, (p_bits,), make_finish, chunk_amax, chunk_bad, *outputs)
