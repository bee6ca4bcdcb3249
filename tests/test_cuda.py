"""The Triton backend on a CUDA GPU: the differential checks of test_triton.py at realistic sizes
(every result compared with the Rust core on CPU copies of the same inputs, and norms with a
float64 reference), plus what only a GPU can show: opcheck on CUDA inputs, no host sync,
CUDA-graph capture and replay, launches per call, torch.compile, tensors over 2^31 elements,
and 16-byte vector accesses in the compiled kernels. Skipped without a GPU (conftest.py).

Tolerances, and why (as in test_triton.py):
- Norms: terms in float32 (float64 for float64 tensors), partials combined in float64; 2e-6
  relative against the float64 reference unless every input is float64 (1e-12); twice that
  against the Rust core, which sums in another order; max/min/count exactly.
- Element-wise results: bit for bit with the Rust core (same arithmetic, one rounding; the
  accumulate kernel is compiled without FMA contraction for that reason). Where a clip
  coefficient comes from a total norm, the expected values use the GPU's own total.
"""

from __future__ import annotations

import copy
import math
import re
import struct
import warnings

import pytest
import torch

import gradfuse
from gradfuse import _rust
from gradfuse._plan import DTYPE_CODES
from gradfuse.kernels import _chunk_table as ct
from gradfuse.kernels import _launch
from op_cases import opcheck_cases, registered_ops
from process_state import sync_debug_mode
from reference import (
    ACCUMULATE_PAIRS,
    FLOAT_DTYPES,
    NORM_TYPES,
    clones,
    close,
    double_rounding_case,
    params_of,
    ref_norms,
    rtol,
    same_bits,
    scaled,
)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
#: A GPT-2-like mix: embedding rows, attention and MLP matrices, biases and LayerNorm vectors,
#: plus sizes at the default chunk's edges and the 16-element body/tail split, a 0-d and an
#: empty tensor (~9.5 M elements in all).
SHAPES = [
    (50257, 64),
    (1024, 768),
    (2304, 768),
    (768, 3072),
    (768,),
    (2304,),
    (3072,),
    (32767,),
    (32768,),
    (32769,),
    (3 * 32768 + 17,),
    (15,),
    (17,),
    (1,),
    (),
    (0,),
]


@pytest.fixture(autouse=True)
def default_backend(monkeypatch):
    monkeypatch.delenv("GRADFUSE_BACKEND", raising=False)
    monkeypatch.setattr(ct, "CHUNK", 1 << 15)
    monkeypatch.setattr(ct, "BLOCK", 2048)
    monkeypatch.setattr(ct, "FBLOCK", 1024)


def rand(shape, dtype, scale=1.0, device=DEVICE):
    return (torch.randn(shape, dtype=torch.float64, device=device) * scale).to(dtype)


def grads_of(dtypes, empty=True, device=DEVICE):
    """One tensor per shape of SHAPES, dtypes cycling through ``dtypes`` (fp16 scaled to use its
    range). ``device``: test_cuda_logic.py runs this module's logic on the CPU."""
    out = []
    for i, shape in enumerate(SHAPES):
        if not empty and 0 in shape:
            continue
        d = dtypes[i % len(dtypes)]
        out.append(rand(shape, d, 100.0 if d == torch.float16 else 1.0, device))
    return out


def cpu(tensors):
    return [t.cpu() for t in tensors]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]).clone()


NAN_AT = 2  # where signaling_nans() puts its NaN


def signaling_nans():
    """Tensors holding a signaling NaN (at NAN_AT) next to ordinary values: a write, even of
    ``x * 1``, changes its bits."""
    f32 = torch.tensor([1.5, -2.0, 0.0], device=DEVICE).view(torch.int32)
    f32[2] = 0x7F800001
    bf16 = torch.tensor([0.25, 3.0, 0.0], dtype=torch.bfloat16, device=DEVICE).view(torch.int16)
    bf16[2] = 0x7F81
    return [f32.view(torch.float32), bf16.view(torch.bfloat16)]


