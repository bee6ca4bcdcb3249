"""Bad input gets a clear exception naming the argument, the index and the problem, and
nothing is modified. Runs on both backends where they differ (Rust, and Triton under the
interpreter for the checks that happen before any kernel)."""

from __future__ import annotations

import math

import pytest
import torch

import gradfuse
from reference import same_bits


@pytest.fixture(autouse=True)
def rust_backend(monkeypatch):
    monkeypatch.setenv("GRADFUSE_BACKEND", "rust")


def snapshot(tensors):
    return [t.clone() for t in tensors]


def unchanged(tensors, before):
    return all(same_bits(t, b) for t, b in zip(tensors, before, strict=True))


INPLACE_OPS = {
    "multi_tensor_scale_": lambda ts: gradfuse.multi_tensor_scale_(ts, torch.tensor(0.5)),
    "unscale_and_check_": lambda ts: gradfuse.unscale_and_check_(ts, torch.full((1,), 0.5), torch.zeros(1)),
    "unscale_and_clip_": lambda ts: gradfuse.unscale_and_clip_(ts, torch.full((1,), 0.5), torch.zeros(1), 0.1),
    "clip_grad_norm_": lambda ts: torch.ops.gradfuse.clip_grad_norm_(ts, 0.1, 2.0, False),
    "clip_grads_with_norm_": lambda ts: torch.ops.gradfuse.clip_grads_with_norm_(ts, 0.1, torch.tensor(9.0)),
    "clamp_": lambda ts: torch.ops.gradfuse.clamp_(ts, -0.1, 0.1),
    "accumulate_": lambda ts: gradfuse.accumulate_(ts, [torch.ones_like(t) for t in ts]),
}
READ_OPS = {
    "multi_tensor_norm": lambda ts: gradfuse.multi_tensor_norm(ts),
    "unscale_check_norm": lambda ts: gradfuse.unscale_check_norm(ts, torch.full((1,), 0.5)),
}
ALL_OPS = {**INPLACE_OPS, **READ_OPS}


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("bad_dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64])
def test_non_float_dtypes_are_refused_by_index(op, bad_dtype):
    ts = [torch.randn(4), torch.randn(3), torch.ones(5, dtype=bad_dtype)]
    before = snapshot(ts)
    with pytest.raises(TypeError, match=rf"\[2\] has dtype {bad_dtype}"):
        ALL_OPS[op](ts)
    assert unchanged(ts, before)


@pytest.mark.parametrize("op", ALL_OPS)
def test_mixed_devices_are_refused_by_index(op):
    ts = [torch.randn(4), torch.randn(3), torch.randn(2, device="meta")]
    if op == "accumulate_":
        with pytest.raises(ValueError, match=r"\[2\] is on meta but .*\[0\] is on cpu"):
            gradfuse.accumulate_(ts, [torch.ones(4), torch.ones(3), torch.ones(2)])
        return
    with pytest.raises(ValueError, match=r"\[2\] is on meta but .*\[0\] is on cpu"):
        ALL_OPS[op](ts)


@pytest.mark.parametrize("op", INPLACE_OPS)
def test_internal_overlap_is_refused(op):
    base = torch.randn(3)
    ts = [torch.randn(4), base.expand(2, 3)]
    before = snapshot([ts[0], base])
    with pytest.raises(RuntimeError, match=r"\[1\] has internal overlap"):
        INPLACE_OPS[op](ts)
    assert unchanged([ts[0], base], before)


@pytest.mark.parametrize("op", INPLACE_OPS)
def test_overlapping_targets_are_refused(op):
    storage = torch.randn(10)
    overlapping = [torch.randn(2), storage[0:6], storage[4:10]]
    before = storage.clone()
    with pytest.raises(ValueError, match=r"\[1\] and .*\[2\] overlap in memory"):
        INPLACE_OPS[op](overlapping)
    assert same_bits(storage, before)
    twice = torch.randn(5)
    before = twice.clone()
    with pytest.raises(ValueError, match=r"\[0\] and .*\[1\] overlap in memory"):
        INPLACE_OPS[op]([twice, twice])
    assert same_bits(twice, before)


@pytest.mark.parametrize("op", INPLACE_OPS)
@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non-leaf"])
def test_targets_that_require_grad_under_grad_mode_are_refused(op, leaf):
    """gradfuse's ops have no derivative: an in-place update of a tensor that requires grad while
    grad mode is on would go unseen by autograd (torch raises for a leaf, and records the update
    of any other tensor), so gradients through it would be silently wrong. Refused, naming the
    tensor, nothing written; under ``torch.no_grad()`` (where updates of gradients and weights
    run) the same call runs."""
    base = torch.randn(5, requires_grad=True)
    ts = [torch.randn(4), torch.randn(5, requires_grad=True) if leaf else base * 2]
    before = snapshot(ts)
    with pytest.raises(RuntimeError, match=r"(tensors|grads|dst)\[1\] is a ") as err:
        INPLACE_OPS[op](ts)
    assert "requires grad" in str(err.value) and ("leaf" in str(err.value)) == leaf
    assert unchanged(ts, before)
    with torch.no_grad():
        INPLACE_OPS[op](ts)
    assert not unchanged(ts, before)


def test_an_accumulated_source_that_requires_grad_under_grad_mode_is_refused():
    """``dst += src`` with ``src`` requiring grad: torch would make ``dst`` depend on it;
    gradfuse cannot, so it refuses rather than leave ``dst`` silently detached."""
    dst, src = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.ones(2, requires_grad=True)]
    with pytest.raises(RuntimeError, match=r"src\[1\] is a leaf tensor that requires grad"):
        gradfuse.accumulate_(dst, src)
    assert all(not d.any() for d in dst)
    with torch.no_grad():
        gradfuse.accumulate_(dst, src)
    assert all(d.eq(1).all() for d in dst)


