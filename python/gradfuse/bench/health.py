"""Gradient-health workloads: per-tensor statistics, ZClip and AGC.

* ``stats``: per-tensor norm, largest magnitude and non-finite count of GPT-2's gradients.
  ``torch``: what a training loop writes for it today (``_foreach_norm`` for the norms, then a
  per-tensor ``abs().amax()`` and ``isfinite`` count: three passes, two kernels per tensor);
  ``gradfuse_norm``: the plain fused norm with per-tensor norms (``multi_tensor_norm``), the
  baseline of the issue's bar (statistics within 1.10x its time on CPU, 1.05x on GPU: the ratio
  of the two rows' medians); ``gradfuse``: ``multi_tensor_stats``, all of it in the norm's one
  read. Read-only: the gradients never change, nothing is restored.
* ``zclip``: ZClip folded into a fused optimizer's read (gradfuse) against the ``zclip``
  package clipping in place, both clipping every call (the issue's bar: >= 3x on CPU); needs
  the package (the workload is listed only when it imports).
* ``agc``: AGC in two fused passes against timm's per-parameter loop (bar: >= 3x on CPU).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

import gradfuse

from .cases import GRADFUSE_NORM_RTOL, RTOL_VS_TORCH, Family, assert_lists_close, parameters_for, pristine
from .measure import BenchError
from .training import ACCUM_STEPS, LR, MAX_NORM, TrainerFamily, _gradfuse_trainer_step, new_model


def _torch_stats(grads):
    norms = torch.stack(torch._foreach_norm(grads, 2.0))
    amax = torch.stack([g.abs().amax() for g in grads])
    nonfinite = torch.stack([(~torch.isfinite(g)).sum() for g in grads])
    return torch.linalg.vector_norm(norms), norms, amax, nonfinite


def _fused_norm(grads):
    return gradfuse.multi_tensor_norm(grads, 2.0, per_tensor=True)


class StatsFamily(Family):
    """Per-tensor statistics from one read (module docstring)."""

    def __init__(self, workload, device, quick):
        super().__init__(workload, device, quick)
        self.pristine = pristine(workload, quick, workload.dtype, device)

    def impls(self):
        return {"torch": _torch_stats, "gradfuse": gradfuse.multi_tensor_stats, "gradfuse_norm": _fused_norm}

    def new_set(self):
        return self.pristine.clone()

    @property
    def set_bytes(self):
        return self.numel * self.workload.dtype.itemsize

    @property
    def bytes_moved(self):
        return self.set_bytes  # one read

    def bind(self, fn, grads, k):
        return lambda: fn(grads)

    def restore(self, grads):
        pass  # read-only

    def compare(self, outs, buffers):
        exact = self.pristine.norm
        (name,) = outs.keys() - {"torch"}
        total = float(outs[name][0])
        if not math.isclose(total, exact, rel_tol=GRADFUSE_NORM_RTOL):
            raise BenchError(f"{name} returned norm {total:.9g}, the fp64 norm is {exact:.9g}")
        ref_norms = outs["torch"][1].float()
        if not torch.allclose(outs[name][1].float(), ref_norms, rtol=RTOL_VS_TORCH[self.workload.dtype]):
            raise BenchError(f"{name}: per-tensor norms differ from torch's")
        if name == "gradfuse":
            _, _, amax, nonfinite = outs[name]
            if not torch.equal(amax, outs["torch"][2].to(amax.dtype)) or not torch.equal(nonfinite, outs["torch"][3]):
                raise BenchError("gradfuse: largest magnitudes or non-finite counts differ from torch's")


# --- clipping policies --------------------------------------------------------------------


class _Holder(torch.nn.Module):
    """A model-shaped holder of parameters, as the zclip package's ``step(model)`` takes one."""

    def __init__(self, params):
        super().__init__()
        self.params = torch.nn.ParameterList(params)


