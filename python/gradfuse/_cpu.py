"""CPU backend: the `gradfuse::` ops on CPU tensors, run by the Rust core (`gradfuse._rust`).

Same functions, arguments and results as the Triton backend (`gradfuse.kernels`); the ops
layer (`gradfuse.ops`) picks one per call. Plans are validated already; scalars in 0-d CPU
tensors are read with ``item()``, which on the CPU is a memory read, not a device sync.
"""

from __future__ import annotations

import ctypes
import math
import threading

import torch

from . import _fork, _rust
from ._plan import DTYPE_CODES, Plan, nonfinite_total_error

_OPENMP_ENTRY_POINTS = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads", "omp_get_max_threads")


def _use_torchs_threads() -> bool:
    """Run the Rust kernels' parallel loops on torch's OpenMP team, when torch has one.

    torch's OpenMP workers spin for a while after each parallel op; a second pool of threads
    beside them shares the cores with spinning threads (a norm run right after a torch op
    took 1.7x as long, see rust/parallel.rs). Work handed to torch's team runs on the threads
    already spinning, and follows ``torch.set_num_threads``. Without OpenMP in torch (or
    without the entry points in the process, or in a child made by os.fork()), the kernels
    keep rayon's pool.
    """
    if _fork.forked_child or "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        # A forked child's OpenMP team is the parent's, whose threads it does not have.
        return False
    try:
        process = ctypes.CDLL(None)  # every symbol loaded globally: torch's OpenMP runtime's
        addrs = [ctypes.cast(getattr(process, name), ctypes.c_void_p).value for name in _OPENMP_ENTRY_POINTS]
    except (AttributeError, OSError, TypeError):
        return False
    return _rust.use_openmp(*addrs)


_use_torchs_threads()


#: Threads whose OpenMP setting follows torch's (see :func:`_tensor_list`).
_THREAD = threading.local()


def _tensor_list(plan: Plan) -> _rust.TensorList:
    """The plan's Rust description of its memory (checked aligned, and disjoint when written, as
    the plan was made), once this thread's OpenMP setting follows torch's."""
    if not hasattr(_THREAD, "synced"):
        # torch.set_num_threads sets OpenMP's thread count for the calling thread; torch gives
        # every other thread the same setting lazily, at its first parallel op. A thread whose
        # first parallel work is gradfuse's (DDP's communication thread running the hook's pass)
        # would run it on a team of the runtime's default size (every core), oversubscribing
        # the cores beside torch's own threads: 3-8% on the 2-rank DDP step (bench ddp).
        # torch.get_num_threads() makes torch set it, once per thread.
        torch.get_num_threads()
        _THREAD.synced = True
    return plan.tensor_list


#: 0-d CPU tensors of the norms' dtypes, to make results like (``empty_like`` costs ~0.6 us where
#: ``torch.empty((), dtype=...)`` costs ~1 us, and it stays on the CPU whatever the default device).
_ZERO_D = {dtype: torch.empty((), dtype=dtype, device="cpu") for dtype in (torch.float32, torch.float64)}


def _zero_d(dtype: torch.dtype) -> torch.Tensor:
    """A new uninitialized 0-d CPU tensor of ``dtype`` (float32 or float64), for a kernel to write."""
    return torch.empty_like(_ZERO_D[dtype])


def _norm_into(plan: Plan, tl: _rust.TensorList, norm_type: float, per_tensor: bool):
    """``(total, per-tensor norms or None, the total as a float)``."""
    out = plan.out_dtype
    total = _zero_d(out)
    per = torch.empty(len(plan), dtype=out) if per_tensor else None
    value = _rust.norm(tl, norm_type, total.data_ptr(), per.data_ptr() if per_tensor else 0, DTYPE_CODES[out])
    return total, per, value


def norm(plan: Plan, norm_type: float, per_tensor: bool):
    total, per, _ = _norm_into(plan, _tensor_list(plan), norm_type, per_tensor)
    return total, per if per_tensor else torch.empty(0, dtype=plan.out_dtype)


def stats(plan: Plan, norm_type: float):
    """``(total, norms, amax, nonfinite)`` in one read (``gradfuse.ops.multi_tensor_stats``)."""
    out, n = plan.out_dtype, len(plan)
    total = _zero_d(out)
    norms, amax = torch.empty(n, dtype=out), torch.empty(n, dtype=out)
    nonfinite = torch.empty(n, dtype=torch.int64)
    _rust.stats(
        _tensor_list(plan),
        norm_type,
        total.data_ptr(),
        norms.data_ptr(),
        amax.data_ptr(),
        nonfinite.data_ptr(),
        DTYPE_CODES[out],
    )
    return total, norms, amax, nonfinite


def unit_norms(plan: Plan, units: list[int], norm_type: float) -> torch.Tensor:
    """The norm of every unit, in one read (``gradfuse.ops`` ``unit_norms``)."""
    out = torch.empty(sum(units), dtype=plan.out_dtype)
    _rust.unit_norms(_tensor_list(plan), units, norm_type, out.data_ptr(), DTYPE_CODES[out.dtype])
    return out


