"""The fused gradfuse:: ops on CPU tensors (Rust core): differential tests against float64
references and torch, property-based over shapes, dtypes, norm orders, inf/NaN positions and
layouts, plus torch.library.opcheck of every op."""

from __future__ import annotations

import math
import threading
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradfuse
from gradfuse import _rust
from op_cases import opcheck_cases, registered_ops
from reference import (
    EDGE_SIZES,
    FLOAT_DTYPES,
    NORM_TYPES,
    close,
    double_rounding_case,
    math_dtype,
    randn,
    ref_norms,
    rtol_for,
    same_bits,
    scaled,
)

pytestmark = pytest.mark.usefixtures("rust_backend")


@pytest.fixture
def rust_backend(monkeypatch):
    monkeypatch.setenv("GRADFUSE_BACKEND", "rust")


# --- strategies ---------------------------------------------------------------------------

shapes = st.one_of(
    st.just(()),
    st.just((0,)),
    st.sampled_from(EDGE_SIZES).map(lambda n: (n,)),
    st.tuples(st.integers(1, 40), st.integers(1, 40)),
    st.tuples(st.integers(0, 5), st.integers(1, 7), st.integers(1, 9)),
)
layouts = st.sampled_from(["contiguous", "transposed", "sliced"])
any_dtype = st.sampled_from(FLOAT_DTYPES)


