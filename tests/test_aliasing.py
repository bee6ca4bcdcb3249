"""Gradients that alias in memory (issues 9 and 10.1).

The drop-ins give exactly torch's result (return value and every gradient afterwards) when
their in-place targets alias: the same parameter twice, one gradient tensor shared by two
parameters, overlapping views. They hand such calls to torch, whose element-by-element updates
define what aliasing does; the fused ops keep refusing them. Views that interleave but share no
element (column slices, even/odd elements) are not aliasing: they run on the fused path.
"""

from __future__ import annotations

import pytest
import torch

import gradfuse
from gradfuse import clip
from gradfuse._plan import InternalOverlapError, OverlapError
from reference import close, params_of, ref_norms, same_bits

# torch's own functions, taken before any test patches torch.
TORCH = {n: getattr(torch.nn.utils, n) for n in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")}
TORCH["get_total_norm"] = torch.nn.utils.get_total_norm


@pytest.fixture(autouse=True)
def rust_backend(monkeypatch):
    monkeypatch.setenv("GRADFUSE_BACKEND", "rust")


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen)


def aliasing(kind: str, seed: int):
    """``(params, memory)``: parameters whose gradients alias as ``kind`` says, and the distinct
    tensors holding all their gradient memory (compared after a call). Same seed, same data."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "repeated parameter":
        a, b = params_of([rand(5, gen=gen), rand(7, gen=gen)])
        return [a, b, a], [a.grad, b.grad]
    if kind == "shared grad tensor":
        shared, other = rand(5, gen=gen), rand(7, gen=gen)
        a, b, c = params_of([shared, other, shared])
        return [a, b, c], [shared, other]
    if kind == "overlapping slices":
        buf = rand(12, gen=gen)
        return params_of([rand(3, gen=gen), buf[0:8], buf[4:12]]), [buf]
    if kind == "overlapping 2-d views":
        grid = rand(6, 6, gen=gen)
        return params_of([grid[0:4, 0:3], grid[2:6, 1:4]]), [grid]
    raise AssertionError(kind)


KINDS = ["repeated parameter", "shared grad tensor", "overlapping slices", "overlapping 2-d views"]

# Each drop-in with clipping active (a small max_norm, a small clip value, a large total).
CALLS = {
    "clip_grad_norm_": lambda f, ps: f(ps, 0.1),
    "clip_grad_norm_ inf": lambda f, ps: f(ps, 0.1, float("inf")),
    "clip_grad_value_": lambda f, ps: f(ps, 0.3),
    "clip_grads_with_norm_": lambda f, ps: f(ps, 0.1, torch.tensor(7.5)),
}


def call_name(call: str) -> str:
    return call.split()[0]


def assert_same_as_torch(ours_out, theirs_out, ours_mem, theirs_mem):
    if theirs_out is None:
        assert ours_out is None
    else:
        assert ours_out.dtype == theirs_out.dtype and torch.equal(ours_out, theirs_out)
    for o, t in zip(ours_mem, theirs_mem, strict=True):
        assert same_bits(o, t)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("patched", [False, True], ids=["direct", "patch_torch"])
def test_drop_ins_give_torchs_result_when_gradients_alias(kind, call, patched):
    ours, ours_mem = aliasing(kind, seed=7)
    theirs, theirs_mem = aliasing(kind, seed=7)
    before = [m.clone() for m in ours_mem]
    if patched:
        with gradfuse.patch_torch():
            out = CALLS[call](getattr(torch.nn.utils, call_name(call)), ours)
    else:
        out = CALLS[call](getattr(gradfuse, call_name(call)), ours)
    want = CALLS[call](TORCH[call_name(call)], theirs)
    assert_same_as_torch(out, want, ours_mem, theirs_mem)
    # Clipping was active: the gradients did change (the comparison above is not vacuous).
    assert not all(same_bits(m, b) for m, b in zip(ours_mem, before, strict=True))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("patched", [False, True], ids=["direct", "patch_torch"])
def test_get_total_norm_counts_every_alias(kind, patched):
    """Read-only: gradfuse computes it (fp32-accurate), each alias counted as torch counts it."""
    params, _ = aliasing(kind, seed=3)
    grads = [p.grad for p in params]
    if patched:
        with gradfuse.patch_torch():
            total = torch.nn.utils.get_total_norm(grads)
    else:
        total = gradfuse.get_total_norm(grads)
    assert close(total.item(), ref_norms(grads, 2.0)[0], 2e-6)
    assert close(total.item(), TORCH["get_total_norm"](grads).item(), 2e-6)


def test_clip_grad_norm_with_error_if_nonfinite_and_aliasing_raises_torchs_error():
    ours, ours_mem = aliasing("shared grad tensor", seed=1)
    theirs, _ = aliasing("shared grad tensor", seed=1)
    for ps in (ours, theirs):
        ps[0].grad[2] = float("inf")
    before = [m.clone() for m in ours_mem]
    with pytest.raises(RuntimeError) as want:
        TORCH["clip_grad_norm_"](theirs, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as got:
        gradfuse.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    assert str(got.value) == str(want.value)
    assert all(same_bits(m, b) for m, b in zip(ours_mem, before, strict=True))


@pytest.mark.parametrize("call", ["clip_grad_norm_", "clip_grad_value_"])
def test_expanded_gradient_gets_torchs_answer(call):
    """An expanded gradient aliases itself: torch refuses to write it, and so do the drop-ins,
    with torch's own error."""
    base = torch.randn(3)
    p = torch.nn.Parameter(torch.empty(2, 3))
    p.grad = base.expand(2, 3)
    q = torch.nn.Parameter(torch.empty(2, 3))
    q.grad = base.clone().expand(2, 3)
    with pytest.raises(RuntimeError) as want:
        CALLS[call](TORCH[call], [q])
    with pytest.raises(RuntimeError) as got:
        CALLS[call](getattr(gradfuse, call), [p])
    assert str(got.value) == str(want.value)


