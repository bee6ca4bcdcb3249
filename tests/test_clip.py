"""Drop-in clipping: gradfuse.clip_grad_norm_ and friends against torch.nn.utils, behaviour by
behaviour (the cases torch's own tests check), plus patch_torch and torch.compile."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import gradfuse
from reference import SPARSE_NORM_ERROR, TORCH_MEASURES_SPARSE, close, randn, ref_norms, same_bits


@pytest.fixture(autouse=True)
def rust_backend(monkeypatch):
    monkeypatch.setenv("GRADFUSE_BACKEND", "rust")


def make_params(shapes, dtype=torch.float32, grads=True, scale=1.0):
    params = [torch.nn.Parameter(torch.empty(s, dtype=dtype)) for s in shapes]
    if grads:
        for p in params:
            p.grad = randn(p.shape, dtype, scale)
    return params


def clone_params(params):
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for o, p in zip(out, params, strict=True):
        o.grad = None if p.grad is None else p.grad.clone()
    return out


SHAPES = [(10, 10), (10,), (3, 4, 5), (1,), (257,)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 4.0, 0.5, 0.0, -1.0, math.inf, -math.inf])
@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e6])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    ours = make_params(SHAPES)
    theirs = clone_params(ours)
    before = [p.grad.clone() for p in ours]
    total = gradfuse.clip_grad_norm_(ours, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    ref_total, _ = ref_norms(before, norm_type)
    assert total.dtype == torch.float32 and total.shape == ()
    assert close(total.item(), ref_total, 2e-6)
    assert close(total.item(), want.item(), 1e-5)
    # Every gradient scaled by one common factor: torch's coefficient from our total.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p, b, t in zip(ours, before, theirs, strict=True):
        assert same_bits(p.grad, b * coef)
        assert torch.allclose(p.grad, t.grad, rtol=1e-5, atol=0)
    if coef.item() == 1.0:
        assert all(same_bits(p.grad, b) for p, b in zip(ours, before, strict=True))


def test_returns_float32_total_for_bf16_grads():
    params = make_params(SHAPES, torch.bfloat16)
    before = [p.grad.clone() for p in params]
    total = gradfuse.clip_grad_norm_(params, 0.5)
    assert total.dtype == torch.float32
    assert close(total.item(), ref_norms(before, 2.0)[0], 2e-6)
    coef = torch.clamp(0.5 / (total + 1e-6), max=1.0)
    for p, b in zip(params, before, strict=True):
        assert same_bits(p.grad, (b.float() * coef).bfloat16())


def test_single_tensor_and_generator_and_none_grads():
    ours = make_params(SHAPES)
    ours[1].grad = None
    theirs = clone_params(ours)
    total = gradfuse.clip_grad_norm_((p for p in ours), 0.5)
    want = torch.nn.utils.clip_grad_norm_((p for p in theirs), 0.5)
    assert close(total.item(), want.item(), 1e-5)
    assert ours[1].grad is None
    one = make_params([(7,)])[0]
    other = clone_params([one])[0]
    assert close(gradfuse.clip_grad_norm_(one, 0.1).item(), torch.nn.utils.clip_grad_norm_(other, 0.1).item(), 1e-6)
    assert torch.allclose(one.grad, other.grad, rtol=1e-6)


def test_empty_inputs_and_exhausted_generator_warning():
    assert gradfuse.clip_grad_norm_([], 1.0).item() == 0.0
    assert gradfuse.clip_grad_norm_(make_params(SHAPES, grads=False), 1.0).item() == 0.0
    with pytest.warns(UserWarning, match="`parameters` is an empty generator, no gradient clipping will occur."):
        total = gradfuse.clip_grad_norm_((p for p in []), 1.0)
    assert total.item() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradfuse.clip_grad_norm_([], 1.0)  # a list is not a generator: no warning
    assert gradfuse.get_total_norm([]).item() == 0.0
    gradfuse.clip_grads_with_norm_([], 1.0, torch.tensor(5.0))
    gradfuse.clip_grad_value_([], 1.0)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 0.0, -1.0, -2.0, math.inf, -math.inf])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_error_if_nonfinite(norm_type, bad):
    """Raises torch's error exactly when torch does, and then leaves every gradient untouched."""
    ours = make_params(SHAPES)
    ours[2].grad.view(-1)[3] = bad
    theirs = clone_params(ours)
    before = [p.grad.clone() for p in ours]
    try:
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type, error_if_nonfinite=True)
        torch_raised = None
    except RuntimeError as e:
        torch_raised = str(e)
    if torch_raised is None:
        # e.g. negative orders ignore inf elements, p = 0 counts them: the total is finite.
        gradfuse.clip_grad_norm_(ours, 1.0, norm_type, error_if_nonfinite=True)
        return
    with pytest.raises(RuntimeError) as info:
        gradfuse.clip_grad_norm_(ours, 1.0, norm_type, error_if_nonfinite=True)
    assert str(info.value) == torch_raised
    for p, b in zip(ours, before, strict=True):
        assert same_bits(p.grad, b)
    # Without the flag both scale by the non-finite coefficient.
    total = gradfuse.clip_grad_norm_(ours, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert close(total.item(), want.item(), 1e-5)
    for p, t in zip(ours, theirs, strict=True):
        assert torch.equal(torch.isnan(p.grad), torch.isnan(t.grad))


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_is_accepted(foreach):
    ours = make_params(SHAPES)
    theirs = clone_params(ours)
    total = gradfuse.clip_grad_norm_(ours, 0.1, foreach=foreach)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.1, foreach=foreach)
    assert close(total.item(), want.item(), 1e-5)
    gradfuse.clip_grad_value_(ours, 0.01, foreach=foreach)
    torch.nn.utils.clip_grad_value_(theirs, 0.01, foreach=foreach)
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-5) for a, b in zip(ours, theirs, strict=True))


