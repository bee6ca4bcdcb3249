"""GradBuckets is never stale: each case gives torch's answer on the same model and inputs (or
a clear error), where the old buckets gave the buffers' stale values.

Tolerances: the bucket norm is one fp32 sum over the buffers and torch's is the norm of
per-tensor norms, so totals agree to fp32 rounding (rtol 1e-5 over a few thousand elements);
a gradient that is the same computation (autograd's, copied into a slot) is compared bitwise.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import gradfuse
from reference import SPARSE_NORM_ERROR, TORCH_MEASURES_SPARSE, close, ref_norms

RTOL = 1e-5  # fp32 sums of ~2000 squares in a different order
REF_RTOL = 2e-6  # gradfuse's fp32-accurate norm against the float64 reference (see reference.py)


@pytest.fixture(autouse=True)
def rust_backend(request, monkeypatch):
    # The CPU tests on the Rust core; a test that moves the model to CUDA keeps the default
    # backend ("auto": Triton there), since GRADFUSE_BACKEND=rust refuses CUDA tensors.
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("GRADFUSE_BACKEND", "rust")


class Net(nn.Module):
    def __init__(self, conv: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1) if conv else None
        self.fc1 = nn.Linear(12, 24)
        self.fc2 = nn.Linear(24, 5)
        self.side = nn.Linear(12, 5)  # used only when asked

    def forward(self, x, side: bool = False):
        if self.conv is not None:
            x = self.conv(x).mean(dim=(2, 3)).repeat(1, 3)
        y = self.fc2(torch.tanh(self.fc1(x)))
        return y + self.side(x) if side else y


def pair(conv: bool = False, dtype=torch.float32):
    torch.manual_seed(0)
    ours = Net(conv).to(dtype)
    theirs = Net(conv).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def inputs(conv: bool = False, dtype=torch.float32, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    shape = (6, 3, 5, 5) if conv else (6, 12)
    return torch.randn(shape, generator=gen).to(dtype)


def backward(model, x, side=False, scale=1.0):
    (model(x, side).square().mean() * scale).backward()


def assert_grads_equal(ours, theirs, exact: bool = True):
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{name}: a gradient where torch has none"
            continue
        assert p.grad is not None, f"{name}: no gradient where torch has one"
        assert p.grad.dtype == q.grad.dtype and p.grad.layout == q.grad.layout, name
        a, b = (p.grad.to_dense(), q.grad.to_dense()) if p.grad.is_sparse else (p.grad, q.grad)
        if exact:
            assert torch.equal(a, b), f"{name} differs by {(a - b).abs().max()}"
        else:
            # Clipped by coefficients that differ in fp32 rounding (the norms' summation order).
            torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-7, msg=name)


def all_in_buckets(buckets, model) -> bool:
    """Every gradient (``side``'s may be None) is a view into the buckets."""
    return all(in_buckets(buckets, p.grad) for p in model.parameters() if p.grad is not None)


def in_buckets(buckets, t) -> bool:
    return t.untyped_storage().data_ptr() in {b.untyped_storage().data_ptr() for b in buckets.buffers}


def ref_norm(model, norm_type=2.0) -> float:
    return ref_norms([p.grad for p in model.parameters() if p.grad is not None], norm_type)[0]


def torch_norm(model, norm_type=2.0):
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None], norm_type)


# --- the module cast or moved after construction ------------------------------------------------


@pytest.mark.parametrize("cast", ["half", "double", "channels_last"])
@pytest.mark.parametrize("with_grads", [True, False])
def test_module_cast_after_construction_gives_torchs_answer(cast, with_grads):
    conv = cast == "channels_last"
    ours, theirs = pair(conv)
    buckets = gradfuse.GradBuckets(ours.parameters(), bucket_cap_mb=0.001)
    x = inputs(conv)
    if with_grads:
        backward(ours, x)
        backward(theirs, x)

    def apply(model):
        if cast == "half":
            return model.half()
        if cast == "double":
            return model.double()
        return model.to(memory_format=torch.channels_last)

    apply(ours)
    apply(theirs)
    dtype = next(theirs.parameters()).dtype
    x = x.to(dtype)
    if with_grads:  # the gradients moved with the module, out of the buckets
        assert_grads_equal(ours, theirs)
        assert close(buckets.get_total_norm().item(), ref_norm(theirs), REF_RTOL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backward(ours, x, scale=4.0)
    backward(theirs, x, scale=4.0)
    # A new dtype or memory format does not fit the old slots: kept outside, with a warning.
    assert any("changed memory format after the buckets were built" in str(w.message) for w in caught)
    assert_grads_equal(ours, theirs)
    assert close(buckets.get_total_norm().item(), ref_norm(theirs), REF_RTOL)
    buckets.clip_grad_norm_(0.01)
    if cast == "half":  # torch's fp16 norm has 3 digits: compare the clipped norm instead
        assert close(ref_norm(ours), 0.01, 1e-3)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            q.grad = None if p.grad is None else p.grad.clone()  # continue from the same gradients
    else:
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.01)
        assert_grads_equal(ours, theirs, exact=False)
    # refresh() plans the buckets for the model as it is now, carrying the gradients over.
    before = [None if p.grad is None else p.grad.clone() for p in ours.parameters()]
    buckets.refresh()
    assert all(b.dtype == dtype for b in buckets.buffers)
    for p, b in zip(ours.parameters(), before, strict=True):
        assert (p.grad is None and b is None) or (in_buckets(buckets, p.grad) and torch.equal(p.grad, b))
    backward(ours, x)
    backward(theirs, x)
    assert all_in_buckets(buckets, ours)
    assert_grads_equal(ours, theirs, exact=cast == "half")


