"""The Triton backend (``gradfuse.kernels``) on CPU tensors under the Triton interpreter.

Every op goes through the public API with ``GRADFUSE_BACKEND=triton`` and is compared with a
float64 reference computed by torch on ``.double()`` copies and with the Rust backend
(``GRADFUSE_BACKEND=rust``) on identical inputs. The chunk size is shrunk to 64 elements (16 per
loop step, 4 partials per finalize step), so inputs of a few hundred elements cross chunk edges,
span several chunks per tensor and need several finalize steps; sizes sit at those edges +-1.

Tolerances, and why:
- Norms: terms formed in float32 (float64 for float64 tensors) and summed lane-wise in that type,
  partials combined in float64. Against the float64 reference: 2e-6 relative (a few float32 ulp)
  when any input is below float64, 1e-12 when all are float64. Against the Rust core (which
  sums in another order) twice that. max/min/count norms are exact: compared for equality.
- Element-wise results (scale, clipping, unscale, clamp, accumulate) are compared bit for bit:
  both backends do the same float32 (float64) arithmetic and round once to the storage dtype
  (float64 into float16/bfloat16 through float32, as torch casts).
  Where a clip coefficient comes from a total norm, the expected values are computed from the
  Triton total with the Rust core's ``clip_coef``, so an ulp of difference between the two
  totals does not hide a wrong coefficient.

Under a real GPU (no interpreter) these tests are skipped: ``tests/test_cuda.py`` covers it.
"""

from __future__ import annotations

import copy
import math
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradfuse
from gradfuse import _plan, _rust, _triton
from gradfuse._plan import DTYPE_CODES, make_plan
from gradfuse.kernels import _chunk_table as ct
from gradfuse.kernels import _launch, _scale, _unscale
from reference import (
    ACCUMULATE_PAIRS,
    FLOAT_DTYPES,
    NORM_TYPES,
    clones,
    close,
    double_rounding_case,
    math_dtype,
    params_of,
    ref_norms,
    rtol,
    same_bits,
    scaled,
)

pytestmark = pytest.mark.skipif(
    not ct.INTERPRET, reason="CPU tensors reach the Triton kernels only under TRITON_INTERPRET=1 (see test_cuda.py)"
)

CHUNK, BLOCK, FBLOCK = 64, 16, 4
#: Sizes at the edges of a chunk, of the 16-element body/tail split and of several chunks.
EDGE_SIZES = (1, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 17)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(ct, "CHUNK", CHUNK)
    monkeypatch.setattr(ct, "BLOCK", BLOCK)
    monkeypatch.setattr(ct, "FBLOCK", FBLOCK)
    monkeypatch.setenv("GRADFUSE_BACKEND", "triton")


def table_of(tensors):
    """The chunk table of ``tensors``'s (read-only) plan: the one a norm of them runs from."""
    return _triton._table(make_plan("t", "tensors", tensors, inplace=False))


def on(monkeypatch, backend: str, fn, *args, **kwargs):
    """``fn(*args)`` with ``GRADFUSE_BACKEND=backend``; back to triton afterwards."""
    monkeypatch.setenv("GRADFUSE_BACKEND", backend)
    try:
        return fn(*args, **kwargs)
    finally:
        monkeypatch.setenv("GRADFUSE_BACKEND", "triton")


def rand(n, dtype, scale=1.0, gen=None):
    shape = n if isinstance(n, tuple) else (n,)
    return (torch.randn(shape, dtype=torch.float64, generator=gen) * scale).to(dtype)


def mixed_list(sizes=EDGE_SIZES, dtypes=FLOAT_DTYPES, empty=True, zero_d=True):
    """Tensors of every size in ``sizes`` for every dtype (fp16 scaled to use its range), plus
    an empty and a 0-d tensor."""
    out = [rand(n, d, 100.0 if d == torch.float16 else 1.0) for d in dtypes for n in sizes]
    if empty:
        out.append(torch.empty(0, dtype=dtypes[0]))
    if zero_d:
        out.append(rand((), dtypes[-1]))
    return out


def f32_nan(bits: int) -> torch.Tensor:
    return torch.tensor([struct.unpack("<f", struct.pack("<I", bits))[0]], dtype=torch.float32).view(-1).clone()


#: Index of the signaling NaN in each tensor of signaling_nans().
SNAN_AT = (2, 2, 1)


def signaling_nans():
    """Tensors holding NaNs whose bits change if anything multiplies them (a signaling NaN
    becomes quiet), next to ordinary values: a write of ``x * 1`` would show."""
    f32 = torch.tensor([1.5, -2.0, 0.0, 0.0]).view(torch.int32)
    f32[2] = 0x7F800001  # signaling NaN
    f32[3] = -0x003FFFFE  # 0xFFC00002: negative quiet NaN with a payload
    bf16 = torch.tensor([0.25, 3.0, 0.0], dtype=torch.bfloat16).view(torch.int16)
    bf16[2] = 0x7F81  # signaling NaN
    f64 = torch.tensor([7.0, 0.0]).double().view(torch.int64)
    f64[1] = 0x7FF0000000000001
    return [f32.view(torch.float32), bf16.view(torch.bfloat16), f64.view(torch.float64)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]).clone()


# --- norms --------------------------------------------------------------------------------