def test_adjacent_views_are_fine():
    storage = torch.ones(10)
    gradfuse.multi_tensor_scale_([storage[0:5], storage[5:10]], torch.tensor(2.0))
    assert torch.equal(storage, torch.full((10,), 2.0))


def test_overlapping_non_dense_targets_are_refused():
    grid = torch.randn(6, 6)
    a, b = grid[0:4, 0:3], grid[2:6, 1:4]  # neither dense; they share grid[2:4, 1:3]
    before = grid.clone()
    with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] overlap in memory"):
        gradfuse.multi_tensor_scale_([a, b], torch.tensor(0.5))
    assert same_bits(grid, before)


def test_accumulate_source_overlapping_another_target_is_refused():
    storage = torch.randn(8)
    dst = [storage[0:4], torch.randn(4)]
    src = [torch.randn(4), storage[2:6]]
    before = storage.clone()
    with pytest.raises(ValueError, match=r"dst\[0\] and src\[1\] overlap in memory"):
        gradfuse.accumulate_(dst, src)
    assert same_bits(storage, before)


def test_accumulate_overlap_names_its_own_arguments_over_lists_other_ops_planned(backend):
    """The lists were planned (and their plans kept) by other ops first, under their argument
    names (``grads``, ``tensors``); accumulate_'s error still names its own: dst and src."""
    storage = torch.randn(8)
    dst = [storage[0:4], storage[4:8]]
    src = [storage[4:8], storage[0:4]]
    torch.ops.gradfuse.clip_grad_norm_(dst, 1e6, 2.0, False)
    gradfuse.multi_tensor_norm(src)
    before = storage.clone()
    with pytest.raises(ValueError, match=r"accumulate_: dst\[0\] and src\[1\] overlap in memory"):
        gradfuse.accumulate_(dst, src)
    one_call = [storage[4:8].view(2, 2).t(), storage[0:4].view(2, 2)]  # src planned for this call alone
    with pytest.raises(ValueError, match=r"accumulate_: dst\[0\] and src\[1\] overlap in memory"):
        gradfuse.accumulate_([d.view(2, 2) for d in dst], one_call)
    assert same_bits(storage, before)


def test_accumulate_length_and_shape_mismatches_name_the_index():
    dst = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(ValueError, match="dst has 2 tensors but src has 1"):
        gradfuse.accumulate_(dst, [torch.ones(3)])
    with pytest.raises(ValueError, match=r"dst\[1\] has shape \(4,\) but src\[1\] has shape \(2, 2\)"):
        gradfuse.accumulate_(dst, [torch.ones(3), torch.ones(2, 2)])
    with pytest.raises(ValueError, match="dst has 2 tensors but src has 1"):
        torch.ops.gradfuse.accumulate_(dst, [torch.ones(3)], 1.0)
    assert all(torch.equal(d, torch.zeros_like(d)) for d in dst)


