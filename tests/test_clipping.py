"""Clipping policies (``gradfuse.clipping``) against the reference packages on the same gradient
sequences: ``zclip``'s ``ZClip`` and ``autoclip``'s ``QuantileClip(global_threshold=True)``; the
fixed ``NormClip`` against torch's ``clip_grad_norm_``. Through the drop-in on the Rust core and
on the Triton kernels (under the interpreter), and through ``GradScaler.unscale_and_clip_``.

Tolerances, and why: the packages measure the total norm with torch (per-parameter fp32 norms,
stacked, squared and summed in fp32); gradfuse's fp32 total is accumulated in f64 and differs by
a few fp32 ulp. Everything downstream inherits that: the clipped gradients agree to 1e-5
relative (fp32 ulps, amplified a little by the z-score arithmetic), the float64 EMA statistics
and the thresholds to 1e-5 relative. Given the *same* norms, the policies' arithmetic is the
packages' own (float64 for ZClip, float32 torch.quantile for AutoClip): checked bit for bit by
feeding ``clip_coef`` the reference's norms.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os

import pytest
import torch

import gradfuse
from gradfuse.clipping import AutoClip, NormClip, ZClip, make_policy
from process_state import sync_debug_mode
from reference import SPARSE_NORM_ERROR, TORCH_MEASURES_SPARSE

RTOL = 1e-5


def reference_package(module: str):
    """A reference package's module. CI installs both with the test extra, and a missing one fails
    there; elsewhere (the GPU machine has neither) only the tests that compare with it skip."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module.split('.')[0]} (the test extra) is not installed")


def QuantileClip(*args, **kwargs):
    return reference_package("autoclip.torch").QuantileClip(*args, **kwargs)


def ReferenceZClip(*args, **kwargs):
    return reference_package("zclip").ZClip(*args, **kwargs)


SPIKES = (9, 14, 15, 23)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6))