@pytest.mark.parametrize("p", NORM_TYPES, ids=str)
def test_norm_matches_reference_and_rust(monkeypatch, p):
    """Every order over all four dtypes at chunk edges in one list (one launch per dtype, the
    last program of the last launch finalizes), total and per-tensor."""
    tensors = mixed_list(empty=p >= 0 and not math.isinf(p))
    total, per = gradfuse.multi_tensor_norm(tensors, p, per_tensor=True)
    rtotal, rper = on(monkeypatch, "rust", gradfuse.multi_tensor_norm, tensors, p, per_tensor=True)
    want_total, want_per = ref_norms(tensors, p)
    assert total.dtype == torch.float64 and per.shape == (len(tensors),)
    tol = rtol(tensors)
    assert close(total.item(), want_total, tol), (total.item(), want_total)
    for got, want in zip(per.tolist(), want_per, strict=True):
        # fp32 per-tensor values: each is a float32-accurate norm whatever the output dtype.
        assert close(got, want, tol), (got, want)
    if p in (0.0, math.inf, -math.inf):
        assert torch.equal(total, rtotal) and torch.equal(per, rper)
    else:
        assert close(total.item(), rtotal.item(), 2 * tol)
        assert all(close(a, b, 2 * tol) for a, b in zip(per.tolist(), rper.tolist(), strict=True))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("p", [2.0, math.inf], ids=str)
def test_norm_single_dtype_at_chunk_edges(monkeypatch, dtype, p):
    tensors = [rand(n, dtype, 100.0 if dtype == torch.float16 else 1.0) for n in EDGE_SIZES]
    total = gradfuse.multi_tensor_norm(tensors, p)
    want, _ = ref_norms(tensors, p)
    assert total.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert close(total.item(), want, rtol(tensors) if p == 2.0 else 0.0)
    rust = on(monkeypatch, "rust", gradfuse.multi_tensor_norm, tensors, p)
    assert close(total.item(), rust.item(), 2 * rtol(tensors) if p == 2.0 else 0.0)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf, -math.inf, 0.0, -1.0], ids=str)
def test_norm_nan_and_inf(monkeypatch, p):
    """NaN propagates through every order but 0 (where it counts as non-zero), inf through the
    positive ones; same answer as the Rust core."""
    a = rand(CHUNK + 5, torch.float32)
    b = rand(40, torch.bfloat16)
    a[CHUNK + 2] = math.nan
    b[7] = math.inf
    for tensors in ([a, b], [b], [a]):
        got = gradfuse.multi_tensor_norm(tensors, p).item()
        want = on(monkeypatch, "rust", gradfuse.multi_tensor_norm, tensors, p).item()
        assert (math.isnan(got) and math.isnan(want)) or close(got, want, 4e-6), (tensors, got, want)
    got = gradfuse.multi_tensor_norm([a], p).item()
    assert math.isfinite(got) if p == 0.0 else math.isnan(got)


def test_norm_outputs_shapes_and_dtypes():
    """As the CPU backend: float32 unless a tensor is float64; per-tensor norms shape (n,), or
    (0,) when not asked for."""
    low = [rand(9, torch.bfloat16), rand(CHUNK + 1, torch.float16), rand((), torch.float32)]
    for tensors, dtype in ((low, torch.float32), ([*low, rand(3, torch.float64)], torch.float64)):
        for per_tensor in (False, True):
            total, per = torch.ops.gradfuse.multi_tensor_norm(tensors, 2.0, per_tensor)
            assert total.shape == () and total.dtype == dtype and per.dtype == dtype
            assert per.shape == ((len(tensors),) if per_tensor else (0,))


def test_fp16_squares_do_not_overflow():
    h = torch.full((CHUNK + 3,), 60000.0, dtype=torch.float16)
    assert gradfuse.multi_tensor_norm([h], 2.0).item() == pytest.approx(60000.0 * math.sqrt(CHUNK + 3), rel=1e-6)


def test_norm_is_bitwise_deterministic():
    tensors = mixed_list(sizes=(CHUNK * 3 + 5, 33), empty=False)
    runs = [gradfuse.multi_tensor_norm(tensors, 2.0, per_tensor=True) for _ in range(2)]
    runs.append(gradfuse.multi_tensor_norm(clones(tensors), 2.0, per_tensor=True))  # another table
    for total, per in runs[1:]:
        assert same_bits(total, runs[0][0]) and same_bits(per, runs[0][1])


def test_norm_counters_are_reset_by_the_kernels():
    tensors = mixed_list(sizes=(CHUNK * 2 + 1, 9), empty=True)
    for p, per in ((2.0, True), (0.0, False), (1.0, False)):
        gradfuse.multi_tensor_norm(tensors, p, per_tensor=per)
        table = table_of(tensors)
        assert not table.scratch()[2].any()
    _, found = gradfuse.unscale_check_norm(tensors, torch.tensor(0.5))
    assert found.item() == 0.0 and not table.scratch()[2].any()


