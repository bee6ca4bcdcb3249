"""Scenarios run on every rank of a 2-rank gloo process group by ``tests/test_distributed.py``
(through ``tests/multiprocess.py``). Each takes ``(rank, world)`` and raises on failure.

The reference for norms is the norm of the full (unsharded) gradients in float64, and torch's
own clip on the same DTensor gradients. (Data parallelism is DDP + gradfuse's hook: see
``ddp_hook_scenarios.py``.)
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

import gradfuse


def group():
    return dist.group.WORLD


class Net(nn.Module):
    """Registration order differs from use order (``head`` first, used last), so the order in
    which backward produces gradients is not reverse registration order; ``extra`` is used on
    rank 0 only and ``never`` on no rank."""

    def __init__(self, d: int = 24, unused: bool = False):
        super().__init__()
        self.head = nn.Linear(d, 8)
        self.body = nn.Sequential(nn.Linear(16, d), nn.LayerNorm(d), nn.Tanh(), nn.Linear(d, d))
        if unused:
            self.extra = nn.Linear(d, d)
            self.never = nn.Linear(d, 3)

    def forward(self, x, use_extra=False):
        h = self.body(x)
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


def same_model(seed: int = 0, unused: bool = False) -> Net:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return Net(unused=unused)


def batch(rank: int, step: int, n: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)  # different data per rank
    return torch.randn(n, 16, generator=gen)


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


NORM_TYPES = [2.0, 1.0, 3.0, 0.5, 0.0, -1.0, math.inf, -math.inf]


def _full_grads(dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)  # the same full gradients on every rank
    shapes = [(10, 4), (7,), (6, 3), (1,), (9, 2)]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads[1][2] = 0.0
    return grads


def sharded_norms_equal_the_full_norm(rank, world):
    """Each rank holds a shard (a slice of every tensor); get_total_norm(process_group=) is the
    norm of the full gradients, identical on every rank; clip_grad_norm_ scales by it."""
    full = _full_grads()
    shards = [g.flatten().tensor_split(world)[rank].clone() for g in full]
    for p in NORM_TYPES:
        if p == 0:
            continue  # order 0 counts tensors: shards of one tensor are separate tensors (below)
        total = gradfuse.get_total_norm(shards, p, process_group=group())
        want = torch.linalg.vector_norm(torch.cat([g.flatten().double() for g in full]), p)
        assert math.isclose(total.item(), want.item(), rel_tol=2e-6), (p, total, want)
        a, b = gather(total)
        assert torch.equal(a, b), f"p={p}: ranks disagree: {a} vs {b}"
    # Order 0 over shards counts each rank's non-zero tensors, summed.
    zeros = [torch.zeros(3) for _ in range(rank + 1)]
    mine = torch.tensor(float(sum(bool(s.count_nonzero()) for s in shards)))
    assert 0 < mine.item() < len(shards) + 1
    count = gradfuse.get_total_norm([*shards, *zeros], 0.0, process_group=group())
    assert count.item() == sum(gather(mine)).item(), count
    # Clipping with the global norm.
    params = []
    for s in shards:
        param = nn.Parameter(torch.empty_like(s))
        param.grad = s.clone()
        params.append(param)
    total = gradfuse.clip_grad_norm_(params, 1.0, process_group=group())
    coef = 1.0 / (total.item() + 1e-6)
    for param, s in zip(params, shards, strict=True):
        torch.testing.assert_close(param.grad, s * coef, rtol=1e-6, atol=0)
    # A non-finite shard on one rank: error_if_nonfinite raises on every rank, nothing modified.
    if rank == 1:
        params[0].grad[0] = math.inf
    before = [param.grad.clone() for param in params]
    try:
        gradfuse.clip_grad_norm_(params, 1.0, error_if_nonfinite=True, process_group=group())
    except RuntimeError as err:
        assert "non-finite" in str(err)
    else:
        raise AssertionError("no error")
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))


def bucket_norm_with_process_group(rank, world):
    """GradBuckets' own methods take process_group= for sharded gradients too."""
    model = same_model()
    buckets = gradfuse.GradBuckets(model.parameters())  # no process group: local buckets
    model(batch(rank, 0)).square().mean().backward()
    for p in (2.0, math.inf, -1.0):
        local = [q.grad for q in model.parameters()]
        everyone = [t for g in local for t in gather(g)]
        want = torch.nn.utils.get_total_norm(everyone, p)
        total = buckets.get_total_norm(p, process_group=group())
        torch.testing.assert_close(total, want, rtol=2e-6, atol=0)
    total = buckets.clip_grad_norm_(0.01, process_group=group())
    after = torch.nn.utils.get_total_norm([t for q in model.parameters() for t in gather(q.grad)])
    assert math.isclose(after.item(), 0.01, rel_tol=1e-4), (total, after)


def dtensor_norms_match_torch(rank, world):
    """DTensor gradients (sharded, uneven, and replicated) through the fused path give torch's
    total and torch's clipped gradients, for every norm order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()], [Shard(0)]]
    for p in NORM_TYPES:
        for max_norm in (0.5, 1e6):
            made = []
            for _ in range(2):  # ours, torch's
                params = []
                for g, pl in zip(_full_grads(), placements, strict=True):
                    param = nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, pl))
                    param.grad = distribute_tensor(g, mesh, pl)
                    params.append(param)
                made.append(params)
            ours, theirs = made
            measured = gradfuse.get_total_norm([a.grad for a in ours], p)
            total = gradfuse.clip_grad_norm_(ours, max_norm, p)
            want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, p)
            assert isinstance(total, DTensor) and isinstance(measured, DTensor), type(total)
            assert math.isclose(total.full_tensor().item(), want.full_tensor().item(), rel_tol=2e-6), (p, total, want)
            assert torch.equal(measured.full_tensor(), total.full_tensor())
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(), rtol=2e-6, atol=1e-7)


def fsdp2_clip_matches_torch(rank, world):
    """A real FSDP2 model (``fully_shard`` on CPU/gloo): gradfuse's clip of its DTensor grads
    equals torch's."""
    from torch.distributed.fsdp import fully_shard

    models = [copy.deepcopy(same_model()) for _ in range(2)]
    for m in models:
        for layer in m.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    x = batch(rank, 0)
    for m in models:
        m(x).square().mean().backward()
    total = gradfuse.clip_grad_norm_(models[0].parameters(), 0.05)
    want = torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.05)
    assert math.isclose(total.full_tensor().item(), want.full_tensor().item(), rel_tol=2e-6)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        if b.grad is not None:
            torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(), rtol=2e-6, atol=1e-8)