def gradient_sequence(steps: int, seed: int = 1):
    """Per step, per parameter: fresh gradients of norm ~1-1.5, x10 at the spike steps."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [p.shape for p in model().parameters()]
    for k in range(steps):
        scale = 10.0 if k in SPIKES else 1.0 + 0.5 * torch.rand((), generator=gen).item()
        yield [torch.randn(s, generator=gen) * scale / 5 for s in shapes]


def set_grads(m, grads):
    for p, g in zip(m.parameters(), grads, strict=True):
        p.grad = g.clone()


def assert_grads_close(a, b, rtol=RTOL):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=0)


ZCLIP_CONFIGS = [
    {"max_grad_norm": None},
    {"max_grad_norm": 2.0},  # also clips during warm-up, and caps the adaptive threshold
    {"max_grad_norm": None, "mode": "percentile"},
    {"max_grad_norm": None, "clip_option": "mean", "skip_update_on_spike": True},
    {"max_grad_norm": None, "clip_factor": 0.7, "alpha": 0.9, "z_thresh": 2.0},
]


@pytest.mark.parametrize("config", ZCLIP_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_zclip_matches_the_zclip_package(backend, config):
    ours, ref = model(), model()
    policy, reference = ZClip(warmup_steps=5, **config), ReferenceZClip(warmup_steps=5, **config)
    clipped = 0
    for k, grads in enumerate(gradient_sequence(30)):
        set_grads(ours, grads)
        set_grads(ref, grads)
        total = gradfuse.clip_grad_norm_(ours.parameters(), policy)
        ref_total = reference.step(ref)
        assert math.isclose(total.item(), ref_total, rel_tol=1e-6)
        assert_grads_close(ours, ref)
        if k >= 5:
            assert math.isclose(policy._mean.item(), reference.mean, rel_tol=RTOL)
            assert math.isclose(policy._var.item(), reference.var, rel_tol=RTOL)
        clipped += any(not torch.equal(p.grad, g) for p, g in zip(ours.parameters(), grads, strict=True))
    assert clipped >= len(SPIKES) - 1  # the spikes were clipped (a test that can fail)


def test_zclip_arithmetic_is_the_packages_bit_for_bit():
    """Given the reference's own norms, the coefficient and the EMA are the package's floats."""
    ref_model = model()
    policy, reference = ZClip(warmup_steps=4, max_grad_norm=None), ReferenceZClip(warmup_steps=4, max_grad_norm=None)
    for grads in gradient_sequence(25):
        set_grads(ref_model, grads)
        norm = reference._compute_grad_norm(ref_model)
        before = [p.grad.clone() for p in ref_model.parameters()]
        coef = policy.clip_coef(torch.tensor(norm, dtype=torch.float32))
        reference.step(ref_model)
        for b, p in zip(before, ref_model.parameters(), strict=True):
            assert torch.equal(b * coef, p.grad)
        if reference.initialized:
            assert policy._mean.item() == reference.mean and policy._var.item() == reference.var


@pytest.mark.parametrize(
    "config",
    [*ZCLIP_CONFIGS, {"max_grad_norm": 0.5, "eps": 0.0}, {"max_grad_norm": None, "mode": "percentile", "alpha": 0.5}],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_zclip_on_the_cpu_host_path_is_the_tensor_path_bit_for_bit(config):
    """On CPU norms after warm-up, ZClip computes its rule in Python floats: the coefficient and
    the EMA must be the tensor path's bit for bit (float32 and float64 norms, spikes, a repeated
    norm, an inf and a NaN, which go to the tensor path)."""
    gen = torch.Generator().manual_seed(3)
    norms = (1.0 + torch.rand(300, generator=gen, dtype=torch.float64)).tolist()
    for k in (20, 21, 50, 120, 121, 122, 200):
        norms[k] *= 10.0 + k
    norms[60:64] = [norms[59]] * 4  # equal norms: the variance decays toward zero
    norms[90], norms[91] = math.inf, math.nan
    host, tensors = ZClip(warmup_steps=5, **config), ZClip(warmup_steps=5, **config)
    used_host = 0
    for k, value in enumerate(norms):
        norm = torch.tensor(value, dtype=torch.float32 if k % 2 else torch.float64)
        used_host += host._count.item() >= 5 and math.isfinite(value)
        a = host.clip_coef(norm)
        b = tensors._clip_coef_tensors(norm)
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (k, a, b)
        assert torch.equal(host._mean, tensors._mean) and torch.equal(host._var, tensors._var), k
        assert torch.equal(host._count, tensors._count) and torch.equal(host.last_coef, tensors.last_coef)
    assert used_host > 250


def test_autoclip_matches_the_autoclip_package(backend):
    ours, ref = model(), model()
    policy = AutoClip(quantile=0.8, history_length=7)
    reference = QuantileClip(ref.parameters(), quantile=0.8, history_length=7, global_threshold=True)
    clipped = 0
    for grads in gradient_sequence(30):
        set_grads(ours, grads)
        set_grads(ref, grads)
        history = reference.state["global_history"]
        threshold = policy.threshold().item()
        want = torch.quantile(history, 0.8).item() if len(history) else math.inf
        assert math.isclose(threshold, want, rel_tol=RTOL) or threshold == want == math.inf
        gradfuse.clip_grad_norm_(ours.parameters(), policy)
        reference.step()
        assert_grads_close(ours, ref)
        clipped += any(not torch.equal(p.grad, g) for p, g in zip(ours.parameters(), grads, strict=True))
    assert clipped >= 5
    kept = torch.sort(policy._history).values
    torch.testing.assert_close(kept, torch.sort(reference.state["global_history"]).values, rtol=RTOL, atol=0)
    assert not kept.isnan().any()


def test_autoclip_threshold_is_torch_quantile_bit_for_bit():
    for q in (0.37, 0.9, 0.123, 0.5, 1.0, 0.0):
        policy = AutoClip(quantile=q, history_length=9)
        norms = torch.rand(40) * 10
        for k, n in enumerate(norms):
            kept = norms[max(0, k - 9) : k]
            want = torch.quantile(kept, q) if len(kept) else torch.tensor(math.inf)
            assert torch.equal(policy.threshold(), want), (q, k)
            policy.clip_coef(n)


def test_norm_policy_is_torchs_clip(backend):
    ours, ref = model(), model()
    for grads in gradient_sequence(4):
        set_grads(ours, grads)
        set_grads(ref, grads)
        total = gradfuse.clip_grad_norm_(ours.parameters(), NormClip(0.5))
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
        assert_grads_close(ours, ref)


@pytest.mark.parametrize(
    "make", [lambda: ZClip(warmup_steps=4, max_grad_norm=None), lambda: AutoClip(0.9, 6)], ids=["zclip", "autoclip"]
)
def test_state_dict_resumes_exactly(make):
    seq = list(gradient_sequence(20))
    straight, resumed = model(), model()
    a = make()
    for grads in seq:
        set_grads(straight, grads)
        gradfuse.clip_grad_norm_(straight.parameters(), a)
    b = make()
    for grads in seq[:9]:
        set_grads(resumed, grads)
        gradfuse.clip_grad_norm_(resumed.parameters(), b)
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c = make()
    c.load_state_dict(torch.load(buf))
    for grads in seq[9:]:
        set_grads(resumed, grads)
        gradfuse.clip_grad_norm_(resumed.parameters(), c)
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    for key, value in a.state_dict().items():
        assert key == "config" or torch.equal(value, c.state_dict()[key]), key


def test_non_finite_norms_are_not_recorded():
    z, auto = ZClip(warmup_steps=3, max_grad_norm=None), AutoClip(0.5, 4)
    for n in (1.0, math.inf, 2.0, math.nan, 3.0, 4.0):
        z.clip_coef(torch.tensor(n))
        auto.clip_coef(torch.tensor(n))
    assert z._count.item() == 3 and math.isfinite(z._mean.item()) and math.isfinite(z._var.item())  # 1, 2, 3
    assert auto._count.item() == 4 and auto.threshold().item() == torch.quantile(torch.tensor([1.0, 2, 3, 4]), 0.5)


def test_bad_configuration_and_state_name_the_field():
    with pytest.raises(ValueError, match="alpha"):
        ZClip(alpha=1.5)
    with pytest.raises(ValueError, match="mode"):
        ZClip(mode="median")
    with pytest.raises(ValueError, match="quantile"):
        AutoClip(quantile=1.5)
    with pytest.raises(ValueError, match="history_length"):
        AutoClip(history_length=0)
    with pytest.raises(ValueError, match="clip must be one of"):
        make_policy("clipz")
    state = ZClip(warmup_steps=4).state_dict()
    fresh = ZClip(warmup_steps=5)
    with pytest.raises(ValueError, match="warmup_steps"):
        fresh.load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        AutoClip().load_state_dict({"history": torch.zeros(1000)})
    assert fresh._count.item() == 0  # nothing modified


@pytest.mark.parametrize("fused", [True, False])
def test_scaler_folds_the_policys_coefficient(fused):
    """``GradScaler.unscale_and_clip_(opt, policy)`` against ``unscale_`` + the drop-in with an
    identical policy + ``step``; an overflowing step is skipped and not recorded."""
    seq = list(gradient_sequence(12))
    runs = []
    for via_scaler in (True, False):
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
        scaler = gradfuse.GradScaler("cpu", init_scale=2.0**8)
        policy = ZClip(warmup_steps=3, max_grad_norm=None)
        for k, grads in enumerate(seq):
            scale = scaler.scale(torch.ones(())).item()  # as scaler.scale(loss).backward() would
            set_grads(m, [g * scale for g in grads])
            if k == 7:
                next(m.parameters()).grad[0, 0] = math.inf
            if via_scaler:
                scaler.unscale_and_clip_(opt, policy)
            else:
                scaler.unscale_(opt)
                if k != 7:  # the reference skips the overflow by hand; the policy must by itself
                    gradfuse.clip_grad_norm_(m.parameters(), policy)
            scaler.step(opt)
            scaler.update()
        runs.append((m, policy))
    (a, pa), (b, pb) = runs
    assert pa._count.item() == pb._count.item() == 3  # warm-up full, the overflow not recorded
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        # Folded: the optimizer divides by scale / coef where the reference multiplies by coef.
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-7)
    torch.testing.assert_close(pa._mean, pb._mean, rtol=1e-6, atol=0)


@pytest.mark.cuda
def test_cuda_policies_run_without_a_host_sync():
    """ZClip, AutoClip (and AGC, in gradfuse.agc) on CUDA gradients: no host sync after the
    first call (which moves the policy's state to the device), the same coefficients as on CPU."""
    from gradfuse.agc import AGC

    for make in (lambda: ZClip(warmup_steps=2, max_grad_norm=None), lambda: AutoClip(0.5, 4), lambda: AGC(0.05)):
        on_gpu, on_cpu = model().cuda(), model()
        policy, ref = make(), make()
        for k, grads in enumerate(gradient_sequence(8)):
            set_grads(on_cpu, grads)
            set_grads(on_gpu, [g.cuda() for g in grads])
            if k:
                torch.cuda.synchronize()
            with sync_debug_mode("error") if k else contextlib.nullcontext():
                gradfuse.clip_grad_norm_(on_gpu.parameters(), policy)
            gradfuse.clip_grad_norm_(on_cpu.parameters(), ref)
            for p, q in zip(on_gpu.parameters(), on_cpu.parameters(), strict=True):
                torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=RTOL, atol=0)