def test_main_grad_parameter_moved_raises_in_backward():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).bfloat16()
    buckets = gradfuse.GradBuckets(model.parameters(), grad_dtype=torch.float32)
    model.weight.data = torch.zeros(3, 2, dtype=torch.bfloat16)  # a different shape: not this slot
    with pytest.raises(RuntimeError, match=r"params\[0\] .* call buckets.refresh\(\)"):
        model(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
    del buckets


# --- gradients replaced, set to None --------------------------------------------------------------


def test_replaced_grad_is_measured_and_clipped():
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    x = inputs()
    backward(ours, x)
    backward(theirs, x)
    p, q = ours.fc1.weight, theirs.fc1.weight
    gen = torch.Generator().manual_seed(5)
    replacement = torch.randn(p.shape, generator=gen) * 3
    p.grad = replacement.clone()
    q.grad = replacement.clone()
    total = buckets.clip_grad_norm_(1.0)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
    assert want.item() > 20  # the replacement dominates: the stale buffers' norm is far below
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)  # the replacement clipped too
    assert math.isclose(torch_norm(ours).item(), 1.0, rel_tol=1e-4)


@pytest.fixture(params=["rust", "maps"])
def probes(request, monkeypatch):
    """The liveness checks through the Rust core's pass over torch's getters, or (a torch or
    Python whose getters it cannot call) through C-level maps."""
    from gradfuse import _plan

    if request.param == "maps":
        monkeypatch.setattr(_plan, "_PROBES", False)
    elif not _plan.probes():
        pytest.skip("the Rust core cannot call this torch's getters")
    return request.param


@pytest.mark.parametrize("how", ["data", "set_"])
def test_a_view_re_pointed_in_place_is_measured_and_clipped_where_it_is_now(how, probes):
    """The same ``.grad`` object, its memory moved out of the bucket (``.data =``, ``set_``): the
    buckets' one-pass check reads each view's address too, so the buffers (which still hold the
    old values) are not taken for the gradients."""
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    x = inputs()
    backward(ours, x, side=True)  # every parameter's gradient its bucket view
    backward(theirs, x, side=True)
    assert buckets.owns([t.grad for t in ours.parameters()])
    p, q = ours.fc1.weight, theirs.fc1.weight
    view = p.grad
    replacement = torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 3
    if how == "data":
        view.data = replacement.clone()
    else:
        view.set_(replacement.clone())
    q.grad = replacement.clone()
    assert p.grad is view
    want_norm = torch.nn.utils.get_total_norm([t.grad for t in theirs.parameters()])
    assert want_norm.item() > 20  # the new values dominate: the stale bucket's norm is far below
    torch.testing.assert_close(buckets.get_total_norm(), want_norm, rtol=RTOL, atol=0)
    total = buckets.clip_grad_norm_(1.0)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)


@pytest.mark.parametrize("how", ["data", "set_"])
def test_a_main_grad_re_pointed_in_place_is_measured_and_clipped_where_it_is_now(how, probes):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).bfloat16()
    buckets = gradfuse.GradBuckets(model.parameters(), grad_dtype=torch.float32)
    model(torch.randn(4, 8).bfloat16()).float().square().sum().backward()
    assert buckets.owns([p.main_grad for p in model.parameters()])
    view = model[0].weight.main_grad
    replacement = torch.randn(view.shape, generator=torch.Generator().manual_seed(5)) * 30
    if how == "data":
        view.data = replacement.clone()
    else:
        view.set_(replacement.clone())
    assert model[0].weight.main_grad is view
    grads = [p.main_grad.double() for p in model.parameters()]
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    assert want.item() > 100  # the new values dominate: the stale bucket's norm is far below
    torch.testing.assert_close(buckets.get_total_norm().double(), want, rtol=RTOL, atol=0)
    total = buckets.clip_grad_norm_(1.0)
    torch.testing.assert_close(total.double(), want, rtol=RTOL, atol=0)
    coef = 1.0 / (total.double() + 1e-6)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.main_grad.double(), g * coef, rtol=RTOL, atol=1e-7)