@pytest.mark.parametrize("value", [-0.5, math.nan])
def test_bad_max_norm_in_every_clipping_op(value):
    ts = [torch.randn(4)]
    before = snapshot(ts)
    for call in (
        lambda: torch.ops.gradfuse.clip_grad_norm_(ts, value, 2.0, False),
        lambda: torch.ops.gradfuse.clip_grads_with_norm_(ts, value, torch.tensor(1.0)),
        lambda: gradfuse.unscale_and_clip_(ts, torch.full((1,), 0.5), torch.zeros(1), value),
    ):
        with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
            call()
    assert unchanged(ts, before)


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the fake implementation
@pytest.mark.parametrize(("lo", "hi"), [(math.nan, 1.0), (-1.0, math.nan)])
def test_nan_clamp_bounds_are_refused(device, lo, hi):
    """torch's clamp to a NaN bound makes every element NaN: gradfuse's clamp raises instead (as
    ``clip_grad_value_`` does for a NaN ``clip_value``), modifying nothing."""
    ts = [torch.randn(4, device=device)]
    before = snapshot(ts) if device == "cpu" else None
    with pytest.raises(ValueError, match="min and max must not be NaN"):
        torch.ops.gradfuse.clamp_(ts, lo, hi)
    assert before is None or unchanged(ts, before)


def test_nan_norm_type_is_refused():
    with pytest.raises(ValueError, match="norm_type must be a real number"):
        gradfuse.multi_tensor_norm([torch.ones(2)], math.nan)
    with pytest.raises(ValueError, match="norm_type must be a real number"):
        gradfuse.clip_grad_norm_(torch.nn.Parameter(torch.ones(2)), 1.0, math.nan)


def test_amp_scalars_are_checked():
    ts = [torch.randn(4)]
    before = snapshot(ts)
    with pytest.raises(TypeError, match="found_inf must be a float32 tensor"):
        gradfuse.unscale_and_check_(ts, torch.full((1,), 0.5), torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="inv_scale must have exactly one element"):
        gradfuse.unscale_and_check_(ts, torch.full((2,), 0.5), torch.zeros(1))
    with pytest.raises(ValueError, match="found_inf is on meta but the tensors are on cpu"):
        gradfuse.unscale_and_check_(ts, torch.full((1,), 0.5), torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match="scale must have exactly one element"):
        gradfuse.multi_tensor_scale_(ts, torch.ones(3))
    assert unchanged(ts, before)


def test_sparse_tensors_are_refused_by_the_fused_ops():
    sparse = torch.randn(4, 4).to_sparse()
    with pytest.raises(gradfuse._plan.UnsupportedTensorError, match=r"tensors\[0\] has layout torch.sparse_coo"):
        gradfuse.multi_tensor_norm([sparse])
    with pytest.raises(TypeError, match=r"tensors\[1\] has layout torch.sparse_coo"):
        gradfuse.multi_tensor_scale_([torch.randn(2), sparse], 0.5)