DTYPE_MIXES = [[d] for d in FLOAT_DTYPES] + [[torch.float32, torch.bfloat16, torch.float16]]
MIX_IDS = ["f32", "f64", "f16", "bf16", "mixed"]


# --- differential checks at realistic sizes -----------------------------------------------


@pytest.mark.parametrize("dtypes", DTYPE_MIXES, ids=MIX_IDS)
@pytest.mark.parametrize("p", NORM_TYPES, ids=str)
def test_norm_matches_rust_and_reference(dtypes, p):
    tensors = grads_of(dtypes, empty=p >= 0 and not math.isinf(p))
    total, per = gradfuse.multi_tensor_norm(tensors, p, per_tensor=True)
    rtotal, rper = gradfuse.multi_tensor_norm(cpu(tensors), p, per_tensor=True)
    want_total, want_per = ref_norms(tensors, p)
    tol = rtol(tensors)
    assert total.device == tensors[0].device and total.dtype == rtotal.dtype
    assert close(total.item(), want_total, tol), (total.item(), want_total)
    assert all(close(g, w, tol) for g, w in zip(per.tolist(), want_per, strict=True))
    if p in (0.0, math.inf, -math.inf):
        assert torch.equal(total.cpu(), rtotal) and torch.equal(per.cpu(), rper)
    else:
        assert close(total.item(), rtotal.item(), 2 * tol)
        assert all(close(a, b, 2 * tol) for a, b in zip(per.tolist(), rper.tolist(), strict=True))


