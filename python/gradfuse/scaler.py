"""``gradfuse.GradScaler``: torch's AMP loss scaler, with fused unscaling and clipping folded
into the optimizer.

A subclass of ``torch.amp.GradScaler``: the constructor, ``scale``, ``step``, ``update``, the
growth/backoff rule and the state dict are torch's own, so the two are interchangeable and a
state dict saved by either loads into the other. Two things change:

* ``unscale_`` (and the inf/NaN check ``step`` runs for an optimizer that unscales itself)
  is one fused pass per device over every gradient, whatever its dtype, instead of one
  ``_amp_foreach_non_finite_check_and_unscale_`` per device and dtype.
* ``unscale_and_clip_(optimizer, max_norm, norm_type)`` unscales, checks for inf/NaN, measures
  the norm of the unscaled gradients and clips them. For an optimizer that applies a gradient
  scale itself (torch's fused Adam, AdamW, SGD and Adagrad, which set
  ``_step_supports_amp_scaling``), nothing is written: one read-only pass gives the norm and
  ``found_inf``, the clip coefficient ``min(max_norm / (norm + 1e-6), 1)`` is computed on the
  device, and the optimizer is handed ``grad_scale = scale / clip_coef`` and ``found_inf``
  at once (the attributes torch's ``step`` hands over), which its own ``step()`` divides the
  gradients by as it reads them, skipping the step on inf/NaN. A folded clip is never lost:
  ``scaler.step(optimizer)`` and a direct ``optimizer.step()`` both apply it (a step
  post-hook withdraws the attributes after that one step, and a second step is refused), and
  ``update`` writes a fold that no step took into the gradients. Otherwise the gradients are
  unscaled and clipped in place, in two passes (a read, then one write of
  ``grad * inv_scale * clip_coef``).
  Gradients that a DDP with gradfuse's hook (``gradfuse.register_ddp_hook``) has reduced were
  measured during backward; handed over, ``unscale_and_clip_(..., measured=state)`` (the
  caller's promise that nothing touched them since: writes through ``.data``, NumPy views or
  collectives move no version counter, so gradfuse cannot check it), that measurement replaces
  the read pass (the norm is the hook's times ``inv_scale``, ``found_inf`` the hook's), and the
  write pass, if any, runs over DDP's buckets; a visibly stale handover raises. Without it, and
  in ``unscale_`` and ``step``'s inf check, the gradients are read (torch's answer); ``unscale_``
  runs its pass over DDP's few buckets.
  DTensor gradients (FSDP2, tensor parallel) are read as their local shards, and one
  all-reduce gives every rank the total norm and the inf/NaN flag together, so that all ranks
  clip alike and skip alike; torch's fused AdamW takes DTensor parameters, and the clip is
  folded into its read as for plain gradients. A probe of per-module statistics (the Trainer's
  ``log_grad_norms``) gets those of the local shards from the same read; AGC clips the local
  shards' units in its own two passes (``agc.py``).

Clipping without loss scaling (bf16 or fp32 training) is the same call on a disabled scaler,
``GradScaler(enabled=False)``: ``scale`` returns the loss unchanged, ``update`` does nothing,
and ``unscale_and_clip_`` + ``step`` clip through the optimizer's read as above (one read-only
norm pass in all), skipping a step whose gradients hold inf or NaN as an enabled scaler does.

No host sync anywhere, except where torch's scaler has one: ``step`` on an optimizer that
does not take ``found_inf`` must read it to decide whether to step.
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from dataclasses import dataclass
from functools import partial
from itertools import chain, compress
from operator import attrgetter, is_not, itemgetter

import torch
from torch.amp.grad_scaler import OptState
from torch.utils.hooks import RemovableHandle

from . import _plan as P
from . import distributed as D
from . import ops
from .clip import _TO_TORCH, _TORCHS, _check_all, _combine_totals, _fused_groups, _nonzero_counts, _run_fused
from .ddp_hook import DDPHookState, handed_over, state_for
from .ops import check_max_norm, multi_tensor_scale_, unscale_check_norm

Tensor = torch.Tensor

__all__ = ["GradScaler"]

EPS = 1e-6  # torch's clip coefficient: max_norm / (total_norm + EPS)


@dataclass
class _Unscaled:
    """What ``unscale_and_clip_`` leaves for ``step``.

    A folded clip (``grad_scale`` set) is handed to the optimizer at once, as torch's scaler
    hands ``grad_scale``/``found_inf`` over in ``step``, so that the optimizer's own ``step()``
    applies it however it is called; a step post-hook (``handle``) withdraws them after that
    step, and ``update`` applies a fold that no step took (:meth:`GradScaler.update`)."""

    found_inf: Tensor  # 0-d float32, 1.0 if any gradient held inf or NaN
    grad_scale: Tensor | None  # scale / clip_coef, for an optimizer that divides by it as it reads
    optimizer: weakref.ref | None = None  # set with grad_scale
    handle: RemovableHandle | None = None  # the step post-hook, while the fold is pending
    via_scaler: bool = False  # inside GradScaler.step, whose torch part withdraws the attributes
    stepped: bool = False  # an optimizer.step() called directly took the fold

    @property
    def pending(self) -> bool:
        """A folded clip that no step has applied yet."""
        return self.handle is not None


def _withdraw(optimizer: torch.optim.Optimizer) -> None:
    """Take back the ``grad_scale`` and ``found_inf`` handed to ``optimizer``."""
    for name in ("grad_scale", "found_inf"):
        if name in vars(optimizer):
            delattr(optimizer, name)


def _refuse_a_second_step(optimizer: torch.optim.Optimizer) -> None:
    """After a step that applied a folded clip, the gradients are still scaled and unclipped:
    a further ``optimizer.step()`` before any backward (the first gradient the same tensor, its
    version counter unmoved) raises instead of stepping on them, where torch's ``unscale_`` +
    clip would step on the same clipped gradients again. One check, at the next step only."""
    param = next((p for group in optimizer.param_groups for p in group["params"] if p.grad is not None), None)
    if param is None:
        return
    param_ref, grad_ref, version = weakref.ref(param), weakref.ref(param.grad), param.grad._version

    def check(optimizer, args, kwargs) -> None:
        handle.remove()
        param, grad = param_ref(), grad_ref()
        if param is not None and grad is not None and param.grad is grad and grad._version == version:
            raise RuntimeError(
                "optimizer.step(): no backward since the last step, which applied the unscale and clip that "
                "GradScaler.unscale_and_clip_() folded into it; the gradients are still scaled and unclipped. "
                "Call unscale_and_clip_() (and step once) after each backward"
            )

    handle = optimizer.register_step_pre_hook(check)


def _optimizer_grads(optimizer: torch.optim.Optimizer, refuse_fp16: bool = False) -> tuple[list[Tensor], bool]:
    """The gradients of the optimizer's parameters, None skipped, and whether they are known to be
    plain tensors (one Rust pass, or C-level maps: no loop per parameter). ``refuse_fp16``: raise
    as torch's scaler does for fp16 gradients (:func:`_refuse_fp16`), nothing modified; the Rust
    pass reads the dtypes as it goes (~20 ns a gradient, where a pass of its own costs ~40)."""
    params = list(chain.from_iterable(map(_params, optimizer.param_groups)))
    grads = P.grads_of(params, torch.float16 if refuse_fp16 else None)
    if grads is not None:
        return grads, True
    grads = list(filter(_not_none, map(_grad, params)))
    if refuse_fp16:
        _refuse_fp16(grads)
    return grads, False


def _params_with_grads(optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], list[Tensor]]:
    """The optimizer's parameters that have a gradient, and those gradients, in order (C-level
    maps: no loop per parameter)."""
    params = list(chain.from_iterable(map(_params, optimizer.param_groups)))
    grads = list(map(_grad, params))
    has = list(map(_not_none, grads))
    return list(compress(params, has)), list(compress(grads, has))


_params = itemgetter("params")
_grad = attrgetter("grad")
_dtype = attrgetter("dtype")
_not_none = partial(is_not, None)


def _folds(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` reads ``optimizer.grad_scale``/``found_inf`` (torch's contract
    for ``_step_supports_amp_scaling``; the older one passes the scaler itself, not folded)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False) and not _takes_grad_scaler(type(optimizer))


def _refuse_fp16(grads: list[Tensor]) -> None:
    """torch's rule for an enabled scaler, kept by ``unscale_`` and ``unscale_and_clip_`` alike:
    fp16 gradients would lose what the loss scale protects once unscaled in place."""
    if torch.float16 in set(map(_dtype, grads)):
        raise ValueError("Attempting to unscale FP16 gradients.")


@functools.cache
def _takes_grad_scaler(optimizer_type: type) -> bool:
    return "grad_scaler" in inspect.signature(optimizer_type.step).parameters  # ~60 us: once per class


def clip_coef(total_norm: Tensor, max_norm: float) -> Tensor:
    """``min(max_norm / (total_norm + 1e-6), 1)`` on the norm's device, as torch computes it
    (its ``number / tensor`` is ``tensor.reciprocal() * number``), in three C++ calls.
    ``max_norm=inf`` clips nothing: 1, also for an infinite norm, where torch's rule gives
    ``inf / inf = NaN`` and would turn every gradient of the (skipped) step into NaN, hiding which
    ones held the inf (the Trainer names them)."""
    if max_norm == math.inf:
        return torch.ones((), dtype=total_norm.dtype, device=total_norm.device)
    return (total_norm + EPS).reciprocal_().mul_(max_norm).clamp_(max=1.0)


def _local_norm_and_flag(
    shards: list[Tensor], inv_scale: Tensor, norm_type: float, device: torch.device, observe=None, across=()
):
    """(norm of ``shards * inv_scale``, found_inf) for one rank's local shards, read-only; the
    fused pass where the kernels run them, torch's ops otherwise (so that every rank reaches
    the all-reduce that follows, whatever its shards). No shard: the combine's identity.

    ``observe`` (a probe's ``observe_stats``): the same single read is ``multi_tensor_stats``,
    whose per-tensor statistics of the non-empty shards go to ``observe(shards, stats,
    inv_scale, across)``, ``across`` being the process groups the shards are split over. It is
    called on every rank, also with no shard (``[]``, ``None``: nothing to add) and where torch
    measured (the shards, ``None``: not taken), so that every rank's probe joins the same
    collectives later."""
    nonempty = [t for t in shards if t.numel()]
    nothing = torch.zeros((), dtype=torch.float32, device=device)
    # The fused kernels' rule, from every shard (also the empty ones, whose dtype is the
    # DTensor's): so a rank without elements ends with the other ranks' dtype.
    out = torch.float64 if any(t.dtype == torch.float64 for t in shards) else torch.float32
    if not nonempty:
        if observe is not None:
            observe([], None, inv_scale, across)
        return D.norm_of_nothing(norm_type, device).to(out), nothing
    groups = _fused_groups(nonempty, one_device=False)
    if groups is not None:
        try:
            if observe is not None:
                total, found = GradScaler._measure_for_policy(groups, inv_scale, norm_type, observe, across)
                return total.to(device, out), torch.stack([f.to(device) for f in found.values()]).amax()
            _check_all(groups)
            norms, found = [], []
            for group_device, group in groups.items():
                norm, flag = unscale_check_norm(group, inv_scale.to(group_device), norm_type)
                norms.append(norm)
                found.append(flag.to(device))
            return _combine_totals(norms, norm_type).to(out), torch.stack(found).amax()
        except _TORCHS:
            pass
    if observe is not None:
        observe(nonempty, None, inv_scale, across)
    norms = [torch.linalg.vector_norm(t.to(out) * inv_scale.to(t.device), norm_type) for t in nonempty]
    per_tensor = torch.stack(norms)
    found = torch.stack([(~torch.isfinite(t)).any().to(device) for t in nonempty]).any().float()
    return torch.linalg.vector_norm(per_tensor.to(device), norm_type).to(out), found


def _plain(total: Tensor) -> Tensor:
    """A norm as a plain tensor: torch gives DTensor gradients' norm as a DTensor (replicated,
    or partial where it is still to be reduced: ``full_tensor`` gives the value either way)."""
    return total.full_tensor() if D.is_dtensor(total) else total


def _measures_norm_only(policy) -> bool:
    """Whether a clipping policy needs nothing but the total norm (ZClip, AutoClip): not the
    per-unit norms of AGC nor the per-tensor statistics of a probe."""
    per_unit, per_tensor = hasattr(policy, "unscale_and_clip_grads_"), hasattr(policy, "observe_stats")
    return hasattr(policy, "clip_coef") and not per_unit and not per_tensor


def _scale_in_place(tensors: list[Tensor], factor: Tensor) -> None:
    """``t *= factor`` for every tensor: one fused pass per device, torch's where it cannot."""
    groups = _fused_groups(tensors, one_device=False) if tensors else {}
    if groups is not None:
        try:
            _check_all(groups)  # what sends the call to torch is found before any device's write
            for device, group in groups.items():
                multi_tensor_scale_(group, factor.to(device))
            return
        except _TORCHS:
            pass
    for t in tensors:
        t.mul_(factor.to(t.device, t.dtype))


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with a fused ``unscale_`` and ``unscale_and_clip_`` (see the
    module docstring). Same constructor: ``GradScaler(device="cuda", init_scale=2.**16,
    growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True)``."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self._unscaled: dict[int, _Unscaled] = {}  # id(optimizer) -> left by unscale_and_clip_

    # --- torch's unscaling, fused ---------------------------------------------------------

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """Every unscale of torch's scaler comes through here: one fused pass per device."""
        grads, plain = _optimizer_grads(optimizer, refuse_fp16=not allow_fp16)
        hook = state_for(grads)
        if hook is not None:  # gradients a DDP with gradfuse's hook just reduced: its few buckets
            grads, plain = hook.buffers, False
        if not grads:
            return {}

        def run(groups):
            _check_all(groups)
            found = {}
            for device, group in groups.items():
                found[device] = found_inf.to(device, copy=True)
                ops.unscale_and_check_op(group, inv_scale.to(device), found[device])
            return found

        # One device first, unchecked (the op finds a list that spans devices before it writes).
        found = _run_fused(grads, run, plain)
        if found is not _TO_TORCH:
            return found
        # Sparse gradients and the like: torch's way.
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def _check_inf_per_device(self, optimizer):
        """For an optimizer that unscales as it reads: only check, in a read-only pass."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        grads, plain = _optimizer_grads(optimizer)
        one = torch.ones((), dtype=torch.float32, device=scale.device)

        def run(groups):
            _check_all(groups)
            return {device: unscale_check_norm(g, one.to(device))[1] for device, g in groups.items()}

        found = _run_fused(grads, run, plain) if grads else {}
        if found is _TO_TORCH:
            return super()._check_inf_per_device(optimizer)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    # --- unscale + check + norm + clip --------------------------------------------------------

    def unscale_and_clip_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        divisor: Tensor | float | None = None,
        measured: DDPHookState | None = None,
    ) -> Tensor:
        """Unscale the optimizer's gradients, check them for inf/NaN, and clip them to
        ``max_norm`` (torch's rule: ``grad *= min(max_norm / (norm + 1e-6), 1)``); returns the
        ``norm_type``-norm of the unscaled gradients (fp32, or fp64 for fp64 gradients), before
        clipping. ``step`` then skips a step whose gradients held inf or NaN.

        Call it once per optimizer between ``scale(loss).backward()`` and ``step``, in place of
        ``unscale_`` + ``clip_grad_norm_``. For an optimizer that takes ``grad_scale`` (fused
        Adam/AdamW/SGD/Adagrad) the gradients are only read here; the unscale and the clip are
        applied by the optimizer's next step, inside its own read, whether that is
        ``scaler.step(optimizer)`` or ``optimizer.step()`` called directly (``update`` writes
        them into the gradients if no step took them). No host sync.

        ``divisor`` (a number or a 0-d tensor, e.g. the step's token count on the device)
        divides the gradients as well, folded into the unscale factor at no extra pass: the
        norm, the clip and the step are those of ``grad / divisor``. As ``unscale_``, an
        enabled scaler refuses fp16 gradients (``ValueError``, nothing modified).
        ``max_norm`` may also be a clipping policy (``gradfuse.clipping``: ZClip, AutoClip, AGC),
        which reads the gradients itself (``measured`` is not used then).

        ``measured``: the state :func:`gradfuse.register_ddp_hook` returned, handed over with
        the promise that nothing touched the gradients since the last synchronised backward
        (gradfuse cannot check it: ``.data``, NumPy and collective writes move no version
        counter). The norm and ``found_inf`` the hook measured during backward then replace the
        read pass: with a fused optimizer nothing reads the gradients before its step. The
        optimizer must hold all of the DDP model's gradients, in the hook's ``norm_type``; a
        handover that is visibly stale (other gradient tensors, or ones modified in place since
        backward) raises ``RuntimeError`` and changes nothing. Where that backward left no
        measurement (see ``DDPHookState.total_norm``), the gradients are read.
        """
        op = "GradScaler.unscale_and_clip_"
        if hasattr(max_norm, "clip_grads_"):  # a clipping policy (gradfuse.clipping, gradfuse.agc)
            return self._unscale_and_clip_by_policy(optimizer, max_norm, norm_type, divisor)
        max_norm = check_max_norm(op, max_norm)
        norm_type = P.check_norm_type(op, norm_type)
        self._check_ready(optimizer)
        grads, plain = _optimizer_grads(optimizer, refuse_fp16=self._enabled)
        hook = None if measured is None else handed_over(measured, grads, norm_type, op)
        if hook is not None:  # plain tensors on one device, measured during backward
            scale, inv_scale = self._scales(hook.total_norm().device, divisor)
            return self._clip_from_hook(optimizer, hook, scale, inv_scale, max_norm)
        folds = _folds(optimizer)

        def run(groups):
            first = next(iter(groups))
            _check_all(groups)
            # max_norm=inf: the coefficient is 1 (clip_coef); the in-place op would apply torch's NaN.
            if folds or len(groups) > 1 or max_norm == math.inf:
                scale, inv_scale = self._scales(first, divisor)
                total, found, coef = self._measure(groups, inv_scale, max_norm, norm_type)
                if folds:
                    return total, found, (scale / coef).float()
                for device, group in groups.items():
                    ops.multi_tensor_scale_op(group, (inv_scale * coef).to(device))
                return total, found, None
            inv_scale, found = ops.inverse_scale(self._scaled_by(first, divisor))
            total = ops.unscale_and_clip_op(groups[first], inv_scale, found, max_norm, norm_type)
            return total, {first: found}, None

        # One device first, unchecked: the ops find a list that spans devices before anything runs.
        result = _run_fused(grads, run, plain) if grads else _TO_TORCH
        if result is _TO_TORCH:
            if grads and D.is_dtensor(grads[0]):  # FSDP2, tensor parallel: their local shards
                coef_of = functools.partial(clip_coef, max_norm=max_norm)
                total = self._unscale_and_clip_dtensor(optimizer, grads, coef_of, norm_type, divisor)
                if total is not None:
                    return total
            return self._unscale_and_clip_by_torch(optimizer, max_norm, norm_type, divisor)
        total, found, grad_scale = result
        self._record(optimizer, found, grad_scale)
        return total

    def _scales(self, device: torch.device, divisor=None) -> tuple[Tensor, Tensor]:
        """(scale, inv_scale) as 0-d float32 tensors on ``device``: the loss scale (1 when
        disabled) times ``divisor`` when given (folded in: ``grad / (scale * divisor)`` is one
        factor), and its reciprocal, taken in fp64 then rounded, as torch's ``unscale_``."""
        scale = self._scaled_by(device, divisor)
        if not self._enabled and divisor is None:
            return scale, scale
        return scale, scale.double().reciprocal().float()

    def _scaled_by(self, device: torch.device, divisor=None) -> Tensor:
        """The loss scale (1 when disabled) on ``device``, times ``divisor`` when given."""
        if self._enabled:
            scale = self._scale.to(device)
        else:
            scale = torch.ones((), dtype=torch.float32, device=device)
        if divisor is not None:
            scale = scale * torch.as_tensor(divisor, device=device).float()
        return scale

    def _clip_from_hook(
        self, optimizer, hook: DDPHookState, scale: Tensor, inv_scale: Tensor, max_norm: float
    ) -> Tensor:
        """The gradients are those a DDP with gradfuse's hook has just reduced, and the hook,
        handed over (``measured=``), measured them during backward: no pass over them here. The
        unscaled norm is the hook's norm times ``inv_scale``; ``found_inf`` is the hook's. A
        fused optimizer then divides by ``scale / clip_coef`` as it reads; otherwise one write
        pass over DDP's bucket buffers."""
        found = hook.found_inf().clone()  # torch's update() adds the other optimizers' flags into it
        with ops.no_grad():
            # Order 0 counts the non-zero gradients: a count that no scale changes.
            total = hook.total_norm() * inv_scale if hook.norm_type != 0 else hook.total_norm().clone()
            coef = clip_coef(total, max_norm)
            if _folds(optimizer):
                grad_scale = (scale / coef).float()
            else:
                grad_scale = None
                multi_tensor_scale_(hook.buffers, (inv_scale * coef).float())
        self._record(optimizer, {found.device: found}, grad_scale)
        return total

    @staticmethod
    def _measure(groups, inv_scale: Tensor, max_norm: float, norm_type: float):
        """One read-only pass per device: (total norm of the unscaled gradients, found_inf per
        device, clip coefficient), all on the devices."""
        norms, found = [], {}
        for device, group in groups.items():
            norm, found[device] = ops.unscale_check_norm_op(group, inv_scale.to(device), norm_type)
            norms.append(norm)
        total = _combine_totals(norms, norm_type)
        return total, found, clip_coef(total, max_norm).to(inv_scale.device)

    def _unscale_and_clip_by_policy(self, optimizer, policy, norm_type: float, divisor=None) -> Tensor:
        """``unscale_and_clip_`` with a clipping policy (``gradfuse.clipping``) in place of
        ``max_norm``. A norm policy: one read-only pass gives the norm of the unscaled gradients
        and ``found_inf``, the policy turns the norm into a coefficient on the device, and the
        coefficient joins the unscale factor (in a fused optimizer's read, or one write pass).
        A per-unit policy (AGC) unscales and clips in its own two passes."""
        norm_type = P.check_norm_type("GradScaler.unscale_and_clip_", norm_type)
        self._check_ready(optimizer)
        params, grads = _params_with_grads(optimizer)
        if self._enabled:
            _refuse_fp16(grads)
        groups = _fused_groups(grads, one_device=False) if grads else None
        observe = getattr(policy, "observe_stats", None)  # a probe of per-tensor statistics
        by_norm = _measures_norm_only(policy) or (observe is not None and hasattr(policy, "clip_coef"))
        if groups is None and grads and D.is_dtensor(grads[0]) and by_norm:
            total = self._unscale_and_clip_dtensor(optimizer, grads, policy.clip_coef, norm_type, divisor, observe)
            if total is not None:
                return total
        unscale_and_clip = getattr(policy, "unscale_and_clip_grads_", None)  # per-unit (AGC)
        if groups is None and grads and D.is_dtensor(grads[0]) and unscale_and_clip is not None:
            # FSDP2: the local shards' units, the ranks' partials combined by one all-reduce
            # between its two passes, which also agrees the inf/NaN flag (agc.py).
            _, inv = self._scales(grads[0].device, divisor)
            total, found = unscale_and_clip(params, inv)
            self._record(optimizer, found, None)
            return total
        if groups is not None and unscale_and_clip is not None:
            try:  # its own two passes, the unscale folded into the clip's write
                with ops.no_grad():
                    _check_all(groups)
                    _, inv = self._scales(next(iter(groups)), divisor)
                    total, found = unscale_and_clip(params, inv)
                self._record(optimizer, found, None)
                return total
            except _TORCHS:
                pass
        measured = None
        if groups is not None and hasattr(policy, "clip_coef"):
            first = next(iter(groups))
            scale, inv_scale = self._scales(first, divisor)
            try:  # read-only: nothing is modified when torch must answer instead
                measured = self._measure_for_policy(groups, inv_scale, norm_type, observe)
            except _TORCHS:
                pass
        if measured is None:
            # Gradients gradfuse cannot run: unscale, then the policy.
            if divisor is not None:  # no fused pass to fold it into here: one more
                with ops.no_grad():
                    for p in params:
                        p.grad.div_(torch.as_tensor(divisor, device=p.grad.device))
            if self._enabled:
                self.unscale_(optimizer)
                return _plain(policy.clip_grads_(params, norm_type))
            total = _plain(policy.clip_grads_(params, norm_type))
            self._record(optimizer, {total.device: (~torch.isfinite(total)).float()}, None)
            return total
        total, found = measured
        with ops.no_grad():
            coef = policy.clip_coef(total).to(first)
            grad_scale = None
            if _folds(optimizer):
                grad_scale = (scale / coef).float()
            else:
                for device, group in groups.items():
                    multi_tensor_scale_(group, (inv_scale * coef).to(device))
        self._record(optimizer, found, grad_scale)
        return total

    @staticmethod
    def _measure_for_policy(groups, inv_scale: Tensor, norm_type: float, observe=None, across=()):
        """One read-only pass per device: (total norm of the unscaled gradients, found_inf per
        device); per-tensor statistics from the same read for a policy that observes them
        (``observe``, its ``observe_stats``; ``across``: the process groups the tensors are
        shards over, for it to combine its statistics over)."""
        norms, found = [], {}
        with ops.no_grad():
            _check_all(groups)
            for device, group in groups.items():
                if observe is None:
                    norm, found[device] = ops.unscale_check_norm_op(group, inv_scale.to(device), norm_type)
                else:
                    # Per-tensor norms, largest magnitudes and inf/NaN counts of the scaled
                    # gradients; the norm scales exactly by a power-of-two inv_scale (GradScaler's
                    # scales), except order 0, a count.
                    from .ops import multi_tensor_stats  # here: the import line above is shared

                    stats = multi_tensor_stats(group, norm_type)
                    inv = inv_scale.to(device)
                    norm = stats.total if norm_type == 0 else (stats.total * inv).to(stats.total.dtype)
                    found[device] = (stats.nonfinite.sum() > 0).float()
                    observe(group, stats, inv, across)
                norms.append(norm)
            return _combine_totals(norms, norm_type), found

    def _unscale_and_clip_dtensor(
        self, optimizer, grads: list[Tensor], coef_of, norm_type: float, divisor, observe=None
    ):
        """``unscale_and_clip_`` for DTensor gradients (FSDP2, tensor parallel), the clip
        coefficient given by ``coef_of(total_norm)``. A read-only pass over this rank's local
        shards gives their unscaled norm and inf/NaN flag; one all-reduce per set of sharded
        mesh dimensions combines both (``combine_norm_and_flag``; order 0, a count, takes a
        second), so every rank has the same norm and the same verdict on skipping the step;
        then the coefficient joins the unscale factor as for plain gradients: inside the fused
        optimizer's read (torch's fused AdamW takes DTensor parameters with a plain
        ``grad_scale``), or one write pass over the shards. Returns the norm as a plain 0-d
        tensor, or None (nothing done) where torch must answer: ``Partial`` placements or
        several meshes. ``observe`` (a probe's ``observe_stats``): the local read is
        ``multi_tensor_stats`` instead, the same single pass, whose per-tensor statistics of the
        local shards go to it with the process groups they are split over (the probe combines
        them across the ranks later, on every rank alike)."""
        spec = D.dtensor_locals(grads)
        if spec is None:
            return None
        mesh, by_dims = spec
        device = next(t for shards in by_dims.values() for t in shards).device
        scale, inv_scale = self._scales(device, divisor)
        with ops.no_grad():
            # Every rank measures first and then joins the same all-reduces, whatever its shards.
            across = {dims: [mesh.get_group(d) for d in dims] for dims in by_dims}
            local = [
                _local_norm_and_flag(shards, inv_scale, norm_type or 1.0, device, observe, across[dims])
                for dims, shards in by_dims.items()
            ]
            totals, flags = [], []
            for (dims, shards), (norm, found) in zip(by_dims.items(), local, strict=True):
                groups = across[dims]
                norm, found = D.combine_norm_and_flag(norm, found, norm_type or 1.0, groups)
                if norm_type == 0:  # a tensor counts once however it is sharded
                    counts = _run_fused(shards, _nonzero_counts)  # one read per device, as the clip's
                    if counts is _TO_TORCH:
                        counts = torch.stack([torch.count_nonzero(t).to(device) for t in shards])
                    # float32 on every rank, whichever way each counted: the all-reduce pairs them.
                    norm = D.count_nonzero_across(counts.to(device, torch.float32), groups)
                totals.append(norm)
                flags.append(found)
            total = _combine_totals(totals, norm_type)
            found = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
            coef = coef_of(total).to(device)
            grad_scale = None
            if _folds(optimizer):
                grad_scale = (scale / coef).float()
            else:
                shards = [t for part in by_dims.values() for t in part if t.numel()]
                _scale_in_place(shards, (inv_scale * coef).float())
        self._record(optimizer, {found.device: found}, grad_scale)
        return total

    def _unscale_and_clip_by_torch(self, optimizer, max_norm: float, norm_type: float, divisor=None) -> Tensor:
        """Gradients gradfuse cannot run (sparse, DTensor, ...): torch's unscale_ and clip."""
        from .clip import clip_grad_norm_

        params = _params_with_grads(optimizer)[0]
        if self._enabled:
            self.unscale_(optimizer)
        if divisor is not None:  # no fused pass to fold it into here: one more
            for p in params:
                p.grad.div_(torch.as_tensor(divisor, device=p.grad.device))
        total = _plain(clip_grad_norm_(params, max_norm, norm_type))
        if self._enabled:
            return total
        found = (~torch.isfinite(total)).float()
        self._record(optimizer, {total.device: found}, None)
        return total

    def _check_ready(self, optimizer) -> None:
        if self._enabled:
            self._check_scale_growth_tracker("unscale_and_clip_")
            stage = self._per_optimizer_states[id(optimizer)]["stage"]
            if stage is OptState.UNSCALED:
                raise RuntimeError(
                    "unscale_and_clip_() or unscale_() has already been called on this optimizer "
                    "since the last update()."
                )
            if stage is OptState.STEPPED:
                raise RuntimeError("unscale_and_clip_() is being called after step().")
        elif (unscaled := self._unscaled.get(id(optimizer))) is not None and unscaled.pending:
            # Disabled: only a folded clip no step has taken yet is refused (a second fold would
            # replace it). A clip done in place needs no step to be complete, and a direct
            # optimizer.step() after it cannot be seen: as torch's disabled scaler, no update()
            # is needed between iterations.
            raise RuntimeError("unscale_and_clip_() has already been called on this optimizer since the last step().")

    def _record(self, optimizer, found_per_device: dict, grad_scale: Tensor | None) -> None:
        first = next(iter(found_per_device.values()))
        found = (
            first
            if len(found_per_device) == 1
            else torch.stack([f.to(first.device) for f in found_per_device.values()]).amax()
        )
        unscaled = self._unscaled[id(optimizer)] = _Unscaled(found, grad_scale)
        if self._enabled:
            state = self._per_optimizer_states[id(optimizer)]
            state["found_inf_per_device"] = found_per_device
            state["stage"] = OptState.UNSCALED
        if grad_scale is not None:
            # Handed over now, as torch's step hands them over, so that the optimizer's own
            # step() applies the unscale and the clip (and skips on inf/NaN) however it is
            # called; found_inf is the tensor skip_step_ updates in place.
            optimizer.grad_scale, optimizer.found_inf = grad_scale, found
            unscaled.optimizer = weakref.ref(optimizer)
            unscaled.handle = optimizer.register_step_post_hook(self._folded_step_taken)

    def _folded_step_taken(self, optimizer, args, kwargs) -> None:
        """The optimizer's step post-hook while a folded clip is pending: that step applied it.
        Called directly (not from ``step``), the step leaves the attributes to us, and counts
        as this optimizer's step (a second one would run on unclipped gradients)."""
        unscaled = self._unscaled.get(id(optimizer))
        if unscaled is None or unscaled.handle is None:
            return
        unscaled.handle.remove()
        unscaled.handle = None
        _refuse_a_second_step(optimizer)
        if unscaled.via_scaler:
            return  # torch's GradScaler.step deletes grad_scale and found_inf itself
        _withdraw(optimizer)
        unscaled.stepped = True
        if self._enabled:
            self._per_optimizer_states[id(optimizer)]["stage"] = OptState.STEPPED

    def _apply_pending(self, unscaled: _Unscaled) -> None:
        """A folded clip that no step took, written into the gradients (one pass): they end as
        torch's ``unscale_`` + ``clip_grad_norm_`` leave them, and nothing is handed over any more."""
        unscaled.handle.remove()
        unscaled.handle = None
        optimizer = unscaled.optimizer()
        if optimizer is None:
            return
        _withdraw(optimizer)
        grads = [g.to_local() if D.is_dtensor(g) else g for g in _optimizer_grads(optimizer)[0]]
        with ops.no_grad():
            _scale_in_place(grads, unscaled.grad_scale.double().reciprocal().float())

    # --- step, update ---------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """As torch's ``step``; after ``unscale_and_clip_``, applies what it folded."""
        unscaled = self._unscaled.get(id(optimizer))
        if unscaled is not None and unscaled.stepped:
            raise RuntimeError(
                "step(): optimizer.step() was already called after unscale_and_clip_() and applied its "
                "unscale and clip; a second step would run on the unscaled, unclipped gradients"
            )
        if self._enabled:
            # torch's step passes optimizer.grad_scale (set by unscale_and_clip_) on in the
            # UNSCALED stage, and deletes it and found_inf after the optimizer's step.
            if unscaled is not None:
                unscaled.via_scaler = True
            try:
                result = super().step(optimizer, *args, **kwargs)
            finally:
                if unscaled is not None:
                    unscaled.via_scaler = False
            self._unscaled.pop(id(optimizer), None)
            return result
        if unscaled is None:
            return optimizer.step(*args, **kwargs)
        if unscaled.grad_scale is None:
            # Clipped in place; skip on inf/NaN as torch's scaler does (a host read, as torch's).
            self._unscaled.pop(id(optimizer))
            return None if unscaled.found_inf.item() else optimizer.step(*args, **kwargs)
        # Folded: grad_scale and found_inf are on the optimizer, whose step reads (and skips on)
        # them; its post-hook withdraws them.
        result = optimizer.step(*args, **kwargs)
        self._unscaled.pop(id(optimizer), None)
        return result

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """As torch's ``update``. A clip that ``unscale_and_clip_`` folded and no step applied
        (a step skipped by the caller) is written into the gradients first, so that they end
        as torch's ``unscale_`` + ``clip_grad_norm_`` would leave them: never dropped."""
        for unscaled in self._unscaled.values():
            if unscaled.pending:
                self._apply_pending(unscaled)
        self._unscaled.clear()
        super().update(new_scale)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> Tensor:
        """A 0-d float32 tensor, 1.0 if the gradients of ``optimizer`` held inf or NaN when they
        were last unscaled (by ``unscale_``, ``unscale_and_clip_`` or ``step``), else 0.0.
        Valid until ``update``; no host sync."""
        if id(optimizer) in self._unscaled:
            return self._unscaled[id(optimizer)].found_inf
        per_device = (
            self._per_optimizer_states.get(id(optimizer), {}).get("found_inf_per_device") if self._enabled else None
        )
        if not per_device:
            raise RuntimeError(
                "found_inf(): this optimizer's gradients have not been unscaled since the last update() "
                "(call unscale_, unscale_and_clip_ or step first)"
            )
        first = next(iter(per_device.values()))
        return torch.stack([f.to(first.device) for f in per_device.values()]).amax()

    def skip_step_(self, optimizer: torch.optim.Optimizer, flag: Tensor) -> None:
        """Mark this step of ``optimizer`` for skipping where the 0-d ``flag`` is nonzero, through
        ``found_inf`` as an overflow would (on the device: a fused optimizer skips without a host
        sync; with loss scaling, ``update`` then backs the scale off). Call it after
        ``unscale_and_clip_`` (or ``unscale_``) and before ``step``."""
        found = []
        if id(optimizer) in self._unscaled:
            found.append(self._unscaled[id(optimizer)].found_inf)
        if self._enabled:
            found += self._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {}).values()
        if not found:
            raise RuntimeError("skip_step_(): call unscale_and_clip_ or unscale_ on this optimizer first")
        for f in {id(f): f for f in found}.values():
            torch.maximum(f, flag.to(f.device, f.dtype), out=f)

    def __getstate__(self):
        state = super().__getstate__()
        state["_unscaled"] = {}
        return state