class ZClipFamily(Family):
    """ZClip after its warm-up, clipping on every call (its ``max_grad_norm`` cap is half the
    gradients' norm, and the gradients are restored before each call, untimed).
    ``torch``: the ``zclip`` package (``ZClip.step(model)``: per-parameter norms, a host read of
    the total, the EMA in Python, then a multiply of every gradient: a read and a read-write);
    ``gradfuse``: ``GradScaler(enabled=False).unscale_and_clip_(optimizer, ZClip)`` for a fused
    AdamW, the issue's "folded" ZClip: one read-only pass, the rule on the device, and the
    coefficient left for the optimizer's own read (its step is not timed in either)."""

    restore_every = 1

    def __init__(self, workload, device, quick):
        super().__init__(workload, device, quick)
        self.pristine = pristine(workload, quick, workload.dtype, device)
        self.cap = 0.5 * self.pristine.norm

    def impls(self):
        def package(s):
            return s.policy.step(s.model)

        def folded(s):
            return s.scaler.unscale_and_clip_(s.optimizer, s.policy)

        return {"torch": package, "gradfuse": folded}

    def new_set_for(self, impl):
        from zclip import ZClip as PackageZClip

        from ..clipping import ZClip

        params = parameters_for(self.pristine.clone())
        if impl == "torch":
            s = SimpleNamespace(model=_Holder(params), policy=PackageZClip(warmup_steps=2, max_grad_norm=self.cap))
        else:
            optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
            s = SimpleNamespace(
                model=_Holder(params),
                optimizer=optimizer,
                scaler=gradfuse.GradScaler(self.device.type, enabled=False),
                policy=ZClip(warmup_steps=2, max_grad_norm=self.cap),
            )
        for _ in range(2):  # past the warm-up, untimed
            self.bind(self.impls()[impl], s, 0)()
            self.restore(s)
        return s

    @property
    def set_bytes(self):
        return self.numel * self.workload.dtype.itemsize

    @property
    def bytes_moved(self):
        return self.set_bytes  # the norm's read; the coefficient rides on the optimizer's read

    def bind(self, fn, s, k):
        if hasattr(s, "scaler"):
            s.scaler.update()  # forget the previous call's clip, which no step applied
        return lambda: fn(s)

    def restore(self, s):
        self.pristine.restore([p.grad for p in s.model.parameters()])

    def compare(self, outs, buffers):
        (name,) = outs.keys() - {"torch"}
        if not math.isclose(float(outs[name]), float(outs["torch"]), rel_tol=RTOL_VS_TORCH[self.workload.dtype]):
            raise BenchError(f"{name} returned norm {float(outs[name]):.8g}, zclip {float(outs['torch']):.8g}")
        # The package clipped in place to the cap; the folded coefficient gives the same norm.
        clipped = float(outs[name]) * buffers[name].policy.last_coef.item()
        if not math.isclose(clipped, self.cap, rel_tol=1e-5):
            raise BenchError(f"{name}: the folded coefficient gives norm {clipped:.8g}, the cap is {self.cap:.8g}")


def _timm_rule(parameters, clip_factor, eps=1e-3):
    """timm's ``adaptive_clip_grad`` loop (timm/utils/agc.py), written out: a few kernels per
    parameter. The baseline when timm itself does not import (it needs torchvision)."""
    for p in parameters:
        w, g = p.detach(), p.grad.detach()
        dims = tuple(range(1, w.dim()))
        wn = w.norm(2) if w.dim() <= 1 else w.norm(2, dim=dims, keepdim=True)
        gn = g.norm(2) if g.dim() <= 1 else g.norm(2, dim=dims, keepdim=True)
        max_norm = wn.clamp_(min=eps).mul_(clip_factor)
        p.grad.detach().copy_(torch.where(gn < max_norm, g, g * (max_norm / gn.clamp(min=1e-6))))


AGC_FACTOR = 0.5  # with weights of std 0.02 and gradients of 0.01: about half the units clip