def test_total_norm_after_optimizer_zero_grad_is_zero():
    ours, _ = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    backward(ours, inputs())
    assert buckets.get_total_norm().item() > 0
    torch.optim.SGD(ours.parameters(), lr=0.1).zero_grad()  # set_to_none
    for norm_type in (2.0, 1.0, math.inf, 0.0, -1.0):
        assert buckets.get_total_norm(norm_type).item() == 0.0, norm_type
        assert buckets.clip_grad_norm_(1.0, norm_type).item() == 0.0
    assert all(p.grad is None for p in ours.parameters())


def test_some_grads_none_gives_torchs_norm_for_every_order():
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters(), bucket_cap_mb=0.001)
    x = inputs()
    backward(ours, x, side=True)
    backward(theirs, x, side=True)
    ours.fc1.weight.grad = None
    theirs.fc1.weight.grad = None
    for norm_type in (2.0, 3.0, math.inf, 0.0, -1.0, -math.inf):
        want = torch.nn.utils.get_total_norm([p.grad for p in theirs.parameters() if p.grad is not None], norm_type)
        torch.testing.assert_close(buckets.get_total_norm(norm_type), want, rtol=RTOL, atol=0)


# --- zero_grad -------------------------------------------------------------------------------------


def test_zero_grad_sets_to_none_so_adamw_leaves_unused_parameters_alone():
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters(), bucket_cap_mb=0.001)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(6):
        side = step < 2  # `side` gets gradients in the first two steps only
        x = inputs(seed=step)
        backward(ours, x, side)
        backward(theirs, x, side)
        # After the first step the weights differ by the clip coefficient's fp32 rounding.
        assert_grads_equal(ours, theirs, exact=step == 0)
        buckets.clip_grad_norm_(0.5)
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        opt_ours.step()
        opt_theirs.step()
        buckets.zero_grad()
        opt_theirs.zero_grad()
        assert all(p.grad is None for p in ours.parameters())
    # Within fp32 rounding of the clip coefficient (a different summation order of the norm).
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    side_ours = torch.cat([p.detach().flatten() for p in ours.side.parameters()])
    side_theirs = torch.cat([p.detach().flatten() for p in theirs.side.parameters()])
    assert torch.equal(side_ours, side_theirs) or torch.allclose(side_ours, side_theirs, rtol=1e-6, atol=0)


# --- main_grad -------------------------------------------------------------------------------------


def test_main_grad_is_cleared_by_buckets_zero_grad_and_a_missing_one_warns():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).bfloat16()
    buckets = gradfuse.GradBuckets(model.parameters(), grad_dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights and gradients stay
    x = torch.randn(4, 8).bfloat16()
    model(x).float().square().sum().backward()
    first = [p.main_grad.clone() for p in model.parameters()]
    optimizer.step()
    optimizer.zero_grad()  # does not clear main_grad
    with pytest.warns(UserWarning, match=r"without buckets.zero_grad\(\).*main_grad is cleared by buckets.zero_grad"):
        model(x).float().square().sum().backward()
    for p, f in zip(model.parameters(), first, strict=True):
        torch.testing.assert_close(p.main_grad, 2 * f, rtol=1e-6, atol=0)
    optimizer.step()
    buckets.zero_grad()
    assert all(p.main_grad.count_nonzero() == 0 for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).float().square().sum().backward()  # after buckets.zero_grad(): no warning
    for p, f in zip(model.parameters(), first, strict=True):
        assert torch.equal(p.main_grad, f)
    # An optimizer over other parameters does not count.
    other = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    buckets.zero_grad()
    other.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).float().square().sum().backward()
    buckets.remove()
    del optimizer


# --- ownership ---------------------------------------------------------------------------------------


def test_a_second_owner_is_refused_until_the_first_is_removed():
    ours, theirs = pair()
    first = gradfuse.GradBuckets(ours.parameters())
    grads_before = [p.grad for p in ours.parameters()]
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(4, 3, 3, 3\)|params\[0\] .* already has its gradient"):
        gradfuse.GradBuckets(list(ours.fc2.parameters()) + list(ours.fc1.parameters()))
    assert [p.grad for p in ours.parameters()] == grads_before
    first.remove()
    second = gradfuse.GradBuckets(ours.parameters())
    x = inputs()
    backward(ours, x)
    backward(theirs, x)
    assert_grads_equal(ours, theirs)  # one set of hooks: no doubled gradients
    assert all_in_buckets(second, ours)


# --- frozen parameters, unfreezing --------------------------------------------------------------------