@settings(max_examples=12)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([(), (0,), (1,), (15,), (17,), (CHUNK,), (CHUNK + 1,), (3, 7), (2, 3, 11)]),
            st.sampled_from(FLOAT_DTYPES),
        ),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(NORM_TYPES),
    st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([0.0, math.inf, -math.inf, math.nan])), max_size=2),
    st.integers(0, 2**31 - 1),
)
def test_norm_property(spec, p, specials, seed):
    """Random shapes, dtypes, orders and inf/NaN positions: Triton and Rust agree."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [rand(shape, d, 100.0 if d == torch.float16 else 1.0, gen) for shape, d in spec]
    if (p < 0 or math.isinf(p)) and any(t.numel() == 0 for t in tensors):
        return
    for pos, value in specials:
        t = tensors[pos % len(tensors)]
        if t.numel():
            t.view(-1)[pos % t.numel()] = value
    got = gradfuse.multi_tensor_norm(tensors, p, per_tensor=True)
    os.environ["GRADFUSE_BACKEND"] = "rust"
    try:
        want = gradfuse.multi_tensor_norm(tensors, p, per_tensor=True)
    finally:
        os.environ["GRADFUSE_BACKEND"] = "triton"
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        g, w = g.item(), w.item()
        assert (math.isnan(g) and math.isnan(w)) or close(g, w, 2 * rtol(tensors)), (g, w)


# --- scaling and clipping ----------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.37, 2.0**-3, 1e30, -1.0], ids=str)
@pytest.mark.parametrize("scale_dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_scale_is_bit_exact(monkeypatch, factor, scale_dtype):
    tensors = mixed_list(sizes=(1, 17, CHUNK + 1))
    scale = torch.tensor(factor, dtype=scale_dtype)
    ours, rust = clones(tensors), clones(tensors)
    gradfuse.multi_tensor_scale_(ours, scale)
    on(monkeypatch, "rust", gradfuse.multi_tensor_scale_, rust, scale)
    for o, r, t in zip(ours, rust, tensors, strict=True):
        assert same_bits(o, r)
        assert same_bits(o, scaled(t, scale.item()))


def test_scale_by_one_touches_no_memory():
    tensors = signaling_nans()
    before = [bits(t) for t in tensors]
    gradfuse.multi_tensor_scale_(tensors, torch.tensor(1.0))
    assert all(torch.equal(bits(t), b) for t, b in zip(tensors, before, strict=True))
    # Control: a real write does change the signaling NaNs' bits (a multiply quiets them), so the
    # check above would see a write even where x * 1 == x.
    gradfuse.multi_tensor_scale_(tensors, torch.tensor(0.5))
    assert all(bits(t)[i] != b[i] for t, b, i in zip(tensors, before, SNAN_AT, strict=True))


@pytest.mark.parametrize("total_dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("total", [7.3, 1.3, 0.999999, 0.25, 0.0, math.inf, math.nan], ids=str)
def test_clip_grads_with_norm_coefficient_on_device(monkeypatch, total_dtype, total):
    """The coefficient is computed in-kernel with torch's arithmetic in the total's dtype: the
    result is bit-identical to the Rust core for every total dtype, including clamping at 1
    and NaN/inf totals."""
    grads = mixed_list(sizes=(5, CHUNK + 1))
    total_t = torch.tensor(total, dtype=total_dtype)
    ours, rust = clones(grads), clones(grads)
    gradfuse.clip_grads_with_norm_(params_of(ours), 0.3, total_t)
    on(monkeypatch, "rust", gradfuse.clip_grads_with_norm_, params_of(rust), 0.3, total_t)
    coef = _rust.clip_coef(total_t.item(), 0.3, DTYPE_CODES[total_dtype])
    for o, r, g in zip(ours, rust, grads, strict=True):
        assert same_bits(o, r)
        assert same_bits(o, scaled(g, coef))


def test_clip_grads_with_norm_below_max_touches_no_memory():
    tensors = signaling_nans()
    before = [bits(t) for t in tensors]
    gradfuse.clip_grads_with_norm_(params_of(tensors), 1.0, torch.tensor(0.5))
    assert all(torch.equal(bits(t), b) for t, b in zip(tensors, before, strict=True))


@pytest.mark.parametrize("p", [2.0, 1.0, 0.0, 3.5, -1.0, math.inf, -math.inf], ids=str)
@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["active", "inactive"])
def test_clip_grad_norm_matches_reference_rust_and_torch(monkeypatch, p, max_norm):
    grads = mixed_list(empty=p >= 0 and not math.isinf(p))
    ours, rust, theirs = clones(grads), clones(grads), [g.double().clone() for g in grads]
    total = gradfuse.clip_grad_norm_(params_of(ours), max_norm, p)
    rtotal = on(monkeypatch, "rust", gradfuse.clip_grad_norm_, params_of(rust), max_norm, p)
    ttotal = torch.nn.utils.clip_grad_norm_(params_of(theirs), max_norm, p)
    tol = rtol(grads)
    assert close(total.item(), ttotal.item(), tol) and close(total.item(), rtotal.item(), 2 * tol)
    coef = _rust.clip_coef(total.item(), max_norm, DTYPE_CODES[total.dtype])
    for o, g in zip(ours, grads, strict=True):
        assert same_bits(o, scaled(g, coef))
    for o, r in zip(ours, rust, strict=True):
        # The two totals may differ by a few float32 ulp, so may the coefficients: results
        # within one ulp of the storage dtype (plus that) of each other.
        eps = torch.finfo(o.dtype).eps
        assert torch.allclose(o.double(), r.double(), rtol=2 * eps + 4 * tol, atol=torch.finfo(o.dtype).tiny)
    if coef == 1.0:
        assert all(same_bits(o, g) for o, g in zip(ours, grads, strict=True))


def test_clip_grad_norm_error_if_nonfinite_modifies_nothing(monkeypatch):
    grads = mixed_list(sizes=(CHUNK + 1,))
    grads[1][3] = math.inf
    ours = clones(grads)
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        gradfuse.clip_grad_norm_(params_of(ours), 1.0, 2.0, error_if_nonfinite=True)
    assert all(same_bits(o, g) for o, g in zip(ours, grads, strict=True))
    # And with finite gradients the same call clips.
    ok = clones(grads)
    ok[1][3] = 0.0
    before = clones(ok)
    gradfuse.clip_grad_norm_(params_of(ok), 1e-3, 2.0, error_if_nonfinite=True)
    assert not same_bits(ok[0], before[0])


def test_clip_grad_value(monkeypatch):
    grads = mixed_list(sizes=(17, CHUNK + 1))
    grads[0][2] = math.nan
    ours, rust = clones(grads), clones(grads)
    gradfuse.clip_grad_value_(params_of(ours), 0.7)
    on(monkeypatch, "rust", gradfuse.clip_grad_value_, params_of(rust), 0.7)
    for o, r, g in zip(ours, rust, grads, strict=True):
        assert same_bits(o, r)
        m = math_dtype(g.dtype)
        lim = torch.tensor(0.7, dtype=torch.float64).to(m)
        assert same_bits(o, g.to(m).clamp(-lim, lim).to(g.dtype))
    assert math.isnan(ours[0][2].item())


# --- AMP ------------------------------------------------------------------------------------


@pytest.mark.parametrize("inv", [2.0**-16, 0.3, 1.0], ids=str)
def test_unscale_and_check_matches_torch_amp_and_rust(monkeypatch, inv):
    grads = mixed_list(sizes=(1, 17, CHUNK + 1))
    inv_t = torch.tensor([inv])
    for bad in (None, math.inf, math.nan):
        g = clones(grads)
        if bad is not None:
            g[5][CHUNK] = bad
        ours, rust, theirs = clones(g), clones(g), clones(g)
        found, rfound, tfound = torch.zeros(1), torch.zeros(1), torch.zeros(1)
        gradfuse.unscale_and_check_(ours, inv_t, found)
        on(monkeypatch, "rust", gradfuse.unscale_and_check_, rust, inv_t, rfound)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, tfound, inv_t)
        assert found.item() == rfound.item() == tfound.item() == (0.0 if bad is None else 1.0)
        for o, r, t in zip(ours, rust, theirs, strict=True):
            assert same_bits(o, r) and same_bits(o, t)


def test_inverse_scale_is_torchs_reciprocal_bit_for_bit():
    """The scaler's one launch for its two scalars: ``inv_scale`` as torch's ``unscale_`` takes it
    (``scale.double().reciprocal().float()``) for scales across the float32 range and its edges,
    and ``found_inf`` zeroed, whatever the output memory held."""
    gen = torch.Generator().manual_seed(5)
    exponents = torch.randint(-126, 127, (24,), generator=gen).double()
    scales = [*(torch.rand(24, generator=gen, dtype=torch.float64) + 0.5) * 2.0**exponents]
    scales += [65536.0, 1.0, 3.0, 2.0**-24, 1e-40, 1e-45, 3.4e38, 0.0, -2.0, math.inf, math.nan]
    for s in scales:
        scale = torch.tensor(float(s), dtype=torch.float32)
        inv, found = torch.full((), math.nan), torch.full((), math.nan)
        _unscale.inverse_scale(scale, inv, found)
        assert same_bits(inv, scale.double().reciprocal().float()), float(s)
        assert found.item() == 0.0
    inv, found = gradfuse.ops.inverse_scale(torch.tensor(0.3))  # through the backend: new tensors
    assert same_bits(inv, torch.tensor(0.3).double().reciprocal().float()) and found.item() == 0.0
    with pytest.raises(TypeError, match="scale must be a one-element float32"):
        _unscale.inverse_scale(torch.tensor(2.0, dtype=torch.float64), inv, found)


@pytest.mark.parametrize("divisor", [None, 3.0], ids=["plain", "divisor"])
def test_scaler_unscale_and_clip_through_the_kernels_matches_torch(divisor):
    """``GradScaler.unscale_and_clip_`` on the Triton kernels (the inverse scale, the norm and the
    clip) against torch's ``unscale_`` + ``clip_grad_norm_``, over a schedule with overflow steps
    (found_inf must be set there, and zero on the clean steps that follow)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    ours = gradfuse.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    for step in range(6):
        x = torch.randn(5, 8)
        for m, scaler in ((model, ours), (twin, theirs)):
            m.zero_grad(set_to_none=True)
            scaler.scale(m(x).square().sum()).backward()
            if step in (2, 3):
                next(m.parameters()).grad[0, 0] = math.inf
        norm = ours.unscale_and_clip_(opts[0], 0.5, divisor=divisor)
        theirs.unscale_(opts[1])
        if divisor is not None:
            for p in twin.parameters():
                p.grad /= divisor
        want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
        assert ours.found_inf(opts[0]).item() == float(step in (2, 3))
        if step not in (2, 3):
            # A few float32 ulp: the norm's partials are summed in float64 (torch's in float32);
            # with a divisor gradfuse rounds once (one factor, 1/(scale*divisor)) where the
            # reference rounds twice (unscale, then divide), within the same bound.
            rtol = 2e-6
            torch.testing.assert_close(norm, want, rtol=rtol, atol=0)
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=0)
        ours.step(opts[0])
        theirs.step(opts[1])
        ours.update()
        theirs.update()
        assert ours.get_scale() == theirs.get_scale()
        with torch.no_grad():  # each step from the same weights: ulps of one step are not amplified by the next
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                b.copy_(a)