def test_norm_nan_inf_match_rust():
    tensors = grads_of([torch.float32, torch.bfloat16])
    tensors[1].view(-1)[tensors[1].numel() // 3] = math.nan
    tensors[3].view(-1)[-1] = math.inf
    for p in NORM_TYPES:
        ts = [t for t in tensors if t.numel()] if (p < 0 or math.isinf(p)) else tensors
        got = gradfuse.multi_tensor_norm(ts, p).item()
        want = gradfuse.multi_tensor_norm(cpu(ts), p).item()
        assert (math.isnan(got) and math.isnan(want)) or close(got, want, 4e-6), (p, got, want)


def test_norm_is_bitwise_deterministic():
    tensors = grads_of([torch.float32, torch.bfloat16])
    first = gradfuse.multi_tensor_norm(tensors, 2.0, per_tensor=True)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for _ in range(3):
                total, per = gradfuse.multi_tensor_norm(tensors, 2.0, per_tensor=True)
                assert same_bits(total, first[0]) and same_bits(per, first[1])
        torch.cuda.synchronize()


@pytest.mark.parametrize("dtypes", DTYPE_MIXES, ids=MIX_IDS)
def test_elementwise_ops_bit_exact_with_rust(dtypes):
    grads = grads_of(dtypes)
    grads[2].view(-1)[7] = math.nan

    def both(fn):
        ours, rust = clones(grads), cpu(grads)
        fn(ours)
        fn(rust)
        for o, r in zip(ours, rust, strict=True):
            assert same_bits(o.cpu(), r)

    for factor in (0.37, 2.0**-7, 1e30):
        both(lambda ts, f=factor: gradfuse.multi_tensor_scale_(ts, torch.tensor(f, device=ts[0].device)))
    for total_dtype in FLOAT_DTYPES:
        for total in (7.3, 0.3, math.inf):
            both(
                lambda ts, td=total_dtype, tv=total: gradfuse.clip_grads_with_norm_(
                    params_of(ts), 0.3, torch.tensor(tv, dtype=td, device=ts[0].device)
                )
            )
    both(lambda ts: gradfuse.clip_grad_value_(params_of(ts), 0.7))
    for inv in (2.0**-16, 0.3, 1.0):

        def unscale(ts, inv=inv):
            found = torch.zeros(1, device=ts[0].device)
            gradfuse.unscale_and_check_(ts, torch.tensor([inv], device=ts[0].device), found)
            assert found.item() == 1.0

        both(unscale)


PAIRS = ACCUMULATE_PAIRS


@pytest.mark.parametrize("alpha", [1.0, 0.3], ids=str)
def test_accumulate_bit_exact_with_rust(alpha):
    shapes = [s for s in SHAPES if len(s) <= 1][:8]
    dst = [rand(s, d) for d, _ in PAIRS for s in shapes]
    src = [rand(s, sd) for _, sd in PAIRS for s in shapes]
    ours, rust = clones(dst), cpu(dst)
    gradfuse.accumulate_(ours, src, alpha)
    gradfuse.accumulate_(rust, cpu(src), alpha)
    for o, r in zip(ours, rust, strict=True):
        assert same_bits(o.cpu(), r)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_accumulate_float64_into_16_bits_rounds_through_float32(dtype):
    """float64 sums stored into 16 bits round through float32, as torch's cast: no direct
    ``cvt.rn.f16.f64`` / ``cvt.rn.bf16.f64`` (which sm_90 has for bfloat16 and sm_80 not)."""
    values, want = double_rounding_case(dtype, n=4096)
    dst = torch.zeros_like(want, device=DEVICE)
    gradfuse.accumulate_([dst], [values.to(DEVICE)])
    assert same_bits(dst.cpu(), want)


@pytest.mark.parametrize("dtypes", DTYPE_MIXES, ids=MIX_IDS)
@pytest.mark.parametrize("max_norm", [1.0, 1e9], ids=["active", "inactive"])
def test_clip_grad_norm_matches_rust_and_torch(dtypes, max_norm):
    grads = grads_of(dtypes)
    ours, rust, theirs = clones(grads), cpu(grads), [g.double().clone() for g in grads]
    total = gradfuse.clip_grad_norm_(params_of(ours), max_norm)
    rtotal = gradfuse.clip_grad_norm_(params_of(rust), max_norm)
    ttotal = torch.nn.utils.clip_grad_norm_(params_of(theirs), max_norm)
    tol = rtol(grads)
    assert close(total.item(), ttotal.item(), tol) and close(total.item(), rtotal.item(), 2 * tol)
    coef = _rust.clip_coef(total.item(), max_norm, DTYPE_CODES[total.dtype])
    for o, g in zip(ours, grads, strict=True):
        assert same_bits(o.cpu(), scaled(g, coef))
    if coef == 1.0:
        assert all(same_bits(o, g) for o, g in zip(ours, grads, strict=True))


def test_skips_touch_no_memory_when_the_factor_is_one():
    for run in (
        lambda ts: gradfuse.multi_tensor_scale_(ts, torch.tensor(1.0, device=DEVICE)),
        lambda ts: gradfuse.clip_grads_with_norm_(params_of(ts), 1.0, torch.tensor(0.5, device=DEVICE)),
        lambda ts: gradfuse.unscale_and_check_(ts, torch.ones(1, device=DEVICE), torch.zeros(1, device=DEVICE)),
        # Order 0 keeps the total finite (2) despite the NaNs; inv_scale 1 and coef 1: no write.
        lambda ts: gradfuse.unscale_and_clip_(
            ts, torch.tensor(1.0, device=DEVICE), torch.zeros((), device=DEVICE), 10.0, 0.0
        ),
    ):
        tensors = signaling_nans()
        before = [bits(t) for t in tensors]
        run(tensors)
        assert all(torch.equal(bits(t), b) for t, b in zip(tensors, before, strict=True))
    # Control: a write changes the NaNs' bits (the GPU returns a canonical quiet NaN), so the
    # checks above would see one even where x * 1 == x.
    tensors = signaling_nans()
    before = [bits(t) for t in tensors]
    gradfuse.multi_tensor_scale_(tensors, torch.tensor(0.5, device=DEVICE))
    assert all(bits(t)[NAN_AT] != b[NAN_AT] for t, b in zip(tensors, before, strict=True))


def test_error_if_nonfinite_modifies_nothing():
    grads = grads_of([torch.float32, torch.bfloat16])
    grads[4].view(-1)[-1] = math.inf
    ours = clones(grads)
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        gradfuse.clip_grad_norm_(params_of(ours), 1.0, 2.0, error_if_nonfinite=True)
    assert all(same_bits(o, g) for o, g in zip(ours, grads, strict=True))


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf], ids=str)
def test_unscale_check_norm_and_unscale_and_clip_match_rust(p):
    grads = grads_of([torch.float16, torch.float32, torch.bfloat16], empty=not math.isinf(p))
    inv = 2.0**-8
    before = clones(grads)
    total, found = gradfuse.unscale_check_norm(grads, torch.tensor(inv, device=DEVICE), p)
    rtotal, rfound = gradfuse.unscale_check_norm(cpu(grads), torch.tensor(inv), p)
    assert all(same_bits(g, b) for g, b in zip(grads, before, strict=True))
    assert found.item() == rfound.item() == 0.0
    assert close(total.item(), rtotal.item(), 2 * rtol(grads))
    for max_norm in (1e-3, 1e9):
        ours, rust = clones(grads), cpu(grads)
        f, rf = torch.zeros((), device=DEVICE), torch.zeros(())
        t = gradfuse.unscale_and_clip_(ours, torch.tensor(inv, device=DEVICE), f, max_norm, p)
        rt = gradfuse.unscale_and_clip_(rust, torch.tensor(inv), rf, max_norm, p)
        assert f.item() == rf.item() == 0.0 and close(t.item(), rt.item(), 2 * rtol(grads))
        factor = inv * _rust.clip_coef(t.item(), max_norm, DTYPE_CODES[t.dtype])
        for o, g in zip(ours, grads, strict=True):
            assert same_bits(o.cpu(), scaled(g, factor))
    grads[5].view(-1)[3] = math.nan
    f = torch.zeros((), device=DEVICE)
    gradfuse.unscale_and_clip_(grads, torch.tensor(inv, device=DEVICE), f, 1.0, p)
    assert f.item() == 1.0


