"""Drop-in replacements for ``torch.nn.utils``'s gradient clipping, and ``patch_torch``.

Same signatures and semantics as torch's (torch's own tests are the reference), with two
differences, both on purpose: every norm accumulates in float32 (float64 for float64
gradients), so the returned total of a bf16/fp16 model is a float32 tensor accurate to fp32;
and a negative or NaN ``max_norm``/``clip_value`` raises ``ValueError`` instead of flipping or
poisoning every gradient. Calls gradfuse cannot run are handed to torch, which answers: sparse,
complex, tensor-subclass (DTensor) or unaligned gradients, devices other than CPU and CUDA, and
gradients that alias each other in memory (the same parameter twice, one gradient tensor shared
by two parameters, overlapping views), where torch's element-by-element updates define the
result. The kernels find all of these before anything is modified.

Gradients that are the views of a live ``GradBuckets`` run over its few flat buffers; those a
DDP with gradfuse's hook has reduced are scaled over DDP's bucket buffers. The norm the hook
measured during backward is used only when handed over, ``clip_grad_norm_(...,
measured=state)``: the caller promises that nothing touched the gradients since backward
(writes through ``.data``, NumPy views or collectives change no version counter, so this
cannot be checked; a visibly stale handover raises). Without it the gradients are read, and
the answer is torch's. DTensor
gradients (FSDP2, tensor parallel) with ``Shard``/``Replicate`` placements run over their local
shards with one all-reduce per mesh; ``process_group=`` combines shards held by several ranks.
"""

from __future__ import annotations

import math
import threading
import types
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from . import _plan as P
from . import distributed as D
from . import ops
from .buckets import owner_of
from .ddp_hook import handed_over, state_for
from .ops import check_max_norm

Tensor = torch.Tensor
_TensorOrTensors = Tensor | Iterable[Tensor]

# torch's own functions, kept before any patching so that delegating never loops back here.
_TORCH = {
    name: getattr(torch.nn.utils, name)
    for name in ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
}
_PLAIN = frozenset({Tensor, torch.nn.Parameter})
_get_device = Tensor.get_device
_DEVICES = frozenset({"cpu", "cuda"})
#: What the ops raise, before modifying anything, for calls that torch must answer (tensors on
#: several devices only where a group was guessed wrong: see :func:`_fused_groups`).
_TORCHS = (P.UnsupportedTensorError, P.OverlapError, P.MixedDevicesError)


def _parameters(parameters: _TensorOrTensors, warn_empty_generator: bool) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    parameters = list(parameters)
    if warn_empty_generator and is_generator and not parameters:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    return parameters


def _grads(parameters: list[Tensor]) -> list[Tensor]:
    return _grads_and_plain(parameters)[0]


def _grads_and_plain(parameters: list[Tensor]) -> tuple[list[Tensor], bool]:
    """The gradients that are not None, in order, and whether they are known to be plain tensors
    (``torch.Tensor``/``nn.Parameter``, the types gradfuse plans)."""
    if torch.compiler.is_compiling():
        return [p.grad for p in parameters if p.grad is not None], False  # dynamo cannot trace the walrus
    # One Rust pass through torch's getter (~44 ns an nn.Parameter, where a Python loop costs ~54),
    # which also vouches for the types: the caller skips its own pass over them (~11 ns a tensor).
    grads = P.grads_of(parameters)
    if grads is not None:
        return grads, True
    return [g for p in parameters if (g := p.grad) is not None], False


def _fused_groups(
    tensors: list[Tensor], one_device: bool, plain: bool = False
) -> dict[torch.device, list[Tensor]] | None:
    """Tensors grouped by device in order of first appearance (the first device holds the
    total), or None when gradfuse leaves them to torch: tensor subclasses (DTensor, ...) and
    devices other than CPU and CUDA. Unsupported dtypes and layouts are found by the ops
    themselves (``UnsupportedTensorError``, raised before anything is modified).

    ``one_device``: assume every tensor is on the first one's device, unchecked (see
    :func:`_run_fused`). ``plain``: the tensors are known to be plain tensors."""
    compiling = torch.compiler.is_compiling()
    if compiling:
        if any(t.layout != torch.strided or t.dtype not in P.DTYPE_CODES for t in tensors):
            return None
    elif not plain and not set(map(type, tensors)) <= _PLAIN:
        return None
    # One C-level pass of get_device() (~30 ns a tensor; .device makes an object each, ~70 ns).
    # It cannot tell the CPU from meta (both -1), nor CUDA from another device of the same index:
    # a wrong guess ends in the op's MixedDevicesError, before anything is modified (see _TORCHS).
    if not compiling and (one_device or len(set(map(_get_device, tensors))) == 1):
        first = tensors[0]
        # Two getters (~35 ns each) where device.type makes a string (~150 ns).
        return {first.device: tensors} if first.is_cpu or first.is_cuda else None
    groups = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    if any(device.type not in _DEVICES for device in groups):
        return None
    return groups


