"""Clipping policies: fixed-norm, ZClip, AutoClip (and AGC in ``gradfuse.agc``), one API.

A norm policy turns the total gradient norm, a 0-d tensor on the gradients' device, into a clip
coefficient on that device, and keeps what it needs from the norms it has seen (an EMA, a
history) there too: no host sync, no extra pass over the gradients. The coefficient then folds
into whatever applies clipping:

* the drop-in: ``gradfuse.clip_grad_norm_(params, policy)`` (a policy in place of ``max_norm``):
  the fused norm pass, then one fused scale pass by the coefficient (skipped when it is 1);
* the scaler: ``GradScaler.unscale_and_clip_(optimizer, policy)``: one read-only pass, and for
  a fused optimizer the coefficient joins the unscale factor in the optimizer's own read;
* anything else: ``coef = policy.clip_coef(total_norm)``, then multiply.

Policies (each a ``state_dict``/``load_state_dict`` pair, resumed exactly):

* ``NormClip(max_norm)``: torch's fixed clip, ``min(max_norm / (norm + 1e-6), 1)``.
* ``ZClip(...)``: the rule of the ``zclip`` package (arXiv:2504.02507): during ``warmup_steps``
  the norms are collected (clipped to ``max_grad_norm`` when one is given); then an EMA of the
  norm's mean and variance gives a z-score; a norm whose z-score exceeds ``z_thresh`` is
  clipped to ``mean + z_thresh * std / (z / z_thresh)`` (``clip_option="adaptive_scaling"``,
  times ``clip_factor``) or to the mean (``"mean"``), or in ``mode="percentile"`` every norm
  above ``mean + z_thresh * std``; the EMA is updated with the clipped norm.
* ``AutoClip(quantile, history_length)``: the global rule of the ``autoclip`` package's
  ``QuantileClip`` (Seetharaman et al. 2020): clip to the ``quantile`` of the last
  ``history_length`` total norms (none on the first step), then record this step's norm.

One deliberate difference from both packages: a non-finite norm (an overflowing fp16 step,
which the scaler skips) is not recorded; the packages would put inf/NaN into their statistics
and clip every later step to NaN or not at all.
"""

from __future__ import annotations

import math

import torch

from . import distributed as D
from . import ops
from ._policy_state import _check_config, _check_keys
from .buckets import owner_of
from .clip import _TO_TORCH, _check_all, _check_writable_all, _grads, _parameters, _run_fused, get_total_norm
from .ops import check_max_norm

Tensor = torch.Tensor

__all__ = ["AutoClip", "ClipPolicy", "NormClip", "ZClip", "make_policy"]

EPS = 1e-6  # torch's clip coefficient: max_norm / (total_norm + EPS)


class ClipPolicy:
    """A clipping rule that needs only the total gradient norm (see the module docstring)."""

    #: Name used by ``make_policy`` and ``TrainConfig(clip=...)``.
    name = ""
    #: The coefficient of the last ``clip_coef`` call (0-d, on the device), for logging.
    last_coef: Tensor | None = None

    def clip_coef(self, total_norm: Tensor) -> Tensor:
        """The clip coefficient (a 0-d float32 tensor on ``total_norm``'s device, in (0, 1]) for
        gradients whose total norm is ``total_norm``; records the norm in the policy's state.
        Call it once per optimizer step. No host sync."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        _check_keys(self, state, set())

    def clip_grads_(
        self,
        parameters,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        process_group=None,
    ) -> Tensor:
        """As ``gradfuse.clip_grad_norm_`` with this policy's coefficient: the fused norm pass,
        then one fused scale pass (skipped when the coefficient is exactly 1); returns the total
        norm before clipping. ``process_group``: the gradients are this rank's shard (the
        coefficient, from the total over all ranks, is then the same on every rank)."""
        parameters = _parameters(parameters, warn_empty_generator=True)
        grads = _grads(parameters)
        if not grads:
            return torch.tensor(0.0)
        total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach, process_group=process_group)
        plain_total = total.to_local() if D.is_dtensor(total) else total
        scale_grads_(grads, self.clip_coef(plain_total))
        return total

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({fields})"

    def _config(self) -> dict:
        return {}


def scale_grads_(grads: list[Tensor], coef: Tensor) -> None:
    """``grad *= coef`` for every gradient: fused per device (over a GradBuckets' buffers when
    the gradients are its views), torch's ``_foreach_mul_`` for what gradfuse cannot run."""
    owner = owner_of(grads)
    targets = owner.buffers if owner is not None else grads

    def run(groups):
        _check_all(groups)
        _check_writable_all(groups)
        for device, group in groups.items():
            ops.multi_tensor_scale_op(group, coef.to(device, non_blocking=True))

    if _run_fused(targets, run) is _TO_TORCH:
        with ops.no_grad():
            locals_ = [g.to_local() if D.is_dtensor(g) else g for g in grads]
            torch._foreach_mul_(locals_, coef.to(locals_[0].device))