# --- opcheck ------------------------------------------------------------------------------


def test_opcheck_every_op_on_cuda():
    cases = opcheck_cases(DEVICE)
    assert registered_ops() == {name for name, _ in cases}  # every op, whatever ran before in this process
    for name, args in cases:
        torch.library.opcheck(getattr(torch.ops.gradfuse, name).default, args)


# --- no host sync, CUDA graphs, launches, torch.compile -----------------------------------


def sync_free_calls(grads, inv, found, total):
    """Every op once, as a training step calls them, on ``grads`` (which may hold an empty
    tensor: the inf-norm clip gets the non-empty ones, as torch refuses an inf norm of an empty
    tensor and so does gradfuse)."""
    nonempty = [g for g in grads if g.numel()]
    return [
        lambda: gradfuse.clip_grad_norm_(params_of(grads), 1.0),
        lambda: gradfuse.clip_grad_norm_(params_of(nonempty), 1.0, math.inf),
        lambda: gradfuse.unscale_and_clip_(grads, inv, found, 1.0),
        lambda: gradfuse.unscale_check_norm(grads, inv),
        lambda: gradfuse.accumulate_(grads, grads, 0.5),
        lambda: gradfuse.multi_tensor_norm(grads, 2.0, per_tensor=True),
        lambda: gradfuse.clip_grads_with_norm_(params_of(grads), 1.0, total),
        lambda: gradfuse.unscale_and_check_(grads, inv.view(1), found.view(1)),
        lambda: gradfuse.multi_tensor_scale_(grads, total),
        lambda: gradfuse.clip_grad_value_(params_of(grads), 0.5),
    ]


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "cached"])
def test_no_host_sync(warm):
    """Only error_if_nonfinite=True may synchronize; the first call (which builds and uploads
    the chunk table) must not either."""
    grads = grads_of([torch.float32, torch.bfloat16])
    inv, found, total = (
        torch.tensor(0.5, device=DEVICE),
        torch.zeros((), device=DEVICE),
        torch.tensor(3.0, device=DEVICE),
    )
    calls = sync_free_calls(grads, inv, found, total)
    if warm:
        for call in calls:
            call()
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        for call in calls:
            call()
        with pytest.raises(RuntimeError, match="synchroniz"):
            gradfuse.clip_grad_norm_(params_of(grads), 1.0, error_if_nonfinite=True)
    torch.cuda.synchronize()