def test_unscale_never_resets_found_inf():
    found = torch.ones(1)
    gradfuse.unscale_and_check_(mixed_list(sizes=(9,)), torch.tensor([0.5]), found)
    assert found.item() == 1.0


def test_unscale_by_one_checks_without_writing():
    tensors = signaling_nans()
    before = [bits(t) for t in tensors]
    found = torch.zeros(1)
    gradfuse.unscale_and_check_(tensors, torch.tensor([1.0]), found)
    assert found.item() == 1.0
    assert all(torch.equal(bits(t), b) for t, b in zip(tensors, before, strict=True))


@pytest.mark.parametrize("p", [2.0, 1.0, 0.0, math.inf, 3.5], ids=str)
def test_unscale_check_norm_reads_only(monkeypatch, p):
    grads = mixed_list(sizes=(17, CHUNK + 1), empty=not math.isinf(p))
    inv = torch.tensor(2.0**-10)
    before = clones(grads)
    total, found = gradfuse.unscale_check_norm(grads, inv, p)
    rtotal, rfound = on(monkeypatch, "rust", gradfuse.unscale_check_norm, grads, inv, p)
    assert all(same_bits(g, b) for g, b in zip(grads, before, strict=True))
    assert found.shape == () and found.dtype == torch.float32 and found.item() == rfound.item() == 0.0
    # The products x * inv formed in the arithmetic type (exact here: inv is a power of two).
    want, _ = ref_norms([g.to(math_dtype(g.dtype)) * inv.to(math_dtype(g.dtype)) for g in grads], p)
    assert close(total.item(), want, rtol(grads)) and close(total.item(), rtotal.item(), 2 * rtol(grads))
    grads[2][1] = math.nan
    total, found = gradfuse.unscale_check_norm(grads, inv, p)
    assert found.item() == 1.0


