"""What each op family times: its buffers, its implementations, its schedule and its checks.

A *family* (clip, amp, accumulate) builds the buffers of one implementation (one *set*; the
engine rotates over several when the workload is small), binds a call for the ``k``-th use of a
set (untimed), checks what the call did (untimed), and compares the implementations once.

Repeated calls must keep measuring the same thing, identically for every implementation:

* **Active clipping.** After one clip the norm *equals* ``max_norm``; clipping again at the same
  ``max_norm`` gives a coefficient that rounds to exactly 1 in fp32, and the workload would
  silently turn inactive. So the ``k``-th call on a set gets ``max_norm = DECAY * (norm it will
  see)``: every call rescales, by ``DECAY``. The norms follow a known geometric schedule, each
  call's returned norm is checked against it (a call that skipped the rescale would leave the
  next norm ``1/DECAY`` too large) and its coefficient is checked to be < 1 in fp32. Every
  ``RESTORE_EVERY`` calls the set is restored from its pristine copy, outside the timing, so
  values never shrink below ``DECAY**RESTORE_EVERY`` (3%) of their start, far from subnormals.
* **Inactive clipping.** ``max_norm`` is twice the norm; the gradients never change; each call's
  norm is checked to be below ``max_norm``.
* **AMP unscaling** multiplies by ``inv_scale``. Repeated unscaling by 2**-16 would take the
  values to zero in a few calls, so the ``k``-th call on a set gets ``inv_scale`` 2**-16 when
  ``k`` is even and 2**16 when odd: stored magnitudes alternate between loss-scaled and unscaled,
  the work per call is the same (a power-of-two multiply), and the found_inf flag is checked to
  stay 0. Clipping on top follows the schedules above.
* **Accumulation** adds the same bf16 gradients into fp32 main gradients each call: magnitudes
  grow by 1e-2 a call, harmlessly; nothing needs restoring.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import torch

import gradfuse

from .measure import BenchError
from .workloads import Workload, numel

GRAD_STD = 1e-2  # element scale of the synthetic gradients: norms of ~1 to ~300, no subnormals
LOSS_SCALE = 2.0**16  # torch.amp.GradScaler's default initial scale
DECAY = 0.9  # active clipping: each call rescales the gradients by this
RESTORE_EVERY = 32  # DECAY**32 = 0.034
INACTIVE_HEADROOM = 2.0  # inactive clipping: max_norm = this x the norm
EPS = 1e-6  # torch's clip coefficient: max_norm / (total_norm + EPS)

# Tolerances. gradfuse accumulates every norm in fp32 (fp64 for fp64): its norm must match the
# fp64 norm of the stored values to GRADFUSE_NORM_RTOL. Against torch the tolerance is torch's own
# error: its CPU fp32 norm of GPT-2's 38.6M-element wte is off by 2.4e-3 (measured, torch 2.15),
# and for bf16 it forms the total norm and the coefficient in bf16 (8 significant bits).
GRADFUSE_NORM_RTOL = 1e-5
RTOL_VS_TORCH = {torch.float32: 5e-3, torch.bfloat16: 2e-2}
# A returned norm against the schedule: wide enough for torch's errors above, narrow enough to
# see a skipped rescale (a factor 1/DECAY = +11%).
SCHEDULE_RTOL = 3e-2


def f32(x: float) -> float:
    """``x`` rounded to float32, as torch computes the clip coefficient of fp32/bf16 grads."""
    return struct.unpack("f", struct.pack("f", x))[0]


class Pristine:
    """A workload's initial gradients, generated once (fixed seed) and copied into every set of
    every implementation, so all implementations start from identical values."""

    def __init__(self, shapes, dtype: torch.dtype, device: torch.device, scale: float = 1.0):
        gen = torch.Generator(device=device).manual_seed(0)
        flat = torch.randn(numel(shapes), generator=gen, device=device).mul_(GRAD_STD * scale).to(dtype)
        chunks = flat.split([math.prod(s) for s in shapes])
        self.tensors = [chunk.view(shape) for chunk, shape in zip(chunks, shapes, strict=True)]
        self.scale = scale
        # The fp64 norm of the values as stored (after rounding to dtype), divided by the scale.
        sumsq = sum(torch.linalg.vector_norm(c, dtype=torch.float64).item() ** 2 for c in flat.split(2**24))
        self.norm = math.sqrt(sumsq) / scale

    def clone(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors]  # separate allocations, as autograd makes them

    def restore(self, tensors: list[torch.Tensor]) -> None:
        for dst, src in zip(tensors, self.tensors, strict=True):
            dst.copy_(src)


_PRISTINE_CACHE: dict[tuple, Pristine] = {}


def pristine(workload: Workload, quick: bool, dtype: torch.dtype, device: torch.device, scale=1.0) -> Pristine:
    """Pristine gradients, reused by consecutive workloads on the same shapes (one kept)."""
    key = (workload.shape_set, quick, dtype, str(device), scale)
    if key not in _PRISTINE_CACHE:
        _PRISTINE_CACHE.clear()
        _PRISTINE_CACHE[key] = Pristine(workload.shapes(quick), dtype, device, scale)
    return _PRISTINE_CACHE[key]


def clear_cache() -> None:
    _PRISTINE_CACHE.clear()


def parameters_for(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters holding ``grads``, as the clipping APIs take them. Their data is one element
    broadcast to the grad's shape (``p.grad`` must match ``p``'s shape); only ``.grad`` is read."""
    base = torch.zeros(1, dtype=grads[0].dtype, device=grads[0].device)
    params = []
    for g in grads:
        p = torch.nn.Parameter(base.expand(g.shape))
        p.grad = g
        params.append(p)
    return params


