"""GradBuckets in one process: the Rust planner's layout (property tests), gradients after
backward against plain autograd, grad-as-view and main_grad, zero_grad, clipping over the
buffers against torch, the drop-ins' bucket path, and bad input. The never-stale cases are in
``test_buckets_stale.py``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import gradfuse
from gradfuse import _rust
from gradfuse import buckets as B
from reference import close, ref_norms

CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
SIZES = {0: 4, 1: 8, 2: 2, 3: 2}


@pytest.fixture(autouse=True)
def rust_backend(monkeypatch):
    monkeypatch.setenv("GRADFUSE_BACKEND", "rust")


# --- the planner ----------------------------------------------------------------------------------


@given(
    params=st.lists(st.tuples(st.integers(0, 3000), st.sampled_from([0, 1, 2, 3])), max_size=25),
    cap=st.integers(1, 20000),
    first_cap=st.integers(1, 20000),
    align=st.sampled_from([64, 128, 256]),
    world=st.integers(1, 5),
    data=st.data(),
)
def test_plan_invariants(params, cap, first_cap, align, world, data):
    numels = [n for n, _ in params]
    codes = [c for _, c in params]
    order = data.draw(st.permutations(range(len(params))))
    slots, buckets = _rust.plan_buckets(numels, codes, order, cap, first_cap, align, world)
    assert len(slots) == len(params)
    placed = sorted(i for _, _, members in buckets for i in members)
    assert placed == list(range(len(params))), "every parameter in exactly one bucket"
    position = {i: k for k, i in enumerate(order)}
    seen_dtypes = set()
    for b, (code, numel, members) in enumerate(buckets):
        size = SIZES[code]
        assert numel > 0 and (numel * size) % (align * world) == 0, "padded to the world size, aligned"
        spans = []
        for i in members:
            assert slots[i][0] == b and codes[i] == code, "one dtype per bucket"
            offset = slots[i][1]
            assert (offset * size) % align == 0, "aligned offset"
            spans.append((offset, offset + numels[i]))
        spans.sort()
        assert all(a[1] <= b_[0] for a, b_ in itertools.pairwise(spans)), "views overlap"
        assert spans[-1][1] <= numel
        limit = first_cap if code not in seen_dtypes else cap
        seen_dtypes.add(code)
        # The cap bounds what the members occupy (zero-size members still pad the bucket to
        # the alignment); a lone parameter may exceed it.
        assert len(members) == 1 or spans[-1][1] * size <= limit, "cap"
        assert [position[i] for i in members] == sorted(position[i] for i in members)
    firsts = [position[members[0]] for _, _, members in buckets]
    assert firsts == sorted(firsts), "buckets in order of first readiness"
    assert _rust.plan_buckets(numels, codes, order, cap, first_cap, align, world) == (slots, buckets)


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="permutation"):
        _rust.plan_buckets([1, 2], [0, 0], [0, 0], 64, 64, 64, 1)
    with pytest.raises(ValueError, match="positive"):
        _rust.plan_buckets([1], [0], [0], 0, 64, 64, 1)
    with pytest.raises(TypeError, match="params\\[1\\] has an unsupported dtype code 7"):
        _rust.plan_buckets([1, 1], [0, 7], [0, 1], 64, 64, 64, 1)


# --- gradients ----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, widths=(12, 32, 32, 5)):
        super().__init__()
        layers = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.LayerNorm(b), nn.GELU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def pair(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    ours = MLP(**kw).to(dtype)
    theirs = MLP(**kw).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def storages(buckets):
    return {b.untyped_storage().data_ptr() for b in buckets.buffers}


@pytest.mark.parametrize("cap_mb", [1e-4, 0.003, 25.0])
def test_grads_equal_plain_autograd_and_are_views(cap_mb):
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters(), bucket_cap_mb=cap_mb)
    for step in range(3):  # accumulation over three backwards
        x = torch.randn(7, 12)
        ours(x).square().mean().backward()
        theirs(x).square().mean().backward()
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}"
            assert p.grad.untyped_storage().data_ptr() in storages(buckets), name
    if cap_mb == 25.0:
        assert len(buckets.buffers) == 1
    if cap_mb == 1e-4:
        assert len(buckets.buffers) == len(list(ours.parameters())), "each parameter over the cap: its own bucket"


def test_existing_grads_are_kept_and_none_grads_stay_none_until_backward():
    ours, theirs = pair()
    first = next(ours.parameters())
    first.grad = torch.randn_like(first)
    want = first.grad.clone()
    buckets = gradfuse.GradBuckets(ours.parameters())
    assert torch.equal(first.grad, want) and first.grad.untyped_storage().data_ptr() in storages(buckets)
    assert all(p.grad is None for p in list(ours.parameters())[1:])
    x = torch.randn(3, 12)
    ours(x).sum().backward()
    theirs(x).sum().backward()
    assert torch.equal(first.grad, want + next(theirs.parameters()).grad)


def test_zero_grad_is_one_fill_per_bucket_and_views_stay_with_set_to_none_false():
    ours, _ = pair()
    buckets = gradfuse.GradBuckets(ours.parameters(), bucket_cap_mb=0.003)
    ours(torch.randn(4, 12)).sum().backward()
    views = [p.grad for p in ours.parameters()]
    assert len(buckets.buffers) > 1
    buckets.zero_grad(set_to_none=False)
    assert all(b.count_nonzero() == 0 for b in buckets.buffers)
    assert all(p.grad is v for p, v in zip(ours.parameters(), views, strict=True))
    ours(torch.randn(4, 12)).sum().backward()
    buckets.zero_grad()  # torch's default: set to None; the buffers zero-filled
    assert all(b.count_nonzero() == 0 for b in buckets.buffers)
    assert all(p.grad is None for p in ours.parameters())


def test_set_to_none_and_replaced_grads_go_back_into_the_buckets():
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    for _step in range(2):
        x = torch.randn(5, 12)
        ours(x).square().sum().backward()
        theirs(x).square().sum().backward()
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
            assert p.grad.untyped_storage().data_ptr() in storages(buckets), name
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
    # A user-replaced gradient is accumulated into, then put back into its slot.
    p, q = next(ours.parameters()), next(theirs.parameters())
    p.grad = torch.ones_like(p)
    q.grad = torch.ones_like(q)
    x = torch.randn(5, 12)
    ours(x).sum().backward()
    theirs(x).sum().backward()
    assert torch.equal(p.grad, q.grad) and p.grad.untyped_storage().data_ptr() in storages(buckets)
    total = buckets.get_total_norm()
    assert close(total.item(), torch.nn.utils.get_total_norm([t.grad for t in theirs.parameters()]).item(), 2e-6)


def test_unused_parameter_keeps_no_grad_and_its_stale_slot_is_not_counted():
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 4), nn.Linear(4, 4)
    params = [*used.parameters(), *unused.parameters()]
    buckets = gradfuse.GradBuckets(params)
    unused(torch.randn(2, 4)).sum().backward()  # every slot written once
    for p in params:
        p.grad = None
    used(torch.randn(2, 4)).square().sum().backward()
    assert unused.weight.grad is None
    assert all(t.count_nonzero() > 0 for t in buckets.grads[2:]), "the slots hold the first backward's values"
    want = torch.nn.utils.get_total_norm([p.grad for p in used.parameters()])
    assert close(buckets.get_total_norm().item(), want.item(), 2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_main_grad_accumulates_low_precision_grads_in_fp32(dtype):
    ours, theirs = pair(dtype)
    buckets = gradfuse.GradBuckets(ours.parameters(), grad_dtype=torch.float32, bucket_cap_mb=0.003)
    assert all(b.dtype == torch.float32 for b in buckets.buffers)
    expected = [torch.zeros(p.shape, dtype=torch.float64) for p in theirs.parameters()]
    folded = [torch.zeros(p.shape, dtype=torch.float32) for p in theirs.parameters()]
    for _ in range(4):
        x = torch.randn(6, 12, dtype=dtype)
        ours(x).float().square().mean().backward()
        theirs(x).float().square().mean().backward()
        for e, f, q in zip(expected, folded, theirs.parameters(), strict=True):
            e += q.grad.double()
            f += q.grad.float()  # each backward's gradient folded in: one fp32 rounding a step
        theirs.zero_grad()
    for (name, p), e, f in zip(ours.named_parameters(), expected, folded, strict=True):
        assert p.grad is None, f"{name}.grad not freed"
        assert p.main_grad.dtype == torch.float32
        assert p.main_grad.untyped_storage().data_ptr() in storages(buckets)
        # fp32 sums of the same low-precision gradients: within fp32 rounding of the exact sum,
        # and bit for bit the fp32 folds, one rounding per backward.
        torch.testing.assert_close(p.main_grad.double(), e, rtol=1e-6, atol=1e-8)
        assert torch.equal(p.main_grad, f), name
    # The norm of the fp32 main gradients, fp32-accurate.
    total = buckets.get_total_norm()
    assert close(total.item(), ref_norms([p.main_grad for p in ours.parameters()], 2.0)[0], 2e-6)


# --- clipping over the buffers ------------------------------------------------------------------

NORM_TYPES = [2.0, 1.0, 3.0, 0.5, math.inf, 0.0, -1.0, -math.inf]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [1e-3, 1e6])
def test_bucket_clip_matches_torch(norm_type, max_norm):
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters(), bucket_cap_mb=0.003)
    x = torch.randn(9, 12)
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    before = [p.grad.clone() for p in ours.parameters()]
    measured = buckets.get_total_norm(norm_type)
    total = buckets.clip_grad_norm_(max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)
    assert total.dtype == torch.float32 and torch.equal(total, measured)
    assert close(total.item(), ref_norms(before, norm_type)[0], 2e-6)
    assert close(total.item(), want.item(), 1e-5)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p, b, q in zip(ours.parameters(), before, theirs.parameters(), strict=True):
        assert torch.equal(p.grad, b * coef)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=0)
    gaps = sum(b.numel() for b in buckets.buffers) - sum(p.numel() for p in ours.parameters())
    assert gaps > 0  # the layout has gaps and padding, and they stayed zero (the norms above)


def test_error_if_nonfinite_leaves_the_buckets_untouched():
    ours, _ = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    ours(torch.randn(3, 12)).sum().backward()
    next(ours.parameters()).grad[0, 0] = math.nan
    before = [b.clone() for b in buckets.buffers]
    with pytest.raises(RuntimeError, match=r"The total norm of order 2\.0 for gradients .* is non-finite"):
        buckets.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(buckets.buffers, before, strict=True))


# --- the drop-ins' bucket path ------------------------------------------------------------------


def spy_on_bucket_path(monkeypatch):
    calls = []
    original = B.GradBuckets.clip_grad_norm_

    def spy(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(B.GradBuckets, "clip_grad_norm_", spy)
    return calls


def test_drop_in_takes_the_bucket_path_when_grads_are_live_views(monkeypatch):
    calls = spy_on_bucket_path(monkeypatch)
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters(), bucket_cap_mb=0.003)
    x = torch.randn(9, 12)
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    total = gradfuse.clip_grad_norm_(ours.parameters(), 0.01)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.01)
    assert calls == [buckets]
    assert close(total.item(), want.item(), 1e-5)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=0)
    # Under patch_torch, an unchanged trainer's call takes it too.
    with gradfuse.patch_torch():
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.01)
    assert calls == [buckets, buckets]


@pytest.mark.parametrize("how", ["new tensor", "data re-pointed", "subset"])
def test_a_replaced_grad_is_never_clipped_through_a_stale_view(monkeypatch, how):
    calls = spy_on_bucket_path(monkeypatch)
    ours, theirs = pair()
    gradfuse.GradBuckets(ours.parameters())
    x = torch.randn(9, 12)
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    p, q = list(ours.parameters())[1], list(theirs.parameters())[1]
    if how == "new tensor":
        p.grad = p.grad * 3  # outside the buckets
        q.grad = q.grad * 3
    elif how == "data re-pointed":
        p.grad.data = p.grad.data * 3  # the same object, its memory outside the buckets
        q.grad.data = q.grad.data * 3
    ours_params = list(ours.parameters())[:-2] if how == "subset" else ours.parameters()
    theirs_params = list(theirs.parameters())[:-2] if how == "subset" else theirs.parameters()
    total = gradfuse.clip_grad_norm_(ours_params, 0.01)
    want = torch.nn.utils.clip_grad_norm_(theirs_params, 0.01)
    assert calls == []
    assert close(total.item(), want.item(), 1e-5)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=0)


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, kw, error, match",
    [
        (
            lambda: [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, device="meta"))],
            {},
            ValueError,
            r"params\[1\] is on meta but params\[0\] is on cpu",
        ),
        (
            lambda: [(p := nn.Parameter(torch.ones(3))), nn.Parameter(torch.ones(2)), p],
            {},
            ValueError,
            r"params\[0\] and params\[2\] are the same parameter",
        ),
        (
            lambda: [nn.Parameter(torch.ones(3)), torch.ones(4, 2, requires_grad=True) * 2],
            {},
            ValueError,
            r"params\[1\] \(shape \(4, 2\)\) is not a leaf tensor",
        ),
        (
            lambda: [nn.Parameter(torch.ones(3))],
            {"process_group": object()},
            TypeError,
            r"(?s)no longer averages.*DistributedDataParallel\(model, gradient_as_bucket_view=True\)"
            r".*state = gradfuse.register_ddp_hook\(ddp\)",
        ),
        (lambda: [nn.Parameter(torch.ones(3))], {"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a positive"),
        (lambda: [nn.Parameter(torch.ones(3))], {"bucket_cap_mb": -1.0}, ValueError, "bucket_cap_mb"),
        (lambda: [nn.Parameter(torch.ones(3))], {"bucket_cap_mb": math.nan}, ValueError, "bucket_cap_mb"),
        (lambda: [nn.Parameter(torch.ones(3))], {"grad_dtype": torch.int32}, TypeError, "grad_dtype"),
        (lambda: [], {}, ValueError, "no parameters"),
        (
            lambda: [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3).to_sparse())],
            {},
            TypeError,
            r"params\[1\] is a Parameter with layout torch.sparse_coo; buckets hold dense",
        ),
        (
            lambda: [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, dtype=torch.complex64))],
            {},
            TypeError,
            r"params\[1\] has dtype torch.complex64",
        ),
    ],
)
def test_bad_input_raises_and_modifies_nothing(make, kw, error, match):
    params = make()
    for p in params:
        if p.requires_grad and p.device.type == "cpu" and p.layout == torch.strided and p.is_floating_point():
            p.grad = torch.full_like(p, 2.0)
    grads = [p.grad for p in params]
    with pytest.raises(error, match=match):
        gradfuse.GradBuckets(params, **kw)
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert all(g is None or torch.all(g == 2.0) for g in grads)
    assert not any(hasattr(p, "main_grad") for p in params)
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in params)
