"""The `gradfuse::` custom ops: registration with torch.library, and their public wrappers.

This is the only module that registers ops. Each op validates its arguments (``_plan``), then
runs on the backend for the tensors' device: the Rust core for CPU tensors, the Triton kernels
(``gradfuse.kernels``) for CUDA tensors. ``GRADFUSE_BACKEND=triton`` sends CPU tensors to the
Triton kernels too (with ``TRITON_INTERPRET=1`` that runs them on the CPU, which is how a
machine without a GPU tests them); ``GRADFUSE_BACKEND=rust`` insists on the Rust core.

The ops are defined with ``torch.library.Library.define`` + ``impl`` rather than
``torch.library.custom_op``: the latter bumps version counters in a Python loop, 1.2 ms per
call at 2000 tensors (measured, torch 2.15), longer than the whole fused clip on small
tensors. Here one C++ call bumps them all (``_plan.bump_versions``); fake implementations are
registered with ``torch.library.register_fake`` and every op passes ``torch.library.opcheck``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import attrgetter
from typing import NamedTuple

import torch

from . import _fork  # noqa: F401  (registers the fork hook with the package, before any fork)
from . import _plan as P

Tensor = torch.Tensor

_LIB = torch.library.Library("gradfuse", "DEF")


def _backend(plan: P.Plan):
    """The backend module that runs ``plan`` (on its device, as ``GRADFUSE_BACKEND`` says)."""
    return _backend_on(plan.on_cuda)


def _backend_on(on_cuda: bool):
    """The backend module for tensors on CUDA (``on_cuda``) or on the CPU."""
    # The environment as os.environ has it, read by the Rust core (loaded on first use, not by
    # `import gradfuse`): os.environ.get of an unset name costs ~0.5 us (a KeyError raised and caught).
    choice = P.rust_core().backend_env()
    if choice is None:  # the usual case, first
        return _triton() if on_cuda else _cpu()
    choice = choice.lower()
    if choice not in ("auto", "rust", "triton"):
        raise ValueError(f"GRADFUSE_BACKEND must be auto, rust or triton, got {choice!r}")
    if on_cuda:
        if choice == "rust":
            raise RuntimeError("GRADFUSE_BACKEND=rust cannot run on CUDA tensors; use auto or triton")
        return _triton()
    if choice == "triton":
        return _triton()
    return _cpu()


def _triton():
    if not _BACKENDS["triton"]:
        from . import _triton

        _BACKENDS["triton"].append(_triton)
    return _BACKENDS["triton"][0]


def _cpu():
    if not _BACKENDS["cpu"]:
        from . import _cpu

        _BACKENDS["cpu"].append(_cpu)
    return _BACKENDS["cpu"][0]


#: The backend modules, imported on first use (the Triton one imports triton).
_BACKENDS: dict[str, list] = {"cpu": [], "triton": []}


# Sparse layouts get the same kernel so that they reach the plan, which rejects them with an
# UnsupportedTensorError naming the tensor (and the drop-ins then hand the call to torch),
# instead of the dispatcher's "could not run ... with arguments from the 'SparseCPU' backend".
_DISPATCH_KEYS = ("CPU", "CUDA", "SparseCPU", "SparseCUDA", "SparseCsrCPU", "SparseCsrCUDA")


def direct() -> bool:
    """Whether an eager call may run an op's implementation straight away, without the
    dispatcher's round trip (~8-12 us): nothing is tracing or compiling, no torch function or
    dispatch mode and no functorch transform is active (each would see or change the op), and
    neither the profiler nor ``torch.jit.trace`` is on (both record ops at the dispatcher: a traced
    graph would hold the op's output as a constant). The call then does exactly what the
    dispatcher would have it do for plain CPU and CUDA tensors: the same implementation (tensors
    the plans cannot describe, on other devices say, still go through the dispatcher)."""
    return plain_eager() and not torch.autograd._profiler_enabled()


def plain_eager() -> bool:
    """Whether a call may launch gradfuse's kernels on raw addresses, outside any op: nothing is
    tracing or compiling, and no torch function or dispatch mode and no functorch transform is
    active (each would need to see the computation as torch ops). The profiler may be on: it
    records the kernels themselves."""
    if torch.compiler.is_compiling():  # first: dynamo folds it, and traces no further
        return False
    return not (
        torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._are_functorch_transforms_active()
        or torch._C._get_tracing_state() is not None
    )


def inverse_scale(scale: Tensor) -> tuple[Tensor, Tensor]:
    """``(inv_scale, found_inf)`` for an unscale by ``scale`` (a one-element float32 tensor on the
    CPU or CUDA): new 0-d float32 tensors on its device, the reciprocal bit for bit as torch's
    ``GradScaler.unscale_`` takes it (in float64, rounded) and a zeroed flag. One launch on CUDA
    where torch's arithmetic makes four; torch's own ops while tracing, compiling or under a mode."""
    if plain_eager() and scale.dtype == torch.float32 and scale.numel() == 1 and (scale.is_cuda or scale.is_cpu):
        return _backend_on(scale.is_cuda).inverse_scale(scale)
    return scale.double().reciprocal().float(), torch.zeros((), dtype=torch.float32, device=scale.device)


class _NoGrad:
    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc) -> None:
        torch._C._set_grad_enabled(self.prev)


def no_grad():
    """``torch.no_grad()`` for the eager hot paths: the same grad-mode switch for ~0.3 us, where
    torch's context manager costs ~1.2 us (it builds a ``set_grad_enabled`` object on entry); under
    ``torch.compile`` torch's own, which dynamo knows."""
    return torch.no_grad() if torch.compiler.is_compiling() else _NoGrad()


class _Op:
    """One ``gradfuse::`` op: its registration (implementation on every backend key, fake
    implementation) and its eager entry.

    ``run`` is the implementation for arguments already checked (numbers as floats, checked as
    ``check`` checks them); the registered implementation is ``run(*check(*args))``. Calling the
    ``_Op`` object is the eager entry for callers that checked the arguments themselves (the
    drop-ins, the scaler, the buckets): ``run`` directly when :func:`direct` allows, else the
    registered op through the dispatcher. Either way, bad tensors raise from the plan, naming the
    op and the index, before anything is modified.
    """

    def __init__(self, schema: str, run, fake, check=None):
        self.name = schema.split("(", 1)[0]
        self.run = run
        self.check = check
        _LIB.define(schema)
        for key in _DISPATCH_KEYS:
            _LIB.impl(self.name, self._impl, key)
        torch.library.register_fake(f"gradfuse::{self.name}", fake, lib=_LIB)
        self.overload = getattr(torch.ops.gradfuse, self.name).default

    def _impl(self, *args):
        return self.run(*self.check(*args)) if self.check is not None else self.run(*args)

    def __call__(self, *args):
        if direct():
            try:
                return self.run(*args)
            except P.NotPlannable:
                pass  # tensors only the dispatcher knows what to do with (meta, say)
        return self.overload(*args)

    def public(self, *args):
        """The call of a public wrapper: arguments not checked yet, and autograd may watch. The
        dispatcher's autograd step has something to do only for tensors that require grad while
        grad mode is on: then it runs (where an in-place target's plan refuses them); otherwise
        this is the eager entry, with grad mode off (what it found out, the plans need not ask
        again)."""
        if not direct():
            return self.overload(*args)
        grad_mode = torch.is_grad_enabled()
        if grad_mode:
            if any(map(_requires_grad, _tensors_of(args))):
                return self.overload(*args)
            torch._C._set_grad_enabled(False)
        try:
            return self._impl(*args)
        except P.NotPlannable:
            return self.overload(*args)
        finally:
            if grad_mode:
                torch._C._set_grad_enabled(True)


_requires_grad = attrgetter("requires_grad")


def _tensors_of(args):
    for a in args:
        if isinstance(a, Tensor):
            yield a
        elif isinstance(a, list):
            yield from a


def check_max_norm(op: str, max_norm) -> float:
    value = float(max_norm)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{op}: max_norm must be a non-negative number, got {value}")
    return value


def _fake_device(op: str, name: str, tensors: list[Tensor]) -> torch.device:
    P.check_dtypes(op, name, tensors)
    return P.check_device(op, name, tensors, strict=True)


def _zeros_like_scalar(like: Tensor, dtype: torch.dtype) -> Tensor:
    """A 0-d zero on ``like``'s device: the result for an empty list (a fill, no host copy)."""
    return torch.zeros((), dtype=dtype, device=like.device)


def _out_dtype(tensors: list[Tensor]) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _empty_norm_check(op: str, name: str, norm_type: float, plan: P.Plan) -> None:
    """torch refuses norms without an identity (inf, -inf, negative orders) of empty tensors."""
    if plan.empty and (math.isinf(norm_type) or norm_type < 0):
        P.check_empty_norm(op, name, norm_type, plan.numels)


# --- multi_tensor_norm --------------------------------------------------------------------

_NORM = "gradfuse.multi_tensor_norm"


def _norm_run(tensors: list[Tensor], norm_type: float, per_tensor: bool):
    plan = P.make_plan(_NORM, "tensors", tensors, inplace=False)
    _empty_norm_check(_NORM, "tensors", norm_type, plan)
    return _backend(plan).norm(plan, norm_type, per_tensor)


def _norm_check(tensors, norm_type, per_tensor):
    return tensors, P.check_norm_type(_NORM, norm_type), per_tensor


def _norm_fake(tensors, norm_type, per_tensor):
    P.check_norm_type(_NORM, norm_type)
    device = _fake_device(_NORM, "tensors", tensors)
    out = _out_dtype(tensors)
    n = len(tensors) if per_tensor else 0
    return torch.empty((), dtype=out, device=device), torch.empty(n, dtype=out, device=device)


multi_tensor_norm_op = _Op(
    "multi_tensor_norm(Tensor[] tensors, float norm_type, bool per_tensor) -> (Tensor, Tensor)",
    _norm_run,
    _norm_fake,
    _norm_check,
)

# --- multi_tensor_scale_ ------------------------------------------------------------------

_SCALE = "gradfuse.multi_tensor_scale_"


def _scale_run(tensors: list[Tensor], scale: Tensor) -> None:
    if not tensors:  # reachable through `scale`, which gives the dispatcher a device
        return
    plan = P.make_plan(_SCALE, "tensors", tensors, inplace=True)
    P.check_scalar(_SCALE, "scale", scale, plan.device)
    _backend(plan).scale_(plan, scale)
    plan.finish_inplace(tensors)


def _scale_fake(tensors, scale):
    P.check_scalar(_SCALE, "scale", scale, _fake_device(_SCALE, "tensors", tensors))


multi_tensor_scale_op = _Op("multi_tensor_scale_(Tensor(a!)[] tensors, Tensor scale) -> ()", _scale_run, _scale_fake)

# --- clip_grads_with_norm_ ----------------------------------------------------------------

_CLIPN = "gradfuse.clip_grads_with_norm_"


def _clip_with_norm_run(grads: list[Tensor], max_norm: float, total_norm: Tensor) -> None:
    if not grads:
        return
    plan = P.make_plan(_CLIPN, "grads", grads, inplace=True)
    P.check_scalar(_CLIPN, "total_norm", total_norm, plan.device)
    _backend(plan).clip_grads_with_norm_(plan, max_norm, total_norm)
    plan.finish_inplace(grads)


def _clip_with_norm_check(grads, max_norm, total_norm):
    return grads, check_max_norm(_CLIPN, max_norm), total_norm


def _clip_with_norm_fake(grads, max_norm, total_norm):
    check_max_norm(_CLIPN, max_norm)
    P.check_scalar(_CLIPN, "total_norm", total_norm, _fake_device(_CLIPN, "grads", grads))


clip_grads_with_norm_op = _Op(
    "clip_grads_with_norm_(Tensor(a!)[] grads, float max_norm, Tensor total_norm) -> ()",
    _clip_with_norm_run,
    _clip_with_norm_fake,
    _clip_with_norm_check,
)

# --- clip_grad_norm_ ----------------------------------------------------------------------

_CLIP = "gradfuse.clip_grad_norm_"


def _clip_run(grads: list[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Tensor:
    plan = P.make_plan(_CLIP, "grads", grads, inplace=True)
    _empty_norm_check(_CLIP, "grads", norm_type, plan)
    total = _backend(plan).clip_grad_norm_(plan, max_norm, norm_type, error_if_nonfinite)
    plan.finish_inplace(grads)
    return total


def _clip_check(grads, max_norm, norm_type, error_if_nonfinite):
    return grads, check_max_norm(_CLIP, max_norm), P.check_norm_type(_CLIP, norm_type), error_if_nonfinite


def _clip_fake(grads, max_norm, norm_type, error_if_nonfinite):
    _clip_check(grads, max_norm, norm_type, error_if_nonfinite)
    device = _fake_device(_CLIP, "grads", grads)
    return torch.empty((), dtype=_out_dtype(grads), device=device)


clip_grad_norm_op = _Op(
    "clip_grad_norm_(Tensor(a!)[] grads, float max_norm, float norm_type, bool error_if_nonfinite) -> Tensor",
    _clip_run,
    _clip_fake,
    _clip_check,
)

# --- unscale_and_check_ -------------------------------------------------------------------

_UNSCALE = "gradfuse.unscale_and_check_"


def _check_amp_scalars(op: str, inv_scale: Tensor, found_inf: Tensor | None, device) -> None:
    P.check_scalar(op, "inv_scale", inv_scale, device, float32=True)
    if found_inf is not None:
        P.check_scalar(op, "found_inf", found_inf, device, float32=True)


def _unscale_run(tensors: list[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    if not tensors:
        return
    plan = P.make_plan(_UNSCALE, "tensors", tensors, inplace=True)
    _check_amp_scalars(_UNSCALE, inv_scale, found_inf, plan.device)
    _backend(plan).unscale_and_check_(plan, inv_scale, found_inf)
    plan.finish_inplace(tensors)
    P.bump_versions([found_inf])


def _unscale_fake(tensors, inv_scale, found_inf):
    _check_amp_scalars(_UNSCALE, inv_scale, found_inf, _fake_device(_UNSCALE, "tensors", tensors))


unscale_and_check_op = _Op(
    "unscale_and_check_(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!) found_inf) -> ()",
    _unscale_run,
    _unscale_fake,
)

# --- unscale_check_norm -------------------------------------------------------------------

_UCN = "gradfuse.unscale_check_norm"


def _ucn_run(tensors: list[Tensor], inv_scale: Tensor, norm_type: float):
    if not tensors:
        return _zeros_like_scalar(inv_scale, torch.float32), _zeros_like_scalar(inv_scale, torch.float32)
    plan = P.make_plan(_UCN, "tensors", tensors, inplace=False)
    _check_amp_scalars(_UCN, inv_scale, None, plan.device)
    _empty_norm_check(_UCN, "tensors", norm_type, plan)
    return _backend(plan).unscale_check_norm(plan, inv_scale, norm_type)


def _ucn_check(tensors, inv_scale, norm_type):
    return tensors, inv_scale, P.check_norm_type(_UCN, norm_type)


def _ucn_fake(tensors, inv_scale, norm_type):
    P.check_norm_type(_UCN, norm_type)
    device = _fake_device(_UCN, "tensors", tensors)
    _check_amp_scalars(_UCN, inv_scale, None, device)
    out = _out_dtype(tensors)
    return torch.empty((), dtype=out, device=device), torch.empty((), dtype=torch.float32, device=device)


unscale_check_norm_op = _Op(
    "unscale_check_norm(Tensor[] tensors, Tensor inv_scale, float norm_type) -> (Tensor, Tensor)",
    _ucn_run,
    _ucn_fake,
    _ucn_check,
)

# --- unscale_and_clip_ --------------------------------------------------------------------

_UCLIP = "gradfuse.unscale_and_clip_"


def _uclip_run(grads: list[Tensor], inv_scale: Tensor, found_inf: Tensor, max_norm: float, norm_type: float):
    if not grads:
        return _zeros_like_scalar(inv_scale, torch.float32)
    plan = P.make_plan(_UCLIP, "grads", grads, inplace=True)
    _check_amp_scalars(_UCLIP, inv_scale, found_inf, plan.device)
    _empty_norm_check(_UCLIP, "grads", norm_type, plan)
    total = _backend(plan).unscale_and_clip_(plan, inv_scale, found_inf, max_norm, norm_type)
    plan.finish_inplace(grads)
    P.bump_versions([found_inf])
    return total


def _uclip_check(grads, inv_scale, found_inf, max_norm, norm_type):
    return grads, inv_scale, found_inf, check_max_norm(_UCLIP, max_norm), P.check_norm_type(_UCLIP, norm_type)


def _uclip_fake(grads, inv_scale, found_inf, max_norm, norm_type):
    _uclip_check(grads, inv_scale, found_inf, max_norm, norm_type)
    device = _fake_device(_UCLIP, "grads", grads)
    _check_amp_scalars(_UCLIP, inv_scale, found_inf, device)
    return torch.empty((), dtype=_out_dtype(grads), device=device)


unscale_and_clip_op = _Op(
    "unscale_and_clip_(Tensor(a!)[] grads, Tensor inv_scale, Tensor(b!) found_inf, float max_norm, "
    "float norm_type) -> Tensor",
    _uclip_run,
    _uclip_fake,
    _uclip_check,
)

# --- unscale_norm_ ------------------------------------------------------------------------

_UNORM = "gradfuse.unscale_norm_"


def _unorm_run(tensors: list[Tensor], inv_scale: Tensor, found_inf: Tensor, norm_type: float):
    if not tensors:
        return _zeros_like_scalar(inv_scale, torch.float32)
    plan = P.make_plan(_UNORM, "tensors", tensors, inplace=True)
    _check_amp_scalars(_UNORM, inv_scale, found_inf, plan.device)
    _empty_norm_check(_UNORM, "tensors", norm_type, plan)
    total = _backend(plan).unscale_norm_(plan, inv_scale, found_inf, norm_type)
    plan.finish_inplace(tensors)
    P.bump_versions([found_inf])
    return total


def _unorm_check(tensors, inv_scale, found_inf, norm_type):
    return tensors, inv_scale, found_inf, P.check_norm_type(_UNORM, norm_type)


def _unorm_fake(tensors, inv_scale, found_inf, norm_type):
    P.check_norm_type(_UNORM, norm_type)
    device = _fake_device(_UNORM, "tensors", tensors)
    _check_amp_scalars(_UNORM, inv_scale, found_inf, device)
    return torch.empty((), dtype=_out_dtype(tensors), device=device)


unscale_norm_op = _Op(
    "unscale_norm_(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!) found_inf, float norm_type) -> Tensor",
    _unorm_run,
    _unorm_fake,
    _unorm_check,
)

# --- accumulate_ --------------------------------------------------------------------------

_ACC = "gradfuse.accumulate_"


def _check_pairs(dst, src):
    P.check_same_length(_ACC, "dst", dst, "src", src)
    P.check_same_shapes(_ACC, "dst", dst, "src", src)


def _acc_run(dst: list[Tensor], src: list[Tensor], alpha: float) -> None:
    _check_pairs(dst, src)
    if torch.is_grad_enabled():  # dst's are checked by its plan
        P.check_untracked(_ACC, "src", src, "added in place into dst")
    d = P.make_plan(_ACC, "dst", dst, inplace=True, dense_ok=False, signed=True)
    s = P.make_plan(_ACC, "src", src, inplace=False, device=d.device, dense_ok=False, signed=True)
    P.check_reads(_ACC, "dst", d, dst, "src", s, src)
    _backend(d).accumulate_(d, s, float(alpha))
    d.finish_inplace(dst)


def _acc_fake(dst, src, alpha):
    _check_pairs(dst, src)
    device = _fake_device(_ACC, "dst", dst)
    P.check_dtypes(_ACC, "src", src)
    if src:
        P.check_device(_ACC, "src", src, device, strict=True)


accumulate_op = _Op("accumulate_(Tensor(a!)[] dst, Tensor[] src, float alpha) -> ()", _acc_run, _acc_fake)

# --- clamp_ -------------------------------------------------------------------------------

_CLAMP = "gradfuse.clamp_"


def _clamp_run(tensors: list[Tensor], min: float, max: float) -> None:
    # A clamp into [-c, c] of a tensor's memory clamps its values too, negated or not.
    plan = P.make_plan(_CLAMP, "tensors", tensors, inplace=True, signed=min != -max)
    _backend(plan).clamp_(plan, float(min), float(max))
    plan.finish_inplace(tensors)


def _clamp_check(tensors, min, max):
    """NaN bounds raise (torch's clamp would make every element NaN; ``clip_grad_value_`` refuses
    a NaN ``clip_value`` as well)."""
    min, max = float(min), float(max)
    if math.isnan(min) or math.isnan(max):
        raise ValueError(f"{_CLAMP}: min and max must not be NaN, got min={min}, max={max}")
    return tensors, min, max


def _clamp_fake(tensors, min, max):
    _clamp_check(tensors, min, max)
    _fake_device(_CLAMP, "tensors", tensors)


clamp_op = _Op("clamp_(Tensor(a!)[] tensors, float min, float max) -> ()", _clamp_run, _clamp_fake, _clamp_check)


# --- multi_tensor_stats -------------------------------------------------------------------

_STATS = "gradfuse.multi_tensor_stats"


def _stats_run(tensors: list[Tensor], norm_type: float):
    plan = P.make_plan(_STATS, "tensors", tensors, inplace=False)
    _empty_norm_check(_STATS, "tensors", norm_type, plan)
    return _backend(plan).stats(plan, norm_type)


def _stats_check(tensors, norm_type):
    return tensors, P.check_norm_type(_STATS, norm_type)


def _stats_fake(tensors, norm_type):
    P.check_norm_type(_STATS, norm_type)
    device = _fake_device(_STATS, "tensors", tensors)
    out, n = _out_dtype(tensors), len(tensors)
    return (
        torch.empty((), dtype=out, device=device),
        torch.empty(n, dtype=out, device=device),
        torch.empty(n, dtype=out, device=device),
        torch.empty(n, dtype=torch.int64, device=device),
    )


multi_tensor_stats_op = _Op(
    "multi_tensor_stats(Tensor[] tensors, float norm_type) -> (Tensor, Tensor, Tensor, Tensor)",
    _stats_run,
    _stats_fake,
    _stats_check,
)

# --- unit_norms, scale_units_ (adaptive gradient clipping) --------------------------------

_UNITS = "gradfuse.unit_norms"
_USCALE = "gradfuse.scale_units_"


def _check_units(op: str, tensors: list[Tensor], units: list[int]) -> None:
    if len(units) != len(tensors):
        raise ValueError(f"{op}: units has {len(units)} entries for {len(tensors)} tensors")
    for i, (t, u) in enumerate(zip(tensors, units, strict=True)):
        n = t.numel()
        if u < 0 or (u == 0 and n) or (u and n % u):
            raise ValueError(f"{op}: tensors[{i}] has {n} elements, which cannot be split into units={u} equal units")


def _rows_plan(op: str, tensors: list[Tensor], units: list[int], inplace: bool) -> P.Plan:
    """The plan of ``tensors`` for an op on units (groups of whole rows along dim 0, in logical
    order): channels-last tensors used in place where each unit is whole rows, any other
    non-contiguous tensor (a dense but permuted one too) copied."""
    plan = P.make_plan(op, "tensors", tensors, inplace=inplace, dense_ok=P.ROWS)
    if P.rows_fit(plan, tensors, units):
        return plan
    return P.make_plan(op, "tensors", tensors, inplace=inplace, dense_ok=False)


def _units_run(tensors: list[Tensor], units: list[int], norm_type: float):
    plan = _rows_plan(_UNITS, tensors, units, inplace=False)
    # A unit of an empty tensor is empty: no identity for these orders (torch refuses them too).
    if math.isinf(norm_type) or norm_type < 0:
        P.check_empty_norm(
            _UNITS, "tensors", norm_type, [n if u else 1 for n, u in zip(plan.numels, units, strict=True)]
        )
    return _backend(plan).unit_norms(plan, list(units), norm_type)


def _units_check(tensors, units, norm_type):
    norm_type = P.check_norm_type(_UNITS, norm_type)
    _check_units(_UNITS, tensors, units)
    return tensors, units, norm_type


def _units_fake(tensors, units, norm_type):
    P.check_norm_type(_UNITS, norm_type)
    _check_units(_UNITS, tensors, units)
    device = _fake_device(_UNITS, "tensors", tensors)
    return torch.empty(sum(units), dtype=_out_dtype(tensors), device=device)


unit_norms_op = _Op(
    "unit_norms(Tensor[] tensors, int[] units, float norm_type) -> Tensor", _units_run, _units_fake, _units_check
)


def _check_factors(factors: Tensor, units: list[int], device) -> None:
    n = sum(units)
    if not isinstance(factors, Tensor) or factors.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{_USCALE}: factors must be a float32 or float64 tensor")
    if factors.dim() != 1 or factors.numel() != n or not factors.is_contiguous():
        raise ValueError(f"{_USCALE}: factors must be a contiguous 1-d tensor of {n} elements (one per unit)")
    if factors.device != device:
        raise ValueError(f"{_USCALE}: factors is on {factors.device}, the tensors on {device}")


def _uscale_run(tensors: list[Tensor], units: list[int], factors: Tensor) -> None:
    if not tensors:
        return
    plan = _rows_plan(_USCALE, tensors, units, inplace=True)
    _check_factors(factors, units, plan.device)
    _backend(plan).scale_units_(plan, list(units), factors)
    plan.finish_inplace(tensors)


def _uscale_check(tensors, units, factors):
    _check_units(_USCALE, tensors, units)
    return tensors, units, factors


def _uscale_fake(tensors, units, factors):
    _check_units(_USCALE, tensors, units)
    _check_factors(factors, units, _fake_device(_USCALE, "tensors", tensors))


scale_units_op = _Op(
    "scale_units_(Tensor(a!)[] tensors, int[] units, Tensor factors) -> ()", _uscale_run, _uscale_fake, _uscale_check
)

# --- public wrappers ----------------------------------------------------------------------


def as_tensor_list(tensors: Tensor | Iterable[Tensor]) -> list[Tensor]:
    """A single tensor or any iterable of tensors, as a list."""
    if isinstance(tensors, Tensor):
        return [tensors]
    return list(tensors)


def multi_tensor_norm(
    tensors: Tensor | Iterable[Tensor], norm_type: float = 2.0, *, per_tensor: bool = False, stats: bool = False
):
    """The ``norm_type``-norm of all ``tensors`` together, in one pass over memory.

    Accumulates in float32 (float64 when any tensor is float64) whatever the tensors' dtype,
    so bf16/fp16 norms are accurate to fp32. Returns a 0-d tensor on the tensors' device, or
    ``(total, per_tensor_norms)`` with ``per_tensor=True``. As torch's ``get_total_norm``,
    ``norm_type=0`` counts the tensors with a non-zero element. ``stats=True``: a
    :class:`TensorStats` from the same single pass (:func:`multi_tensor_stats`).
    """
    if stats:
        return multi_tensor_stats(tensors, norm_type)
    tensors = as_tensor_list(tensors)
    if not tensors:
        total = torch.zeros(())
        return (total, torch.zeros(0)) if per_tensor else total
    total, per = multi_tensor_norm_op.public(tensors, float(norm_type), per_tensor)
    return (total, per) if per_tensor else total


def _scalar_on(value, like: Tensor, dtype: torch.dtype) -> Tensor:
    if isinstance(value, Tensor):
        return value
    # torch.full launches a fill; torch.tensor(value, device=cuda) would copy from pageable
    # host memory, which synchronises.
    return torch.full((), float(value), dtype=dtype, device=like.device)


def multi_tensor_scale_(tensors: Tensor | Iterable[Tensor], scale: Tensor | float) -> None:
    """``t *= scale`` for every tensor, in one pass; ``scale`` is a 0-d tensor (or a number).

    A scale of exactly 1 leaves memory untouched (the result would be bit-identical).
    """
    tensors = as_tensor_list(tensors)
    if tensors:
        multi_tensor_scale_op.public(tensors, _scalar_on(scale, tensors[0], torch.float64))


def unscale_and_check_(tensors: Tensor | Iterable[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    """As ``torch._amp_foreach_non_finite_check_and_unscale_``: ``t *= inv_scale`` and
    ``found_inf = 1`` if any element was inf or NaN. ``inv_scale`` and ``found_inf`` are
    one-element float32 tensors on the tensors' device."""
    tensors = as_tensor_list(tensors)
    if tensors:
        unscale_and_check_op.public(tensors, inv_scale, found_inf)


def unscale_check_norm(tensors: Tensor | Iterable[Tensor], inv_scale: Tensor, norm_type: float = 2.0):
    """One read-only pass: ``(norm of t * inv_scale over all tensors, found_inf)``.

    The products are formed in float32 (float64 for float64 tensors) and never rounded to the
    tensors' dtype, so fp16 gradients that would underflow when unscaled in place still count.
    ``found_inf`` is a new 0-d float32 tensor, 1.0 if any element was inf or NaN.
    """
    tensors = as_tensor_list(tensors)
    return unscale_check_norm_op.public(tensors, inv_scale, float(norm_type))


def unscale_and_clip_(
    tensors: Tensor | Iterable[Tensor],
    inv_scale: Tensor,
    found_inf: Tensor,
    max_norm: float,
    norm_type: float = 2.0,
) -> Tensor:
    """Unscale, check, measure and clip in two passes (one read, one read-write).

    Equivalent to ``unscale_and_check_`` followed by ``clip_grad_norm_`` (the norm is that of
    the unscaled gradients); returns that norm. Sets ``found_inf`` to 1 if any element was
    inf or NaN. When the combined factor ``inv_scale * clip_coef`` is exactly 1 the write pass
    is skipped.
    """
    tensors = as_tensor_list(tensors)
    return unscale_and_clip_op.public(tensors, inv_scale, found_inf, check_max_norm(_UCLIP, max_norm), float(norm_type))


def unscale_norm_(tensors: Tensor | Iterable[Tensor], inv_scale: Tensor, found_inf: Tensor, norm_type: float = 2.0):
    """``t *= inv_scale`` in place, measuring as it goes: returns the ``norm_type``-norm of the
    scaled values and sets ``found_inf`` to 1 if any element was inf or NaN (before scaling).

    One read-write pass on the CPU (what a DDP bucket needs after a sum all-reduce: the average
    and its norm together); on CUDA a read-only norm pass then the write. ``inv_scale`` and
    ``found_inf`` are one-element float32 tensors on the tensors' device.
    """
    tensors = as_tensor_list(tensors)
    return unscale_norm_op.public(tensors, inv_scale, found_inf, float(norm_type))


def accumulate_(dst: Tensor | Iterable[Tensor], src: Tensor | Iterable[Tensor], alpha: float = 1.0) -> None:
    """``dst[i] += alpha * src[i]`` for every pair, in one pass. Dtypes may differ (bf16 or
    fp16 gradients into fp32 main gradients); the sum is formed in float32, or float64 when
    either side is float64. Shapes must match pairwise."""
    dst, src = as_tensor_list(dst), as_tensor_list(src)
    P.check_same_length(_ACC, "dst", dst, "src", src)
    if dst:
        accumulate_op.public(dst, src, float(alpha))


class TensorStats(NamedTuple):
    """Gradient-health statistics of a list of tensors (see :func:`multi_tensor_stats`)."""

    total: Tensor  #: 0-d: the norm of all tensors together
    norms: Tensor  #: (n,): each tensor's norm
    amax: Tensor  #: (n,): each tensor's largest |x| (inf/NaN when it holds one; 0 when empty)
    nonfinite: Tensor  #: (n,) int64: each tensor's count of inf and NaN elements


def multi_tensor_stats(tensors: Tensor | Iterable[Tensor], norm_type: float = 2.0) -> TensorStats:
    """The norm of all ``tensors`` together and, per tensor, its norm, its largest magnitude and
    its count of non-finite elements, all from one read of the tensors (the fused norm's pass).

    The norms are those of ``multi_tensor_norm(..., per_tensor=True)`` (bitwise on the CPU; on
    CUDA the stats kernel's smaller blocks add in another order, within rounding); like them they
    are float32 (float64 when any tensor is float64) and stay on the tensors' device, as do the
    counts (int64): nothing is read back to the host.
    """
    tensors = as_tensor_list(tensors)
    if not tensors:
        empty = torch.zeros(0)
        return TensorStats(torch.zeros(()), empty, empty.clone(), torch.zeros(0, dtype=torch.int64))
    return TensorStats(*multi_tensor_stats_op.public(tensors, float(norm_type)))
