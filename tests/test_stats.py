"""``gradfuse.multi_tensor_stats``: per-tensor norm, largest magnitude and non-finite count from
the norm's one read, on the Rust core and on the Triton kernels (under ``TRITON_INTERPRET=1``,
with chunks shrunk to 64 elements so that small inputs cross chunk and body/tail edges).

References are computed by torch in float64 on the same values: ``vector_norm`` per tensor (and
torch's ``get_total_norm`` rule for the total), ``abs().amax()`` and ``~isfinite().sum()``.

Tolerances, and why: norms as in ``reference.py`` (2e-6 relative below float64, 1e-12 for
float64); the largest magnitude is a value the tensor holds, widened exactly to the output
dtype: compared for equality; counts are exact. The norms must also equal those of
``multi_tensor_norm(per_tensor=True)`` on the same backend: bit for bit on the Rust core (the
same partials, reduced in the same order), within rounding on Triton (smaller blocks).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradfuse
from process_state import sync_debug_mode
from reference import EDGE_SIZES, FLOAT_DTYPES, close, ref_norms, rtol, same_bits

TRITON_EDGES = (1, 15, 16, 17, 63, 64, 65, 145)


def sizes_for(backend: str):
    return TRITON_EDGES if backend == "triton" else EDGE_SIZES


def ref_stats(tensors, p):
    total, norms = ref_norms(tensors, p)
    amax = [t.double().abs().amax().item() if t.numel() else 0.0 for t in tensors]
    bad = [int((~torch.isfinite(t)).sum()) for t in tensors]
    return total, norms, amax, bad


def check(tensors, p, got):
    total, norms, amax, bad = ref_stats(tensors, p)
    tol = rtol(tensors)
    out = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    assert got.total.dtype == got.norms.dtype == got.amax.dtype == out
    assert got.nonfinite.dtype == torch.int64
    assert close(got.total.item(), total, tol), (got.total.item(), total)
    for i, t in enumerate(tensors):
        assert close(got.norms[i].item(), norms[i], tol), (i, t.dtype, t.numel(), got.norms[i].item(), norms[i])
        want_amax = amax[i]
        assert (math.isnan(want_amax) and math.isnan(got.amax[i].item())) or got.amax[i].item() == want_amax, (
            i,
            got.amax[i].item(),
            want_amax,
        )
        assert got.nonfinite[i].item() == bad[i], (i, got.nonfinite[i].item(), bad[i])
    # The norms are the plain fused norm's: bit for bit on the Rust core (the same loop). The
    # Triton stats kernel runs smaller blocks than the norm kernel (to keep its three accumulators
    # in registers, see kernels/_stats.py), so its lanes add in another order: equal within the
    # norm's own rounding there.
    plain_total, plain_per = gradfuse.multi_tensor_norm(tensors, p, per_tensor=True)
    if os.environ.get("GRADFUSE_BACKEND") == "triton":
        assert close(got.total.item(), plain_total.item(), tol)
        assert all(close(a, b, tol) for a, b in zip(got.norms.tolist(), plain_per.tolist(), strict=True))
    else:
        assert same_bits(got.norms, plain_per) and same_bits(got.total, plain_total)


def tensors_of(dtype, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    scale = 100.0 if dtype == torch.float16 else 1.0
    return [(torch.randn(n, dtype=torch.float64, generator=g) * scale).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("p", [2.0, 1.0, 0.0, 3.5, math.inf])
def test_every_dtype_and_size_against_float64(backend, dtype, p):
    tensors = tensors_of(dtype, sizes_for(backend), seed=7)
    tensors.append(torch.randn((), dtype=torch.float64).to(dtype))  # 0-d
    if p != math.inf:
        tensors.append(torch.empty(0, dtype=dtype))  # no identity for max: refused (tested below)
    check(tensors, p, gradfuse.multi_tensor_stats(tensors, p))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_inf_and_nan_at_chunk_edges_are_counted_per_tensor(backend, dtype):
    sizes = sizes_for(backend)
    tensors = tensors_of(dtype, sizes, seed=11)
    n = max(sizes)
    # Positions at the first, the last, block and chunk edges of the largest tensor.
    big = tensors[sizes.index(n)]
    for pos, v in [(0, math.inf), (n - 1, -math.inf), (15, math.nan), (16, math.inf), (n // 2, math.nan)]:
        big[pos] = v
    tensors[0][0] = -math.inf  # a one-element tensor that is only inf
    tensors[2][-1] = math.inf  # only infs: amax inf, not NaN
    for p in (2.0, 1.0, 0.0):
        got = gradfuse.multi_tensor_stats(tensors, p)
        check(tensors, p, got)
    assert got.nonfinite.tolist()[sizes.index(n)] == 5
    assert math.isnan(got.amax[sizes.index(n)].item()) and got.amax[2].item() == math.inf


def test_mixed_dtypes_in_one_call(backend):
    sizes = sizes_for(backend)[:4]
    tensors = [t for d in FLOAT_DTYPES for t in tensors_of(d, sizes, seed=3)]
    tensors[5][0] = math.nan
    check(tensors, 2.0, gradfuse.multi_tensor_stats(tensors, 2.0))


def test_non_contiguous_and_empty_list(backend):
    base = torch.randn(40, 30)
    base[3, 4] = math.inf
    tensors = [base.t(), base[::2, 1:], torch.randn(7)]
    check(tensors, 2.0, gradfuse.multi_tensor_stats(tensors))
    empty = gradfuse.multi_tensor_stats([])
    assert empty.total.item() == 0.0 and empty.norms.numel() == empty.amax.numel() == empty.nonfinite.numel() == 0


def test_bad_input_is_refused_naming_the_argument(backend):
    with pytest.raises(RuntimeError, match="tensors"):
        gradfuse.multi_tensor_stats([torch.ones(3), torch.empty(0)], math.inf)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        gradfuse.multi_tensor_stats([torch.ones(3), torch.ones(3, dtype=torch.int32)])
    with pytest.raises(ValueError, match="norm_type"):
        gradfuse.multi_tensor_stats([torch.ones(3)], math.nan)


def test_opcheck_stats():
    tensors = [torch.randn(3, 4), torch.randn(0), torch.randn(()), torch.randn(5).bfloat16()]
    torch.library.opcheck(torch.ops.gradfuse.multi_tensor_stats.default, (tensors, 2.0))
    torch.library.opcheck(torch.ops.gradfuse.multi_tensor_stats.default, ([torch.randn(5).double()], 1.0))


@pytest.mark.cuda
def test_cuda_stats_match_the_rust_core_without_a_host_sync():
    """On a GPU (the real Triton compiler, not the interpreter): the same statistics as the
    Rust core on the same values, norms within 2x the float64 tolerance, the rest exact."""
    tensors = [t.cuda() for d in FLOAT_DTYPES for t in tensors_of(d, (1, 1000, 70000), seed=5)]
    tensors[1][7] = math.nan
    tensors[2][-1] = -math.inf
    gradfuse.multi_tensor_stats(tensors)  # builds the chunk table
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        got = gradfuse.multi_tensor_stats(tensors)
    want = gradfuse.multi_tensor_stats([t.cpu() for t in tensors])
    torch.testing.assert_close(got.norms.cpu(), want.norms, rtol=2 * rtol(tensors), atol=0, equal_nan=True)
    assert same_bits(got.amax.cpu(), want.amax) and torch.equal(got.nonfinite.cpu(), want.nonfinite)


def test_the_norms_stats_option_is_multi_tensor_stats(backend):
    tensors = tensors_of(torch.float32, sizes_for(backend), seed=13)
    tensors[3][0] = math.inf
    a, b = gradfuse.multi_tensor_norm(tensors, 1.0, stats=True), gradfuse.multi_tensor_stats(tensors, 1.0)
    assert isinstance(a, gradfuse.TensorStats)
    assert all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    assert a.nonfinite.tolist() == [0, 0, 0, 1, *[0] * (len(tensors) - 4)]


@settings(max_examples=30)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    sizes=st.lists(st.integers(0, 70000), min_size=1, max_size=5),
    specials=st.lists(
        st.tuples(st.integers(0, 4), st.floats(0, 1), st.sampled_from([math.inf, -math.inf, math.nan])), max_size=6
    ),
    p=st.sampled_from([2.0, 1.0, 0.0]),
)
def test_random_specials_on_the_rust_core(dtype, sizes, specials, p):
    """Random sizes (up to two segments), dtypes and inf/NaN positions, against float64."""
    tensors = tensors_of(dtype, sizes, seed=len(sizes))
    for which, where, value in specials:
        t = tensors[which % len(tensors)]
        if t.numel():
            t[int(where * (t.numel() - 1))] = value
    before = os.environ.get("GRADFUSE_BACKEND")
    os.environ["GRADFUSE_BACKEND"] = "rust"  # (hypothesis runs many examples per fixture)
    try:
        check(tensors, p, gradfuse.multi_tensor_stats(tensors, p))
    finally:
        if before is None:
            del os.environ["GRADFUSE_BACKEND"]
        else:
            os.environ["GRADFUSE_BACKEND"] = before