def _capture(fn, warmups=2):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float32, torch.bfloat16]], ids=["f32", "f32+bf16"])
def test_cuda_graph_clip_grad_norm(dtypes):
    grads = grads_of(dtypes)
    params = params_of(grads)
    graph, total = _capture(lambda: gradfuse.clip_grad_norm_(params, 1.0))
    for scale in (1.0, 1e-6, 100.0):  # active, inactive, active
        new = [(torch.randn(g.shape, device=DEVICE) * scale).to(g.dtype) for g in grads]
        for g, n in zip(grads, new, strict=True):
            g.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        rust = cpu(new)
        rtotal = gradfuse.clip_grad_norm_(params_of(rust), 1.0)
        assert close(total.item(), rtotal.item(), 2 * rtol(grads))
        coef = _rust.clip_coef(total.item(), 1.0, DTYPE_CODES[total.dtype])
        for g, n in zip(grads, new, strict=True):
            assert same_bits(g.cpu(), scaled(n, coef))


def test_cuda_graph_unscale_and_clip():
    grads = grads_of([torch.float16, torch.float32])
    inv = torch.tensor(2.0**-10, device=DEVICE)
    found = torch.zeros((), device=DEVICE)
    graph, total = _capture(lambda: gradfuse.unscale_and_clip_(grads, inv, found, 1.0))
    for trial, (scale, bad) in enumerate([(1.0, None), (1e-3, None), (1.0, math.inf)]):
        new = [(torch.randn(g.shape, device=DEVICE) * scale * 2**10).to(g.dtype) for g in grads]
        if bad is not None:
            new[2].view(-1)[trial] = bad
        for g, n in zip(grads, new, strict=True):
            g.copy_(n)
        inv.fill_(2.0**-10)
        found.zero_()
        graph.replay()
        torch.cuda.synchronize()
        rust, rfound = cpu(new), torch.zeros(())
        rtotal = gradfuse.unscale_and_clip_(rust, torch.tensor(2.0**-10), rfound, 1.0)
        assert found.item() == rfound.item() == (0.0 if bad is None else 1.0)
        if bad is None:
            assert close(total.item(), rtotal.item(), 2 * rtol(grads))
            factor = 2.0**-10 * _rust.clip_coef(total.item(), 1.0, DTYPE_CODES[total.dtype])
            for g, n in zip(grads, new, strict=True):
                assert same_bits(g.cpu(), scaled(n, factor))