def test_get_total_norm_and_clip_grads_with_norm():
    grads = [randn(s, torch.float32) for s in SHAPES]
    params = make_params(SHAPES)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = gradfuse.get_total_norm(grads, 3.0)
    assert close(total.item(), torch.nn.utils.get_total_norm(grads, 3.0).item(), 1e-5)
    assert close(gradfuse.get_total_norm(grads[0]).item(), grads[0].norm().item(), 1e-6)
    gradfuse.clip_grads_with_norm_(params, 0.25, total)
    coef = torch.clamp(0.25 / (total + 1e-6), max=1.0)
    for p, g in zip(params, grads, strict=True):
        assert same_bits(p.grad, g * coef)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_clip_grads_with_norm_uses_torch_arithmetic_in_the_totals_dtype(dtype):
    """A total norm handed in by the caller (say torch's bf16 total) gives torch's coefficient."""
    grads = [randn(s, torch.float32) for s in SHAPES]
    total = torch.tensor(7.3, dtype=dtype)
    params = make_params(SHAPES)
    theirs = make_params(SHAPES)
    for p, t, g in zip(params, theirs, grads, strict=True):
        p.grad, t.grad = g.clone(), g.clone()
    gradfuse.clip_grads_with_norm_(params, 0.3, total)
    torch.nn.utils.clip_grads_with_norm_(theirs, 0.3, total)
    for p, t in zip(params, theirs, strict=True):
        assert same_bits(p.grad, t.grad)


def test_clip_grad_value_matches_torch():
    ours = make_params(SHAPES, scale=3.0)
    ours[0].grad.view(-1)[0] = math.nan
    ours[3].grad = None
    theirs = clone_params(ours)
    gradfuse.clip_grad_value_(ours, 1.5)
    torch.nn.utils.clip_grad_value_(theirs, 1.5)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.grad is None and b.grad is None) or same_bits(a.grad, b.grad)


