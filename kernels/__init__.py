"""Triton backend of the ``gradfuse::`` ops: CUDA tensors (and, with ``GRADFUSE_BACKEND=triton``
under ``TRITON_INTERPRET=1``, CPU tensors).

Same functions, arguments, results and side effects as the CPU backend (``gradfuse._cpu``); the
ops layer (``gradfuse.ops``) validates every argument and picks a backend per call. Each list of
tensors runs from a cached chunk table (``_chunk_table``): one launch per dtype group covers every
tensor, whatever their number. Nothing here waits for the device or reads a device value on the
host, except ``clip_grad_norm_(error_if_nonfinite=True)``, whose error needs the total on the
host; every call can be captured in a CUDA graph (after one warm-up call, as usual, so that the
chunk table is built outside the capture).

A chunk table's scratch buffers (norm partials and counters) serve one call at a time: calls on
one stream are ordered, but two norms of the very same tensors running concurrently on two
streams would share them.

Launches per call, for tensors of one dtype: ``norm`` 1 (the last program finalizes), ``stats`` 2, ``unit_norms`` 1,
``scale_units_`` 1, ``scale_``/``clip_grads_with_norm_``/``unscale_and_check_``/``accumulate_``/``clamp_`` 1,
``clip_grad_norm_`` 2, ``unscale_check_norm`` 1, ``unscale_and_clip_`` 2. Mixed dtypes (or mixed
16-byte address alignment) add one launch per extra group to each pass.
"""

from __future__ import annotations

import torch

from . import _accumulate, _clamp, _norm, _scale, _stats, _unitwise, _unscale
from ._chunk_table import chunk_table

__all__ = [
    "accumulate_",
    "clamp_",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "norm",
    "scale_",
    "scale_units_",
    "stats",
    "unit_norms",
    "unscale_and_check_",
    "unscale_and_clip_",
    "unscale_check_norm",
    "unscale_norm_",
]


def _nonfinite_error(norm_type: float) -> RuntimeError:
    from gradfuse._plan import nonfinite_total_error

    return nonfinite_total_error(norm_type)


def _empty_norm(plan, per_tensor: bool):
    out = plan.out_dtype
    total = torch.zeros((), dtype=out, device=plan.device)
    return total, torch.zeros(0, dtype=out, device=plan.device)


def norm(plan, norm_type: float, per_tensor: bool):
    """``(total, per)``: the ``norm_type``-norm of all tensors (0-d) and of each (shape ``(n,)``,
    or ``(0,)`` unless ``per_tensor``), in ``plan.out_dtype``."""
    if len(plan) == 0:
        return _empty_norm(plan, per_tensor)
    table = chunk_table([plan])
    out = plan.out_dtype
    total = torch.empty((), dtype=out, device=plan.device)
    per = torch.empty(len(plan) if per_tensor else 0, dtype=out, device=plan.device)
    _norm.multi_tensor_norm(table, norm_type, total, per if per_tensor else None)
    return total, per


def stats(plan, norm_type: float):
    """``(total, norms, amax, nonfinite)``: the total norm (0-d), and per tensor its norm, its
    largest magnitude (``plan.out_dtype``) and its count of inf/NaN elements (int64), in one
    read of the tensors (two launches, see ``_stats``)."""
    out, n, device = plan.out_dtype, len(plan), plan.device
    norms, amax = torch.empty(n, dtype=out, device=device), torch.empty(n, dtype=out, device=device)
    nonfinite = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return torch.zeros((), dtype=out, device=device), norms, amax, nonfinite
    total = torch.empty((), dtype=out, device=device)
    _stats.multi_tensor_stats(chunk_table([plan]), norm_type, total, norms, amax, nonfinite)
    return total, norms, amax, nonfinite


def unit_norms(plan, units: list[int], norm_type: float) -> torch.Tensor:
    """The norm of every unit (``units[i]`` equal parts of tensor ``i``): one norm launch over
    the units as tensors of their own (``_unitwise``)."""
    out = torch.empty(sum(units), dtype=plan.out_dtype, device=plan.device)
    if out.numel():
        total = torch.empty((), dtype=plan.out_dtype, device=plan.device)
        _norm.multi_tensor_norm(chunk_table([_unitwise.row_plan(plan, units)]), norm_type, total, out)
    return out


def scale_units_(plan, units: list[int], factors: torch.Tensor) -> None:
    """``x *= factors[k]`` for every element of unit ``k``; units with factor 1 are not touched."""
    if sum(units):
        table = chunk_table([_unitwise.row_plan(plan, units)])
        plan.before_write()
        _unitwise.scale_units_(table, factors)