def profiled_names(fn, device=DEVICE):
    """The kernels ``fn`` launches on CUDA (copies and memsets left out); on the CPU, the
    ``gradfuse::`` ops it dispatches (test_cuda_logic.py)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    fn()  # warm: compile and build the table outside the profile
    sync()
    # acc_events=True: there is one profiling cycle either way, and without it torch 2.11 warns on
    # entering the profile that events are cleared at the end of each cycle.
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU], acc_events=True) as prof:
        fn()
        sync()
    if not cuda:
        return [e.name for e in prof.events() if e.name.startswith("gradfuse::")]
    return [
        e.name
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not re.match(r"(?i)mem(cpy|set)", e.name)
    ]


def test_launches_per_clip_call_with_1000_tensors():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 5000, (1000,), generator=gen).tolist()
    grads = [torch.randn(n, device=DEVICE) for n in sizes]
    names = profiled_names(lambda: gradfuse.clip_grad_norm_(params_of(grads), 1e-3))
    assert len(names) == 2, names  # one dtype group: norm (finalize fused), then scale
    mixed = [g if i % 2 else g.bfloat16() for i, g in enumerate(grads)]
    names = profiled_names(lambda: gradfuse.clip_grad_norm_(params_of(mixed), 1e-3))
    assert len(names) <= 4, names  # two dtype groups
    # The scalars are made outside the profiled call: torch.zeros on the device is a fill kernel
    # of the caller's, which the H100 run counted as a third launch of gradfuse's.
    inv, found = torch.tensor(0.5, device=DEVICE), torch.zeros((), device=DEVICE)
    names = profiled_names(lambda: gradfuse.unscale_and_clip_(grads, inv, found, 1e-3))
    assert len(names) == 2, names


def test_scaler_unscale_and_clip_is_three_launches_with_torchs_inverse_scale():
    """``GradScaler.unscale_and_clip_``: the inverse scale and the zeroed flag in one launch (torch's
    arithmetic makes four: double, reciprocal, float, fill), then the norm and the clip; the
    inverse bit for bit torch's ``scale.double().reciprocal().float()`` across the float32 range."""
    gen = torch.Generator().manual_seed(4)
    exponents = torch.randint(-126, 127, (64,), generator=gen).double()
    scales = ((torch.rand(64, generator=gen, dtype=torch.float64) + 0.5) * 2.0**exponents).tolist()
    for s in [*scales, 65536.0, 1.0, 3.0, 1e-40, 3.4e38, 0.0, math.inf, math.nan]:
        scale = torch.tensor(s, dtype=torch.float32, device=DEVICE)
        inv, found = gradfuse.ops.inverse_scale(scale)
        assert same_bits(inv, scale.double().reciprocal().float()), s
        assert found.item() == 0.0 and found.device == scale.device
    originals = [torch.randn(n, device=DEVICE) for n in (5, 300, 4097)]
    params = params_of(clones(originals))
    scaler = gradfuse.GradScaler("cuda", init_scale=3.0 * 2**10)
    scaler.scale(torch.ones((), device=DEVICE))  # the scale made before the profiled call
    # A new optimizer per call (profiled_names calls twice): each its first unscale since update().
    # Kept alive: the scaler's state is keyed by the optimizer's id, which a freed one hands on.
    opts = []

    def call():
        opts.append(torch.optim.SGD(params, lr=0.1))
        return scaler.unscale_and_clip_(opts[-1], 1e-3)

    names = profiled_names(call)
    assert len(names) == 3, names
    for p, g in zip(params, originals, strict=True):
        p.grad = g.clone()
    opt = torch.optim.SGD(params, lr=0.1)
    norm = scaler.unscale_and_clip_(opt, 1e-3)
    want = [g.double() / (3.0 * 2**10) for g in originals]
    want_norm = torch.linalg.vector_norm(torch.cat([w.reshape(-1) for w in want]))
    torch.testing.assert_close(norm.double(), want_norm, rtol=1e-6, atol=0)
    assert scaler.found_inf(opt).item() == 0.0
    coef = min(1e-3 / (norm.item() + 1e-6), 1.0)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad.double(), w * coef, rtol=1e-5, atol=0)


