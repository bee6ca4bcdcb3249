"""Scenarios for ``tests/test_buckets_distributed.py``: GradBuckets' sharded norm
(``process_group=`` on its ``get_total_norm``/``clip_grad_norm_``) on 2 gloo ranks, where one
rank holds no gradient at all. Each takes ``(rank, world)`` and raises on failure.

The reference is torch's norm of every rank's gradients, computed on each rank from a copy of
the same model fed the same data (rank 0's); every rank must join the collective, or the
other waits for the process group's timeout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

import gradfuse

NORM_TYPES = (2.0, 1.0, math.inf, 0.0, -1.0, -math.inf)


def _model():
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _rank0_grads():
    """The gradients rank 0 holds, computed on a copy (the reference, on every rank)."""
    model = _model()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    model(x).square().sum().backward()
    return model


def norm_when_one_rank_has_no_gradients(rank, world):
    """Orders <= 0 included: the rank without gradients joins the all-reduce (no hang) and
    both ranks get torch's norm of rank 0's gradients (the only ones there are)."""
    reference = _rank0_grads()
    grads = [p.grad for p in reference.parameters()]
    model = _model()
    buckets = gradfuse.GradBuckets(model.parameters())
    if rank == 0:
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
    for norm_type in NORM_TYPES:
        want = torch.nn.utils.get_total_norm(grads, norm_type)
        got = buckets.get_total_norm(norm_type, process_group=dist.group.WORLD)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0, msg=f"order {norm_type}")
    total = buckets.clip_grad_norm_(0.01, process_group=dist.group.WORLD)
    torch.testing.assert_close(total, torch.nn.utils.get_total_norm(grads), rtol=2e-6, atol=0)
    if rank == 0:
        after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        assert math.isclose(after.item(), 0.01, rel_tol=1e-4), after
    else:
        assert all(p.grad is None for p in model.parameters())
    buckets.remove()