@st.composite
def tensor_lists(draw, dtypes=any_dtype, max_tensors=5, specials=False):
    """Lists of fresh random tensors of mixed shapes, dtypes and layouts; optionally with
    zeros, infs and NaNs at random positions."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draw(st.integers(1, max_tensors))):
        shape = draw(shapes)
        dtype = draw(dtypes)
        layout = draw(layouts) if len(shape) >= 2 else "contiguous"
        scale = 100.0 if dtype == torch.float16 else draw(st.sampled_from([1e-3, 1.0, 1e3]))
        if layout == "transposed":
            t = randn(shape[::-1], dtype, scale, gen).transpose(0, 1)
        elif layout == "sliced":
            t = randn((shape[0], shape[1] + 3, *shape[2:]), dtype, scale, gen)[:, 1 : 1 + shape[1]]
        else:
            t = randn(shape, dtype, scale, gen)
        if specials and t.numel():
            flat = t.view(-1) if t.is_contiguous() else None
            for _ in range(draw(st.integers(0, 3))):
                i = draw(st.integers(0, t.numel() - 1))
                v = draw(st.sampled_from([0.0, math.inf, -math.inf, math.nan]))
                if flat is not None:
                    flat[i] = v
                else:
                    t[tuple(torch.unravel_index(torch.tensor(i), t.shape))] = v
        out.append(t)
    return out


def _needs_elements(p: float) -> bool:
    return math.isinf(p) or p < 0


# --- multi_tensor_norm --------------------------------------------------------------------


@given(tensor_lists(specials=True), st.sampled_from(NORM_TYPES))
def test_norm_matches_float64_reference(tensors, p):
    if _needs_elements(p) and any(t.numel() == 0 for t in tensors):
        with pytest.raises(RuntimeError, match="empty tensor because the operation does not have an identity"):
            gradfuse.multi_tensor_norm(tensors, p)
        return
    total, per = gradfuse.multi_tensor_norm(tensors, p, per_tensor=True)
    want_total, want_per = ref_norms(tensors, p)
    rtol = rtol_for(t.dtype for t in tensors)
    out = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    assert total.dtype == out and total.shape == () and per.dtype == out and per.shape == (len(tensors),)
    assert close(total.item(), want_total, rtol), (total.item(), want_total)
    for got, want in zip(per.tolist(), want_per, strict=True):
        assert close(got, want, rtol), (got, want)


@given(tensor_lists(dtypes=st.sampled_from([torch.float32, torch.float64])), st.sampled_from([2.0, 1.0, math.inf]))
def test_norm_agrees_with_torch(tensors, p):
    """fp32/fp64: torch.nn.utils.get_total_norm gives the same number to its own precision,
    and where torch refuses (inf norm of an empty tensor) gradfuse refuses too."""
    if _needs_elements(p) and any(t.numel() == 0 for t in tensors):
        for fn in (gradfuse.multi_tensor_norm, torch.nn.utils.get_total_norm):
            with pytest.raises(
                RuntimeError, match="on an empty tensor because the operation does not have an identity"
            ):
                fn(tensors, p)
        return
    got = gradfuse.multi_tensor_norm(tensors, p)
    want = torch.nn.utils.get_total_norm(tensors, p)
    assert close(got.item(), want.item(), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_norm_is_fp32_accurate_unlike_torch(dtype):
    """The point of gradfuse: a bf16/fp16 model's norm to fp32 precision (torch returns a
    16-bit total with ~3 significant digits)."""
    grads = [randn((4096,), dtype) for _ in range(50)]
    want, _ = ref_norms(grads, 2.0)
    ours = gradfuse.multi_tensor_norm(grads).item()
    theirs = torch.nn.utils.get_total_norm(grads).item()
    assert abs(ours - want) / want < 2e-6
    assert abs(theirs - want) / want > 10 * abs(ours - want) / want


def test_fp16_squares_do_not_overflow():
    g = torch.full((8,), 60000.0, dtype=torch.float16)
    assert gradfuse.multi_tensor_norm([g]).item() == pytest.approx(60000.0 * math.sqrt(8), rel=1e-6)


@pytest.fixture
def torch_threads():
    """Sets torch's intra-op thread count for one test, restoring it after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_kernels_run_on_torchs_openmp_team(torch_threads):
    """With torch on OpenMP the Rust kernels run as OpenMP regions on torch's team (rayon's
    pool would share the cores with torch's spinning workers) and follow set_num_threads."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch build does not use OpenMP")
    gradfuse.multi_tensor_norm([torch.ones(3)])  # the CPU backend hooks up on first use
    assert _rust.on_openmp()
    for n in (1, 3):
        torch_threads(n)
        assert _rust.num_threads() == n


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_results_are_bitwise_the_same_for_any_thread_count(torch_threads, threads):
    # Many segments, split unevenly between threads; sums depend only on the segment order.
    tensors = [randn((70000,), torch.float32), randn((33, 1000), torch.bfloat16), randn((200_001,), torch.float16)]
    torch_threads(1)
    want = gradfuse.multi_tensor_norm(tensors, 2.0, per_tensor=True)
    want_ucn = gradfuse.unscale_check_norm(tensors, torch.tensor([0.25]), 1.0)
    torch_threads(threads)
    got = gradfuse.multi_tensor_norm(tensors, 2.0, per_tensor=True)
    got_ucn = gradfuse.unscale_check_norm(tensors, torch.tensor([0.25]), 1.0)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    assert same_bits(got_ucn[0], want_ucn[0]) and same_bits(got_ucn[1], want_ucn[1])


def test_norm_of_empty_list_is_zero():
    assert gradfuse.multi_tensor_norm([]).item() == 0.0
    total, per = gradfuse.multi_tensor_norm([], per_tensor=True)
    assert total.item() == 0.0 and per.numel() == 0


def test_norm_releases_the_gil():
    """A Python thread keeps running while a long norm is computed in Rust."""
    big = [randn((8_000_000,), torch.float32) for _ in range(4)]
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        before = counter[0]
        gradfuse.multi_tensor_norm(big, 3.0)  # general order: slow enough (~0.1 s) to notice
        after = counter[0]
    finally:
        stop.set()
        thread.join()
    assert after > before


def test_concurrent_calls_from_python_threads_agree():
    """Each Python thread's call runs its own parallel region (OpenMP team or rayon); calls at
    the same time from several threads must neither deadlock nor mix up their results."""
    lists = [[randn((300_000,), dtype), randn((70_001,), dtype)] for dtype in (torch.float32, torch.bfloat16)] * 2
    want = [gradfuse.multi_tensor_norm(ts, 2.0) for ts in lists]
    scaled = [[t.clone() for t in ts] for ts in lists]
    got = [None] * len(lists)

    def work(i):
        for _ in range(5):
            got[i] = gradfuse.multi_tensor_norm(lists[i], 2.0)
            gradfuse.multi_tensor_scale_(scaled[i], torch.tensor(0.5))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(lists))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert all(same_bits(g, w) for g, w in zip(got, want, strict=True))
    for ts, out in zip(lists, scaled, strict=True):
        for t, o in zip(ts, out, strict=True):
            assert torch.equal(o, t * 0.5**5)


# --- in-place element-wise ops --------------------------------------------------------------


@given(tensor_lists(specials=True), st.sampled_from([0.5, 0.1, 3.0, 1.0, 0.0]))
def test_scale_is_torch_arithmetic_bit_for_bit(tensors, factor):
    originals = [t.clone() for t in tensors]
    versions = [t._version for t in tensors]
    gradfuse.multi_tensor_scale_(tensors, torch.tensor(factor))
    for t, o, v in zip(tensors, originals, versions, strict=True):
        assert same_bits(t, scaled(o, torch.tensor(factor)))
        assert t._version > v  # autograd is told about the in-place write


def test_scale_by_one_touches_no_memory():
    """x * 1 == x, so the pass is skipped: even a NaN payload survives bit for bit."""
    t = torch.tensor([1.5, -0.0, 3.0], dtype=torch.float32)
    t.view(torch.int32)[2] = 0x7FC0_1234  # a NaN with a payload that any write would canonicalise
    bits = t.view(torch.int32).clone()
    gradfuse.multi_tensor_scale_([t], torch.tensor(1.0))
    assert torch.equal(t.view(torch.int32), bits)


@given(tensor_lists(specials=True), st.sampled_from([2.0**-16, 0.5, 1.0, 3.0]))
def test_unscale_and_check_matches_torch_amp(tensors, inv):
    ours = [t.clone() for t in tensors]
    theirs = [t.clone() for t in tensors]
    found_ours, found_theirs = torch.zeros(1), torch.zeros(1)
    inv_t = torch.full((1,), inv)
    gradfuse.unscale_and_check_(ours, inv_t, found_ours)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv_t)
    assert found_ours.item() == found_theirs.item()
    for a, b in zip(ours, theirs, strict=True):
        assert same_bits(a, b)


def test_unscale_never_resets_found_inf():
    found = torch.ones(1)
    gradfuse.unscale_and_check_([torch.ones(3)], torch.full((1,), 0.5), found)
    assert found.item() == 1.0


@given(tensor_lists(specials=True), st.sampled_from([2.0**-16, 0.25, 1.0]), st.sampled_from([2.0, 1.0, math.inf]))
def test_unscale_check_norm_reads_only(tensors, inv, p):
    snapshot = [t.clone() for t in tensors]
    if _needs_elements(p) and any(t.numel() == 0 for t in tensors):
        return
    norm, found = gradfuse.unscale_check_norm(tensors, torch.full((1,), inv), p)
    for t, s in zip(tensors, snapshot, strict=True):
        assert same_bits(t, s)
    unscaled = [(t.to(math_dtype(t.dtype)) * inv) for t in tensors]
    want, _ = ref_norms(unscaled, p)
    assert close(norm.item(), want, rtol_for(t.dtype for t in tensors))
    has_bad = any((~torch.isfinite(t.double())).any().item() for t in tensors if t.numel())
    assert found.item() == float(has_bad) and found.dtype == torch.float32


def test_unscale_check_norm_counts_fp16_values_that_would_underflow():
    g = torch.full((4,), 2.0**-10, dtype=torch.float16)
    norm, _ = gradfuse.unscale_check_norm([g], torch.full((1,), 2.0**-16))
    assert norm.item() == pytest.approx(2 * 2.0**-26, rel=1e-6)  # f16 storage would hold 0


@given(
    tensor_lists(dtypes=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), specials=True),
    st.sampled_from([0.25, 1.0]),
    st.sampled_from([1e-3, 1.0, 1e6]),
)
def test_unscale_and_clip_equals_unscale_then_clip(tensors, inv, max_norm):
    if not any(t.numel() for t in tensors):
        return
    ours = [t.clone() for t in tensors]
    found = torch.zeros(1)
    inv_t = torch.full((1,), inv)
    total = gradfuse.unscale_and_clip_(ours, inv_t, found, max_norm)
    # Reference: unscale in place as torch would, then clip with gradfuse's own total.
    ref = [t.clone() for t in tensors]
    ref_found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inv_t)
    assert found.item() == ref_found.item()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for a, r in zip(ours, ref, strict=True):
        # inv is a power of two, so (x * inv) * coef == x * (inv * coef) exactly.
        assert same_bits(a, scaled(r, coef))


@given(tensor_lists(specials=True), st.floats(0.0, 10.0))
def test_clamp_matches_torch_clip_grad_value(tensors, clip):
    params = [torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype)) for t in tensors]
    for p, t in zip(params, tensors, strict=True):
        p.grad = t.clone()
    theirs = [t.clone() for t in tensors]
    gradfuse.clip_grad_value_(params, clip)
    for t in theirs:
        t.clamp_(min=-clip, max=clip)
    for p, t in zip(params, theirs, strict=True):
        assert same_bits(p.grad, t)


@given(
    st.lists(st.sampled_from(FLOAT_DTYPES), min_size=2, max_size=2),
    st.sampled_from(EDGE_SIZES),
    st.sampled_from([1.0, 0.5, -2.0]),
    layouts,
    st.sampled_from([(False, False), (True, False), (False, True), (True, True)]),
)
def test_accumulate_mixed_dtypes(dtypes, n, alpha, layout, negated):
    """Every dtype pair and layout, either side a lazily negated view or not (torch's negative
    bit: the values are the negation of the memory): torch's sum of the values, bit for bit."""
    d_dtype, s_dtype = dtypes
    shape = (n, 3)
    dst = randn(shape, d_dtype)
    src = randn(shape, s_dtype)
    if layout == "transposed":
        src = src.t().contiguous().t()
    elif layout == "sliced":
        src = randn((n, 5), s_dtype)[:, 1:4]
    if negated[0]:
        dst = torch._neg_view(dst)
    if negated[1]:
        src = torch._neg_view(src)
    start = dst.resolve_neg().clone()  # resolve_neg of a plain tensor is the tensor itself
    gradfuse.accumulate_([dst], [src], alpha)
    m = torch.float64 if torch.float64 in dtypes else torch.float32
    want = (start.to(m) + torch.tensor(alpha, dtype=m) * src.resolve_neg().to(m)).to(d_dtype)
    assert same_bits(dst.resolve_neg(), want)