def test_frozen_parameters_are_skipped_and_refresh_follows_unfreezing():
    ours, theirs = pair()
    for model in (ours, theirs):
        model.fc1.requires_grad_(False)
    buckets = gradfuse.GradBuckets(ours.parameters())  # no error: skipped, as DDP does
    assert len(buckets.params) == 4
    x = inputs()
    backward(ours, x)
    backward(theirs, x)
    assert_grads_equal(ours, theirs)
    # Unfrozen without refresh(): the gradient lands outside the buckets and is included.
    for model in (ours, theirs):
        model.fc1.requires_grad_(True)
    backward(ours, x)
    backward(theirs, x)
    assert_grads_equal(ours, theirs)
    assert not in_buckets(buckets, ours.fc1.weight.grad)
    with pytest.warns(UserWarning, match=r"was frozen when the buckets were planned.*buckets.refresh\(\)"):
        total = buckets.clip_grad_norm_(0.05)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)
    # refresh() plans it in, the gradients carried over; then the fast path again.
    buckets.refresh()
    assert len(buckets.params) == 6
    assert all_in_buckets(buckets, ours)
    assert_grads_equal(ours, theirs, exact=False)
    backward(ours, x)
    backward(theirs, x)
    assert all_in_buckets(buckets, ours)
    torch.testing.assert_close(buckets.get_total_norm(), torch_norm(theirs), rtol=RTOL, atol=0)
    # Freezing again: refresh() leaves it out, its gradient where it is (as torch leaves it).
    ours.fc2.requires_grad_(False)
    buckets.refresh()
    assert len(buckets.params) == 4 and ours.fc2.weight.grad is not None


# --- sparse gradients ------------------------------------------------------------------------------------


class WithEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        return self.fc(self.emb(ids)).square().mean()


def test_sparse_gradients_stay_sparse_and_are_measured_and_clipped():
    torch.manual_seed(0)
    ours, theirs = WithEmbedding(), WithEmbedding()
    theirs.load_state_dict(ours.state_dict())
    buckets = gradfuse.GradBuckets(ours.parameters())
    for step in range(2):  # the second backward accumulates into the sparse gradient
        ids = torch.randint(0, 50, (7,), generator=torch.Generator().manual_seed(step))
        ours(ids).backward()
        theirs(ids).backward()
    assert ours.emb.weight.grad.is_sparse
    assert_grads_equal(ours, theirs)
    if not TORCH_MEASURES_SPARSE:  # torch's answer is its error (torch 2.11), and nothing is modified
        for measure in (lambda: buckets.get_total_norm(), lambda: buckets.clip_grad_norm_(1e-3)):
            with pytest.raises(NotImplementedError, match=SPARSE_NORM_ERROR):
                measure()
        with pytest.raises(NotImplementedError, match=SPARSE_NORM_ERROR):
            torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1e-3)
        assert_grads_equal(ours, theirs)
        return
    for norm_type in (2.0, math.inf, 1.0):
        want = torch.nn.utils.get_total_norm([p.grad for p in theirs.parameters()], norm_type)
        torch.testing.assert_close(buckets.get_total_norm(norm_type), want, rtol=RTOL, atol=0)
    total = buckets.clip_grad_norm_(1e-3)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1e-3)
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)
    buckets.zero_grad()
    assert ours.emb.weight.grad is None


# --- grad_dtype, create_graph ------------------------------------------------------------------------


def test_parameter_grad_dtype_is_followed():
    ours, theirs = pair(dtype=torch.bfloat16)
    for model in (ours, theirs):
        model.fc1.weight.grad_dtype = torch.float32
    buckets = gradfuse.GradBuckets(ours.parameters())
    assert ours.fc1.weight.grad is None
    x = inputs(dtype=torch.bfloat16)
    for _ in range(2):
        backward(ours, x)
        backward(theirs, x)
    assert ours.fc1.weight.grad.dtype == torch.float32
    assert all_in_buckets(buckets, ours)
    assert_grads_equal(ours, theirs)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_keeps_the_grad_fn():
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    x = inputs()
    backward(ours, x)  # first a plain backward: the gradients are bucket views
    backward(theirs, x)
    for model in (ours, theirs):
        model(x).pow(3).mean().backward(create_graph=True)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None
            continue
        assert (p.grad.grad_fn is None) == (q.grad.grad_fn is None), name
        assert torch.equal(p.grad, q.grad), name
    assert ours.fc1.weight.grad.grad_fn is not None
    # The graph is usable: a gradient penalty's second backward gives torch's gradients.
    penalty_ours = sum(p.grad.square().sum() for p in ours.parameters() if p.grad is not None)
    penalty_theirs = sum(p.grad.square().sum() for p in theirs.parameters() if p.grad is not None)
    grads_ours = torch.autograd.grad(penalty_ours, list(ours.parameters()), allow_unused=True)
    grads_theirs = torch.autograd.grad(penalty_theirs, list(theirs.parameters()), allow_unused=True)
    for a, b in zip(grads_ours, grads_theirs, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    torch.testing.assert_close(buckets.get_total_norm(), torch_norm(theirs), rtol=RTOL, atol=0)
    total = buckets.clip_grad_norm_(0.01)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.01)
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)
    for p in [*ours.parameters(), *theirs.parameters()]:
        p.grad = None  # break the grad -> graph -> parameter cycle


