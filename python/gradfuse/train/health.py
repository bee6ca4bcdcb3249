"""Gradient health in the Trainer: clipping policies (``TrainConfig(clip=..., clip_options=...)``)
and spike-aware skipping (``TrainConfig(skip_spikes=(window, threshold, warmup))``).

Clipping policies are ``gradfuse.clipping``'s (``"norm"``: the fixed ``max_grad_norm``;
``"zclip"``, ``"autoclip"``, ``"agc"``: the policy made from ``clip_options``), applied through
``GradScaler.unscale_and_clip_`` like the fixed clip: the coefficient on the device, folded into
a fused optimizer's read; the policy's state is checkpointed.

Spike-aware skipping:
The rule of OLMo-core's skip-step optimizer: a step whose loss or gradient norm is more than
``threshold`` standard deviations above the mean of the last ``window`` steps is skipped; no
step is judged before ``warmup`` values are kept. Two differences, both on purpose: the
statistics live on the device (ring buffers, no host read), and a skipped spike is not added to
the window (OLMo-core's lets the spikes in, which widens the window's deviation after each one
and lets the next spike through).

A spike skips the step through the same flag as an overflow (``GradScaler.skip_step_``), so a
fused optimizer skips it on the device and the trainer reads it in the step's one host sync.
With fp16 loss scaling the scaler then backs its scale off as after an overflow.
"""

from __future__ import annotations

import math

import torch

from ..clipping import make_policy
from ..distributed import combine_module_stats

Tensor = torch.Tensor
CLIPS = ("norm", "zclip", "autoclip", "agc")