@pytest.mark.parametrize("alpha", [1.0, 2.0], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_accumulate_float64_into_16_bits_rounds_through_float32(dtype, alpha):
    """float64 sums stored into float16/bfloat16 are rounded to float32 first, as torch casts:
    values just above a 16-bit midpoint by less than float32 keeps end on the even neighbour
    (``1 + 2**-11 + 2**-40`` into a zero float16 gives 1.0, not 1.0009765625). ``alpha`` 2 with
    halved sources (exact) takes the multiply path."""
    values, want = double_rounding_case(dtype)
    dst = torch.zeros_like(want)
    gradfuse.accumulate_([dst], [values / alpha], alpha)
    assert same_bits(dst, want)


def test_accumulate_into_itself():
    t = torch.arange(5, dtype=torch.float32)
    gradfuse.accumulate_([t], [t], 1.0)
    assert torch.equal(t, 2 * torch.arange(5, dtype=torch.float32))


def test_accumulate_bf16_into_fp32_main_grads_beats_bf16_accumulation():
    """Many small bf16 micro-batch gradients: fp32 main grads keep them, bf16 sums stall."""
    main = torch.zeros(1000)
    naive = torch.zeros(1000, dtype=torch.bfloat16)
    micro = [randn((1000,), torch.bfloat16, 1e-3) for _ in range(64)]
    for g in micro:
        gradfuse.accumulate_([main], [g])
        naive.add_(g)
    exact = torch.stack([g.double() for g in micro]).sum(0)
    assert (main.double() - exact).abs().max() < 1e-7
    assert (naive.double() - exact).abs().max() > 10 * (main.double() - exact).abs().max()


# --- non-contiguous results land in the caller's tensors --------------------------------------


def test_inplace_ops_write_back_into_strided_views_only():
    base = torch.full((6, 8), 7.0)
    view = base[1:5, 2:6]  # not dense: results go through a copy and back
    t = base.t()  # dense but not contiguous: used in place
    gradfuse.multi_tensor_scale_([view], torch.tensor(0.5))
    assert torch.equal(view, torch.full((4, 4), 3.5))
    outside = torch.ones(6, 8, dtype=torch.bool)
    outside[1:5, 2:6] = False
    assert torch.equal(base[outside], torch.full((int(outside.sum()),), 7.0))
    gradfuse.multi_tensor_scale_([t], torch.tensor(2.0))
    assert base[0, 0].item() == 14.0 and base[2, 3].item() == 7.0


@given(
    tensor_lists(dtypes=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), specials=True),
    st.sampled_from([0.5, 0.25, 1.0]),
    st.sampled_from(NORM_TYPES),
)
def test_unscale_norm_scales_in_place_and_measures_the_result(tensors, inv, p):
    """unscale_norm_ (the DDP hook's pass: average a summed bucket and measure it) equals
    torch's in-place multiply, bit for bit (inv is a power of two: the products are exact),
    and its norm is the float64 norm of the scaled values within the dtype's fp32 tolerance."""
    if p < 0 or math.isinf(p):  # no identity: an empty tensor raises, as torch's norm does
        tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    ours = [t.clone() for t in tensors]
    found = torch.zeros(1)
    total = gradfuse.unscale_norm_(ours, torch.full((1,), inv), found, p)
    want_found = any(not torch.isfinite(t).all() for t in tensors)
    assert found.item() == float(want_found)
    for o, t in zip(ours, tensors, strict=True):
        assert same_bits(o, scaled(t, inv))
    if not want_found:
        want, _ = ref_norms([t.to(math_dtype(t.dtype)) * inv for t in tensors], p)
        assert close(total.item(), want, rtol_for(t.dtype for t in tensors))


