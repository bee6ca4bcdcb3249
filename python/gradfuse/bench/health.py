"""Gradient-health workloads.

* ``stats``: per-tensor norm, largest magnitude and non-finite count of GPT-2's gradients.
  ``torch``: what a training loop writes for it today (``_foreach_norm`` for the norms, then a
  per-tensor ``abs().amax()`` and ``isfinite`` count: three passes, two kernels per tensor);
  ``gradfuse_norm``: the plain fused norm with per-tensor norms (``multi_tensor_norm``), the
  baseline of the issue's bar (statistics within 1.10x its time on CPU, 1.05x on GPU: the ratio
  of the two rows' medians); ``gradfuse``: ``multi_tensor_stats``, all of it in the norm's one
  read. Read-only: the gradients never change, nothing is restored.
"""

from __future__ import annotations

import math

import torch

import gradfuse

from .cases import GRADFUSE_NORM_RTOL, RTOL_VS_TORCH, Family, pristine
from .measure import BenchError


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


HEALTH_FAMILIES = {"stats": StatsFamily}