#: What :func:`_run_fused` returns when the call must go to torch.
_TO_TORCH = object()


def _run_fused(
    tensors: list[Tensor], run: Callable[[dict[torch.device, list[Tensor]]], object], plain: bool = False
) -> object:
    """``run(groups)`` on gradfuse's kernels (``groups`` as :func:`_fused_groups` makes them), or
    ``_TO_TORCH`` when torch must answer the call; nothing has been modified then.

    One device is tried first, unchecked: the ops check that all their tensors are on one
    device before anything runs (``MixedDevicesError``, or the dispatcher's NotImplementedError
    for a device gradfuse has no kernel for), so checking here as well would read every tensor's
    device twice (~90 us at 2000 tensors, measured). A list that spans devices is then grouped
    and run again."""
    groups = _fused_groups(tensors, one_device=True, plain=plain)
    try:
        with ops.no_grad():
            if groups is not None:
                try:
                    return run(groups)
                except (P.MixedDevicesError, NotImplementedError):
                    groups = _fused_groups(tensors, one_device=False, plain=plain)
                    if groups is not None:
                        return run(groups)
    except _TORCHS:
        pass
    return _TO_TORCH


def _check_all(groups: dict[torch.device, list[Tensor]]) -> None:
    """Before a call that launches once per device: find on every device first what would send
    the call to torch (unsupported or unaligned tensors, aliasing gradients), so that no
    device's gradients are modified when another's must go to torch."""
    if len(groups) > 1:
        for group in groups.values():
            P.check_dtypes("gradfuse", "grads", group)
            P.check_layouts("gradfuse", "grads", group)
            P.check_aligned("gradfuse", "grads", group)
            P.check_disjoint("gradfuse", "grads", group)


def _check_writable_all(groups: dict[torch.device, list[Tensor]]) -> None:
    """Right before the first device's write: torch's inference-tensor rule on every device."""
    if len(groups) > 1:
        for group in groups.values():
            P.check_writable(group)


def _combine_totals(totals: list[Tensor], norm_type: float) -> Tensor:
    """The total norm from per-device totals (on the first device), as torch would get it."""
    if len(totals) == 1:
        return totals[0]
    first = totals[0].device
    stacked = torch.stack([t.to(first) for t in totals])
    if norm_type == 0:
        # Per-device totals of order 0 are counts of non-zero tensors: they add up.
        return stacked.sum()
    return torch.linalg.vector_norm(stacked, norm_type)