def test_fused_ops_still_refuse_aliasing_targets():
    g = torch.randn(5)
    before = g.clone()
    with pytest.raises(OverlapError, match=r"grads\[0\] and grads\[1\] overlap in memory"):
        torch.ops.gradfuse.clip_grad_norm_([g, g], 0.1, 2.0, False)
    with pytest.raises(InternalOverlapError, match=r"tensors\[0\] has internal overlap"):
        gradfuse.multi_tensor_scale_([torch.randn(3).expand(2, 3)], 0.5)
    assert same_bits(g, before)


@pytest.mark.parametrize("call", ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"])
def test_several_devices_modify_nothing_before_handing_to_torch(monkeypatch, call):
    """Grads on two devices, aliasing only on the second: no device may be modified before the
    call goes to torch (else the first device's gradients would be clipped twice). Two CPU
    devices ("cpu" and "cpu:0") stand in for two devices, so the per-device path runs here."""

    def two_devices(tensors, one_device, plain=False):
        half = len(tensors) // 2
        return {torch.device("cpu"): tensors[:half], torch.device("cpu", 0): tensors[half:]}

    monkeypatch.setattr(clip, "_fused_groups", two_devices)

    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        first = params_of([rand(4, gen=gen), rand(6, gen=gen)])
        shared = rand(5, gen=gen)
        second = params_of([shared, shared])
        return first + second, [p.grad for p in first] + [shared]

    ours, ours_mem = build(5)
    theirs, theirs_mem = build(5)
    out = CALLS[call](getattr(gradfuse, call), ours)
    want = CALLS[call](TORCH[call], theirs)
    assert_same_as_torch(out, want, ours_mem, theirs_mem)


# --- views that interleave but share no element (issue 10.1) ------------------------------


def disjoint_views(kind: str, seed: int):
    """``(views, base)``: gradients that interleave in memory without sharing an element."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "column slices":
        w = rand(6, 11, gen=gen)
        return [w[:, 0:4], w[:, 4:8], w[:, 8:11]], w
    if kind == "even and odd":
        buf = rand(40, gen=gen)
        return [buf[0::2], buf[1::2]], buf
    if kind == "column and rows":
        w = rand(5, 5, gen=gen)
        return [w[:, 0], w[0, 1:], w[1:, 1:]], w
    raise AssertionError(kind)


DISJOINT = ["column slices", "even and odd", "column and rows"]


def no_torch(monkeypatch):
    """Fails the test if a drop-in hands its call to torch."""

    def refuse(*args, **kwargs):
        raise AssertionError("the call was handed to torch: gradfuse saw an overlap that is not there")

    for name in clip._TORCH:
        monkeypatch.setitem(clip._TORCH, name, refuse)


@pytest.mark.parametrize("kind", DISJOINT)
@pytest.mark.parametrize("call", CALLS)
def test_drop_ins_run_fused_on_views_sharing_no_element(monkeypatch, kind, call):
    ours, _ = disjoint_views(kind, seed=2)
    theirs, _ = disjoint_views(kind, seed=2)
    want = CALLS[call](TORCH[call_name(call)], params_of(theirs))
    no_torch(monkeypatch)
    out = CALLS[call](getattr(gradfuse, call_name(call)), params_of(ours))
    if want is not None:
        assert close(out.item(), want.item(), 2e-6)
        # Same coefficient from our total as torch takes from its own: compare to that.
        if call_name(call) == "clip_grad_norm_":
            theirs, _ = disjoint_views(kind, seed=2)
            TORCH["clip_grads_with_norm_"](params_of(theirs), 0.1, out)
    for o, t in zip(ours, theirs, strict=True):
        assert same_bits(o, t)


FUSED = {
    "multi_tensor_scale_": lambda ts: gradfuse.multi_tensor_scale_(ts, torch.tensor(0.5)),
    "unscale_and_check_": lambda ts: gradfuse.unscale_and_check_(ts, torch.full((1,), 0.25), torch.zeros(1)),
    "unscale_and_clip_": lambda ts: gradfuse.unscale_and_clip_(ts, torch.full((1,), 0.25), torch.zeros(1), 0.1),
    "clip_grad_norm_": lambda ts: torch.ops.gradfuse.clip_grad_norm_(ts, 0.1, 2.0, False),
    "clip_grads_with_norm_": lambda ts: torch.ops.gradfuse.clip_grads_with_norm_(ts, 0.1, torch.tensor(9.0)),
    "clamp_": lambda ts: torch.ops.gradfuse.clamp_(ts, -0.2, 0.2),
    "accumulate_": lambda ts: gradfuse.accumulate_(ts, [torch.full_like(t, 0.375) for t in ts]),
}


@pytest.mark.parametrize("kind", DISJOINT)
@pytest.mark.parametrize("op", FUSED)
def test_fused_ops_accept_views_sharing_no_element(kind, op):
    """Each view ends up exactly as the same op leaves a contiguous copy of it."""
    views, _ = disjoint_views(kind, seed=4)
    copies = [v.clone() for v in views]
    FUSED[op](views)
    FUSED[op](copies)
    for v, c in zip(views, copies, strict=True):
        assert same_bits(v, c)


@pytest.mark.parametrize("op", FUSED)
def test_views_that_do_share_an_element_are_still_refused(op):
    w = torch.randn(6, 11)
    before = w.clone()
    with pytest.raises(OverlapError, match=r"\[1\] and .*\[2\] overlap in memory"):
        FUSED[op]([w[:, 0:4], w[:, 4:8], w[:, 7:10]])
    assert same_bits(w, before)


def test_error_if_nonfinite_with_column_slices_raises_torchs_error():
    ours, w = disjoint_views("column slices", seed=6)
    theirs, w2 = disjoint_views("column slices", seed=6)
    w[3, 5] = w2[3, 5] = float("nan")
    before = w.clone()
    with pytest.raises(RuntimeError) as want:
        TORCH["clip_grad_norm_"](params_of(theirs), 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as got:
        gradfuse.clip_grad_norm_(params_of(ours), 1.0, error_if_nonfinite=True)
    assert type(got.value) is RuntimeError and str(got.value) == str(want.value)
    assert same_bits(w, before)


def test_accumulate_refuses_a_source_overlapping_a_copied_target():
    """Non-dense targets are accumulated in copies; the overlap check compares what the copies
    stand for, so a source that overlaps the target memory is still refused."""
    w = torch.randn(4, 8)
    before = w.clone()
    with pytest.raises(OverlapError, match=r"dst\[0\] and src\[0\] overlap in memory"):
        gradfuse.accumulate_([w[:, 0:4]], [w[:, 2:6]])
    with pytest.raises(OverlapError, match=r"dst\[1\] and src\[0\] overlap in memory"):
        gradfuse.accumulate_([torch.zeros(4), w[:, 1]], [w[:, 1], torch.ones(4)])
    assert same_bits(w, before)
    # A non-dense target that is its own source is fine: dst += alpha * dst.
    col = w[:, 3]
    want = col * 3
    gradfuse.accumulate_([col], [col], 2.0)
    assert same_bits(col, want)


def test_triton_backend_hands_aliasing_to_torch_and_runs_disjoint_views(monkeypatch):
    """The Triton backend's overlap check (its chunk table) raises the same OverlapError: the
    drop-ins give torch's result there too, and disjoint views still run fused."""
    monkeypatch.setenv("GRADFUSE_BACKEND", "triton")
    ours, ours_mem = aliasing("repeated parameter", seed=8)
    theirs, theirs_mem = aliasing("repeated parameter", seed=8)
    out, want = gradfuse.clip_grad_norm_(ours, 0.1), TORCH["clip_grad_norm_"](theirs, 0.1)
    assert_same_as_torch(out, want, ours_mem, theirs_mem)
    views, _ = disjoint_views("even and odd", seed=8)
    copies = [v.clone() for v in views]
    no_torch(monkeypatch)
    gradfuse.clip_grad_value_(params_of(views), 0.2)
    gradfuse.clip_grad_value_(params_of(copies), 0.2)
    assert all(same_bits(v, c) for v, c in zip(views, copies, strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("call", ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"])
def test_cpu_and_cuda_grads_aliasing_on_one_device_get_torchs_result(call):
    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        cpu = params_of([rand(4, gen=gen), rand(6, gen=gen)])
        shared = rand(5, gen=gen).cuda()
        cuda = params_of([shared, shared])
        return cpu + cuda, [p.grad for p in cpu] + [shared]

    ours, ours_mem = build(9)
    theirs, theirs_mem = build(9)
    out = CALLS[call](getattr(gradfuse, call), ours)
    want = CALLS[call](TORCH[call], theirs)
    assert_same_as_torch(out, want, [m.cpu() for m in ours_mem], [m.cpu() for m in theirs_mem])