def test_triton_backend_checks_before_any_kernel(monkeypatch):
    """Validation is shared: the Triton path refuses the same input with the same message."""
    monkeypatch.setenv("GRADFUSE_BACKEND", "triton")
    ts = [torch.randn(4), torch.ones(2, dtype=torch.int32)]
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.int32"):
        gradfuse.multi_tensor_norm(ts)
    monkeypatch.setenv("GRADFUSE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="GRADFUSE_BACKEND must be auto, rust or triton"):
        gradfuse.multi_tensor_norm([torch.randn(2)])


@pytest.mark.parametrize(
    "call",
    [
        lambda ts, found: gradfuse.unscale_and_clip_(ts, torch.full((1,), 0.5), found, 0.1),
        lambda ts, found: gradfuse.unscale_and_check_(ts, torch.full((1,), 0.5), found),
    ],
)
def test_overlap_is_found_before_found_inf_is_written(call):
    """The read pass of unscale_and_clip_ would set found_inf: overlap must be caught first."""
    storage = torch.randn(10)
    storage[5] = math.inf
    found = torch.zeros(1)
    with pytest.raises(ValueError, match="overlap in memory"):
        call([storage[0:6], storage[4:10]], found)
    assert found.item() == 0.0


def test_raw_ops_on_empty_lists():
    """An empty list reaches the kernels when another tensor argument gives the dispatcher a
    device: nothing to do, and the outputs are zeros on that device."""
    inv, found = torch.full((1,), 0.5), torch.zeros(1)
    torch.ops.gradfuse.multi_tensor_scale_([], torch.tensor(0.5))
    torch.ops.gradfuse.clip_grads_with_norm_([], 1.0, torch.tensor(3.0))
    torch.ops.gradfuse.unscale_and_check_([], inv, found)
    norm, found_out = torch.ops.gradfuse.unscale_check_norm([], inv, 2.0)
    assert norm.item() == 0.0 and found_out.item() == 0.0
    assert torch.ops.gradfuse.unscale_and_clip_([], inv, found, 1.0, 2.0).item() == 0.0
    assert found.item() == 0.0
    assert gradfuse.unscale_check_norm([], inv)[0].item() == 0.0


# --- every op's errors carry its own name ---------------------------------------------------


def _bad_calls(device: str):
    """Per registered op, calls that each fail in the op itself: an integer tensor in the first
    list, and (where the op takes one) a NaN norm order."""
    bad = [torch.ones(3, device=device), torch.ones(4, dtype=torch.int32, device=device)]
    inv, found = torch.full((), 0.5, device=device), torch.zeros((), device=device)
    ops = torch.ops.gradfuse
    nan = math.nan
    return {
        "multi_tensor_norm": [
            lambda: ops.multi_tensor_norm(bad, 2.0, False),
            lambda: ops.multi_tensor_norm(bad[:1], nan, False),
        ],
        "multi_tensor_scale_": [lambda: ops.multi_tensor_scale_(bad, inv)],
        "clip_grads_with_norm_": [lambda: ops.clip_grads_with_norm_(bad, 1.0, inv)],
        "clip_grad_norm_": [
            lambda: ops.clip_grad_norm_(bad, 1.0, 2.0, False),
            lambda: ops.clip_grad_norm_(bad[:1], 1.0, nan, False),
        ],
        "unscale_and_check_": [lambda: ops.unscale_and_check_(bad, inv, found)],
        "unscale_check_norm": [
            lambda: ops.unscale_check_norm(bad, inv, 2.0),
            lambda: ops.unscale_check_norm(bad[:1], inv, nan),
        ],
        "unscale_and_clip_": [
            lambda: ops.unscale_and_clip_(bad, inv, found, 1.0, 2.0),
            lambda: ops.unscale_and_clip_(bad[:1], inv, found, 1.0, nan),
        ],
        "unscale_norm_": [
            lambda: ops.unscale_norm_(bad, inv, found, 2.0),
            lambda: ops.unscale_norm_(bad[:1], inv, found, nan),
        ],
        "accumulate_": [lambda: ops.accumulate_(bad, [torch.ones_like(t) for t in bad], 1.0)],
        "clamp_": [lambda: ops.clamp_(bad, -1.0, 1.0)],
        "multi_tensor_stats": [lambda: ops.multi_tensor_stats(bad, 2.0), lambda: ops.multi_tensor_stats(bad[:1], nan)],
        "unit_norms": [lambda: ops.unit_norms(bad, [1, 1], 2.0), lambda: ops.unit_norms(bad[:1], [1], nan)],
        "scale_units_": [lambda: ops.scale_units_(bad, [1, 1], torch.ones(2, device=device))],
    }


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the fake implementations
def test_every_op_names_itself_in_its_errors(device):
    """An error raised by op ``gradfuse::X`` starts with ``gradfuse.X:`` (two ops once shared the
    name variable of another, so that unscale_norm_'s errors named unit_norms)."""
    from kernel_compile import registered_ops

    calls = _bad_calls(device)
    assert set(calls) == registered_ops()
    for op, fns in calls.items():
        for fn in fns:
            with pytest.raises((TypeError, ValueError)) as e:
                fn()
            assert str(e.value).startswith(f"gradfuse.{op}: "), (op, str(e.value))