def check_clip(clip, options, max_grad_norm) -> None:
    """``TrainConfig.clip``/``clip_options`` (with ``max_grad_norm``); raises naming the field."""
    if clip not in CLIPS:
        raise ValueError(f"TrainConfig.clip must be one of {', '.join(map(repr, CLIPS))}, got {clip!r}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"TrainConfig.clip_options must be a dict or None, got {type(options).__name__}")
    if clip == "norm":
        if options:
            raise ValueError(
                "TrainConfig.clip_options is for clip='zclip', 'autoclip' or 'agc'; clip='norm' uses max_grad_norm"
            )
        return
    if max_grad_norm is not None:
        raise ValueError(
            f"TrainConfig.max_grad_norm must be None with clip={clip!r}: the policy sets the threshold "
            "(ZClip's cap is clip_options={'max_grad_norm': ...})"
        )
    try:
        make_policy(clip, **(options or {}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"TrainConfig.clip_options: {err}") from None


def clip_policy(config):
    """The Trainer's clipping policy, or None for the fixed ``max_grad_norm``."""
    return None if config.clip == "norm" else make_policy(config.clip, **(config.clip_options or {}))


def check_skip_spikes(value) -> tuple[int, float, int] | None:
    """``TrainConfig.skip_spikes`` as ``(window, threshold, warmup)``, or None; raises naming the field."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 3:
        raise TypeError(f"TrainConfig.skip_spikes must be None or (window, threshold, warmup), got {value!r}")
    window, threshold, warmup = value
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"TrainConfig.skip_spikes: window must be an integer >= 2, got {window!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
        raise ValueError(
            f"TrainConfig.skip_spikes: threshold must be a positive number of deviations, got {threshold!r}"
        )
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 2 <= warmup <= window:
        raise ValueError(f"TrainConfig.skip_spikes: warmup must be an integer in [2, window], got {warmup!r}")
    return window, float(threshold), warmup


class SpikeSkipper:
    """The loss and gradient-norm windows of spike-aware skipping (module docstring)."""

    def __init__(self, window: int = 128, threshold: float = 6.0, warmup: int = 64):
        self.window, self.threshold, self.warmup = check_skip_spikes((window, threshold, warmup))
        # Rows: loss, grad norm. Unused slots are NaN. float64: the statistics of a long run. On
        # the CPU until the first step's device is known (check_ moves them).
        self._values = torch.full((2, self.window), math.nan, dtype=torch.float64, device="cpu")
        self._count = torch.zeros((), dtype=torch.int64, device="cpu")  # values kept so far (spikes excluded)
        self.flag = torch.zeros((), dtype=torch.float32, device="cpu")  # 1.0 when the last step checked spiked

    def check_(self, loss: Tensor, grad_norm: Tensor) -> Tensor:
        """Whether this step's ``loss`` and ``grad_norm`` (0-d, on the device) make a spike: a
        0-d float32 flag (also kept as ``self.flag``). A finite, non-spike step enters the
        windows. No host sync."""
        device = grad_norm.device
        if self._count.device != device:
            self._values, self._count = self._values.to(device), self._count.to(device)
        x = torch.stack([loss.detach().to(device), grad_norm.detach()]).double()
        kept = ~torch.isnan(self._values)
        n = kept.sum(dim=1).double()
        mean = torch.where(kept, self._values, 0.0).sum(dim=1) / n.clamp(min=1)
        # Unbiased, as torch.std (and OLMo-core's torch.std_mean) computes it.
        var = torch.where(kept, (self._values - mean[:, None]) ** 2, 0.0).sum(dim=1) / (n - 1).clamp(min=1)
        finite = torch.isfinite(x).all()
        above = x > mean + self.threshold * var.sqrt()
        spike = finite & (self._count >= self.warmup) & above.any()
        record = finite & ~spike
        slot = (self._count % self.window).view(1, 1).expand(2, 1)
        self._values.scatter_(1, slot, torch.where(record, x, self._values.gather(1, slot)[:, 0]).view(2, 1))
        self._count = self._count + record.long()
        self.flag = spike.float()
        return self.flag

    def state_dict(self) -> dict:
        return {
            "config": [self.window, self.threshold, self.warmup],
            "values": self._values.cpu().clone(),
            "count": self._count.cpu().clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"config", "values", "count"}:
            raise ValueError("SpikeSkipper.load_state_dict: expected the keys config, values, count")
        if list(state["config"]) != [self.window, self.threshold, self.warmup]:
            raise ValueError(
                f"SpikeSkipper.load_state_dict: saved with skip_spikes={tuple(state['config'])}, "
                f"now {(self.window, self.threshold, self.warmup)}"
            )
        values, count = state["values"], state["count"]
        if tuple(values.shape) != (2, self.window) or values.dtype != torch.float64 or count.dtype != torch.int64:
            raise ValueError("SpikeSkipper.load_state_dict: values must be (2, window) float64, count int64")
        device = self._count.device
        self._values, self._count = values.clone().to(device), count.clone().to(device)


# --- per-module gradient norms ------------------------------------------------------------


def module_prefix(name: str, depth: int) -> str:
    """``"blocks.0.mlp.0.weight"`` at depth 2 -> ``"blocks.0"`` (a parameter of a shallower
    module keeps its module's name: ``"head.weight"`` -> ``"head"``)."""
    parts = name.split(".")[:-1] or name.split(".")
    return ".".join(parts[:depth])


class LayerStatsProbe:
    """Stands in for the clipping policy (or fixed ``max_norm``) on a log step: the scaler's
    policy path then takes the norm from ``multi_tensor_stats`` (the same single read) and hands
    the per-tensor statistics here; the per-module norms and largest magnitudes are reduced on
    the device, ready for the step's one host sync.

    DTensor gradients (FSDP2) are read as their local shards (``prefixes`` keys the shards):
    each rank reduces its own shards per module, and :meth:`values` combines the ranks' partials
    (``distributed.combine_module_stats``: one or two small all-reduces, on every rank alike)."""

    def __init__(self, inner, prefixes: dict[int, str], modules: list[str], norm_type: float):
        if norm_type == 0:
            raise ValueError("per-module gradient norms of order 0 (a count of tensors) are not available")
        self.inner = inner  # a ClipPolicy
        self.prefixes = prefixes  # id(grad), or id of its local shard for a DTensor -> module name
        self.index = {m: i for i, m in enumerate(modules)}
        self.modules = modules
        self.norm_type = norm_type
        self.parts = []

    def clip_coef(self, total_norm: Tensor) -> Tensor:
        return self.inner.clip_coef(total_norm)

    def clip_grads_(self, *args, **kwargs):  # gradients the fused path cannot run: the policy's own way
        return self.inner.clip_grads_(*args, **kwargs)

    def observe_stats(self, group, stats, inv_scale: Tensor, across=()) -> None:
        """``stats`` (``multi_tensor_stats`` of ``group``, scaled by ``inv_scale``) of tensors that
        are shards over the process groups ``across`` (none: whole tensors). ``stats`` None: no
        statistics, for an empty ``group`` (a rank with no shard: nothing to add) or because
        torch measured them (their modules report NaN)."""
        self.parts.append((group, stats, inv_scale, tuple(across)))

    def values(self, device: torch.device) -> Tensor:
        """``[norm per module..., largest magnitude per module...]`` (float64, on ``device``),
        NaN for every module when the statistics were not taken (gradients torch had to clip),
        and for the modules of shards torch measured. A collective for shards: every rank of
        their groups calls it."""
        n, p = len(self.modules), self.norm_type
        if not self.parts:
            return torch.full((2 * n,), math.nan, dtype=torch.float64, device=device)
        identity = math.inf if p == -math.inf else 0.0  # what adds nothing to a module's partial
        # Per set of process groups the tensors are split over: the partials of this rank.
        partials: dict[tuple, tuple[tuple, Tensor, Tensor]] = {}
        for group, stats, inv, across in self.parts:
            key = tuple(map(id, across))
            if key not in partials:
                empty = torch.full((n,), identity, dtype=torch.float64, device=device)
                partials[key] = (across, empty, torch.zeros(n, dtype=torch.float64, device=device))
            _, sums, amax = partials[key]
            idx = torch.tensor([self.index[self.prefixes[id(g)]] for g in group], dtype=torch.int64, device=device)
            if stats is None:  # not taken (no shard: idx is empty)
                sums.index_fill_(0, idx, math.nan)
                amax.index_fill_(0, idx, math.nan)
                continue
            norms = stats.norms.double().to(device) * inv.double().to(device)
            if math.isinf(p):
                sums.scatter_reduce_(0, idx, norms, "amax" if p > 0 else "amin")
            else:
                sums.index_add_(0, idx, norms.pow(p))
            amax.scatter_reduce_(0, idx, stats.amax.double().to(device) * inv.double().to(device), "amax")
        total_sums = total_amax = None
        for across, sums, amax in partials.values():  # the same sets, in the same order, on every rank
            sums, amax = combine_module_stats(sums, amax, p, across)
            if total_sums is None:
                total_sums, total_amax = sums, amax
                continue
            if math.isinf(p):
                total_sums = torch.maximum(total_sums, sums) if p > 0 else torch.minimum(total_sums, sums)
            else:
                total_sums = total_sums + sums
            total_amax = torch.maximum(total_amax, amax)
        norms = total_sums if math.isinf(p) else total_sums.pow(1.0 / p)
        return torch.cat([norms, total_amax])


def check_log_grad_norms(depth, clip, norm_type: float = 2.0) -> None:
    if depth is None:
        return
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"TrainConfig.log_grad_norms must be a module depth >= 1 or None, got {depth!r}")
    if clip == "agc":
        raise ValueError("TrainConfig.log_grad_norms is not available with clip='agc' (its passes are per unit)")
    if norm_type == 0:
        raise ValueError(
            "TrainConfig.log_grad_norms is not available with norm_type=0 (a count of non-zero tensors, "
            "which has no per-module norm here)"
        )