def test_create_graph_with_main_grad_raises():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).bfloat16()
    buckets = gradfuse.GradBuckets(model.parameters(), grad_dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"params\[\d\] .*create_graph=True.*would drop the graph"):
        model(torch.randn(2, 4).bfloat16()).pow(3).sum().backward(create_graph=True)
    buckets.remove()
    for p in model.parameters():
        p.grad = None


def test_all_frozen_at_construction_then_refresh():
    ours, theirs = pair()
    for model in (ours, theirs):
        model.requires_grad_(False)
    buckets = gradfuse.GradBuckets(ours.parameters())
    assert buckets.buffers == [] and buckets.get_total_norm().item() == 0.0
    assert buckets.clip_grad_norm_(1.0).item() == 0.0
    for model in (ours, theirs):
        model.requires_grad_(True)
    buckets.refresh()
    x = inputs()
    backward(ours, x)
    backward(theirs, x)
    assert_grads_equal(ours, theirs)
    assert all_in_buckets(buckets, ours)


def test_drop_in_over_the_trainable_parameters_ignores_a_frozen_parameters_gradient():
    """The drop-in's bucket path answers for the gradients it was given: a frozen parameter's
    gradient, which the bucket methods include, sends it the ordinary way."""
    ours, theirs = pair()
    for model in (ours, theirs):
        model.side.requires_grad_(False)
    gradfuse.GradBuckets(ours.parameters())
    x = inputs()
    backward(ours, x)
    backward(theirs, x)
    for model in (ours, theirs):
        model.side.weight.grad = torch.full_like(model.side.weight, 10.0)
    total = gradfuse.clip_grad_norm_([p for p in ours.parameters() if p.requires_grad], 0.01)
    want = torch.nn.utils.clip_grad_norm_([p for p in theirs.parameters() if p.requires_grad], 0.01)
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)


@pytest.mark.cuda
def test_module_moved_to_cuda_after_construction():
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    x = inputs()
    backward(ours, x)
    backward(theirs, x)
    ours.cuda()
    theirs.cuda()
    x = x.cuda()
    assert close(buckets.get_total_norm().item(), ref_norm(theirs), REF_RTOL)
    with pytest.warns(UserWarning, match="cast, moved or changed memory format"):
        backward(ours, x)
    backward(theirs, x)
    assert_grads_equal(ours, theirs)
    assert close(buckets.get_total_norm().item(), ref_norm(theirs), REF_RTOL)
    buckets.refresh()
    assert all(b.is_cuda for b in buckets.buffers) and all_in_buckets(buckets, ours)
    backward(ours, x)
    backward(theirs, x)
    assert_grads_equal(ours, theirs)


# --- randomized: a training loop's moves against torch -------------------------------------------


