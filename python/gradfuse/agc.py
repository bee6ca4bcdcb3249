"""Adaptive gradient clipping (AGC, Brock et al. 2021, "High-Performance Large-Scale Image
Recognition Without Normalization"), as ``timm.utils.agc.adaptive_clip_grad``: per output unit
of every parameter (a row of a Linear or Conv weight, along its first dimension; the whole
tensor when it has at most one dimension)

    max_norm = clip_factor * max(||W_unit||, eps)
    G_unit  *= max_norm / max(||G_unit||, 1e-6)   where ||G_unit|| >= max_norm

in two fused passes over all parameters, whatever their number: one read of every weight and
gradient for the unit norms (``gradfuse::unit_norms``), then one write of the gradient units
that are clipped (``gradfuse::scale_units_``); the factors in between are a few element-wise
ops over the unit norms (one value per unit), on the device, with no host sync.

DTensor parameters (FSDP2's ``fully_shard``) are clipped from their local shards, exactly: FSDP2
shards dim 0, so a row of a tensor with more than one dimension (its unit) is whole on one
rank; a tensor of at most one dimension is one unit spread over the ranks, whose weight and
gradient norms are combined from the ranks' partials by one all-reduce between the two passes
(with the total norm's partial and the inf/NaN flag riding it). Placements that split a row
(``Shard(1)`` of a matrix, ``Partial``) raise.

Where timm's arithmetic differs: its norms are computed by torch in the parameters' dtype
(a bf16 weight's norm in bf16); here every unit norm accumulates in float32 (float64 for
float64 tensors), and the factors are formed in float32 as timm forms them for fp32 models.
"""

from __future__ import annotations

import math
from itertools import compress, repeat
from operator import attrgetter, is_not

import torch
import torch.distributed as dist

from . import _plan as P
from . import distributed as D
from . import ops
from ._policy_state import _check_config, _check_keys
from .clip import _combine_totals
from .ops import _check_units

Tensor = torch.Tensor

__all__ = ["AGC", "adaptive_clip_grad_"]


_grad = attrgetter("grad")
_shape = attrgetter("shape")
#: Units per list of parameter shapes (bounded): AGC's units follow the shapes alone.
_UNITS: dict[tuple, list[int]] = {}


def _units_of(shapes: tuple) -> list[int]:
    """Each parameter's number of units (its rows: ``shape[0]``, or 1 for at most one
    dimension), from its shape; kept per tuple of shapes, so that a later call maps the shapes
    alone (C-level) and looks them up."""
    units = _UNITS.get(shapes)
    if units is None:
        if len(_UNITS) >= 16:
            _UNITS.clear()
        units = _UNITS[shapes] = [s[0] if len(s) > 1 else 1 for s in shapes]
    return units


def adaptive_clip_grad_(parameters, clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0) -> Tensor:
    """Clip ``p.grad`` of every parameter unit-wise (module docstring); returns the
    ``norm_type``-norm of all gradients together before clipping (from the unit norms)."""
    return _agc(parameters, clip_factor, eps, norm_type, None)[0]


def _agc(parameters, clip_factor, eps, norm_type, inv_scale: Tensor | None):
    """``(total norm, {device: found_inf})``. With ``inv_scale`` the gradients are loss-scaled:
    the rule applies to ``grad * inv_scale``, and the one write leaves ``grad * inv_scale *
    factor`` (unscale and clip together); ``found_inf`` (0-d float32 per device, with
    ``inv_scale`` only: empty without) says whether any unit norm, hence any element, was inf or
    NaN."""
    norm_type = P.check_norm_type("gradfuse.adaptive_clip_grad_", norm_type)
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    # C-level maps over the parameters: no Python statement per parameter.
    grads = list(map(_grad, params))
    if not all(map(is_not, grads, repeat(None))):
        keep = list(map(is_not, grads, repeat(None)))
        params, grads = list(compress(params, keep)), list(compress(grads, keep))
    if not params:
        return torch.tensor(0.0), {}
    if D.is_dtensor(grads[0]):  # FSDP2: from the local shards
        with ops.no_grad():
            return _agc_sharded(params, clip_factor, eps, norm_type, inv_scale)
    with ops.no_grad():
        try:
            # One device first, unchecked: the unit-norm pass refuses tensors on several devices
            # (MixedDevicesError) before anything is written.
            return _agc_by_device({grads[0].device: (params, grads)}, clip_factor, eps, norm_type, inv_scale)
        except P.MixedDevicesError:
            by_device: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
            for p, g in zip(params, grads, strict=True):
                ps, gs = by_device.setdefault(g.device, ([], []))
                ps.append(p)
                gs.append(g)
            return _agc_by_device(by_device, clip_factor, eps, norm_type, inv_scale)


