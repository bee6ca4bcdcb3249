"""Norms over gradients that are spread across ranks.

- :func:`combine_norm` turns the norm of this rank's shard of the gradients into the norm over
  every rank's shard with one all-reduce on the device: partial sums of ``|x|**p`` are added
  (counts of non-zero tensors for ``p = 0``), maxima or minima are taken for ``±inf``.
- :func:`dtensor_locals` and :func:`as_replicated` let the clip do the same for DTensor
  gradients (FSDP2, tensor parallel): the local shards run through the fused kernels, then one
  all-reduce over the mesh dimensions the gradients are sharded on.
- :func:`combine_module_stats` does it for per-module norms and largest magnitudes (the
  Trainer's ``log_grad_norms``), one or two small all-reduces.

Data parallelism itself is torch's ``DistributedDataParallel``, with gradfuse's communication
hook (``ddp_hook.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor


# --- norms across ranks -----------------------------------------------------------------------


def norm_of_nothing(norm_type: float, device: torch.device) -> Tensor:
    """The local norm of a rank holding no elements, as :func:`combine_norm` expects it: the
    value that adds nothing (0 for positive orders and counts, and +inf for negative orders and
    -inf, whose partials ``|x|**p`` or minima it turns into 0 and +inf)."""
    return torch.full((), math.inf if norm_type < 0 else 0.0, device=device)


def combine_norm(local: Tensor, norm_type: float, groups: Sequence) -> Tensor:
    """The ``norm_type``-norm over all ranks of ``groups`` (each group in turn, for a mesh
    sharded on several dimensions), from this rank's norm ``local`` (a 0-d fp32/fp64 tensor).

    Identical on every rank: one all-reduce per group, whose result every rank receives.
    """
    if not groups:
        return local
    if math.isinf(norm_type):
        partial, op = local.double(), dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
    elif norm_type == 0:
        partial, op = local.double(), dist.ReduceOp.SUM  # counts of non-zero tensors add up
    else:
        partial, op = local.double().pow(norm_type), dist.ReduceOp.SUM
    for group in groups:
        dist.all_reduce(partial, op=op, group=group)
    if not math.isinf(norm_type) and norm_type != 0:
        partial = partial.pow(1.0 / norm_type)
    return partial.to(local.dtype)


def combine_norm_and_flag(
    local: Tensor, found_inf: Tensor, norm_type: float, groups: Sequence
) -> tuple[Tensor, Tensor]:
    """As :func:`combine_norm`, with this rank's inf/NaN flag ``found_inf`` (0-d, 1.0 or 0.0)
    riding the same all-reduce: (the norm over all ranks, 1.0 if any rank's flag was set),
    identical on every rank. The flag is what decides a skipped step: a NaN can vanish in a
    max-reduction of the norms, never from the flag. ``norm_type`` non-zero."""
    if not groups:
        return local, found_inf
    if math.isinf(norm_type):
        op = dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
        partial = local.double()
    else:
        op, partial = dist.ReduceOp.SUM, local.double().pow(norm_type)
    # Under MIN the flag travels negated, so that a set flag wins in every reduction.
    flag = found_inf.double().reshape(()) * (-1.0 if op == dist.ReduceOp.MIN else 1.0)
    both = torch.stack([partial, flag.to(partial.device)])
    for group in groups:
        dist.all_reduce(both, op=op, group=group)
    partial, flag = both.unbind()
    if not math.isinf(norm_type):
        partial = partial.pow(1.0 / norm_type)
    return partial.to(local.dtype), (flag != 0).float().to(found_inf.device)


def count_nonzero_across(counts: Tensor, groups: Sequence) -> Tensor:
    """The number of tensors with a non-zero element, from the non-zero counts of this rank's
    shard of each (the 0-"norm" torch gives sharded gradients: a tensor counts once)."""
    summed = counts.double()
    for group in groups:
        dist.all_reduce(summed, group=group)
    return (summed != 0).sum().to(counts.dtype)


def combine_module_stats(partials: Tensor, amax: Tensor, norm_type: float, groups: Sequence) -> tuple[Tensor, Tensor]:
    """Per-module statistics over all ranks of ``groups`` from this rank's: ``partials`` (1-d
    float64: per module, the sum of ``|x|**p`` over this rank's shards, or their largest /
    smallest ``|x|`` for ``p = ±inf``) and ``amax`` (per module, the largest ``|x|``). Sums add,
    maxima and minima are taken: one all-reduce per group for ``±inf`` (a minimum travels
    negated under MAX), two for a finite order. Identical on every rank; every rank must call
    it alike.

    A NaN on any rank (statistics not taken there, a NaN gradient) makes the module's values NaN
    on every rank, as in one process: a NaN can vanish in a MAX, so a count of them rides along."""
    if not groups:
        return partials, amax
    nan = torch.isnan(partials) | torch.isnan(amax)
    partials, amax = partials.masked_fill(nan, 0.0), amax.masked_fill(nan, 0.0)
    if math.isinf(norm_type):
        sign = 1.0 if norm_type > 0 else -1.0
        both = torch.cat([partials * sign, amax, nan.double()])
        for group in groups:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        partials, amax, nan = both.chunk(3)
        partials = partials * sign
    else:
        summed = torch.cat([partials, nan.double()])
        for group in groups:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        partials, nan = summed.chunk(2)
    lost = nan > 0
    return partials.masked_fill(lost, math.nan), amax.masked_fill(lost, math.nan)


def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch built without distributed
        return None
    return DTensor, Replicate, Shard


def is_dtensor(t: Tensor) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(t, types[0])


def dtensor_locals(tensors: list[Tensor]):
    """For DTensor gradients whose placements are all ``Shard`` or ``Replicate``: the mesh and,
    per set of sharded mesh dimensions, the local tensors. ``None`` when gradfuse leaves them to
    torch (``Partial`` placements, several meshes, or a mix with plain tensors)."""
    types = _dtensor_types()
    if types is None:
        return None
    DTensor, Replicate, Shard = types
    if not all(isinstance(t, DTensor) for t in tensors):
        return None
    mesh = tensors[0].device_mesh
    by_dims: dict[tuple[int, ...], list[Tensor]] = {}
    for t in tensors:
        if t.device_mesh != mesh or not all(isinstance(p, Shard | Replicate) for p in t.placements):
            return None
        dims = tuple(i for i, p in enumerate(t.placements) if isinstance(p, Shard))
        by_dims.setdefault(dims, []).append(t._local_tensor)
    return mesh, by_dims


def as_replicated(total: Tensor, mesh) -> Tensor:
    """``total`` (the same value on every rank) as a replicated DTensor, the type torch returns
    for the norm of DTensor gradients."""
    DTensor, Replicate, _ = _dtensor_types()
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)


def collective_device(group, fallback: torch.device | None = None) -> torch.device:
    """Where ``group``'s collectives take tensors: NCCL reduces CUDA tensors only (``fallback``,
    else the current CUDA device), gloo CPU tensors."""
    if "nccl" not in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    return fallback if fallback is not None else torch.device("cuda", torch.cuda.current_device())