class Tied(nn.Module):
    """A weight used twice (tied), a branch used only when asked, an embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 12)
        self.shared = nn.Linear(12, 12)
        self.branch = nn.Linear(12, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, ids, branch: bool):
        h = torch.tanh(self.shared(self.emb(ids)))
        h = self.shared(h)
        if branch:
            h = h + self.branch(h)
        return self.out(h).square().mean()


def test_random_loop_matches_torch():
    """Two hundred moves drawn at random (backward with or without the branch, the three ways
    of zeroing, replaced and None gradients, freezing and unfreezing with refresh(), clipping
    and norms of every order, optimizer steps), each compared with torch on a copy of the
    model. After each check torch's copy takes our values, so that a clip coefficient's fp32
    rounding (the norm's summation order) does not build up."""
    import random

    rng = random.Random(13)
    torch.manual_seed(0)
    ours, theirs = Tied(), Tied()
    theirs.load_state_dict(ours.state_dict())
    buckets = gradfuse.GradBuckets(ours.parameters(), bucket_cap_mb=0.002)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    names = [n for n, _ in ours.named_parameters()]
    pairs = list(zip(ours.parameters(), theirs.parameters(), strict=True))
    moves = ["backward"] * 6 + ["zero", "zero_keep", "opt_zero", "replace", "none", "freeze", "clip", "norm", "step"]
    for move_no in range(200):
        move = rng.choice(moves)
        if move == "backward":
            ids = torch.randint(0, 20, (5,), generator=torch.Generator().manual_seed(move_no))
            branch = rng.random() < 0.5
            ours(ids, branch).backward()
            theirs(ids, branch).backward()
        elif move == "zero":
            buckets.zero_grad()
            opt_theirs.zero_grad()
        elif move == "zero_keep":
            buckets.zero_grad(set_to_none=False)
            opt_theirs.zero_grad(set_to_none=False)
        elif move == "opt_zero":
            opt_ours.zero_grad()
            opt_theirs.zero_grad()
        elif move in ("replace", "none"):
            k = rng.randrange(len(pairs))
            p, q = pairs[k]
            if move == "none" or not p.requires_grad:
                p.grad = q.grad = None
            else:
                g = torch.randn(p.shape, generator=torch.Generator().manual_seed(move_no))
                p.grad, q.grad = g.clone(), g.clone()
        elif move == "freeze":
            name = rng.choice(["branch", "shared", "emb"])
            flag = not getattr(ours, name).weight.requires_grad
            getattr(ours, name).requires_grad_(flag)
            getattr(theirs, name).requires_grad_(flag)
            if rng.random() < 0.7:
                buckets.refresh()
        elif move in ("clip", "norm"):
            norm_type = rng.choice([2.0, 1.0, math.inf, 0.0, -1.0])
            present = [q.grad for q in theirs.parameters() if q.grad is not None]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "GradBuckets: .* was frozen", UserWarning)
                if move == "clip":
                    total = buckets.clip_grad_norm_(0.05, norm_type)
                    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05, norm_type)
                else:
                    total = buckets.get_total_norm(norm_type)
                    want = torch.nn.utils.get_total_norm(present, norm_type)
            if present:
                torch.testing.assert_close(total, want, rtol=RTOL, atol=0, msg=f"move {move_no}: {move} {norm_type}")
            else:
                assert total.item() == 0.0, f"move {move_no}: {move} with no gradients"
        else:
            opt_ours.step()
            opt_theirs.step()
        for name, (p, q) in zip(names, pairs, strict=True):
            assert (p.grad is None) == (q.grad is None), f"move {move_no} ({move}): {name}"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=1e-7, msg=f"move {move_no} ({move}): {name}")
                with torch.no_grad():
                    q.grad.copy_(p.grad)
            torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-7, msg=f"move {move_no} ({move}): {name} weights")
            with torch.no_grad():
                q.copy_(p)


def test_refresh_refuses_parameters_it_cannot_plan_and_changes_nothing():
    ours, _ = pair()
    ours.side.requires_grad_(False)
    buckets = gradfuse.GradBuckets(ours.parameters())
    x = inputs()
    backward(ours, x)
    before = ([b.clone() for b in buckets.buffers], [p.grad for p in ours.parameters()])
    ours.side.weight.data = ours.side.weight.data.to(torch.complex64)
    ours.side.requires_grad_(True)
    with pytest.raises(TypeError, match=r"params\[4\] has dtype torch.complex64"):
        buckets.refresh()
    assert all(torch.equal(a, b) for a, b in zip(buckets.buffers, before[0], strict=True))
    assert all(p.grad is g for p, g in zip(ours.parameters(), before[1], strict=True))
    assert len(buckets.params) == 4


# --- parameters replaced after construction (issue 21.2) ------------------------------------------


def _replace(model, how: str, seed: int = 7) -> None:
    """A new ``fc2.weight`` (the same values in every model given the same seed), or for
    ``load_state_dict_assign`` a new parameter for every entry."""
    gen = torch.Generator().manual_seed(seed)
    if how == "load_state_dict_assign":
        sd = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=True)
        return
    new = nn.Parameter(torch.randn(model.fc2.weight.shape, generator=gen).to(model.fc2.weight.dtype))
    if how == "setattr":
        model.fc2.weight = new
    else:
        model.fc2.register_parameter("weight", new)


REPLACEMENTS = ["setattr", "register_parameter", "load_state_dict_assign"]