@pytest.mark.parametrize("value", [-1.0, math.nan])
def test_bad_max_norm_and_clip_value_raise_and_modify_nothing(value):
    params = make_params(SHAPES)
    before = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        gradfuse.clip_grad_norm_(params, value)
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        gradfuse.clip_grads_with_norm_(params, value, torch.tensor(1.0))
    with pytest.raises(ValueError, match="clip_value must be a non-negative number"):
        gradfuse.clip_grad_value_(params, value)
    for p, b in zip(params, before, strict=True):
        assert same_bits(p.grad, b)


def test_sparse_and_complex_grads_are_handed_to_torch():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    other = torch.nn.Embedding(10, 4, sparse=True)
    other.weight.grad = emb.weight.grad.clone()
    if TORCH_MEASURES_SPARSE:
        total = gradfuse.clip_grad_norm_(emb.parameters(), 0.5)
        want = torch.nn.utils.clip_grad_norm_(other.parameters(), 0.5)
        assert torch.equal(total, want)
    else:  # torch's answer is its error (torch 2.11), and nothing is modified
        with pytest.raises(NotImplementedError, match=SPARSE_NORM_ERROR):
            torch.nn.utils.clip_grad_norm_(other.parameters(), 0.5)
        with pytest.raises(NotImplementedError, match=SPARSE_NORM_ERROR):
            gradfuse.clip_grad_norm_(emb.parameters(), 0.5)
    assert torch.equal(emb.weight.grad.to_dense(), other.weight.grad.to_dense())

    c = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    c.grad = torch.tensor([3 + 4j, 0, 1j], dtype=torch.complex64)
    real = make_params([(4,)])
    mine = [c, *real]
    c2 = torch.nn.Parameter(c.detach().clone())
    c2.grad = c.grad.clone()
    theirs = [c2, *clone_params(real)]
    assert torch.equal(gradfuse.clip_grad_norm_(mine, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs, strict=True))


def test_patch_torch_routes_and_restores():
    original = torch.nn.utils.clip_grad_norm_
    names = ["clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_"]
    saved = {n: getattr(torch.nn.utils, n) for n in names}
    params = make_params(SHAPES, torch.bfloat16)
    with gradfuse.patch_torch():
        for n in names:
            assert getattr(torch.nn.utils, n) is getattr(gradfuse, n)
        assert torch.nn.utils.clip_grad.clip_grad_norm_ is gradfuse.clip_grad_norm_
        # A trainer calling torch's name gets gradfuse's fp32-accurate total.
        assert torch.nn.utils.clip_grad_norm_(params, 1.0).dtype == torch.float32
    for n in names:
        assert getattr(torch.nn.utils, n) is saved[n]
    assert torch.nn.utils.clip_grad_norm_ is original
    assert torch.nn.utils.clip_grad_norm_(make_params(SHAPES, torch.bfloat16), 1.0).dtype == torch.bfloat16
    patch = gradfuse.patch_torch()
    try:
        assert torch.nn.utils.clip_grad_value_ is gradfuse.clip_grad_value_
    finally:
        patch.restore()
    assert torch.nn.utils.clip_grad_value_ is saved["clip_grad_value_"]


def test_deprecated_clip_grad_norm_warns_like_torch():
    with pytest.warns(FutureWarning, match="now deprecated in favor of `torch.nn.utils.clip_grad_norm_`"):
        gradfuse.clip_grad_norm(make_params(SHAPES), 1.0)


def test_compiles_without_graph_breaks():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    params = list(model.parameters())
    saved = [p.grad.clone() for p in params]

    def step(ps):
        return gradfuse.clip_grad_norm_(ps, 0.05)

    explanation = torch._dynamo.explain(step)(params)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    for p, s in zip(params, saved, strict=True):
        p.grad = s.clone()
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    total = compiled(params)
    eager = make_params([p.shape for p in params])
    for e, s in zip(eager, saved, strict=True):
        e.grad = s.clone()
    want = gradfuse.clip_grad_norm_(eager, 0.05)
    assert same_bits(total, want)
    assert all(same_bits(p.grad, e.grad) for p, e in zip(params, eager, strict=True))