@pytest.mark.parametrize("p", [2.0, 1.0, 0.0, math.inf, -1.0], ids=str)
def test_unscale_norm_matches_rust(monkeypatch, p):
    """The in-place unscale that measures (the DDP hook's pass on gloo + CUDA): the same bits as
    the Rust core in the tensors (one rounding of x * inv), the norm of the scaled values, and
    the flag set by an inf."""
    grads = mixed_list(sizes=(17, CHUNK + 1), empty=p > 0 and not math.isinf(p))
    rust = clones(grads)
    inv = torch.tensor(0.5)
    found, rfound = torch.zeros(()), torch.zeros(())
    total = gradfuse.unscale_norm_(grads, inv, found, p)
    rtotal = on(monkeypatch, "rust", gradfuse.unscale_norm_, rust, inv, rfound, p)
    assert all(same_bits(g, r) for g, r in zip(grads, rust, strict=True))
    assert found.item() == rfound.item() == 0.0
    want, _ = ref_norms([g.to(math_dtype(g.dtype)) for g in grads], p)
    assert close(total.item(), want, rtol(grads)) and close(total.item(), rtotal.item(), 2 * rtol(grads))
    grads[1][0] = math.inf
    gradfuse.unscale_norm_(grads, inv, found, p)
    assert found.item() == 1.0


def test_unscale_check_norm_counts_fp16_values_that_would_underflow():
    h = torch.ones(CHUNK + 1, dtype=torch.float16)
    total, found = gradfuse.unscale_check_norm([h], torch.tensor(2.0**-30), 1.0)
    assert total.item() == (CHUNK + 1) * 2.0**-30 and found.item() == 0.0


@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["active", "inactive"])
@pytest.mark.parametrize("bad", [None, math.nan], ids=["finite", "nan"])
def test_unscale_and_clip_matches_rust(monkeypatch, max_norm, bad):
    grads = mixed_list(sizes=(17, CHUNK + 1))
    if bad is not None:
        grads[0][4] = bad
    inv = torch.tensor(2.0**-4)
    ours, rust = clones(grads), clones(grads)
    found, rfound = torch.zeros(()), torch.zeros(())
    total = gradfuse.unscale_and_clip_(ours, inv, found, max_norm)
    rtotal = on(monkeypatch, "rust", gradfuse.unscale_and_clip_, rust, inv, rfound, max_norm)
    assert found.item() == rfound.item() == (0.0 if bad is None else 1.0)
    assert (math.isnan(total.item()) and math.isnan(rtotal.item())) or close(
        total.item(), rtotal.item(), 2 * rtol(grads)
    )
    factor = inv.item() * _rust.clip_coef(total.item(), max_norm, DTYPE_CODES[total.dtype])
    for o, g in zip(ours, grads, strict=True):
        assert same_bits(o, scaled(g, factor))


