"""Scenarios run on every rank of a 2-rank gloo process group by ``tests/test_scaler_dtensor.py``:
``GradScaler.unscale_and_clip_`` over DTensor gradients (the local shards' read, then one
all-reduce of the norm and the inf/NaN flag together), against an unscale and clip of the
same gradients in float64, for every norm order; and the dtype of the norm where a rank's shards
are all empty, for the scaler and ``clip_grad_norm_``."""

from __future__ import annotations

import math

import torch
from dist_scenarios import NORM_TYPES, _full_grads
from torch import nn

import gradfuse


def _params(scale: float, poison_rank1: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    grads = [*_full_grads(), torch.tensor([0.75])]
    placements = [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()], [Shard(0)], [Shard(0)]]
    if poison_rank1:
        grads[0][-1, 0] = math.inf  # the last row of a Shard(0) split: rank 1's shard only
    params = []
    for g, pl in zip(grads, placements, strict=True):
        param = nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, pl))
        param.grad = distribute_tensor(g * scale, mesh, pl)
        params.append(param)
    return params


def scaler_clip_of_dtensor_grads_matches_torch(rank, world):
    """The norm, the clipped gradients and the step are those of the unscaled full gradients
    clipped in float64, every order."""
    for p in NORM_TYPES:
        for enabled in (False, True):
            scale = 2.0**10 if enabled else 1.0
            ours = _params(scale)
            opt = torch.optim.SGD(ours, lr=1.0)
            scaler = gradfuse.GradScaler("cpu", init_scale=scale, enabled=enabled)
            scaler.scale(torch.ones(()))  # makes the scale tensor, as scaling the loss does
            total = scaler.unscale_and_clip_(opt, 0.5, p)
            # The float64 reference over the full gradients (torch's own clip of these DTensors
            # raises for negative orders on rank 1's empty shard); fp32 inputs: rtol 2e-6.
            full = [q.grad.full_tensor().double() / scale for q in _params(scale)]
            if p == 0:  # a count of the tensors with a non-zero element
                want = float(sum(bool(g.any()) for g in full))
            else:
                want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, p) for g in full]), p).item()
            coef = min(0.5 / (want + 1e-6), 1.0)
            msg = f"order {p}, scaler enabled={enabled}"
            assert not gradfuse.distributed.is_dtensor(total), msg
            assert math.isclose(total.item(), want, rel_tol=2e-6), (msg, total, want)
            for a, g in zip(ours, full, strict=True):
                torch.testing.assert_close(a.grad.full_tensor().double(), g * coef, rtol=2e-6, atol=1e-7, msg=msg)
            scaler.step(opt)
            scaler.update()
            for a, g in zip(ours, full, strict=True):  # SGD with lr=1 from zeros: minus the gradient
                torch.testing.assert_close(a.full_tensor().double(), -g * coef, rtol=2e-6, atol=1e-7, msg=msg)


def an_inf_in_one_ranks_shard_skips_the_step_on_every_rank(rank, world):
    """An inf in rank 1's shard only: both ranks skip the step and back the scale off alike,
    for every order (under ``-inf`` the minimum hides the inf: only the flag carries it)."""
    for p in NORM_TYPES:
        params = _params(2.0**10, poison_rank1=True)
        opt = torch.optim.SGD(params, lr=1.0)
        scaler = gradfuse.GradScaler("cpu", init_scale=2.0**10)
        scaler.scale(torch.ones(()))
        scaler.unscale_and_clip_(opt, 0.5, p)
        scaler.step(opt)
        scaler.update()
        msg = f"order {p}, rank {rank}"
        assert scaler.get_scale() == 2.0**9, msg
        for q in params:
            assert not q.to_local().any(), msg


def fp64_gradients_give_an_fp64_norm_on_every_rank(rank, world):
    """fp64 gradients whose only shard on rank 1 is empty: the norm is float64 on every rank
    (as in one process), the same value everywhere, so every rank clips by the same factor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.tensor([[3.0, -4.0, 12.0]], dtype=torch.float64)  # one row: rank 1's shard is empty
    for p in (2.0, math.inf, -math.inf, -1.0):
        param = nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]))
        param.grad = distribute_tensor(full.clone(), mesh, [Shard(0)])
        opt = torch.optim.SGD([param], lr=1.0)
        scaler = gradfuse.GradScaler("cpu", enabled=False)
        total = scaler.unscale_and_clip_(opt, 0.5, p)
        want = torch.linalg.vector_norm(full, p)
        msg = f"order {p}, rank {rank}"
        assert total.dtype == torch.float64, (msg, total.dtype)
        assert math.isclose(total.item(), want.item(), rel_tol=1e-12), (msg, total, want)
        everyone = [torch.empty_like(total) for _ in range(world)]
        torch.distributed.all_gather(everyone, total)
        assert all(torch.equal(t, everyone[0]) for t in everyone), (msg, everyone)


def fp64_clip_grad_norm_gives_an_fp64_norm_on_every_rank(rank, world):
    """The same for ``gradfuse.clip_grad_norm_`` / ``get_total_norm`` (a replicated DTensor
    whose local value must be float64 on every rank, as torch's is)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.tensor([[3.0, -4.0, 12.0]], dtype=torch.float64)  # one row: rank 1's shard is empty
    for p in (2.0, math.inf, -math.inf, -1.0):
        param = nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]))
        param.grad = distribute_tensor(full.clone(), mesh, [Shard(0)])
        want = torch.linalg.vector_norm(full, p)
        msg = f"order {p}, rank {rank}"
        for total in (gradfuse.get_total_norm([param.grad], p), gradfuse.clip_grad_norm_([param], 0.5, p)):
            local = total.to_local()
            assert local.dtype == torch.float64, (msg, local.dtype)
            assert math.isclose(local.item(), want.item(), rel_tol=1e-12), (msg, local, want)