def assert_lists_close(what: str, actual: list, expected: list, rtol: float) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=1e-12)
        except AssertionError as err:
            raise BenchError(f"{what}, tensor {i} of {len(expected)}: {err}") from None


# --- implementations ----------------------------------------------------------------------


def _apex_clip():
    from apex.contrib.clip_grad import clip_grad_norm_  # amp_C.multi_tensor_l2norm + multi_tensor_scale

    return clip_grad_norm_


def _te_clip():
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.optimizers import multi_tensor_applier

    def clip(params, max_norm):
        grads = [p.grad for p in params]
        noop = torch.zeros(1, dtype=torch.int32, device=grads[0].device)
        total, _ = multi_tensor_applier(tex.multi_tensor_l2norm, noop, [grads], False)
        # tex.multi_tensor_scale takes the scale as a Python float: this reads the norm (a sync).
        coef = min(max_norm / (float(total) + EPS), 1.0)
        multi_tensor_applier(tex.multi_tensor_scale, noop, [grads, grads], coef)
        return total

    return clip


def _extras(device: torch.device, loaders: dict[str, Callable]) -> dict[str, Callable]:
    """The optional reference implementations that import on this machine (CUDA only)."""
    found = {}
    if device.type == "cuda":
        for name, load in loaders.items():
            try:
                found[name] = load()
            except Exception:  # not installed, or built for another torch: not compared
                pass
    return found


def _torch_amp(params, inv_scale, found_inf, max_norm):
    grads = [p.grad for p in params]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _gradfuse_amp(params, inv_scale, found_inf, max_norm):
    return gradfuse.unscale_and_clip_([p.grad for p in params], inv_scale, found_inf, max_norm)


def _torch_add_loop(dst, src):
    for d, s in zip(dst, src, strict=True):
        d.add_(s)


# --- families -----------------------------------------------------------------------------


class Family:
    """One op family on one workload. Subclasses define the buffers, calls and checks."""

    restore_every: int | None = None
    #: Rotate over several buffer sets so that no call finds the last one's data in cache;
    #: off for whole training steps, whose activations dwarf any cache.
    rotate_sets = True

    def __init__(self, workload: Workload, device: torch.device, quick: bool):
        self.workload = workload
        self.device = device
        self.shapes = workload.shapes(quick)
        self.n_tensors = len(self.shapes)
        self.numel = numel(self.shapes)

    def impls(self) -> dict[str, Callable]:
        """Implementation name -> function; ``torch`` first, ``gradfuse`` second."""
        raise NotImplementedError

    def new_set(self):
        raise NotImplementedError

    def new_set_for(self, impl: str):
        """The buffers of implementation ``impl`` (by default the same kind for every one)."""
        return self.new_set()

    @property
    def set_bytes(self) -> int:
        """Bytes of one set of buffers (sets are rotated until they exceed the cache)."""
        raise NotImplementedError

    @property
    def bytes_moved(self) -> int:
        """Algorithmic bytes: what the operation must read and write at the least."""
        raise NotImplementedError

    def bind(self, fn: Callable, buffers, k: int) -> Callable[[], object]:
        """The timed call: ``fn`` on ``buffers`` for their ``k``-th use (``k`` counts from the
        last restore). Runs untimed; only the returned callable is timed."""
        raise NotImplementedError

    def verify(self, out, buffers, k: int) -> None:
        """After a timed call, untimed: raise BenchError if it broke the schedule's assumptions."""

    def restore(self, buffers) -> None:
        raise NotImplementedError

    def compare(self, outs: dict[str, object], buffers: dict[str, object]) -> None:
        """After every implementation's first call on identical inputs: raise BenchError naming
        an implementation whose result differs from torch's."""
        raise NotImplementedError