def test_unscale_and_clip_skips_the_write_when_the_factor_is_one():
    """inv_scale 1 and a coefficient of 1: no write. Order 0 keeps the total finite (2, the
    tensors with a non-zero element) although the NaNs that would show a write are there."""
    tensors = signaling_nans()
    before = [bits(t) for t in tensors]
    found = torch.zeros(())
    total = gradfuse.unscale_and_clip_(tensors, torch.tensor(1.0), found, 100.0, 0.0)
    assert total.item() == 3.0 and found.item() == 1.0
    assert all(torch.equal(bits(t), b) for t, b in zip(tensors, before, strict=True))
    # Control: any other factor writes, which those NaNs show.
    gradfuse.unscale_and_clip_(tensors, torch.tensor(0.5), found, 100.0, 0.0)
    assert all(bits(t)[i] != b[i] for t, b, i in zip(tensors, before, SNAN_AT, strict=True))


# --- accumulate ---------------------------------------------------------------------------

PAIRS = ACCUMULATE_PAIRS


@pytest.mark.parametrize("alpha", [1.0, 0.3, -2.0], ids=str)
def test_accumulate_mixed_pairs_bit_exact(monkeypatch, alpha):
    """Every dtype pair in one list (one launch per pair type): bit-exact against the Rust core
    and against torch doing the same arithmetic (product and sum each rounded, no FMA)."""
    dst = [rand(n, d) for d, _ in PAIRS for n in (5, CHUNK + 1)] + [torch.empty(0), rand((), torch.float32)]
    src = [rand(n, s) for _, s in PAIRS for n in (5, CHUNK + 1)] + [torch.empty(0), rand((), torch.bfloat16)]
    ours, rust = clones(dst), clones(dst)
    gradfuse.accumulate_(ours, src, alpha)
    on(monkeypatch, "rust", gradfuse.accumulate_, rust, src, alpha)
    for o, r, d, s in zip(ours, rust, dst, src, strict=True):
        assert same_bits(o, r)
        m = torch.float64 if torch.float64 in (d.dtype, s.dtype) else torch.float32
        a = torch.tensor(alpha, dtype=torch.float64).to(m)
        add = s.to(m) if alpha == 1.0 else s.to(m) * a
        assert same_bits(o, (d.to(m) + add).to(d.dtype))