@pytest.mark.parametrize("how", REPLACEMENTS)
@pytest.mark.parametrize("built_from", ["params", "module"])
def test_a_replaced_parameter_raises_until_refresh_then_gives_torchs_answer(how, built_from):
    """Before the fix: ``buckets.clip_grad_norm_`` gave the old parameters' norm (0.0, or 0.512
    where torch gives 0.631) and left the new gradients unclipped, and ``refresh()`` did not
    help. Now the methods raise naming ``refresh()`` (nothing modified), the drop-in over
    ``model.parameters()`` is torch's meanwhile, and after ``refresh()`` the buckets hold the
    model's parameters as they are now: torch's norm and clip, gradients carried over and
    every gradient a bucket view from the next backward on."""
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours if built_from == "module" else ours.parameters(), bucket_cap_mb=0.001)
    x = inputs()
    backward(ours, x)
    _replace(ours, how)
    _replace(theirs, how)
    ours.zero_grad(set_to_none=True)  # as an optimizer over the new parameters would
    theirs.zero_grad(set_to_none=True)
    backward(ours, x, scale=50.0)
    backward(theirs, x, scale=50.0)
    assert_grads_equal(ours, theirs)
    before = [p.grad.clone() for p in ours.parameters() if p.grad is not None]
    for call in (lambda: buckets.clip_grad_norm_(0.1), buckets.get_total_norm, buckets.zero_grad):
        with pytest.raises(RuntimeError, match=r"replaced in its module .* Call buckets\.refresh\(\)"):
            call()
    after = [p.grad for p in ours.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # nothing modified
    # The drop-in over the model's parameters reads what the model has: torch's answer.
    total = gradfuse.clip_grad_norm_(ours.parameters(), 0.1)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    assert want.item() > 0.1
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)
    # refresh(): the parameters the model has now, their gradients carried into the buckets.
    buckets.refresh()
    assert {id(p) for p in buckets.params} == {id(p) for p in ours.parameters()}
    assert all_in_buckets(buckets, ours)
    assert close(buckets.get_total_norm().item(), ref_norm(theirs), REF_RTOL)
    backward(ours, x, scale=50.0)
    backward(theirs, x, scale=50.0)
    assert all_in_buckets(buckets, ours)
    total = buckets.clip_grad_norm_(0.1)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)
    buckets.zero_grad()
    assert all(p.grad is None for p in ours.parameters())


def test_an_optimizer_step_over_new_parameters_after_refresh_matches_torch():
    """The issue's loop: buckets built, a checkpoint loaded with ``assign=True``, an optimizer
    made over the new parameters, refresh(), then training with the buckets' clip; every
    step's weights as torch's."""
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    _replace(ours, "load_state_dict_assign", seed=3)
    _replace(theirs, "load_state_dict_assign", seed=3)
    buckets.refresh()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for step in range(3):
        buckets.zero_grad()
        opt_theirs.zero_grad()
        x = inputs(seed=10 + step)
        backward(ours, x, scale=20.0)
        backward(theirs, x, scale=20.0)
        total = buckets.clip_grad_norm_(0.5)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
        opt_ours.step()
        opt_theirs.step()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-7)


def test_main_grad_parameter_replaced_then_refreshed():
    """A bf16 model with fp32 ``main_grad``: a replaced parameter raises until ``refresh()``,
    which gives the new one its ``main_grad`` view; the norm is then the float64 reference's
    (torch's own bf16 norm has three digits)."""
    torch.manual_seed(0)
    model = Net().bfloat16()
    buckets = gradfuse.GradBuckets(model.parameters(), grad_dtype=torch.float32)
    _replace(model, "setattr")
    x = inputs(dtype=torch.bfloat16)
    backward(model, x)
    with pytest.raises(RuntimeError, match=r"params\[2\] .* replaced"):
        buckets.clip_grad_norm_(1.0)
    new_grad = model.fc2.weight.grad.clone()  # outside the buckets: no main_grad yet
    assert not hasattr(model.fc2.weight, "main_grad")
    buckets.refresh()
    assert torch.equal(model.fc2.weight.main_grad, new_grad.float()) and model.fc2.weight.grad is None
    grads = [p.main_grad for p in model.parameters() if p.requires_grad]
    want = ref_norms(grads, 2.0)[0]
    assert close(buckets.get_total_norm().item(), want, REF_RTOL)


def test_refresh_with_parameters_given():
    """``refresh(params)`` plans exactly those: a parameter the hook cannot see (set through
    ``_parameters``) and one left out."""
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    with torch.no_grad():
        new = nn.Parameter(ours.fc1.weight.detach() * 2)
    ours.fc1._parameters["weight"] = new  # no registration hook fires: not noticed
    theirs.fc1._parameters["weight"] = nn.Parameter(new.detach().clone())
    buckets.refresh([p for n, p in ours.named_parameters() if not n.startswith("side")])
    assert any(p is new for p in buckets.params) and len(buckets.params) == 4
    x = inputs()
    backward(ours, x)
    backward(theirs, x)
    want = torch.nn.utils.get_total_norm([q.grad for n, q in theirs.named_parameters() if not n.startswith("side")])
    torch.testing.assert_close(buckets.get_total_norm(), want, rtol=RTOL, atol=0)
    # The left-out parameters may go into another GradBuckets now; the kept ones may not.
    other = gradfuse.GradBuckets(ours.side.parameters())
    with pytest.raises(ValueError, match="already has its gradient in another GradBuckets"):
        gradfuse.GradBuckets([ours.fc2.bias])
    del other