class ClipFamily(Family):
    """``clip_grad_norm_`` on the parameters, ``max_norm`` scheduled per call (module docstring)."""

    amp = False

    def __init__(self, workload, device, quick):
        super().__init__(workload, device, quick)
        self.active = workload.mode == "active"
        self.restore_every = RESTORE_EVERY if self.active else None
        self.pristine = pristine(workload, quick, workload.dtype, device, LOSS_SCALE if self.amp else 1.0)
        self.rtol = RTOL_VS_TORCH[workload.dtype]

    def impls(self):
        impls = {"torch": torch.nn.utils.clip_grad_norm_, "gradfuse": gradfuse.clip_grad_norm_}
        return impls | _extras(self.device, {"apex": _apex_clip, "te": _te_clip})

    def new_set(self):
        return parameters_for(self.pristine.clone())

    @property
    def set_bytes(self):
        return self.numel * self.workload.dtype.itemsize

    @property
    def bytes_moved(self):
        # Active: read for the norm, read and write for the scale. Inactive: the norm's read only.
        return self.set_bytes * (3 if self.active else 1)

    def expected_norm(self, k: int) -> float:
        """The norm the ``k``-th call on a set measures (of the unscaled gradients)."""
        norm = self.pristine.norm * (DECAY**k if self.active else 1.0)
        return norm * LOSS_SCALE if self.amp and k % 2 else norm

    def max_norm(self, k: int) -> float:
        return self.expected_norm(k) * (DECAY if self.active else INACTIVE_HEADROOM)

    def bind(self, fn, params, k):
        max_norm = self.max_norm(k)
        return lambda: fn(params, max_norm)

    def verify(self, out, params, k):
        total, expected, max_norm = float(out), self.expected_norm(k), self.max_norm(k)
        if not math.isclose(total, expected, rel_tol=SCHEDULE_RTOL):
            raise BenchError(
                f"returned norm {total:.6g}, the schedule expects {expected:.6g}: "
                "the previous call on these gradients did not rescale them as torch does"
            )
        if self.active and not f32(max_norm / (total + EPS)) < 1.0:
            raise BenchError(f"active clip with coefficient 1 (norm {total:.6g}, max_norm {max_norm:.6g})")
        if not self.active and not total < max_norm:
            raise BenchError(f"inactive clip with norm {total:.6g} >= max_norm {max_norm:.6g}")

    def restore(self, params):
        self.pristine.restore([p.grad for p in params])

    def compare(self, outs, buffers):
        exact = self.expected_norm(0)  # fp64, of the values as stored
        if "gradfuse" in outs and not math.isclose(float(outs["gradfuse"]), exact, rel_tol=GRADFUSE_NORM_RTOL):
            raise BenchError(f"gradfuse returned norm {float(outs['gradfuse']):.9g}, the fp64 norm is {exact:.9g}")
        ref_norm, ref_grads = float(outs["torch"]), [p.grad for p in buffers["torch"]]
        for name, out in outs.items():
            if name == "torch":
                continue
            if not math.isclose(float(out), ref_norm, rel_tol=self.rtol):
                raise BenchError(f"{name} returned norm {float(out):.8g}, torch {ref_norm:.8g} (fp64: {exact:.8g})")
            assert_lists_close(
                f"{name} gradients after one call", [p.grad for p in buffers[name]], ref_grads, self.rtol
            )


class BucketParams(list):
    """Parameters whose gradients are the views of one ``GradBuckets`` (kept as ``buckets``)."""

    buckets: gradfuse.GradBuckets


def _bucket_clip(params: BucketParams, max_norm: float):
    return params.buckets.clip_grad_norm_(max_norm)