@pytest.mark.parametrize("alpha", [1.0, 2.0], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_accumulate_float64_into_16_bits_rounds_through_float32(monkeypatch, dtype, alpha):
    """As the Rust core and torch: a float64 sum bound for float16/bfloat16 is rounded to float32
    first (``1 + 2**-11 + 2**-40`` into a zero float16 gives 1.0; rounded directly, 1.0009765625).
    Sizes cross the chunk and body/tail edges; ``alpha`` 2 (halved sources, exact) is the
    multiply path. (The interpreter's bfloat16 rounding already went through float32; on a GPU
    the direct conversion is what tests/test_compile.py rules out for both dtypes.)"""
    values, want = double_rounding_case(dtype, n=2 * CHUNK + 17)
    ours, rust = torch.zeros_like(want), torch.zeros_like(want)
    gradfuse.accumulate_([ours], [values / alpha], alpha)
    on(monkeypatch, "rust", gradfuse.accumulate_, [rust], [values / alpha], alpha)
    assert same_bits(ours, want) and same_bits(rust, want)


def test_accumulate_into_itself_and_overlap_rejected(monkeypatch):
    x = rand(CHUNK + 1, torch.float32)
    want = x * 3
    gradfuse.accumulate_([x], [x], 2.0)
    assert same_bits(x, want)
    base = rand(100, torch.float32)
    before = base.clone()
    dst, src = [base[:50]], [base[25:75]]
    with pytest.raises(ValueError, match="overlap") as ours:
        gradfuse.accumulate_(dst, src)
    assert same_bits(base, before)
    with pytest.raises(ValueError) as rust:
        on(monkeypatch, "rust", gradfuse.accumulate_, dst, src)
    assert str(ours.value) == str(rust.value)


def test_inplace_overlap_rejected_like_rust(monkeypatch):
    base = rand(100, torch.float32)
    before = base.clone()
    views = [base[:60], base[50:]]
    with pytest.raises(ValueError, match="overlap") as ours:
        gradfuse.multi_tensor_scale_(views, torch.tensor(0.5))
    with pytest.raises(ValueError) as rust:
        on(monkeypatch, "rust", gradfuse.multi_tensor_scale_, views, torch.tensor(0.5))
    assert str(ours.value) == str(rust.value)
    assert same_bits(base, before)


# --- chunk table, launches, alignment -----------------------------------------------------


def test_chunk_table_is_cached_and_keyed_on_storage():
    tensors = mixed_list(sizes=(CHUNK + 1,))
    plan = make_plan("t", "tensors", tensors, inplace=False)
    table = _triton._table(plan)
    assert table_of(tensors) is table
    other = table_of(clones(tensors))
    assert other is not table
    # One group per dtype, chunks contiguous per group, every tensor at least one chunk.
    assert [g.codes for g in table.groups] == [(0,), (1,), (2,), (3,)]
    assert sum(g.count for g in table.groups) == table.n_chunks
    assert table.chunk_count.min().item() >= 1
    for i, t in enumerate(tensors):
        first, count = table.first_chunk[i].item(), table.chunk_count[i].item()
        assert count == max(1, -(-t.numel() // CHUNK))
        assert table.chunk_tensor[first : first + count].eq(i).all()
        assert table.chunk_index[first : first + count].tolist() == list(range(count))


def test_chunk_table_cache_is_bounded(monkeypatch):
    """Tables are kept with the plans, whose cache is bounded: lists of other shapes, and lists
    of one shape at other addresses."""
    monkeypatch.setattr(_plan, "CACHE_SIZE", 3)
    keep = [[rand(5 + i, torch.float32)] for i in range(6)] + [[rand(5, torch.float32)] for _ in range(6)]
    for ts in keep:
        table_of(ts)
    assert len(_plan._PLANS) <= 3
    assert all(len(kept) <= _plan.PLANS_PER_KEY for kept in _plan._PLANS.values())


def test_unaligned_views_form_their_own_group(monkeypatch):
    """A view starting 4 bytes into its storage cannot promise 16-byte accesses: it runs in an
    unaligned group, with the same results."""
    base = rand(CHUNK * 2 + 9, torch.float32)
    tensors = [base[1:], rand(CHUNK + 3, torch.float32)]
    table = table_of(tensors)
    assert sorted(g.aligned for g in table.groups) == [False, True]
    total = gradfuse.multi_tensor_norm(tensors, 2.0)
    want, _ = ref_norms(tensors, 2.0)
    assert close(total.item(), want, 2e-6)
    ours, rust = clones(tensors), clones(tensors)
    ours[0] = base.clone()[1:]
    gradfuse.multi_tensor_scale_(ours, torch.tensor(0.1))
    on(monkeypatch, "rust", gradfuse.multi_tensor_scale_, rust, torch.tensor(0.1))
    assert all(same_bits(o, r) for o, r in zip(ours, rust, strict=True))


def test_moved_tables_keep_every_alignment():
    """A plan's table moves with its tensors without checking their alignment again (the Rust
    core checked each tensor's as the plan moved), and a move that changes a tensor's 16-byte
    alignment makes a new plan and table instead; unit rows, whose alignment can change while
    their tensor's does not (rows of 8 bytes 4, then 8, bytes past a boundary), are checked by
    their table. Every table's groups say what each address is, and the results are right."""
    buf = torch.randn(80, generator=torch.Generator().manual_seed(11))
    assert buf.data_ptr() % 64 == 0
    # Element offsets: aligned, aligned (moved), 4 bytes past (a new plan), 8 bytes past (moved,
    # its rows' alignment changed: a new unit table), aligned again (a new plan).
    for start in (0, 4, 1, 2, 8):
        x = buf[start : start + 16].view(8, 2)
        assert table_of([x]).aligned[0].tolist() == [x.data_ptr() % 16 == 0]
        got = torch.ops.gradfuse.unit_norms([x], [8], 2.0)
        units = make_plan("t", "tensors", [x], inplace=False).memo[("units", (8,))]
        assert units.aligned[0].tolist() == [x[k].data_ptr() % 16 == 0 for k in range(8)], start
        assert sorted(g.aligned for g in units.groups) == sorted({x[k].data_ptr() % 16 == 0 for k in range(8)})
        torch.testing.assert_close(got, torch.linalg.vector_norm(x.double(), dim=1).float(), rtol=2e-6, atol=0)


def clip_checked(grads, max_norm):
    """gradfuse's clip of ``grads`` (fp32, in place), checked against float64: the total is the
    norm they had, and each is scaled by torch's coefficient."""
    want = [g.double() for g in grads]
    total = gradfuse.clip_grad_norm_(params_of(grads), max_norm)
    exact, _ = ref_norms(want, 2.0)
    assert close(total.item(), exact, 2e-6)
    coef = max_norm / (exact + 1e-6)
    assert all(torch.allclose(g.double(), w * coef, rtol=2e-6, atol=0) for g, w in zip(grads, want, strict=True))


def test_prepared_launches_follow_a_list_to_its_new_addresses():
    """A list made again at other addresses (gradients set to None, a step later) moves its plan's
    chunk table, and the table's prepared launches with it: the norm and the scale run on the new
    tensors (the old ones untouched), through launches bound to the new table's buffers."""
    gen = torch.Generator().manual_seed(7)
    old = [rand(n, torch.float32, 3.0, gen) for n in (5, CHUNK + 3, 40)]
    old_before = clones(old)
    gradfuse.clip_grad_norm_(params_of(old), 1e-2)  # prepares the norm and scale launches
    old_after = clones(old)
    table = _triton._table(make_plan("t", "grads", old, inplace=True))
    assert table._prepared, "the clip left no prepared launches"
    new = [rand(n, torch.float32, 3.0, gen) for n in (5, CHUNK + 3, 40)]
    clip_checked(new, 1e-2)
    assert all(torch.equal(a, b) for a, b in zip(old, old_after, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(old_after, old_before, strict=True))
    moved = _triton._table(make_plan("t", "grads", new, inplace=True))
    assert moved is not table and moved._prepared
    for runs in moved._prepared.values():
        for prepared in runs:
            assert moved.addr_args[0] in prepared.args and table.addr_args[0] not in prepared.args


def test_a_prepared_launch_holding_a_buffer_not_the_new_tables_is_not_moved():
    """A prepared launch whose fixed pointers include one that is neither the new table's nor
    shared with it is not moved (it would launch on the old buffer): the moved table prepares its
    launch anew."""
    tensors = [rand(n, torch.float32) for n in (3, 20)]
    table = table_of(tensors)
    foreign = _launch.Ptr(torch.ones(()))
    (group,) = table.groups
    meta = ct._meta(group, False, {"CODE": 0, "MODE": 0, "FACTOR_CODE": 0})
    args = (table.addr_args[0], *table.args[:3], foreign, ct.SLOT, group.base, 0, 0)
    prepared = _launch.Prepared(_launch.launcher(_scale._scale_kernel), group.count, args, meta, group.device)
    replace = {id(table.addr_args[0]): _launch.Ptr(torch.zeros(2, dtype=torch.int64))}
    assert prepared.moved(replace, {id(p) for p in (*table.args, *replace.values())}) is None
    allowed = {id(p) for p in (*table.args, *replace.values(), foreign)}
    moved = prepared.moved(replace, allowed)
    assert moved is not None and moved.args[0] is replace[id(table.addr_args[0])] and moved.args[4] is foreign
    assert moved.kernels is prepared.kernels  # the same keys: the specializations are shared
    # Everything else is the launch's as it was: no part left out of the copy.
    kept = [s for s in _launch.Prepared.__slots__ if s not in ("args", "packed")]
    assert all(getattr(moved, s) is getattr(prepared, s) for s in kept)


def test_kept_launch_sets_follow_the_table_and_the_tuning(monkeypatch):
    """The clip keeps its launches (the norm's, the scale's) with its plan; a change of the
    kernels' tuning (a block size, say: the table stays) or of the plan's table makes them again,
    and each call still gives the right answer."""
    gen = torch.Generator().manual_seed(3)
    grads = [rand(n, torch.float32, 3.0, gen) for n in (5, CHUNK + 3, 40)]

    def clip_and_check():
        clip_checked(grads, 1e-2)
        plan = make_plan("t", "grads", grads, inplace=True)
        table, tuning, sets = plan.memo["launches"]
        assert table is _triton._table(plan) and tuning == ct.tuning()
        norm, scale = sets[("clip", 2.0)]
        return table, norm + scale

    table, launches = clip_and_check()
    assert all(p.meta["BLOCK"] == BLOCK for p in launches)
    assert clip_and_check()[1] == launches  # kept
    monkeypatch.setattr(ct, "BLOCK", 2 * BLOCK)
    again, launches = clip_and_check()
    assert again is table and all(p.meta["BLOCK"] == 2 * BLOCK for p in launches)
    del make_plan("t", "grads", grads, inplace=True).memo["table"]  # the plan's next table is a new one
    renewed, launches = clip_and_check()
    assert renewed is not table and all(renewed.addr_args[0] in p.args for p in launches)
    monkeypatch.setattr(ct, "CHUNK", 2 * CHUNK)  # a table of other chunks
    other, launches = clip_and_check()
    assert other is not table and all(p.meta["CHUNK"] == 2 * CHUNK for p in launches)


def test_prepared_launches_kept_per_table_are_bounded():
    """A configuration that changes at every call (a norm order per call) prepares a launch set
    each time; a table keeps a bounded number of them, and each call still gives its own norm."""
    tensors = [rand(n, torch.float32) for n in (3, 20)]
    table = table_of(tensors)
    sizes = []
    for i in range(ct._PREPARED_PER_TABLE + 8):
        p = 1.0 + i / 8
        total = gradfuse.multi_tensor_norm(tensors, p)
        want, _ = ref_norms(tensors, p)
        assert close(total.item(), want, 2e-6), (p, total.item(), want)
        sizes.append(len(table._prepared))
        kept = make_plan("t", "tensors", tensors, inplace=False).memo["launches"][2]
        assert 0 < len(kept) <= _triton._LAUNCH_SETS_PER_PLAN  # and the plan keeps a bounded number
    assert max(sizes) <= ct._PREPARED_PER_TABLE and sizes[-1] < sizes[ct._PREPARED_PER_TABLE - 1]


def test_launch_counts(monkeypatch):
    """clip_grad_norm_ is two launches per dtype group (norm with fused finalize, then scale),
    whatever the number of tensors; the other ops one per group per pass."""
    calls = []
    real = _launch.Launcher.__call__

    def counting(self, grid, args, meta, device):
        calls.append(self.fn)
        return real(self, grid, args, meta, device)

    # Every launch under the interpreter, prepared (ct.run) or not, is a launcher's.
    monkeypatch.setattr(_launch.Launcher, "__call__", counting)
    grads = [rand(n, torch.float32) for n in (3, CHUNK + 1, 40, 7, 200)]
    gradfuse.clip_grad_norm_(params_of(grads), 1e-3)
    assert len(calls) == 2
    calls.clear()
    gradfuse.clip_grad_norm_(params_of(mixed_list(sizes=(9,), empty=False, zero_d=False)), 1e-3)
    assert len(calls) == 2 * len(FLOAT_DTYPES)
    calls.clear()
    gradfuse.unscale_and_clip_(grads, torch.tensor(0.5), torch.zeros(()), 1e-3)
    assert len(calls) == 2
    calls.clear()
    gradfuse.unscale_check_norm(grads, torch.tensor(0.5))
    gradfuse.accumulate_(grads, clones(grads))
    gradfuse.multi_tensor_norm(grads, 0.0, per_tensor=True)
    assert len(calls) == 3
