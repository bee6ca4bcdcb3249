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

Where timm's arithmetic differs: its norms are computed by torch in the parameters' dtype
(a bf16 weight's norm in bf16); here every unit norm accumulates in float32 (float64 for
float64 tensors), and the factors are formed in float32 as timm forms them for fp32 models.
"""

from __future__ import annotations

import math

import torch

from . import _plan as P
from ._policy_state import _check_config, _check_keys
from .ops import _check_units

Tensor = torch.Tensor

__all__ = ["AGC", "adaptive_clip_grad_"]


def _units(p: Tensor) -> int:
    return p.shape[0] if p.dim() > 1 else 1


def adaptive_clip_grad_(parameters, clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0) -> Tensor:
    """Clip ``p.grad`` of every parameter unit-wise (module docstring); returns the
    ``norm_type``-norm of all gradients together before clipping (from the unit norms)."""
    return _agc(parameters, clip_factor, eps, norm_type, None)[0]


def _agc(parameters, clip_factor, eps, norm_type, inv_scale: Tensor | None):
    """``(total norm, {device: found_inf})``. With ``inv_scale`` the gradients are loss-scaled:
    the rule applies to ``grad * inv_scale``, and the one write leaves ``grad * inv_scale *
    factor`` (unscale and clip together); ``found_inf`` (0-d float32 per device) says whether
    any unit norm, hence any element, was inf or NaN."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0), {}
    by_device: dict[torch.device, list[Tensor]] = {}
    for p in params:
        by_device.setdefault(p.grad.device, []).append(p)
    totals, found = [], {}
    with torch.no_grad():
        for device, group in by_device.items():
            weights, grads = [p.detach() for p in group], [p.grad for p in group]
            units = [_units(p) for p in group]
            _check_units("gradfuse.adaptive_clip_grad_", grads, units)  # before any pass
            norms = torch.ops.gradfuse.unit_norms(weights + grads, units + units, float(norm_type))
            w_norm, g_norm = norms.split(sum(units))
            if inv_scale is not None:
                g_norm = g_norm * inv_scale.to(device, g_norm.dtype)
            max_norm = w_norm.clamp(min=eps).mul_(clip_factor)
            factors = torch.where(g_norm < max_norm, 1.0, max_norm / g_norm.clamp(min=1e-6))
            if inv_scale is not None:
                factors = factors * inv_scale.to(device, factors.dtype)
            torch.ops.gradfuse.scale_units_(grads, units, factors)
            totals.append(torch.linalg.vector_norm(g_norm, norm_type))
            found[device] = (~torch.isfinite(g_norm).all()).float()
    first = totals[0].device
    total = (
        totals[0]
        if len(totals) == 1
        else torch.linalg.vector_norm(torch.stack([t.to(first) for t in totals]), norm_type)
    )
    return total, found


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