@pytest.mark.parametrize("enabled", [False, True])
def test_sparse_gradients_go_to_torch_with_a_policy(enabled):
    """What the fused kernels cannot run (sparse gradients) is clipped the policy's way by torch,
    through the drop-in and the scaler, with nothing modified by a failed fused attempt."""
    for via_scaler in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        scaler = gradfuse.GradScaler("cpu", enabled=enabled)
        loss = emb(torch.tensor([1, 2, 2])).sum() * 10
        (scaler.scale(loss) if via_scaler else loss).backward()
        unscale = scaler.get_scale() if via_scaler and enabled else 1.0
        want = torch.linalg.vector_norm(emb.weight.grad.to_dense()) / unscale
        if not TORCH_MEASURES_SPARSE:
            # torch's answer is its error (torch 2.11): as torch's scaler.unscale_ then a failing
            # clip_grad_norm_, the gradients are left unscaled (exactly: a power of 2) and not clipped.
            before = emb.weight.grad.to_dense() / unscale
            with pytest.raises(NotImplementedError, match=SPARSE_NORM_ERROR):
                if via_scaler:
                    scaler.unscale_and_clip_(torch.optim.SGD(emb.parameters(), lr=0.1), NormClip(0.5))
                else:
                    gradfuse.clip_grad_norm_(emb.parameters(), NormClip(0.5))
            assert emb.weight.grad.is_sparse and torch.equal(emb.weight.grad.to_dense(), before)
            continue
        if via_scaler:
            opt = torch.optim.SGD(emb.parameters(), lr=0.1)
            total = scaler.unscale_and_clip_(opt, NormClip(0.5))
        else:
            total = gradfuse.clip_grad_norm_(emb.parameters(), NormClip(0.5))
        assert emb.weight.grad.is_sparse
        torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
        assert torch.linalg.vector_norm(emb.weight.grad.to_dense()).item() == pytest.approx(0.5, rel=1e-5)