def import_inductor() -> None:
    """Import torch.compile's default backend up front. torch 2.11's inductor imports
    ``torch.utils.mkldnn``, whose classes use ``torch.jit.script_method``, deprecated there with a
    DeprecationWarning at import (Python < 3.14): torch's own, raised once per process, and under
    ``filterwarnings = error`` it aborted the compile half way through the import. Only that
    warning is ignored, only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is", category=DeprecationWarning)
        import torch._inductor.compile_fx  # noqa: F401


def test_torch_compile_fullgraph():
    import_inductor()
    grads = grads_of([torch.float32])
    eager, compiled_grads = clones(grads), clones(grads)
    eager_params, compiled_params = params_of(eager), params_of(compiled_grads)

    def step(params):
        return gradfuse.clip_grad_norm_(params, 0.5)

    compiled = torch.compile(step, fullgraph=True)
    want = step(eager_params)
    got = compiled(compiled_params)
    assert same_bits(got, want)
    assert all(same_bits(a, b) for a, b in zip(compiled_grads, eager, strict=True))


# --- sizes and code generation -----------------------------------------------------------


@pytest.mark.serial  # 4 GiB and more, and its skip reads the free memory, which other workers change
def test_tensors_over_two_to_the_31_elements():
    """64-bit offsets: a bf16 tensor of 2^31 + 7 elements (4 GiB) measured, scaled, unscaled."""
    n = 2**31 + 7
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    big = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    big[-1] = 3.0
    small = torch.full((5,), 2.0, device=DEVICE)
    total, per = gradfuse.multi_tensor_norm([big, small], 1.0, per_tensor=True)
    # The exact sum n + 2, rounded once to the float32 result.
    assert per[0].item() == torch.tensor(float(n + 2)).item()
    assert total.item() == torch.tensor(float(n + 2 + 10)).item()
    assert gradfuse.multi_tensor_norm([big], math.inf).item() == 3.0
    gradfuse.multi_tensor_scale_([big], torch.tensor(0.5, device=DEVICE))
    assert big[-1].item() == 1.5 and big[-8].item() == 0.5 and big[0].item() == 0.5
    big[-2] = math.inf
    found = torch.zeros(1, device=DEVICE)
    gradfuse.unscale_and_check_([big], torch.tensor([4.0], device=DEVICE), found)
    assert found.item() == 1.0 and big[-1].item() == 6.0 and big[2**31].item() == 2.0
    del big


def test_aligned_groups_compile_to_16_byte_accesses(monkeypatch):
    """The address and size hints of aligned groups reach the code generator: 128-bit loads
    (norm) and loads and stores (scale) in the compiled kernels."""
    compiled = []
    real = _launch.Prepared.__call__

    def keep(self, *values):  # every chunk kernel's launch (ct.run, a kept launch set) is a prepared one's
        k = real(self, *values)
        compiled.append(k)
        return k

    monkeypatch.setattr(_launch.Prepared, "__call__", keep)
    grads = [torch.randn(4096 * 4 + 3, device=DEVICE), torch.randn(777, device=DEVICE)]
    gradfuse.clip_grad_norm_(params_of(grads), 1e-3)
    norm_ptx, scale_ptx = (k.asm["ptx"] for k in compiled)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.", norm_ptx)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.", scale_ptx) and re.search(r"st\.global(\.\w+)*\.v4\.", scale_ptx)
    assert not re.search(r"div\.(full|approx)\.f32", scale_ptx)  # the clip coefficient divides exactly


def test_float32_nan_payload_helper_is_sane():
    """Guards the poison tests: the signaling NaN built above is one (quiet bit clear)."""
    word = bits(signaling_nans()[0])[2].item() & 0xFFFFFFFF
    value = struct.unpack("<f", struct.pack("<I", word))[0]
    assert math.isnan(value) and not word & 0x00400000


# --- GradBuckets on the GPU -----------------------------------------------------------------


def _bucketed_mlp(dtype=torch.float32, grad_dtype=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(256, 256) for _ in range(6)], torch.nn.LayerNorm(256), torch.nn.Linear(256, 10)
    ).to(DEVICE, dtype)
    reference = torch.nn.Sequential(
        *[torch.nn.Linear(256, 256) for _ in range(6)], torch.nn.LayerNorm(256), torch.nn.Linear(256, 10)
    ).to(DEVICE, dtype)
    reference.load_state_dict(model.state_dict())
    buckets = gradfuse.GradBuckets(model.parameters(), bucket_cap_mb=0.5, grad_dtype=grad_dtype)
    x = torch.randn(32, 256, device=DEVICE, dtype=dtype)
    model(x).float().square().mean().backward()
    reference(x).float().square().mean().backward()
    return model, reference, buckets


def test_a_list_of_one_shape_made_again_on_either_device_gives_torchs_answer():
    """Plans are kept by a list's shape, not its device: gradients of the same shapes made again
    at every call, by turns on the CPU and on the GPU (a kept plan of each; the probe reads the
    device of a tensor that moved), are clipped where they are, as torch clips them."""
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        device = "cpu" if step % 2 == 0 else DEVICE
        grads = [torch.randn(n, generator=gen).to(device) for n in (7, 4096, 33)]
        theirs = clones(grads)
        total = gradfuse.clip_grad_norm_(params_of(grads), 0.5)
        want = torch.nn.utils.clip_grad_norm_(params_of(theirs), 0.5)
        assert total.device.type == torch.device(device).type
        assert close(total.item(), want.item(), 2e-6), step
        for g, t in zip(grads, theirs, strict=True):
            torch.testing.assert_close(g, t, rtol=2e-6, atol=0)


def test_buckets_grads_and_clip_match_torch():
    model, reference, buckets = _bucketed_mlp()
    assert len(buckets.buffers) > 1
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    total = buckets.clip_grad_norm_(1e-3)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    assert close(total.item(), want.item(), 2e-6)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-6, atol=0)


def test_buckets_clip_is_two_launches_and_sync_free():
    model, _, buckets = _bucketed_mlp()
    buckets.clip_grad_norm_(1e-3)  # compile
    torch.cuda.synchronize()
    names = profiled_names(lambda: buckets.clip_grad_norm_(1e-3))
    assert len(names) == 2, names
    names = profiled_names(lambda: gradfuse.clip_grad_norm_(model.parameters(), 1e-3))  # the drop-in finds them
    assert len(names) == 2, names
    with sync_debug_mode("error"):
        buckets.clip_grad_norm_(1e-3)
        buckets.zero_grad()


def test_buckets_main_grad_bf16_on_gpu():
    model, reference, _buckets = _bucketed_mlp(torch.bfloat16, grad_dtype=torch.float32)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert torch.equal(p.main_grad, q.grad.float())


# --- the DDP hook on one GPU (NCCL: an average all-reduce, then a read-only pass; gloo on CUDA:
# a sum, then the in-place unscale_norm_). One rank: the paths and the state, not the averaging,
# which the 2-rank gloo tests in test_ddp_hook.py check.


@pytest.fixture(params=["nccl", "gloo"])
def one_rank_group(request, tmp_path):
    import torch.distributed as dist

    if request.param == "nccl" and not dist.is_nccl_available():
        pytest.skip("no NCCL")
    dist.init_process_group(request.param, init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


@pytest.mark.serial  # a process group (NCCL, gloo) per run
def test_ddp_hook_on_cuda_matches_ddp_and_folds_the_clip(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradfuse.ddp_hook import state_for

    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)], torch.nn.Linear(256, 10))

    model = make().to(DEVICE)
    reference = make().to(DEVICE)
    reference.load_state_dict(model.state_dict())
    ours = DDP(model, device_ids=[DEVICE.index or 0], gradient_as_bucket_view=True, bucket_cap_mb=0.5)
    theirs = DDP(reference, device_ids=[DEVICE.index or 0], gradient_as_bucket_view=True, bucket_cap_mb=0.5)
    hook = gradfuse.register_ddp_hook(ours)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), fused=True)
    scaler = gradfuse.GradScaler("cuda", init_scale=2.0**10)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    for _ in range(3):
        x = torch.randn(32, 256, device=DEVICE)
        for m, o, s in ((ours, opt, scaler), (theirs, ref_opt, ref_scaler)):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        grads = [p.grad for p in model.parameters()]
        assert state_for(grads, 2.0) is hook
        total = scaler.unscale_and_clip_(opt, 1e-3)
        assert torch.equal(total, hook.total_norm() * (1.0 / scaler.get_scale()))
        ref_scaler.unscale_(ref_opt)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
        assert close(total.item(), want.item(), 2e-6)
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.step(o)
            s.update()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                q.copy_(p)
        ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict would share tensors