class BucketClipFamily(ClipFamily):
    """``clip_grad_norm_`` of gradients laid out in a ``GradBuckets`` (each ``.grad`` a view into
    a flat bucket): torch's clip of the parameters, against ``GradBuckets.clip_grad_norm_`` and
    the drop-in, which finds the buckets behind the views."""

    def impls(self):
        return {
            "torch": torch.nn.utils.clip_grad_norm_,
            "gradfuse": _bucket_clip,
            "gradfuse_dropin": gradfuse.clip_grad_norm_,
        }

    def new_set(self):
        params = BucketParams(super().new_set())
        params.buckets = gradfuse.GradBuckets(params)  # copies the gradients into the buckets
        return params


class AmpFamily(ClipFamily):
    """Unscale, check, measure and clip: torch's ``_amp_foreach_non_finite_check_and_unscale_``
    then ``clip_grad_norm_``, against ``gradfuse.unscale_and_clip_``. Gradients are stored
    loss-scaled; ``inv_scale`` alternates per call (module docstring)."""

    amp = True

    def impls(self):
        return {"torch": _torch_amp, "gradfuse": _gradfuse_amp}

    def new_set(self):
        def scalar(value):
            return torch.full((1,), value, dtype=torch.float32, device=self.device)

        return {
            "params": super().new_set(),
            "inv_scale": (scalar(1 / LOSS_SCALE), scalar(LOSS_SCALE)),
            "found_inf": scalar(0.0),
        }

    @property
    def bytes_moved(self):
        # Active: one read (unscale + check + norm), one read and write (unscale x clip
        # coefficient). Inactive: the unscaled values must be written, the norm can be taken on
        # the way: one read and write.
        return self.set_bytes * (3 if self.active else 2)

    def bind(self, fn, buffers, k):
        buffers["found_inf"].zero_()
        args = (buffers["params"], buffers["inv_scale"][k % 2], buffers["found_inf"], self.max_norm(k))
        return lambda: fn(*args)

    def verify(self, out, buffers, k):
        super().verify(out, buffers["params"], k)
        if buffers["found_inf"].item() != 0:
            raise BenchError("found_inf was set on finite gradients")

    def restore(self, buffers):
        super().restore(buffers["params"])

    def compare(self, outs, buffers):
        super().compare(outs, {name: b["params"] for name, b in buffers.items()})


class AccumulateFamily(Family):
    """fp32 main gradients += bf16 gradients: a per-parameter ``add_`` loop (what a trainer
    writes), ``torch._foreach_add_`` (an extra reference), and ``gradfuse.accumulate_``."""

    def __init__(self, workload, device, quick):
        super().__init__(workload, device, quick)
        self.dst = pristine(workload, quick, torch.float32, device)
        gen = torch.Generator(device=device).manual_seed(1)
        self.src = [torch.randn(s, generator=gen, device=device).mul_(GRAD_STD).to(workload.dtype) for s in self.shapes]

    def impls(self):
        return {"torch": _torch_add_loop, "gradfuse": gradfuse.accumulate_, "torch_foreach": torch._foreach_add_}

    def new_set(self):
        return self.dst.clone(), [s.clone() for s in self.src]

    @property
    def set_bytes(self):
        return self.numel * (4 + self.workload.dtype.itemsize)

    @property
    def bytes_moved(self):
        return self.numel * (4 + self.workload.dtype.itemsize + 4)  # read dst and src, write dst

    def bind(self, fn, buffers, k):
        dst, src = buffers
        return lambda: fn(dst, src)

    def compare(self, outs, buffers):
        ref = buffers["torch"][0]
        for name, (dst, _) in buffers.items():
            if name != "torch":
                # fp32 + bf16-widened-to-fp32, rounded once: every implementation is exact.
                assert_lists_close(f"{name} sums after one call", dst, ref, 1.3e-6)


FAMILY_CLASSES = {"clip": ClipFamily, "buckets": BucketClipFamily, "amp": AmpFamily, "accumulate": AccumulateFamily}


def make_family(workload: Workload, device: torch.device, quick: bool) -> Family:
    from .health import HEALTH_FAMILIES  # built on Family, kept in modules of their own
    from .training import TRAINING_FAMILIES

    return (FAMILY_CLASSES | TRAINING_FAMILIES | HEALTH_FAMILIES)[workload.family](workload, device, quick)