# --- opcheck ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "args"), opcheck_cases("cpu"), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    op = getattr(torch.ops.gradfuse, name).default
    torch.library.opcheck(op, args)


def test_every_registered_op_is_opchecked():
    assert registered_ops() == {name for name, _ in opcheck_cases("cpu")}


@pytest.mark.slow
def test_tensors_over_two_to_the_31_elements():
    """64-bit sizes: a bf16 tensor of 2^31 + 7 elements (4 GiB) is measured and written whole."""
    n = 2**31 + 7
    big = torch.ones(n, dtype=torch.bfloat16)
    big[-1] = 3.0
    # The exact sum n + 2, as the float32 total holds it.
    assert gradfuse.multi_tensor_norm([big], 1.0).item() == torch.tensor(float(n + 2)).item()
    assert gradfuse.multi_tensor_norm([big], math.inf).item() == 3.0
    gradfuse.multi_tensor_scale_([big], torch.tensor(0.5))
    assert big[-1].item() == 1.5 and big[-2].item() == 0.5 and big[0].item() == 0.5
    del big


@given(
    tensor_lists(dtypes=any_dtype, specials=True),
    st.sampled_from([2.0**-16, 0.5, 4.0]),
    st.sampled_from([1e-3, 1.0, 1e6]),
)
def test_unscale_and_clip_paths_are_bit_identical(tensors, inv, max_norm):
    """Both ways unscale_and_clip_ can take (read then one write; or unscale while measuring,
    then clip only if needed) give the same gradients, norm and found_inf, bit for bit."""
    from gradfuse import _cpu

    if not any(t.numel() for t in tensors):
        return
    results = []
    for clipped_last in (True, False):
        ts = [t.clone() for t in tensors]
        found = torch.zeros(1)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(_cpu, "clipped_last", lambda plan, clipped_last=clipped_last: clipped_last)
            total = gradfuse.unscale_and_clip_(ts, torch.full((1,), inv), found, max_norm)
        results.append((ts, total, found))
    (a, total_a, found_a), (b, total_b, found_b) = results
    assert same_bits(total_a, total_b) and same_bits(found_a, found_b)
    assert all(same_bits(x, y) for x, y in zip(a, b, strict=True))


