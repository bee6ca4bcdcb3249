"""Adaptive gradient clipping (``gradfuse.agc``) and its two ops (``unit_norms``,
``scale_units_``), on the Rust core and on the Triton kernels under the interpreter.

References: timm's own ``adaptive_clip_grad`` (``timm.utils.agc``; timm and torchvision are in
the ``test`` extra: torchvision 0.29.2, built for torch 2.14, declares ``torch>=2.14`` and installs
beside torch 2.15 without replacing it; the extra's upper bound keeps pip from ever choosing a
torchvision that would pull a newer torch), and always the same rule written out from timm's
documentation in float64 (``reference_agc``), below.

Tolerances, and why: gradfuse accumulates each unit norm in float64 and rounds it to float32;
timm's torch fp32 norm differs by a few ulp, which moves the factor by as much: clipped
gradients agree to 1e-5 relative with timm (fp32), 1e-5 with the float64 rule. Unclipped units
are untouched, bit for bit. Unit norms: 2e-6 relative vs float64 (as every fp32 norm here).
"""

from __future__ import annotations

import math

import pytest
import torch

import gradfuse
from gradfuse.agc import AGC, adaptive_clip_grad_


def timm_agc():
    # Skips only where timm is not installed (outside the test extra); a timm or torchvision
    # that is installed but broken fails the test.
    return pytest.importorskip("timm.utils.agc").adaptive_clip_grad


def reference_agc(params, clip_factor, eps, norm_type=2.0):
    """timm's documented rule, in float64: per output unit (dim 0 of a weight with more than one
    dimension, else the whole tensor), g *= max_norm / max(||g||, 1e-6) where ||g|| >= max_norm,
    max_norm = clip_factor * max(||w||, eps). Returns the new gradients (float64)."""
    out = []
    for p in params:
        w, g = p.detach().double(), p.grad.double()
        if w.dim() <= 1:
            wn, gn = torch.linalg.vector_norm(w, norm_type), torch.linalg.vector_norm(g, norm_type)
        else:
            dims = tuple(range(1, w.dim()))
            wn = torch.linalg.vector_norm(w, norm_type, dim=dims, keepdim=True)
            gn = torch.linalg.vector_norm(g, norm_type, dim=dims, keepdim=True)
        max_norm = wn.clamp(min=eps) * clip_factor
        out.append(torch.where(gn < max_norm, g, g * (max_norm / gn.clamp(min=1e-6))))
    return out


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 5 * 5, 70),  # rows of 150: across the 64-element Triton chunks
        torch.nn.LayerNorm(70),
        torch.nn.Linear(70, 4),
    )


def with_grads(m, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for i, p in enumerate(m.parameters()):
        # Magnitudes that put some units above their threshold and some below.
        rows = p.shape[0] if p.dim() > 1 else 1
        scale = torch.rand((rows,) + (1,) * (p.dim() - 1), generator=gen) * (0.2 if i % 2 else 0.02)
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return m


def clipped_units(before, after):
    count = total = 0
    for b, a in zip(before, after, strict=True):
        b2, a2 = (
            (b.reshape(b.shape[0], -1), a.reshape(a.shape[0], -1)) if b.dim() > 1 else (b.view(1, -1), a.view(1, -1))
        )
        same = (b2 == a2).all(dim=1)
        count += int((~same).sum())
        total += same.numel()
    return count, total


@pytest.mark.parametrize(("clip_factor", "eps"), [(0.05, 1e-3), (0.01, 1e-3), (0.2, 0.5)])
def test_agc_matches_timm_and_the_float64_rule(backend, clip_factor, eps):
    ours = with_grads(model())
    theirs = with_grads(model())
    before = [p.grad.clone() for p in ours.parameters()]
    want64 = reference_agc(list(ours.parameters()), clip_factor, eps)
    total = gradfuse.clip_grad_norm_(ours.parameters(), AGC(clip_factor, eps))
    for p, w in zip(ours.parameters(), want64, strict=True):
        torch.testing.assert_close(p.grad.double(), w, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        total.double(), torch.linalg.vector_norm(torch.cat([b.reshape(-1) for b in before]).double()), rtol=2e-6, atol=0
    )
    clipped, units = clipped_units(before, [p.grad for p in ours.parameters()])
    if clip_factor < 0.2:
        assert 0 < clipped < units  # the rule both clipped and left alone (a test that can fail)
    timm_agc()(list(theirs.parameters()), clip_factor, eps)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=0)