def _total_norm(groups: dict[torch.device, list[Tensor]], norm_type: float, error_if_nonfinite: bool) -> Tensor:
    totals = [ops.multi_tensor_norm_op(group, norm_type, False)[0] for group in groups.values()]
    total = _combine_totals(totals, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise P.nonfinite_total_error(norm_type)
    return total


def _is_dtensor(tensors: list[Tensor]) -> bool:
    return type(tensors[0]) not in _PLAIN and D.is_dtensor(tensors[0])


def _local_norm(shards: list[Tensor], norm_type: float, device: torch.device) -> Tensor | None:
    """The norm of this rank's ``shards``, to be combined with the other ranks'. An empty shard
    adds nothing (a rank may hold none of a small tensor), so empty ones are left out; with none
    left the result is the combine's identity. None when torch must answer."""
    nonempty = [t for t in shards if t.numel()]
    # The fused kernels' rule, from every shard (also the empty ones, whose dtype is the
    # DTensor's): so a rank without elements ends with the other ranks' dtype.
    out = torch.float64 if any(t.dtype == torch.float64 for t in shards) else torch.float32
    if not nonempty:
        return D.norm_of_nothing(norm_type, device).to(out)
    total = _run_fused(nonempty, lambda groups: _total_norm(groups, norm_type, False))
    return None if total is _TO_TORCH else total.to(out)


def _nonzero_counts(groups: dict[torch.device, list[Tensor]]) -> Tensor:
    first = next(iter(groups))
    return torch.cat([ops.multi_tensor_norm_op(g, 0.0, True)[1].to(first) for g in groups.values()])


def _dtensor_total(tensors: list[Tensor], norm_type: float) -> Tensor | None:
    """The total norm of DTensor gradients as torch gives it (a replicated DTensor), from their
    local shards through the fused kernels and one all-reduce per set of sharded mesh
    dimensions; None when torch must answer."""
    spec = D.dtensor_locals(tensors)
    if spec is None:
        return None
    mesh, by_dims = spec
    totals = []
    for dims, shards in by_dims.items():
        groups = [mesh.get_group(d) for d in dims]
        if norm_type == 0:
            # Order 0 counts a tensor once however it is sharded: its non-zero elements, summed.
            counts = _run_fused(shards, _nonzero_counts)
            if counts is _TO_TORCH:
                return None
            totals.append(D.count_nonzero_across(counts, groups))
            continue
        local = _local_norm(shards, norm_type, torch.device(mesh.device_type))
        if local is None:
            return None
        totals.append(D.combine_norm(local, norm_type, groups))
    return D.as_replicated(_combine_totals(totals, norm_type), mesh)


def get_total_norm(
    tensors: _TensorOrTensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group=None,
) -> Tensor:
    """As ``torch.nn.utils.get_total_norm``, in one fused pass per device (fp32-accurate).

    ``process_group``: ``tensors`` are this rank's shard of the gradients (ZeRO, sharded
    optimizers); the result is the norm over every rank's shard (one all-reduce on the device),
    identical on every rank. Every rank must call it, with or without tensors. Order 0 then
    counts each rank's non-zero tensors. DTensor gradients are reduced over their own mesh.
    """
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    norm_type = P.check_norm_type("gradfuse.get_total_norm", norm_type)
    if process_group is not None:
        return _total_across(tensors, norm_type, error_if_nonfinite, foreach, process_group)
    if not tensors:
        return torch.tensor(0.0)
    owner = owner_of(tensors) if norm_type > 0 else None
    if owner is not None:
        return owner.get_total_norm(norm_type, error_if_nonfinite)
    if _is_dtensor(tensors):
        with ops.no_grad():
            total = _dtensor_total(tensors, norm_type)
        if total is not None:
            if error_if_nonfinite and not torch.isfinite(total.to_local()):
                raise P.nonfinite_total_error(norm_type)
            return total
    else:
        total = _run_fused(tensors, lambda groups: _total_norm(groups, norm_type, error_if_nonfinite))
        if total is not _TO_TORCH:
            return total
    return _TORCH["get_total_norm"](tensors, norm_type, error_if_nonfinite, foreach)


def _total_across(tensors: list[Tensor], norm_type: float, error_if_nonfinite: bool, foreach, group) -> Tensor:
    nonempty = [t for t in tensors if t.numel()]
    if nonempty:
        local = get_total_norm(nonempty if len(nonempty) < len(tensors) else tensors, norm_type, False, foreach)
        if D.is_dtensor(local):
            local = local.to_local()
    else:
        local = D.norm_of_nothing(norm_type, D.collective_device(group))
    total = D.combine_norm(local, norm_type, [group])
    if error_if_nonfinite and not torch.isfinite(total):
        raise P.nonfinite_total_error(norm_type)
    return total


def clip_grads_with_norm_(
    parameters: _TensorOrTensors,
    max_norm: float,
    total_norm: Tensor,
    foreach: bool | None = None,
) -> None:
    """As ``torch.nn.utils.clip_grads_with_norm_``: ``grad *= min(max_norm / (total_norm + 1e-6), 1)``.

    The coefficient is computed on the device, inside the kernel (no host sync); when it is
    exactly 1 no gradient memory is touched.
    """
    parameters = _parameters(parameters, warn_empty_generator=False)
    max_norm = check_max_norm("gradfuse.clip_grads_with_norm_", max_norm)
    _scale_grads(parameters, _grads(parameters), max_norm, total_norm, foreach)


def _scale_grads(parameters: list[Tensor], grads: list[Tensor], max_norm: float, total_norm, foreach) -> None:
    """The scale pass of clipping, on whatever holds the gradients: a GradBuckets' buffers,
    DTensors' local shards, the gradients themselves (per device), or torch."""
    if not grads:
        return
    owner = owner_of(grads)
    targets, local_total = grads, total_norm
    if owner is not None:
        targets = owner.buffers
    elif (hook := state_for(grads)) is not None:
        targets = hook.buffers
    elif _is_dtensor(grads) and (spec := D.dtensor_locals(grads)) is not None:
        targets = [t for shards in spec[1].values() for t in shards]
        local_total = total_norm.to_local() if D.is_dtensor(total_norm) else total_norm
    total = _fused_total(local_total)

    def run(groups):
        _check_all(groups)
        _check_writable_all(groups)
        for device, group in groups.items():
            ops.clip_grads_with_norm_op(group, max_norm, total.to(device, non_blocking=True))

    if total is None or _run_fused(targets, run) is _TO_TORCH:
        _TORCH["clip_grads_with_norm_"](parameters, max_norm, total_norm, foreach)


def _fused_total(total_norm) -> Tensor | None:
    """``total_norm`` as the fused op takes it, or None where torch must decide: torch
    multiplies the gradients by the 0-d ``clamp(max_norm / (total_norm + 1e-6), max=1)``, so it
    refuses other shapes (its foreach path does; its per-tensor path may broadcast) and lifts
    an integer or bool total to the default float dtype by type promotion, as done here."""
    if not isinstance(total_norm, Tensor) or type(total_norm) not in _PLAIN or total_norm.dim() != 0:
        return None
    if total_norm.dtype in P.DTYPE_CODES:
        return total_norm
    if total_norm.is_floating_point() or total_norm.is_complex():
        return None
    return total_norm.to(torch.get_default_dtype())


def clip_grad_norm_(
    parameters: _TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group=None,
    measured=None,
) -> Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_``: two passes over the gradients (a read
    for the norm, a read-write for the scale, skipped when no clipping is needed), one or two
    kernel launches per device whatever the number of tensors, no host sync. Returns the total
    norm of the gradients (viewed as one vector), float32 for fp32/bf16/fp16 gradients.

    When the gradients are exactly the views of a live :class:`gradfuse.GradBuckets`, both
    passes run over its few flat buffers.
    ``measured``: the state :func:`gradfuse.register_ddp_hook` returned, handed over with the
    promise that nothing touched the gradients since the last synchronised backward (which
    gradfuse cannot check: ``.data``, NumPy and collective writes move no version counter).
    The norm is then the one the hook measured during backward, and only the scale pass runs,
    over DDP's bucket buffers.
    ``parameters`` must be all of the DDP model's; a handover that is visibly stale (other
    gradient tensors, or ones modified in place since) raises ``RuntimeError``, and one of
    another ``norm_type`` ``ValueError``; where that backward left no measurement the
    gradients are read.
    ``process_group``: the gradients are this rank's shard and the norm is over every rank's
    (see :func:`get_total_norm`).
    ``max_norm`` may also be a clipping policy (``gradfuse.clipping``: ZClip, AutoClip, AGC),
    which picks the coefficient.
    """
    parameters = _parameters(parameters, warn_empty_generator=True)
    if measured is not None and (process_group is not None or hasattr(max_norm, "clip_grads_")):
        raise ValueError(
            "gradfuse.clip_grad_norm_: measured= (the DDP hook's norm) takes a max_norm number and no process_group"
        )
    if hasattr(max_norm, "clip_grads_"):  # a clipping policy (gradfuse.clipping) in place of max_norm
        return max_norm.clip_grads_(parameters, norm_type, error_if_nonfinite, foreach, process_group=process_group)
    grads, plain = _grads_and_plain(parameters)
    max_norm = check_max_norm("gradfuse.clip_grad_norm_", max_norm)
    norm_type = P.check_norm_type("gradfuse.clip_grad_norm_", norm_type)
    if process_group is None:
        hook = None if measured is None else handed_over(measured, grads, norm_type, "gradfuse.clip_grad_norm_")
        if not grads:
            return torch.tensor(0.0)
        owner = owner_of(grads) if norm_type > 0 else None
        if owner is not None:
            return owner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        if hook is not None:
            # The norm was measured during backward: only the scale pass is left, over DDP's buckets.
            total = hook.total_norm().clone()  # the caller's own, as torch's is
            if error_if_nonfinite and not torch.isfinite(total):
                raise P.nonfinite_total_error(norm_type)
            ops.clip_grads_with_norm_op(hook.buffers, max_norm, total)
            return total
        if not _is_dtensor(grads):

            def run(groups):
                if len(groups) == 1:
                    return ops.clip_grad_norm_op(grads, max_norm, norm_type, error_if_nonfinite)
                _check_all(groups)
                total = _total_norm(groups, norm_type, error_if_nonfinite)
                _check_writable_all(groups)
                for device, group in groups.items():
                    ops.clip_grads_with_norm_op(group, max_norm, total.to(device, non_blocking=True))
                return total

            total = _run_fused(grads, run, plain)
            if total is not _TO_TORCH:
                return total
            return _TORCH["clip_grad_norm_"](parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    # DTensors, or shards across a process group: the total, then the scale pass.
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach, process_group=process_group)
    _scale_grads(parameters, grads, max_norm, total, foreach)
    return total


def clip_grad_norm(
    parameters: _TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Deprecated alias of :func:`clip_grad_norm_`, warning as torch's does."""
    warnings.warn(
        "`torch.nn.utils.clip_grad_norm` is now deprecated in favor of `torch.nn.utils.clip_grad_norm_`.",
        FutureWarning,
        stacklevel=2,
    )
    return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