def _state_tensor(policy, state: dict, key: str, shape: tuple, dtype: torch.dtype) -> Tensor:
    value = state[key]
    if not isinstance(value, Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
        got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{type(policy).__name__}.load_state_dict: {key} must be a {shape} {dtype} tensor, got {got}")
    return value.detach().clone()


def _fixed_coef(total_norm: Tensor, max_norm) -> Tensor:
    """torch's ``min(max_norm / (total_norm + 1e-6), 1)`` in the norm's dtype (torch's
    ``number / tensor`` is ``tensor.reciprocal() * number``)."""
    return (total_norm + EPS).reciprocal_().mul_(max_norm).clamp_(max=1.0)


# --- fixed norm ---------------------------------------------------------------------------


class NormClip(ClipPolicy):
    """torch's fixed clip: ``coef = min(max_norm / (total_norm + 1e-6), 1)``. Stateless."""

    name = "norm"

    def __init__(self, max_norm: float = 1.0):
        self.max_norm = check_max_norm("NormClip", max_norm)

    def clip_coef(self, total_norm: Tensor) -> Tensor:
        self.last_coef = _fixed_coef(total_norm, self.max_norm).float()
        return self.last_coef

    def _config(self):
        return {"max_norm": self.max_norm}


# --- ZClip --------------------------------------------------------------------------------


class ZClip(ClipPolicy):
    """ZClip, as the ``zclip`` package's ``ZClip`` (same arguments, same defaults, same
    arithmetic in float64), with its statistics kept on the gradients' device."""

    name = "zclip"

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        max_grad_norm: float | None = 1.0,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        mode: str = "zscore",
        clip_option: str = "adaptive_scaling",
        clip_factor: float = 1.0,
        skip_update_on_spike: bool = False,
    ):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"ZClip: alpha must be in [0, 1), got {alpha}")
        if not z_thresh > 0:
            raise ValueError(f"ZClip: z_thresh must be positive, got {z_thresh}")
        if not (isinstance(warmup_steps, int) and warmup_steps >= 1):
            raise ValueError(f"ZClip: warmup_steps must be an int >= 1, got {warmup_steps!r}")
        if mode not in ("zscore", "percentile"):
            raise ValueError(f"ZClip: mode must be 'zscore' or 'percentile', got {mode!r}")
        if clip_option not in ("adaptive_scaling", "mean"):
            raise ValueError(f"ZClip: clip_option must be 'adaptive_scaling' or 'mean', got {clip_option!r}")
        if not (eps >= 0 and clip_factor > 0):
            raise ValueError(f"ZClip: eps must be >= 0 and clip_factor > 0, got {eps}, {clip_factor}")
        self.alpha, self.z_thresh, self.eps = float(alpha), float(z_thresh), float(eps)
        self.max_grad_norm = None if max_grad_norm is None else check_max_norm("ZClip", max_grad_norm)
        self.warmup_steps, self.mode, self.clip_option = warmup_steps, mode, clip_option
        self.clip_factor, self.skip_update_on_spike = float(clip_factor), bool(skip_update_on_spike)
        # float64 scalars on the norm's device, moved there on first use (made on the CPU, whatever
        # the default device): the norms seen in warm-up, how many (finite ones), and the EMA of
        # the mean and variance.
        self._buffer = torch.zeros(warmup_steps, dtype=torch.float64, device="cpu")
        self._count = torch.zeros((), dtype=torch.int64, device="cpu")
        self._mean = torch.zeros((), dtype=torch.float64, device="cpu")
        self._var = torch.zeros((), dtype=torch.float64, device="cpu")

    def _config(self):
        return {
            "alpha": self.alpha,
            "z_thresh": self.z_thresh,
            "max_grad_norm": self.max_grad_norm,
            "eps": self.eps,
            "warmup_steps": self.warmup_steps,
            "mode": self.mode,
            "clip_option": self.clip_option,
            "clip_factor": self.clip_factor,
            "skip_update_on_spike": self.skip_update_on_spike,
        }

    def _to(self, device: torch.device) -> None:
        if self._count.device != device:
            self._buffer, self._count = self._buffer.to(device), self._count.to(device)
            self._mean, self._var = self._mean.to(device), self._var.to(device)

    def threshold(self) -> Tensor:
        """The norm above which the next step would be clipped as an outlier (``mode="percentile"``:
        ``mean + z_thresh * std``; ``"zscore"``: the norm whose z-score is ``z_thresh``), NaN
        during warm-up. A 0-d float64 tensor; for logging."""
        std = self._var.sqrt()
        edge = (
            self._mean + self.z_thresh * std
            if self.mode == "percentile"
            else self._mean + self.z_thresh * (std + self.eps)
        )
        return torch.where(self._count >= self.warmup_steps, edge, torch.nan)

    def clip_coef(self, total_norm: Tensor) -> Tensor:
        self._to(total_norm.device)
        host = total_norm.device.type == "cpu" and not torch.compiler.is_compiling()  # under compile: traceable ops
        if host and int(self._count) >= self.warmup_steps:
            # On the CPU the norm is in host memory already: the rule in Python floats, the same
            # float64 operations in the same order (bit for bit the tensor path's), instead of
            # some forty 0-d tensor ops (~100-250 us measured, against ~10 us).
            coef = self._clip_coef_host(float(total_norm))
            if coef is not None:
                return coef
        return self._clip_coef_tensors(total_norm)

    def _clip_coef_host(self, t: float) -> Tensor | None:
        """``clip_coef`` after warm-up, in Python floats; None where Python's arithmetic would
        part from torch's (a non-finite norm or state, a zero denominator): the tensor path then."""
        mean, var = float(self._mean), float(self._var)
        std = math.sqrt(var) if var >= 0 else math.nan
        if not (math.isfinite(t) and math.isfinite(mean) and math.isfinite(std)):
            return None
        if self.mode == "percentile":
            threshold = mean + self.z_thresh * std
            spike = t > threshold
        else:
            if std + self.eps == 0:
                return None
            z = (t - mean) / (std + self.eps)
            spike = z > self.z_thresh
            if not spike:
                threshold = math.nan  # unused
            elif self.clip_option == "adaptive_scaling":
                threshold = (mean + (self.z_thresh * std) / (z / self.z_thresh)) * self.clip_factor
            else:
                threshold = mean
        clip_val = threshold if spike else t
        effective = clip_val if self.max_grad_norm is None else min(clip_val, self.max_grad_norm)
        coef = effective / (t + EPS) if t > effective else 1.0
        if not (self.skip_update_on_spike and spike):
            new_mean = self.alpha * mean + (1 - self.alpha) * clip_val
            deviation = clip_val - new_mean
            self._mean.fill_(new_mean)
            self._var.fill_(self.alpha * var + (1 - self.alpha) * (deviation * deviation))  # torch's ** 2 is x * x
        self.last_coef = torch.tensor(coef, dtype=torch.float32, device="cpu")  # rounded to nearest, as .float()
        return self.last_coef

    def _clip_coef_tensors(self, total_norm: Tensor) -> Tensor:
        """``clip_coef`` as 0-d tensor ops on the norm's device (no host sync)."""
        t = total_norm.detach().double()
        finite = torch.isfinite(t)
        warm = self._count < self.warmup_steps  # this step still collects

        # Warm-up: record the norm; the step that fills the buffer initialises the EMA.
        slot = self._count.clamp(max=self.warmup_steps - 1).view(1)
        record = warm & finite
        self._buffer.scatter_(0, slot, torch.where(record, t, self._buffer.gather(0, slot)[0]).view(1))
        count = self._count + record.long()
        filled = record & (count == self.warmup_steps)
        init_mean = self._buffer.sum() / self.warmup_steps
        init_var = ((self._buffer - init_mean) ** 2).sum() / self.warmup_steps
        if self.max_grad_norm is None:
            warm_coef = torch.ones((), dtype=torch.float32, device=t.device)
        else:  # torch.nn.utils.clip_grad_norm_(..., max_grad_norm), in the norm's dtype
            warm_coef = _fixed_coef(total_norm.detach(), self.max_grad_norm).float()

        # After warm-up: the z-score rule, in float64 as the package's Python floats.
        std = self._var.sqrt()
        if self.mode == "percentile":
            threshold = self._mean + self.z_thresh * std
            spike = t > threshold
        else:
            z = (t - self._mean) / (std + self.eps)
            spike = z > self.z_thresh
            if self.clip_option == "adaptive_scaling":
                threshold = (self._mean + (self.z_thresh * std) / (z / self.z_thresh)) * self.clip_factor
            else:
                threshold = self._mean
        clip_val = torch.where(spike, threshold, t)
        effective = clip_val if self.max_grad_norm is None else clip_val.clamp(max=self.max_grad_norm)
        coef = torch.where(t > effective, effective / (t + EPS), 1.0).float()
        update = ~warm & finite
        if self.skip_update_on_spike:
            update &= ~spike
        mean = self.alpha * self._mean + (1 - self.alpha) * clip_val
        var = self.alpha * self._var + (1 - self.alpha) * (clip_val - mean) ** 2

        self._mean = torch.where(filled, init_mean, torch.where(update, mean, self._mean))
        self._var = torch.where(filled, init_var, torch.where(update, var, self._var))
        self._count = count
        self.last_coef = torch.where(warm, warm_coef, coef)
        return self.last_coef

    def state_dict(self) -> dict:
        return {
            "config": self._config(),
            "buffer": self._buffer.clone(),
            "count": self._count.clone(),
            "mean": self._mean.clone(),
            "var": self._var.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        _check_keys(self, state, {"config", "buffer", "count", "mean", "var"})
        _check_config(self, state)
        buffer = _state_tensor(self, state, "buffer", (self.warmup_steps,), torch.float64)
        count = _state_tensor(self, state, "count", (), torch.int64)
        mean = _state_tensor(self, state, "mean", (), torch.float64)
        var = _state_tensor(self, state, "var", (), torch.float64)
        device = self._count.device
        self._buffer, self._count, self._mean, self._var = (x.to(device) for x in (buffer, count, mean, var))


# --- AutoClip -----------------------------------------------------------------------------


class AutoClip(ClipPolicy):
    """AutoClip, as the ``autoclip`` package's ``QuantileClip(global_threshold=True)``: the
    threshold is the ``quantile`` (torch.quantile's linear interpolation) of the last
    ``history_length`` total norms, kept in float32 on the gradients' device."""

    name = "autoclip"

    def __init__(self, quantile: float = 0.9, history_length: int = 1000):
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"AutoClip: quantile must be in [0, 1], got {quantile}")
        if not (isinstance(history_length, int) and history_length >= 1):
            raise ValueError(f"AutoClip: history_length must be an int >= 1, got {history_length!r}")
        self.quantile, self.history_length = float(quantile), history_length
        # A ring of the last norms (unused slots NaN) and the number recorded so far; on the CPU
        # until the first norm's device is known.
        self._history = torch.full((history_length,), math.nan, dtype=torch.float32, device="cpu")
        self._count = torch.zeros((), dtype=torch.int64, device="cpu")

    def _config(self):
        return {"quantile": self.quantile, "history_length": self.history_length}

    def _to(self, device: torch.device) -> None:
        if self._count.device != device:
            self._history, self._count = self._history.to(device), self._count.to(device)

    def threshold(self) -> Tensor:
        """The clipping threshold of the next step (inf before any norm is recorded); 0-d float32."""
        # Unused slots hold NaN, which nanquantile leaves out: torch.quantile of the kept norms,
        # its rank taken from the count of non-NaN values on the device (no host sync).
        value = torch.nanquantile(self._history, self.quantile)
        return torch.where(self._count > 0, value, math.inf)

    def clip_coef(self, total_norm: Tensor) -> Tensor:
        self._to(total_norm.device)
        norm = total_norm.detach().float()
        # torch's clip_grads_with_norm_ with a tensor max_norm: a true division, then clamp.
        coef = (self.threshold() / (norm + EPS)).clamp(max=1.0)
        finite = torch.isfinite(norm)
        slot = (self._count % self.history_length).view(1)
        self._history.scatter_(0, slot, torch.where(finite, norm, self._history.gather(0, slot)[0]).view(1))
        self._count = self._count + finite.long()
        self.last_coef = coef
        return coef

    def state_dict(self) -> dict:
        return {"config": self._config(), "history": self._history.clone(), "count": self._count.clone()}

    def load_state_dict(self, state: dict) -> None:
        _check_keys(self, state, {"config", "history", "count"})
        _check_config(self, state)
        history = _state_tensor(self, state, "history", (self.history_length,), torch.float32)
        count = _state_tensor(self, state, "count", (), torch.int64)
        device = self._count.device
        self._history, self._count = history.to(device), count.to(device)


_POLICIES = {cls.name: cls for cls in (NormClip, ZClip, AutoClip)}


def make_policy(clip: str | ClipPolicy, **options) -> ClipPolicy:
    """A policy by name (``"norm"``, ``"zclip"``, ``"autoclip"``, ``"agc"``) with its options,
    or ``clip`` itself when it is a policy already."""
    if not isinstance(clip, str):
        if options:
            raise ValueError("make_policy: options are for a policy given by name")
        return clip
    if clip == "agc":
        from .agc import AGC

        return AGC(**options)
    if clip not in _POLICIES:
        raise ValueError(f"make_policy: clip must be one of {[*sorted(_POLICIES), 'agc']}, got {clip!r}")
    return _POLICIES[clip](**options)