@pytest.mark.parametrize("shapes", [[(0, 4)], [(0, 4), (0, 3)], [(0, 4), (3, 5), (6,)]])
def test_parameters_empty_along_dim_0_have_no_units(backend, shapes):
    """A weight with no rows has no units: alone (no unit at all), with others of none, or among
    others, AGC gives timm's gradients and the total of all of them (0 where there is nothing)."""
    gen = torch.Generator().manual_seed(4)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, theirs, strict=True):
        p.grad = torch.randn(p.shape, generator=gen) * 10
        q.grad = p.grad.clone()
    want = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ours]).double())
    total = adaptive_clip_grad_(ours, 0.01)
    torch.testing.assert_close(total.double(), want, rtol=2e-6, atol=0)
    timm_agc()(theirs, 0.01)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_unit_norms_against_float64(backend, dtype, norm_type):
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(20, 9, generator=gen)
    tensors = [
        torch.randn(7, 150, generator=gen),  # rows across chunk edges
        base.t(),  # non-contiguous: units along the logical first dimension
        torch.randn(65, generator=gen),
        torch.randn(3, 0),  # three empty units
        torch.randn((), generator=gen),
    ]
    tensors = [t.to(dtype) for t in tensors]
    if norm_type == math.inf:
        tensors = [t for t in tensors if t.numel()]  # no identity for the max of nothing
    units = [t.shape[0] if t.dim() > 1 else 1 for t in tensors]
    got = torch.ops.gradfuse.unit_norms(tensors, units, norm_type)
    want = torch.cat(
        [
            torch.linalg.vector_norm(t.double().reshape(u, -1), norm_type, dim=1)
            for t, u in zip(tensors, units, strict=True)
        ]
    )
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=1e-12 if dtype == torch.float64 else 2e-6, atol=0)


def test_scale_units_writes_only_units_with_a_factor_other_than_one(backend):
    t = torch.randn(33, 5).t()  # non-contiguous: units are its logical rows
    b = torch.randn(17).bfloat16()
    factors = torch.tensor([1.0, 0.5, 1.0, 0.25, 3.0, 0.7])
    want_t = t * factors[:5, None]
    want_b = (b.float() * factors[5]).bfloat16()
    t_before = t.clone()
    torch.ops.gradfuse.scale_units_([t, b], [5, 1], factors)
    assert torch.equal(t, want_t) and torch.equal(b, want_b)
    assert torch.equal(t[0], t_before[0]) and torch.equal(t[2], t_before[2])


def test_bad_units_and_factors_name_the_argument():
    t = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"tensors\[0\] has 24 elements, which cannot be split into units=5"):
        torch.ops.gradfuse.unit_norms([t], [5], 2.0)
    with pytest.raises(ValueError, match="units has 2 entries for 1 tensors"):
        torch.ops.gradfuse.unit_norms([t], [6, 1], 2.0)
    before = t.clone()
    with pytest.raises(ValueError, match=r"factors must be a contiguous 1-d tensor of 6 elements"):
        torch.ops.gradfuse.scale_units_([t], [6], torch.ones(5))
    with pytest.raises(TypeError, match="factors must be a float32 or float64 tensor"):
        torch.ops.gradfuse.scale_units_([t], [6], torch.ones(6, dtype=torch.int64))
    assert torch.equal(t, before)
    with pytest.raises(ValueError, match="clip_factor"):
        AGC(clip_factor=0.0)
    with pytest.raises(ValueError, match=r"clip_factor is 0\.02 here"):
        AGC(0.02).load_state_dict(AGC(0.01).state_dict())


@pytest.mark.parametrize("rows", [5, 0])
def test_a_gradient_its_weight_no_longer_splits_into_units_is_refused(backend, rows):
    """The units come from the weights' shapes; a weight re-pointed (``.data =``) to another
    shape keeps its old gradient, which its new rows may not divide: refused, naming the op and
    the gradient, with nothing modified (the Triton kernels would split it into units that leave
    its last elements out, unclipped)."""
    ok = torch.nn.Parameter(torch.randn(2, 3))
    ok.grad = torch.randn(2, 3) * 100
    p = torch.nn.Parameter(torch.randn(3, 4))
    p.grad = torch.randn(3, 4) * 100
    p.data = torch.randn(rows, 4)
    before = [ok.grad.clone(), p.grad.clone()]
    with pytest.raises(ValueError, match=r"adaptive_clip_grad_: tensors\[1\] has 12 elements, which cannot be split"):
        adaptive_clip_grad_([ok, p], clip_factor=0.01)
    assert torch.equal(ok.grad, before[0]) and torch.equal(p.grad, before[1])