def _agc_by_device(by_device: dict, clip_factor, eps, norm_type, inv_scale: Tensor | None):
    """``_agc`` for parameters grouped by device: every device's unit norms and factors first,
    then the total, then (nothing having raised) every device's write."""
    totals, found, writes = [], {}, []
    for device, (weights, grads) in by_device.items():
        # The parameters themselves are the weights: the kernels read their memory (a detached
        # view per parameter would cost a tensor each).
        shapes = tuple(map(_shape, weights))
        units = _units_of(shapes)
        if tuple(map(_shape, grads)) != shapes:
            # A weight re-pointed (.data =) to another shape since its gradient: the units of its
            # shape may not split the gradient. Before any pass (C-level maps when not).
            _check_units("gradfuse.adaptive_clip_grad_", grads, units)
        norms = ops.unit_norms_op(weights + grads, units + units, norm_type)
        k = sum(units)  # 0 when every parameter is empty along dim 0: split() would give one part
        w_norm, g_norm = norms[:k], norms[k:]
        if inv_scale is not None:
            inv = inv_scale.to(device, g_norm.dtype)
            g_norm = g_norm * inv
        factors = _factors(w_norm, g_norm, clip_factor, eps)
        if inv_scale is not None:
            factors.mul_(inv)
            found[device] = (~torch.isfinite(g_norm).all()).float()  # only the scaler's callers read it
        writes.append((grads, units, factors))
        totals.append(torch.linalg.vector_norm(g_norm, norm_type))
    total = _combine_totals(totals, norm_type)
    if len(writes) > 1:  # what would stop a later device's write, found before the first's
        for grads, _, _ in writes:
            P.check_disjoint("gradfuse.adaptive_clip_grad_", "grads", grads)
            P.check_writable(grads)
    for grads, units, factors in writes:
        ops.scale_units_op(grads, units, factors)
    return total, found


def _factors(w_norm: Tensor, g_norm: Tensor, clip_factor: float, eps: float) -> Tensor:
    """timm's rule per unit: ``max_norm / max(||G||, 1e-6)`` where ``||G|| >= max_norm``, else 1."""
    max_norm = w_norm.clamp(min=eps).mul_(clip_factor)
    return torch.where(g_norm < max_norm, 1.0, max_norm / g_norm.clamp(min=1e-6))