def scale_units_(plan: Plan, units: list[int], factors: torch.Tensor) -> None:
    tl = _tensor_list(plan)
    plan.before_write()
    _rust.scale_units_(tl, units, factors.data_ptr(), DTYPE_CODES[factors.dtype])


def scale_(plan: Plan, scale: torch.Tensor) -> None:
    tl = _tensor_list(plan)
    plan.before_write()
    _rust.scale_(tl, scale.item())


def clip_grads_with_norm_(plan: Plan, max_norm: float, total_norm: torch.Tensor) -> None:
    coef = _rust.clip_coef(total_norm.item(), max_norm, DTYPE_CODES[total_norm.dtype])
    tl = _tensor_list(plan)
    plan.before_write()
    _rust.scale_(tl, coef)


def clip_grad_norm_(plan: Plan, max_norm: float, norm_type: float, error_if_nonfinite: bool):
    tl = _tensor_list(plan)
    total, _, value = _norm_into(plan, tl, norm_type, False)
    if error_if_nonfinite and not math.isfinite(value):
        raise nonfinite_total_error(norm_type)
    plan.before_write()
    _rust.scale_(tl, _rust.clip_coef(value, max_norm, DTYPE_CODES[total.dtype]))
    return total


def unscale_and_check_(plan: Plan, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    tl = _tensor_list(plan)
    plan.before_write(found_inf)
    if _rust.unscale_and_check_(tl, inv_scale.item()):
        found_inf.fill_(1.0)


def inverse_scale(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inv_scale, found_inf)`` for an unscale by ``scale``: torch's own arithmetic (the
    reciprocal in float64, rounded to float32) and a zeroed flag, as the Triton backend makes them."""
    return scale.double().reciprocal().float(), torch.zeros((), dtype=torch.float32, device=scale.device)


def unscale_check_norm(plan: Plan, inv_scale: torch.Tensor, norm_type: float):
    out = plan.out_dtype
    total = _zero_d(out)
    _, found = _rust.unscale_check_norm(
        _tensor_list(plan), inv_scale.item(), norm_type, total.data_ptr(), DTYPE_CODES[out]
    )
    return total, torch.tensor(1.0 if found else 0.0)


# unscale_and_clip_ can reach its result two ways, bit-identical when inv_scale is a power of
# two (always so under GradScaler) and no tensor is fp16: then x * inv is exact in storage
# (fp16's narrow exponent would make unscaled values subnormal and round them early):
#   clip expected:    read pass (norm of x*inv), then one write of x * (inv*coef)  -> 3N bytes
#   no clip expected: write pass x *= inv that also measures, then x *= coef only
#                     if coef != 1                                               -> 2N (4N if wrong)
# Which one is cheaper depends on whether clipping will be active, which the previous call on
# the same gradients predicts well (clipping is active for long stretches early in training and
# inactive late). Kept with the plan (``memo["clipped"]``, carried when the plan moves).
_FP16 = DTYPE_CODES[torch.float16]


def clipped_last(plan: Plan) -> bool:
    """Whether the last ``unscale_and_clip_`` on these tensors clipped (True when none ran yet)."""
    memo = plan.memo
    return memo.get("clipped", memo.get("moved_from", memo).get("clipped", True))


def _power_of_two(v: float) -> bool:
    m, _ = math.frexp(v)
    return m == 0.5


def unscale_and_clip_(plan: Plan, inv_scale: torch.Tensor, found_inf: torch.Tensor, max_norm: float, norm_type):
    tl = _tensor_list(plan)
    inv = inv_scale.item()
    out = plan.out_dtype
    total = _zero_d(out)
    unscale_now = not (clipped_last(plan) or not _power_of_two(inv) or _FP16 in plan.codes)
    plan.before_write(found_inf)
    value, found = _rust.unscale_check_norm(tl, inv, norm_type, total.data_ptr(), DTYPE_CODES[out], unscale_now)
    coef = _rust.clip_coef(value, max_norm, DTYPE_CODES[out])
    _rust.scale_(tl, coef if unscale_now else inv * coef)
    if found:
        found_inf.fill_(1.0)
    plan.memo["clipped"] = coef != 1.0
    return total


def unscale_norm_(plan: Plan, inv_scale: torch.Tensor, found_inf: torch.Tensor, norm_type: float):
    tl = _tensor_list(plan)
    out = plan.out_dtype
    total = _zero_d(out)
    plan.before_write(found_inf)
    _, found = _rust.unscale_check_norm(tl, inv_scale.item(), norm_type, total.data_ptr(), DTYPE_CODES[out], True)
    if found:
        found_inf.fill_(1.0)
    return total


def accumulate_(dst: Plan, src: Plan, alpha: float) -> None:
    d, s = _tensor_list(dst), _tensor_list(src)
    dst.before_write()
    _rust.accumulate_(d, s, alpha)


def clamp_(plan: Plan, lo: float, hi: float) -> None:
    tl = _tensor_list(plan)
    plan.before_write()
    _rust.clamp_(tl, lo, hi)