def test_parameters_on_two_devices_whose_total_cannot_be_formed_modify_nothing():
    """Parameters on the CPU and on meta: the CPU's units are measured, but the total cannot be
    formed (a meta norm has no value to bring to the CPU), so the call raises before any device's
    gradients are written (it used to clip the CPU's first)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5, device="meta"))]
    ps.append(torch.nn.Parameter(torch.randn(3, 2)))
    for p in ps:
        p.grad = torch.randn_like(p) * 10  # every CPU unit above its threshold
    before = [p.grad.clone() for p in ps if p.device.type == "cpu"]
    with pytest.raises(NotImplementedError, match="meta"):
        adaptive_clip_grad_(ps, clip_factor=0.01)
    after = [p.grad for p in ps if p.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_opcheck_unit_ops():
    tensors = [torch.randn(3, 4), torch.randn(0), torch.randn(5).bfloat16()]
    torch.library.opcheck(torch.ops.gradfuse.unit_norms.default, (tensors, [3, 0, 1], 2.0))
    torch.library.opcheck(torch.ops.gradfuse.scale_units_.default, (tensors, [3, 0, 1], torch.rand(4)))


def test_scaler_with_agc_unscales_then_clips_unit_wise():
    a, b = with_grads(model()), with_grads(model())
    scaler = gradfuse.GradScaler("cpu", init_scale=2.0**10)
    scale = scaler.scale(torch.ones(())).item()
    for p in a.parameters():
        p.grad.mul_(scale)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    scaler.unscale_and_clip_(opt, AGC(0.05))
    adaptive_clip_grad_(b.parameters(), 0.05)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        # Unscaled and clipped in one write, x * (inv * factor): with a power-of-two inv_scale,
        # bit for bit the clip of the unscaled gradients.
        assert torch.equal(p.grad, q.grad)
    assert scaler.found_inf(opt).item() == 0
    scaler.step(opt)
    scaler.update()
    # An overflow: found_inf set, the step skipped, the scale backed off.
    scale = scaler.scale(torch.ones(())).item()
    with_grads(a, seed=2)
    next(a.parameters()).grad[0, 0, 0, 0] = math.inf
    before = [p.detach().clone() for p in a.parameters()]
    scaler.unscale_and_clip_(opt, AGC(0.05))
    assert scaler.found_inf(opt).item() == 1
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(x, p) for x, p in zip(before, a.parameters(), strict=True))
    assert scaler.get_scale() == scale / 2


# --- channels-last weights: rows are blocks of memory, used in place --------------------------


def _channels_last_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(6, 5, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(5 * 3 * 3, 4),
    )
    return net.to(memory_format=torch.channels_last)


def test_agc_on_channels_last_weights_matches_timm_and_plans_once(backend, monkeypatch):
    """A channels-last conv net (weights and gradients contiguous in channels-last only): each
    output channel's row is one block of memory there, so AGC's unit passes use the tensors in
    place and keep their plans (no copy, no plan made again at later calls); the result is timm's
    and the float64 rule's, call after call."""
    from gradfuse import _plan

    ours, theirs = with_grads(_channels_last_model()), with_grads(_channels_last_model())
    for net in (ours, theirs):
        for p in net.parameters():
            if p.dim() == 4:
                p.grad = p.grad.contiguous(memory_format=torch.channels_last)
    assert any(p.dim() == 4 and not p.is_contiguous() and not p.grad.is_contiguous() for p in ours.parameters())
    _plan.clear_plans()  # what earlier tests left (lists of these shapes would only be moved)
    real, built = _plan._build, []

    def counting(op, name, tensors, *args):
        built.append(op)
        return real(op, name, tensors, *args)

    monkeypatch.setattr(_plan, "_build", counting)
    for step in range(3):
        want64 = reference_agc(list(ours.parameters()), 0.02, 1e-3)
        adaptive_clip_grad_(ours.parameters(), 0.02, 1e-3)
        timm_agc()(list(theirs.parameters()), 0.02, 1e-3)
        for p, q, w in zip(ours.parameters(), theirs.parameters(), want64, strict=True):
            torch.testing.assert_close(p.grad.double(), w, rtol=1e-5, atol=0)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=0)
            if p.dim() == 4:
                assert p.grad.is_contiguous(memory_format=torch.channels_last)
        if step == 0:
            first = len(built)
            assert first > 0
        for net in (ours, theirs):  # new gradients, the same layout and addresses
            for p in net.parameters():
                p.grad.mul_(3.0)
    assert len(built) == first, built


@pytest.mark.parametrize("units_of", ["rows", "finer", "whole"])
def test_unit_ops_on_a_channels_last_tensor_take_units_in_logical_order(backend, units_of):
    """Units are groups of rows in logical (row-major) order. For a channels-last tensor, whole
    rows are blocks of its memory (used in place); finer units (a row split in two) are not, and
    the tensor is copied. The same tensor is planned with each kind in turn (a kept plan, then
    units it does not fit): every call gives the float64 answer of the logical layout."""
    gen = torch.Generator().manual_seed(11)
    t = torch.randn(4, 6, 3, 3, generator=gen).contiguous(memory_format=torch.channels_last)
    rows = {"rows": 4, "finer": 8, "whole": 1}
    for kind in ("rows", units_of, "rows"):
        u = rows[kind]
        want = torch.linalg.vector_norm(t.double().reshape(u, -1), dim=1)
        got = torch.ops.gradfuse.unit_norms([t], [u], 2.0)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
        factors = torch.rand(u, generator=gen) + 0.5
        expect = (t.double().reshape(u, -1) * factors.double()[:, None]).reshape(t.shape)
        torch.ops.gradfuse.scale_units_([t], [u], factors)
        torch.testing.assert_close(t.double(), expect, rtol=2e-6, atol=1e-7)
        assert t.is_contiguous(memory_format=torch.channels_last)