def clip_grad_value_(parameters: _TensorOrTensors, clip_value: float, foreach: bool | None = None) -> None:
    """Drop-in for ``torch.nn.utils.clip_grad_value_``: clamps every gradient to
    ``[-clip_value, clip_value]`` in one pass per device (NaN stays NaN)."""
    parameters = _parameters(parameters, warn_empty_generator=False)
    clip_value = float(clip_value)
    if math.isnan(clip_value) or clip_value < 0:
        raise ValueError(f"gradfuse.clip_grad_value_: clip_value must be a non-negative number, got {clip_value}")
    grads = _grads(parameters)
    if not grads:
        return

    def run(groups):
        _check_all(groups)
        _check_writable_all(groups)
        for group in groups.values():
            ops.clamp_op(group, -clip_value, clip_value)

    if _run_fused(grads, run) is _TO_TORCH:
        _TORCH["clip_grad_value_"](parameters, clip_value, foreach)


_REPLACEMENTS = {
    "clip_grad_norm_": clip_grad_norm_,
    "clip_grad_norm": clip_grad_norm,
    "clip_grad_value_": clip_grad_value_,
    "get_total_norm": get_total_norm,
    "clip_grads_with_norm_": clip_grads_with_norm_,
}
# Only public names are replaced. torch.nn.utils.clip_grad also holds get_total_norm and
# clip_grads_with_norm_ under private names, which its clip_grad_norm_ calls: left alone, they
# keep a call that gradfuse hands to torch (aliasing gradients, say) torch's own end to end.