def test_unscale_and_clip_remembers_whether_it_clipped():
    from gradfuse import _cpu, _plan

    grads = [torch.full((1000,), 4.0)]
    inv = torch.full((1,), 0.5)
    gradfuse.unscale_and_clip_(grads, inv, torch.zeros(1), max_norm=1e6)
    plan = _plan.make_plan("t", "grads", grads, inplace=True)  # the plan the call kept
    assert _cpu.clipped_last(plan) is False
    gradfuse.unscale_and_clip_(grads, inv, torch.zeros(1), max_norm=1.0)
    assert _cpu.clipped_last(plan) is True
    assert grads[0].norm().item() == pytest.approx(1.0, rel=1e-5)


def test_unscale_and_clip_fp16_underflow_takes_the_exact_path():
    """fp16 values unscaled by 2^-16 become subnormal: rounding them in storage before
    clipping would change the result, so fp16 lists always clip in one write."""
    from gradfuse import _cpu

    x = torch.linspace(0.05, 0.1, 97, dtype=torch.float16)  # x * 2^-16 is an fp16 subnormal
    inv = 2.0**-16
    unscaled_norm = torch.linalg.vector_norm(x.float() * inv).item()
    max_norm = 0.9 * (unscaled_norm + 1e-6)  # a coefficient near 0.9: both roundings matter
    outs = []
    for clipped_last in (True, False):
        g = [x.clone()]
        with pytest.MonkeyPatch.context() as m:
            m.setattr(_cpu, "clipped_last", lambda plan, clipped_last=clipped_last: clipped_last)
            total = gradfuse.unscale_and_clip_(g, torch.full((1,), inv), torch.zeros(1), max_norm=max_norm)
        outs.append(g[0])
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    want = (x.float() * (inv * coef)).half()
    assert same_bits(outs[0], want) and same_bits(outs[1], want)