class AGCFamily(Family):
    """AGC on GPT-2's parameters, gradients restored before every call (same work each time).
    ``torch``: timm's per-parameter loop (``_timm_rule``); ``timm``: timm's own function when
    it imports; ``gradfuse``: ``gradfuse.agc.adaptive_clip_grad_`` (two fused passes)."""

    restore_every = 1

    def __init__(self, workload, device, quick):
        super().__init__(workload, device, quick)
        self.pristine = pristine(workload, quick, workload.dtype, device)
        gen = torch.Generator(device=device).manual_seed(2)
        self.weights = [torch.randn(s, generator=gen, device=device).mul_(0.02) for s in self.shapes]

    def impls(self):
        from ..agc import adaptive_clip_grad_

        impls = {
            "torch": lambda params: _timm_rule(params, AGC_FACTOR),
            "gradfuse": lambda params: adaptive_clip_grad_(params, AGC_FACTOR),
        }
        try:
            from timm.utils.agc import adaptive_clip_grad

            impls["timm"] = lambda params: adaptive_clip_grad(params, AGC_FACTOR)
        except Exception:  # not installed, or without torchvision
            pass
        return impls

    def new_set(self):
        params = [torch.nn.Parameter(w.clone()) for w in self.weights]
        for p, g in zip(params, self.pristine.clone(), strict=True):
            p.grad = g
        return params

    @property
    def set_bytes(self):
        return 2 * self.numel * self.workload.dtype.itemsize

    @property
    def bytes_moved(self):
        # Read weights and gradients, write the gradients (at most: unclipped units are skipped).
        return 3 * self.numel * self.workload.dtype.itemsize

    def bind(self, fn, params, k):
        return lambda: fn(params)

    def restore(self, params):
        self.pristine.restore([p.grad for p in params])

    def compare(self, outs, buffers):
        (name,) = outs.keys() - {"torch"}
        assert_lists_close(
            f"{name} gradients after AGC",
            [p.grad for p in buffers[name]],
            [p.grad for p in buffers["torch"]],
            RTOL_VS_TORCH[self.workload.dtype],
        )


HEALTH_FAMILIES = {"stats": StatsFamily, "zclip": ZClipFamily, "agc": AGCFamily}


# --- the Trainer with every gradient-health feature -----------------------------------------


class TrainerHealthFamily(TrainerFamily):
    """``health``: one ``gradfuse.Trainer`` step with ``log_grad_norms`` (log_every=10),
    ``skip_spikes`` and ``clip="zclip"`` (``gradfuse``) against the plain Trainer step with the
    fixed clip (in the ``torch`` slot, which the engine's speedup divides by: the issue's bar is
    a ratio of at most 1.03, i.e. a speedup of at least 0.97). Same model and data as the
    ``trainer`` workload (its family's, as are the sizes and the finite-loss check)."""

    def impls(self):
        return {"torch": _gradfuse_trainer_step, "gradfuse": _gradfuse_trainer_step}

    def new_set_for(self, impl: str):
        model = new_model(self.gpt, self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
        common = {"max_steps": 10**6, "grad_accum_steps": ACCUM_STEPS, "lr": LR, "lr_schedule": "cosine"}
        common.update(min_lr_ratio=0.1, progress=False, log_every=10)
        if impl == "torch":
            config = gradfuse.TrainConfig(max_grad_norm=MAX_NORM, **common)
        else:
            config = gradfuse.TrainConfig(
                max_grad_norm=None, clip="zclip", clip_options={"max_grad_norm": MAX_NORM},
                skip_spikes=(128, 6.0, 64), log_grad_norms=2, **common,
            )  # fmt: skip
        return gradfuse.Trainer(model, optimizer, self.batches, config)

    def compare(self, outs, buffers):
        if not math.isclose(outs["gradfuse"], outs["torch"], rel_tol=1e-6):  # same weights, same batch
            raise BenchError(f"the first losses differ: {outs['gradfuse']:.8g} vs {outs['torch']:.8g}")


HEALTH_FAMILIES["health"] = TrainerHealthFamily
