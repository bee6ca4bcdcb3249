"""Data parallelism with ``torch.distributed``: the bucket reducer behind ``GradBuckets``, and
norms over gradients that are spread across ranks.

- :class:`BucketReducer` averages ``GradBuckets``' flat buffers across a process group. A
  bucket's all-reduce starts, asynchronously, as soon as backward has produced every gradient
  in it, and buckets start strictly in order so that every rank issues the same collectives in
  the same order (as DDP's reducer does); the end of backward waits for all of them.
- :func:`combine_norm` turns the norm of this rank's shard of the gradients into the norm over
  every rank's shard with one all-reduce on the device: partial sums of ``|x|**p`` are added
  (counts of non-zero tensors for ``p = 0``), maxima or minima are taken for ``±inf``.
- :func:`dtensor_total_norm` does the same for DTensor gradients (FSDP2, tensor parallel): the
  local shards run through the fused kernels, then one all-reduce over the mesh dimensions the
  gradients are sharded on.
- :func:`check_same_layout` and :func:`broadcast_parameters`: the small collectives
  ``GradBuckets`` runs once, at construction.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _src(group) -> int:
    """The global rank of the group's rank 0 (``broadcast`` takes global ranks)."""
    return dist.get_process_group_ranks(group)[0]


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


def count_nonzero_across(counts: Tensor, groups: Sequence) -> Tensor:
    """The number of tensors with a non-zero element, from the non-zero counts of this rank's
    shard of each (the 0-"norm" torch gives sharded gradients: a tensor counts once)."""
    summed = counts.double()
    for group in groups:
        dist.all_reduce(summed, group=group)
    return (summed != 0).sum().to(counts.dtype)


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


# --- construction-time collectives --------------------------------------------------------------


def collective_device(group, fallback: torch.device | None = None) -> torch.device:
    """Where ``group``'s collectives take tensors: NCCL reduces CUDA tensors only (``fallback``,
    else the current CUDA device), gloo CPU tensors."""
    if "nccl" not in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    return fallback if fallback is not None else torch.device("cuda", torch.cuda.current_device())


def check_same_layout(description: list, group, device: torch.device) -> None:
    """Raises ``ValueError`` on every rank unless every rank of ``group`` passed the same
    ``description`` (sizes, dtypes, options). One all-gather of four integers per rank: a rank
    that disagrees is found before any gradient is reduced, instead of a hang or silently
    averaging unrelated gradients."""
    digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    count, numel = len(description) - 1, sum(entry[0] for entry in description[1:])
    mine = torch.tensor(
        [count, numel, int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")],
        dtype=torch.int64,
        device=collective_device(group, device),
    )
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.tolist() for t in everyone]
    if any(row != rows[0] for row in rows):
        counts = [row[:2] for row in rows]
        if any(c != counts[0] for c in counts):
            found = "; ".join(f"rank {r}: {c[0]} parameters, {c[1]} elements" for r, c in enumerate(counts))
        else:
            found = "the same counts, but different shapes, dtypes or options"
        raise ValueError(
            f"GradBuckets: the ranks of the process group disagree on the parameter layout ({found}); "
            "every rank must pass the same parameters, in the same order, with the same options"
        )


def broadcast_parameters(params: list[Tensor], group) -> None:
    """Every rank starts from the group's rank 0's parameters, as DDP does at construction
    (one broadcast per dtype)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([p.reshape(-1) for p in same])
            dist.broadcast(flat, src=_src(group), group=group)
            for p, chunk in zip(same, flat.split([p.numel() for p in same]), strict=True):
                p.copy_(chunk.view_as(p))


# --- the reducer ----------------------------------------------------------------------------------


class BucketReducer:
    """Averages flat buckets across ``group``, overlapping backward.

    ``ready(b)`` is called when backward has produced every gradient of bucket ``b``; buckets
    are launched in index order (a ready bucket waits for the ones before it), each as
    ``buffer /= world_size`` then an asynchronous sum all-reduce (DDP's arithmetic: with two
    ranks both give the same bits). ``finish(used)`` launches what is left, all-reduces the
    ``used`` flags (which parameters any rank produced a gradient for since the last
    reduction: DDP's ``find_unused_parameters``), waits for everything and returns those flags
    summed over ranks.
    """

    def __init__(self, group, buffers: list[Tensor]) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.set_buffers(buffers)

    def set_buffers(self, buffers: list[Tensor]) -> None:
        self.buffers = buffers
        self._ready = [False] * len(buffers)
        self._launched = 0
        self._works: list = []

    def ready(self, b: int) -> None:
        self._ready[b] = True
        while self._launched < len(self.buffers) and self._ready[self._launched]:
            self._launch(self._launched)

    def _launch(self, b: int) -> None:
        buffer = self.buffers[b]
        buffer.div_(self.world)
        self._works.append(dist.all_reduce(buffer, group=self.group, async_op=True))
        self._launched += 1

    def finish(self, used: Tensor) -> Tensor:
        while self._launched < len(self.buffers):
            self._launch(self._launched)
        self._works.append(dist.all_reduce(used, group=self.group, async_op=True))
        for work in self._works:
            work.wait()
        self._works.clear()
        self._ready = [False] * len(self.buffers)
        self._launched = 0
        return used

    def broadcast_order(self, order: list[int], device: torch.device) -> list[int]:
        """Rank 0's ``order``, on every rank (the rebuilt bucket order must be the same everywhere)."""
        t = torch.tensor(order, dtype=torch.int64, device=collective_device(self.group, device))
        dist.broadcast(t, src=_src(self.group), group=self.group)
        return t.tolist()