def test_a_module_built_buckets_refresh_takes_new_submodules_too():
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours)
    for model in (ours, theirs):
        torch.manual_seed(5)
        model.extra = nn.Linear(5, 5)  # registered afresh: nothing replaced, refresh() picks it up
    buckets.refresh()
    assert len(buckets.params) == len(list(ours.parameters())) == 8
    x = inputs()
    for model in (ours, theirs):
        (model(x).square().mean() + model.extra(model(x)).square().mean()).backward()
    assert all_in_buckets(buckets, ours)
    torch.testing.assert_close(buckets.get_total_norm(), torch_norm(theirs), rtol=RTOL, atol=0)


def test_registering_the_same_parameter_again_is_no_replacement():
    ours, _ = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    ours.fc2.weight = ours.fc2.weight
    ours.fc2.register_parameter("bias", ours.fc2.bias)
    backward(ours, inputs())
    assert close(buckets.get_total_norm().item(), ref_norm(ours), REF_RTOL)


def test_the_watch_holds_no_buckets_and_refresh_lets_replaced_parameters_go():
    """torch's registration hook is global and outlives every GradBuckets: it holds none of
    them (one removed from its parameters' hooks is collected, and replacing a parameter
    afterwards is harmless), and after ``refresh()`` a replaced parameter is no longer kept
    alive by the buckets."""
    import gc
    import weakref

    ours, _ = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    gone = weakref.ref(buckets)
    buckets.remove()  # the parameters' own hooks hold a live GradBuckets; nothing else does
    del buckets
    gc.collect()
    assert gone() is None
    _replace(ours, "setattr")  # no owner any more: nothing to note, nothing raised

    buckets = gradfuse.GradBuckets(ours.parameters())
    old = weakref.ref(ours.fc2.weight)
    _replace(ours, "setattr", seed=8)
    buckets.refresh()
    gc.collect()
    assert old() is None
    assert any(p is ours.fc2.weight for p in buckets.params)


def _replace_submodule(model, how: str) -> None:
    """``fc2`` replaced by a new module (a fine-tuning head): its parameters leave the model."""
    torch.manual_seed(11)
    new = nn.Linear(24, 5)
    if how == "setattr":
        model.fc2 = new
    else:
        model.register_module("fc2", new)


@pytest.mark.parametrize("how", ["setattr", "register_module"])
@pytest.mark.parametrize("built_from", ["params", "module"])
def test_a_replaced_submodule_raises_until_refresh_then_gives_torchs_answer(how, built_from):
    """A submodule replaced after the buckets were built (``model.fc2 = nn.Linear(...)``) takes
    its parameters out of the model as surely as ``model.fc2.weight = nn.Parameter(...)``, but
    torch registers no parameter over theirs. Before the fix the buckets' norm was over the old
    head (7.9 where torch gives 14.1) and the new head's gradients went unclipped; now the
    methods raise naming ``refresh()``, which then plans the model's parameters."""
    ours, theirs = pair()
    buckets = gradfuse.GradBuckets(ours if built_from == "module" else ours.parameters())
    x = inputs()
    backward(ours, x)
    _replace_submodule(ours, how)
    _replace_submodule(theirs, how)
    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
        backward(model, x, scale=50.0)
    assert_grads_equal(ours, theirs)
    message = r"replaced in its module \(Net\.fc2\.weight: .* Call buckets\.refresh\(\)"
    for call in (lambda: buckets.clip_grad_norm_(0.1), buckets.get_total_norm, buckets.zero_grad):
        with pytest.raises(RuntimeError, match=message):
            call()
    buckets.refresh()
    assert {id(p) for p in buckets.params} == {id(p) for p in ours.parameters()}
    assert all_in_buckets(buckets, ours)
    total = buckets.clip_grad_norm_(0.1)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    assert want.item() > 0.1
    torch.testing.assert_close(total, want, rtol=RTOL, atol=0)
    assert_grads_equal(ours, theirs, exact=False)


def test_a_submodule_wrapped_or_removed():
    """Wrapping a submodule (``model.fc2 = Wrapper(model.fc2)``, as activation checkpointing
    does) keeps its parameters in the model: nothing is replaced. Setting one to ``None``
    takes its parameters out: the methods raise until ``refresh()``, which drops them."""
    ours, _ = pair()
    buckets = gradfuse.GradBuckets(ours.parameters())
    ours.fc1 = nn.Sequential(ours.fc1)
    backward(ours, inputs())
    assert close(buckets.get_total_norm().item(), ref_norm(ours), REF_RTOL)
    ours.side = None
    with pytest.raises(RuntimeError, match=r"replaced in its module \(Net\.side\.weight: "):
        buckets.get_total_norm()
    buckets.refresh()
    assert {id(p) for p in buckets.params} == {id(p) for p in ours.parameters()}
    assert close(buckets.get_total_norm().item(), ref_norm(ours), REF_RTOL)