def _sharded_locals(params: list[Tensor]):
    """{sharded mesh dims: [(local weight, local grad, whole tensor is one unit)]} and the
    process groups of each set, for DTensor parameters whose rows are whole on each rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = params[0].grad.device_mesh
    by_dims: dict[tuple[int, ...], list[tuple[Tensor, Tensor, bool]]] = {}
    for i, p in enumerate(params):
        g = p.grad
        if not isinstance(p, DTensor) or not isinstance(g, DTensor) or g.device_mesh != mesh:
            raise ValueError(f"AGC: parameter {i} and its gradient must be DTensors on one mesh, as the first's")
        if tuple(p.placements) != tuple(g.placements) or not all(
            isinstance(q, Shard | Replicate) for q in g.placements
        ):
            raise ValueError(
                f"AGC: parameter {i} has placements {tuple(p.placements)}, gradient {tuple(g.placements)}: "
                "AGC needs Shard or Replicate, the same for both"
            )
        if p.dim() > 1 and any(isinstance(q, Shard) and q.dim != 0 for q in g.placements):
            raise ValueError(
                f"AGC: parameter {i} {tuple(p.shape)} is sharded along {tuple(g.placements)}: its units (rows along "
                "dim 0) are split across ranks"
            )
        dims = tuple(d for d, q in enumerate(g.placements) if isinstance(q, Shard))
        by_dims.setdefault(dims, []).append((p._local_tensor.detach(), g._local_tensor, p.dim() <= 1))
    return {dims: (items, [mesh.get_group(d) for d in dims]) for dims, items in by_dims.items()}


def _agc_sharded(params: list[Tensor], clip_factor, eps, norm_type, inv_scale: Tensor | None):
    """``_agc`` for DTensor parameters (module docstring), per set of sharded mesh dims: pass 1
    reads the local weight and gradient units (rows, and the local part of each tensor of at
    most one dimension as one unit); one all-reduce (SUM of ``|x|**p`` partials, or MAX for
    order inf) gives every rank the whole norms of the tensors of at most one dimension, the
    total's partial and the inf/NaN flag; pass 2 writes the local units. Every rank calls the
    same collectives, whatever its shards."""
    p, finite = float(norm_type), math.isfinite(norm_type)
    powered_totals, flags = [], []
    first = params[0].grad._local_tensor.device
    for items, groups in _sharded_locals(params).values():
        rows = [(w, g) for w, g, whole in items if not whole and g.numel()]
        flats = [(w, g) for w, g, whole in items if whole]
        local = [j for j, (_, g) in enumerate(flats) if g.numel()]  # the flat units with elements here
        weights = [w for w, _ in rows] + [flats[j][0] for j in local]
        grads = [g for _, g in rows] + [flats[j][1] for j in local]
        units = [g.shape[0] for _, g in rows] + [1] * len(local)
        devices = {t.device for t in weights + grads}
        if devices - {first}:
            raise ValueError(f"AGC: the local shards are on several devices ({sorted(map(str, devices))})")
        _check_units("gradfuse.adaptive_clip_grad_", grads, units)  # before any pass
        n_rows, k = sum(units) - len(local), len(flats)
        if grads:
            w_norm, g_norm = ops.unit_norms_op(weights + grads, units + units, p).split(sum(units))
        else:  # nothing here: the all-reduce still needs this rank
            w_norm = g_norm = torch.zeros(0, dtype=torch.float32, device=first)
        if inv_scale is not None:
            g_norm = g_norm * inv_scale.to(first, g_norm.dtype)
        index = torch.tensor(local, dtype=torch.int64, device=first)
        partial_w = torch.zeros(k, dtype=torch.float64, device=first)
        partial_g = torch.zeros(k, dtype=torch.float64, device=first)
        to_partial = (lambda x: x.double().pow(p)) if finite else (lambda x: x.double())
        partial_w.index_copy_(0, index, to_partial(w_norm[n_rows:]))
        partial_g.index_copy_(0, index, to_partial(g_norm[n_rows:]))
        row_g = torch.cat([to_partial(g_norm[:n_rows]), torch.zeros(1, dtype=torch.float64, device=first)])
        row_total = row_g.sum() if finite else row_g.amax()  # the rows' part of the total (0: none here)
        flag = (~torch.isfinite(g_norm)).any().double()
        both = torch.cat([partial_w, partial_g, row_total.reshape(1), flag.reshape(1)])
        op = dist.ReduceOp.SUM if finite else dist.ReduceOp.MAX
        for group in groups:
            dist.all_reduce(both, op=op, group=group)
        whole_w, whole_g, row_total, flag = both.split([k, k, 1, 1])
        whole = torch.cat([row_total, whole_g])  # every unit's part of the total, over all ranks
        powered_totals.append(whole.sum() if finite else whole.amax())
        flags.append(flag[0] > 0)
        if not grads:
            continue
        to_norm = (lambda x: x.pow(1.0 / p)) if finite else (lambda x: x)
        flat_w = to_norm(whole_w).index_select(0, index).to(w_norm.dtype)
        flat_g = to_norm(whole_g).index_select(0, index).to(g_norm.dtype)
        factors = _factors(torch.cat([w_norm[:n_rows], flat_w]), torch.cat([g_norm[:n_rows], flat_g]), clip_factor, eps)
        if inv_scale is not None:
            factors = factors * inv_scale.to(first, factors.dtype)
        ops.scale_units_op(grads, units, factors)
    powered = torch.stack(powered_totals)
    total = (powered.sum().pow(1.0 / p) if finite else powered.amax()).float()
    found = torch.stack(flags).any().float()
    return total, {first: found}


class AGC:
    """AGC as a clipping policy (``gradfuse.clipping``): pass it where ``max_norm`` goes,
    ``gradfuse.clip_grad_norm_(model.parameters(), AGC(0.01))``, or to
    ``GradScaler.unscale_and_clip_``. Stateless; its ``state_dict`` holds its configuration."""

    name = "agc"

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0):
        if not (clip_factor > 0 and math.isfinite(clip_factor)):
            raise ValueError(f"AGC: clip_factor must be a positive number, got {clip_factor}")
        if not eps >= 0:
            raise ValueError(f"AGC: eps must be >= 0, got {eps}")
        norm_type = P.check_norm_type("AGC", norm_type)
        if not norm_type > 0:
            raise ValueError(f"AGC: norm_type must be positive (a norm of each unit), got {norm_type}")
        self.clip_factor, self.eps, self.norm_type = float(clip_factor), float(eps), norm_type

    def clip_grads_(self, parameters, norm_type=None, error_if_nonfinite=False, foreach=None, *, process_group=None):
        """Unit-wise clipping of the parameters' gradients; returns their total norm (of this
        policy's ``norm_type``) before clipping. The drop-in's ``norm_type`` is not used: AGC's
        own applies to each unit."""
        if process_group is not None:
            raise NotImplementedError("AGC: process_group= is not supported (AGC needs each unit's full weight row)")
        total = adaptive_clip_grad_(parameters, self.clip_factor, self.eps, self.norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise P.nonfinite_total_error(self.norm_type)
        return total

    def unscale_and_clip_grads_(self, parameters, inv_scale: Tensor):
        """For ``GradScaler.unscale_and_clip_``: unscale and clip loss-scaled gradients in the
        same two passes; returns ``(total norm of the unscaled gradients, {device: found_inf})``."""
        return _agc(parameters, self.clip_factor, self.eps, self.norm_type, inv_scale)

    def _config(self) -> dict:
        return {"clip_factor": self.clip_factor, "eps": self.eps, "norm_type": self.norm_type}

    def state_dict(self) -> dict:
        return {"config": self._config()}

    def load_state_dict(self, state: dict) -> None:
        _check_keys(self, state, {"config"})
        _check_config(self, state)

    def __repr__(self) -> str:
        return f"AGC(clip_factor={self.clip_factor}, eps={self.eps}, norm_type={self.norm_type})"