# --- the eager entries, and what they must not skip -------------------------------------------


def test_an_op_under_torch_jit_trace_is_recorded_not_baked_in():
    """Under ``torch.jit.trace`` the tracer records ops at the dispatcher: an eager entry that ran
    the implementation straight away would leave the traced graph without the op (its output a
    constant, here even an uninitialised ``empty``), silently wrong at every replay."""
    import warnings

    def f(x, y):
        total = gradfuse.multi_tensor_norm([x, y])
        norm, found = gradfuse.unscale_check_norm([x, y], torch.full((1,), 0.5))
        return total * 2, norm, found

    with warnings.catch_warnings():
        # Deprecated in favour of torch.compile/export, which are tested elsewhere; still torch's API
        # (a FutureWarning on newer torches, a DeprecationWarning on 2.11).
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", r".*torch\.jit\.trace. is deprecated", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(f, (torch.ones(4), torch.ones(3)), check_trace=False)
    assert "gradfuse::multi_tensor_norm" in str(traced.graph)
    for bad in (False, True):
        x, y = randn((4,), torch.float32), randn((3,), torch.float32) * 3
        if bad:
            x[1] = math.nan
        total, norm, found = traced(x, y)
        want, _ = ref_norms([x, y], 2.0)
        assert found.item() == float(bad)
        if not bad:
            assert close(total.item(), 2 * want, 2e-6) and close(norm.item(), 0.5 * want, 2e-6)


class _Logged(torch.Tensor):
    """A subclass with a __torch_function__ of its own: it sees every torch function and op
    called on it (and could answer them otherwise)."""

    seen: ClassVar[list] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class _Dispatched(torch.Tensor):
    """A subclass holding its data (``_make_subclass``) with a __torch_dispatch__ of its own."""

    seen: ClassVar[list] = []
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data):
        self = torch.Tensor._make_subclass(cls, data)
        self.plain = data  # the same memory, as a plain tensor
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)

        def plain(a):
            if isinstance(a, list):
                return [plain(x) for x in a]
            return a.plain if isinstance(a, cls) else a

        return func(*plain(list(args)), **(kwargs or {}))


@pytest.mark.parametrize("subclass", [_Logged, _Dispatched])
def test_a_tensor_subclass_that_overrides_torch_sees_the_op(subclass):
    """A subclass that overrides torch's functions or dispatch decides what an op does on it:
    the eager entry leaves such calls to the dispatcher, which hands them over (the ops' own
    kernels then run on what the subclass passes on), instead of running on its memory unseen."""
    data = randn((5,), torch.float32)
    x = subclass(data) if subclass is _Dispatched else data.as_subclass(subclass)
    subclass.seen.clear()
    total = gradfuse.multi_tensor_norm([x, torch.ones(3)])
    assert any(str(f).startswith("gradfuse.multi_tensor_norm") for f in subclass.seen)
    want, _ = ref_norms([data, torch.ones(3)], 2.0)
    assert close(total.item(), want, 2e-6)
    want_scaled = data * 0.5
    subclass.seen.clear()
    gradfuse.multi_tensor_scale_([x], torch.tensor(0.5))
    assert any(str(f).startswith("gradfuse.multi_tensor_scale_") for f in subclass.seen)
    assert same_bits(data, want_scaled)


def test_a_public_call_under_grad_mode_leaves_grad_mode_on():
    """The eager entry runs an op with grad mode off once it found no tensor requiring grad (the
    plans then need not ask again), and turns it back on, also when the call raises."""
    tensors = [torch.randn(3), torch.randn(2)]
    assert torch.is_grad_enabled()
    gradfuse.multi_tensor_scale_(tensors, torch.tensor(0.5))
    assert torch.is_grad_enabled()
    total = gradfuse.multi_tensor_norm(tensors)
    assert torch.is_grad_enabled() and not total.requires_grad
    with pytest.raises(ValueError, match=r"dst\[1\] has shape"):
        gradfuse.accumulate_(tensors, [torch.ones(3), torch.ones(3)])
    assert torch.is_grad_enabled()
    with pytest.raises(gradfuse._plan.UnsupportedTensorError, match=r"tensors\[0\] has dtype torch.int64"):
        gradfuse.multi_tensor_scale_([torch.ones(2, dtype=torch.int64)], torch.tensor(0.5))
    assert torch.is_grad_enabled()