def scale_(plan, scale: torch.Tensor) -> None:
    """``x *= scale`` in place; ``scale`` is a one-element device tensor, read by the kernel (a
    scale of exactly 1 touches nothing)."""
    if len(plan):
        table = chunk_table([plan])
        plan.before_write()
        _scale.multi_tensor_scale_(table, _scale.SCALE, scale)


def clip_grads_with_norm_(plan, max_norm: float, total_norm: torch.Tensor) -> None:
    """``x *= clamp(max_norm / (total_norm + 1e-6), max=1)`` with the coefficient computed on the
    device in ``total_norm``'s dtype (torch's arithmetic); a coefficient of 1 touches nothing."""
    if len(plan):
        table = chunk_table([plan])
        plan.before_write()
        _scale.multi_tensor_scale_(table, _scale.CLIP, total_norm, max_norm)


def clip_grad_norm_(plan, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """Total norm, then clipping by it: two launches (norm with fused finalize, then scale)."""
    if len(plan) == 0:
        return _empty_norm(plan, False)[0]
    table = chunk_table([plan])
    total = torch.empty((), dtype=plan.out_dtype, device=plan.device)
    _norm.multi_tensor_norm(table, norm_type, total)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        # The one host sync of this backend, asked for by the caller; nothing was modified yet.
        raise _nonfinite_error(norm_type)
    plan.before_write()
    _scale.multi_tensor_scale_(table, _scale.CLIP, total, max_norm)
    return total


def unscale_and_check_(plan, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """As ``torch._amp_foreach_non_finite_check_and_unscale_``: ``x *= inv_scale``, and
    ``found_inf = 1.0`` if any ``x`` was inf or NaN (never reset to 0)."""
    if len(plan):
        table = chunk_table([plan])
        plan.before_write(found_inf)
        _unscale.unscale_and_check_(table, inv_scale, found_inf)


def unscale_check_norm(plan, inv_scale: torch.Tensor, norm_type: float):
    """One read-only pass: ``(norm of x * inv_scale, found_inf)``, ``found_inf`` a new 0-d
    float32 tensor (1.0 if any ``x`` was inf or NaN)."""
    found = torch.empty((), dtype=torch.float32, device=inv_scale.device)
    if len(plan) == 0:
        return _empty_norm(plan, False)[0], found.zero_()
    table = chunk_table([plan])
    total = torch.empty((), dtype=plan.out_dtype, device=plan.device)
    _norm.multi_tensor_norm(table, norm_type, total, None, inv_scale, found, _norm.FOUND_WRITE)
    return total, found


def _measure_then_scale(plan, inv_scale: torch.Tensor, found_inf: torch.Tensor, norm_type: float, scale):
    """The read-only unscale+check+norm pass, then ``scale(table, total)``, the write pass;
    returns the norm of the unscaled tensors."""
    if len(plan) == 0:
        return _empty_norm(plan, False)[0]
    table = chunk_table([plan])
    total = torch.empty((), dtype=plan.out_dtype, device=plan.device)
    plan.before_write(found_inf)
    _norm.multi_tensor_norm(table, norm_type, total, None, inv_scale, found_inf, _norm.FOUND_SET)
    scale(table, total)
    return total


def unscale_and_clip_(plan, inv_scale: torch.Tensor, found_inf: torch.Tensor, max_norm: float, norm_type: float):
    """Read-only unscale+check+norm pass, then one write pass by ``inv_scale * clip_coef(norm)``
    (skipped when that product is exactly 1); returns the norm of the unscaled tensors."""
    return _measure_then_scale(
        plan,
        inv_scale,
        found_inf,
        norm_type,
        lambda table, total: _scale.multi_tensor_scale_(table, _scale.UNSCALE_CLIP, total, max_norm, inv_scale),
    )


def unscale_norm_(plan, inv_scale: torch.Tensor, found_inf: torch.Tensor, norm_type: float):
    """``x *= inv_scale`` in place; returns the norm of the scaled values and sets ``found_inf``
    to 1.0 if any ``x`` was inf or NaN. Two launches (a read-only norm pass, then the write):
    the DDP hook takes this path only for gloo on CUDA; with NCCL the all-reduce averages and
    the hook's pass is read-only."""
    return _measure_then_scale(
        plan,
        inv_scale,
        found_inf,
        norm_type,
        lambda table, total: _scale.multi_tensor_scale_(table, _scale.SCALE, inv_scale),
    )


def accumulate_(dst, src, alpha: float) -> None:
    """``dst[i] += alpha * src[i]``, in float64 if either side is float64, else float32."""
    if len(dst):
        table = chunk_table([dst, src])
        dst.before_write()
        _accumulate.accumulate_(table, alpha)


def clamp_(plan, lo: float, hi: float) -> None:
    """``x = min(max(x, lo), hi)`` in place, NaN kept."""
    if len(plan):
        table = chunk_table([plan])
        plan.before_write()
        _clamp.clamp_(table, lo, hi)