_PATCH_LOCK = threading.Lock()
#: patch_torch objects in force, and what the first of them replaced.
_PATCHES: list[patch_torch] = []
_SAVED: list[tuple[object, str, object]] = []


class patch_torch:
    """Route torch's clipping functions through gradfuse.

    ``gradfuse.patch_torch()`` replaces ``torch.nn.utils.clip_grad_norm_``,
    ``clip_grad_norm``, ``clip_grad_value_``, ``get_total_norm`` and ``clip_grads_with_norm_``
    (and the public ones of these in ``torch.nn.utils.clip_grad``), so a trainer that calls
    them picks up the fused path unchanged. Used as a context manager, it restores torch's
    functions on exit; otherwise ``.restore()`` does.

    Patches are counted: torch stays patched while any patch object is in force, and the
    functions that were there before the first one come back when the last one is restored,
    whatever the order. A patch object can be used again (``with p:`` re-applies it), and
    restoring one twice is harmless. The same object nests as distinct ones do: its ``with``
    blocks are counted, and only the outermost one's exit restores it.
    """

    def __init__(self) -> None:
        self._entries = 0  # ``with`` blocks of this object now open
        self.apply()

    @property
    def active(self) -> bool:
        """Whether this patch is in force."""
        return any(p is self for p in _PATCHES)

    def apply(self) -> None:
        """Put this patch in force (nothing to do if it is)."""
        with _PATCH_LOCK:
            if self.active:
                return
            if not _PATCHES:
                for name, fn in _REPLACEMENTS.items():
                    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
                        if hasattr(module, name):
                            _SAVED.append((module, name, getattr(module, name)))
                            setattr(module, name, fn)
            _PATCHES.append(self)

    def restore(self) -> None:
        """Withdraw this patch; when no other is in force, put back the functions that were
        there before patching began."""
        with _PATCH_LOCK:
            if not self.active:
                return
            _PATCHES[:] = [p for p in _PATCHES if p is not self]
            if not _PATCHES:
                for module, attr, original in reversed(_SAVED):
                    setattr(module, attr, original)
                _SAVED.clear()

    def __enter__(self) -> patch_torch:
        with _PATCH_LOCK:
            self._entries += 1
        self.apply()
        return self

    def __exit__(self, *exc_info) -> None:
        with _PATCH_LOCK:
            self._entries -= 1
            outermost = self._entries == 0
        if outermost:
            self.restore()
