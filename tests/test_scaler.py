"""gradfuse.GradScaler against torch.amp.GradScaler, side by side on identical models.

Every test runs both scalers over the same steps and compares weights, scale, growth tracker
and skipped steps. Where the two differ by design the difference is one rounding: torch
unscales (an exact power-of-two multiply) and then clips (one rounding), gradfuse folds
``inv_scale * clip_coef`` into one multiply or into the fused optimizer's division by
``scale / clip_coef``; both are within a few fp32 ulps per step, hence rtol 1e-5 over a
dozen steps of AdamW (whose update is ~lr in size whatever the gradient's rounding).
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

import gradfuse
from reference import SPARSE_NORM_ERROR, TORCH_MEASURES_SPARSE, params_of, same_bits

RTOL = 1e-5
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
}


def _model(device: str, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.to(device)


class Pair:
    """The same model, optimizer and batches under torch's scaler and under gradfuse's."""

    def __init__(self, device: str, optimizer: str, **scaler_kwargs):
        self.device = device
        self.models = [_model(device), _model(device)]
        self.opts = [OPTIMIZERS[optimizer](m.parameters()) for m in self.models]
        self.scalers = [torch.amp.GradScaler(device, **scaler_kwargs), gradfuse.GradScaler(device, **scaler_kwargs)]

    def backward(self, x: torch.Tensor, poison: float | None = None) -> None:
        for model, opt, scaler in zip(self.models, self.opts, self.scalers, strict=True):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            if poison is not None:  # an overflow in one gradient element
                model[0].weight.grad[1, 2] = poison

    def assert_same(self) -> None:
        for a, b in zip(self.models[0].parameters(), self.models[1].parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=1e-7)
        t, g = self.scalers
        assert g.get_scale() == t.get_scale()
        assert g._get_growth_tracker() == t._get_growth_tracker()


# inf and NaN injected at steps 3, 4 (two skips in a row) and 8; growth every 3 clean steps.
POISON = {3: math.inf, 4: math.nan, 8: -math.inf}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip"])
def test_growth_backoff_and_skips_match_torch(device, optimizer, clip):
    pair = Pair(device, optimizer, init_scale=2.0**10, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    scales = []
    for step in range(12):
        pair.backward(torch.randn(16, 8, generator=gen).to(device), POISON.get(step))
        before = [p.detach().clone() for p in pair.models[1].parameters()]
        (t_opt, g_opt), (t_scaler, g_scaler) = pair.opts, pair.scalers
        if clip:
            t_scaler.unscale_(t_opt)
            t_norm = torch.nn.utils.clip_grad_norm_(pair.models[0].parameters(), 0.3)
            g_norm = g_scaler.unscale_and_clip_(g_opt, 0.3)
            if step in POISON:
                assert not torch.isfinite(g_norm)
            else:
                torch.testing.assert_close(g_norm, t_norm, rtol=RTOL, atol=0)
        assert g_scaler.step(g_opt) == t_scaler.step(t_opt)
        assert g_scaler.found_inf(g_opt).item() == float(step in POISON)
        t_scaler.update()
        g_scaler.update()
        skipped = all(torch.equal(a, b) for a, b in zip(before, pair.models[1].parameters(), strict=True))
        assert skipped == (step in POISON), step
        pair.assert_same()
        scales.append(g_scaler.get_scale())
    # The schedule exercised both directions: two backoffs in a row, and growth.
    assert scales[3] == scales[2] / 2 and scales[4] == scales[3] / 2 and max(scales) > 2.0**10


@pytest.mark.parametrize("optimizer", ["adamw_fused", "sgd_fused"])
def test_fused_optimizer_gets_the_clip_folded_into_its_read(optimizer):
    """unscale_and_clip_ only reads the gradients; step applies unscale and clip together."""
    pair = Pair("cpu", optimizer)
    pair.backward(torch.randn(16, 8))
    grads = [p.grad.clone() for p in pair.models[1].parameters()]
    norm = pair.scalers[1].unscale_and_clip_(pair.opts[1], 0.05)
    assert all(torch.equal(p.grad, g) for p, g in zip(pair.models[1].parameters(), grads, strict=True))
    # Handed to the optimizer at once (issue 24.1: a direct opt.step() applies it too), and
    # withdrawn after the step.
    assert torch.is_tensor(pair.opts[1].grad_scale) and torch.is_tensor(pair.opts[1].found_inf)
    pair.scalers[0].unscale_(pair.opts[0])
    torch_norm = torch.nn.utils.clip_grad_norm_(pair.models[0].parameters(), 0.05)
    torch.testing.assert_close(norm, torch_norm, rtol=RTOL, atol=0)
    assert norm > 0.05  # the clip was active
    for scaler, opt in zip(pair.scalers, pair.opts, strict=True):
        scaler.step(opt)
        scaler.update()
    pair.assert_same()
    assert not hasattr(pair.opts[1], "grad_scale") and not hasattr(pair.opts[1], "found_inf")


def test_unscale_is_one_fused_pass_over_mixed_dtypes(monkeypatch):
    """fp32 and bf16 gradients in one call; the same values and found_inf as torch's."""
    grads = [torch.randn(100) * 2.0**12, torch.randn(7, 3).bfloat16() * 2.0**12]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, q, g in zip(params, copies, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    scalers = torch.amp.GradScaler("cpu", init_scale=2.0**12), gradfuse.GradScaler("cpu", init_scale=2.0**12)
    opts = torch.optim.SGD(copies, lr=0.1), torch.optim.SGD(params, lr=0.1)
    for scaler in scalers:
        scaler.scale(torch.ones(()))
    # The op's implementation, which its eager entry and the dispatcher both run.
    op = gradfuse.ops.unscale_and_check_op
    calls, real = [], op.run
    monkeypatch.setattr(op, "run", lambda *args: calls.append(args[0]) or real(*args))
    scalers[1].unscale_(opts[1])
    scalers[0].unscale_(opts[0])
    assert len(calls) == 1 and len(calls[0]) == 2
    for p, q in zip(params, copies, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert scalers[1].found_inf(opts[1]).item() == 0.0


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_without_loss_scaling_a_disabled_scaler_clips_through_the_optimizer(optimizer):
    """bf16/fp32 training: GradScaler(enabled=False) gives the clip of torch's clip_grad_norm_."""
    models = [_model("cpu"), _model("cpu")]
    opts = [OPTIMIZERS[optimizer](m.parameters()) for m in models]
    scaler = gradfuse.GradScaler("cpu", enabled=False)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(16, 8, generator=gen)
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.1)
        opts[0].step()
        grads = [p.grad.clone() for p in models[1].parameters()]
        norm = scaler.unscale_and_clip_(opts[1], 0.1)
        torch.testing.assert_close(norm, torch_norm, rtol=RTOL, atol=0)
        if "fused" in optimizer:  # read only
            assert all(torch.equal(p.grad, g) for p, g in zip(models[1].parameters(), grads, strict=True))
        scaler.step(opts[1])
        scaler.update()
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=1e-7)
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_without_loss_scaling_a_nan_gradient_skips_the_step(optimizer):
    model = _model("cpu")
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = gradfuse.GradScaler("cpu", enabled=False)
    model(torch.randn(4, 8)).sum().backward()
    model[2].bias.grad[0] = math.nan
    before = copy.deepcopy(model.state_dict())
    assert torch.isnan(scaler.unscale_and_clip_(opt, 1.0))
    assert scaler.found_inf(opt).item() == 1.0
    scaler.step(opt)
    scaler.update()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_state_dicts_load_both_ways():
    pair = Pair("cpu", "adamw", init_scale=2.0**8, growth_interval=2)
    gen = torch.Generator().manual_seed(3)
    for step in range(5):  # grow, back off: a state that is not the default
        pair.backward(torch.randn(4, 8, generator=gen), math.inf if step == 3 else None)
        for scaler, opt in zip(pair.scalers, pair.opts, strict=True):
            scaler.step(opt)
            scaler.update()
    torch_state, ours_state = (s.state_dict() for s in pair.scalers)
    assert ours_state == torch_state and ours_state["_growth_tracker"] == 1
    into_ours, into_torch = gradfuse.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    into_ours.load_state_dict(torch_state)
    into_torch.load_state_dict(ours_state)
    assert into_ours.state_dict() == into_torch.state_dict() == torch_state
    # Both continue identically from the loaded state.
    pair.scalers = [into_torch, into_ours]
    for step in range(3):
        pair.backward(torch.randn(4, 8, generator=gen), math.nan if step == 1 else None)
        for scaler, opt in zip(pair.scalers, pair.opts, strict=True):
            scaler.step(opt)
            scaler.update()
        pair.assert_same()
    assert pickle.loads(pickle.dumps(into_ours)).state_dict() == into_ours.state_dict()


def test_misuse_is_refused_like_torchs_unscale():
    pair = Pair("cpu", "adamw_fused")
    pair.backward(torch.randn(4, 8))
    scaler, opt = pair.scalers[1], pair.opts[1]
    grads = [p.grad.clone() for p in pair.models[1].parameters()]
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        scaler.unscale_and_clip_(opt, -1.0)
    with pytest.raises(ValueError, match="norm_type must be a real number"):
        scaler.unscale_and_clip_(opt, 1.0, math.nan)
    assert all(torch.equal(p.grad, g) for p, g in zip(pair.models[1].parameters(), grads, strict=True))
    scaler.unscale_and_clip_(opt, 1.0)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_and_clip_(opt, 1.0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_and_clip_(opt, 1.0)
    disabled = gradfuse.GradScaler("cpu", enabled=False)
    disabled.unscale_and_clip_(opt, 1.0)
    with pytest.raises(RuntimeError, match="already been called"):
        disabled.unscale_and_clip_(opt, 1.0)


def test_fp16_gradients_are_refused_as_torch_refuses_them():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    p.grad = torch.ones(3, dtype=torch.float16)
    scaler, opt = gradfuse.GradScaler("cpu"), torch.optim.SGD([p], lr=0.1)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


class _OwnParameter(torch.nn.Parameter):
    """A parameter subclass: its gradients are read in Python, not by the Rust core's pass."""


FP16_CALLS = {
    "unscale_": lambda scaler, opt: scaler.unscale_(opt),
    "unscale_and_clip_": lambda scaler, opt: scaler.unscale_and_clip_(opt, 0.1),
    "step": lambda scaler, opt: scaler.step(opt),
}


@pytest.mark.parametrize("call", FP16_CALLS)
@pytest.mark.parametrize("where", [0, 2])
@pytest.mark.parametrize("kind", [torch.nn.Parameter, _OwnParameter], ids=["plain", "subclass"])
def test_fp16_gradients_anywhere_are_refused_and_nothing_changes(call, where, kind):
    """The refusal is read in the same pass as the gradients (plain parameters) or in a pass of
    its own (others): either way torch's error, wherever the fp16 gradient sits, and no gradient,
    weight or optimizer state touched."""
    gen = torch.Generator().manual_seed(where)
    dtypes = [torch.float32] * 3
    dtypes[where] = torch.float16
    params = [kind(torch.randn(5, generator=gen).to(d)) for d in dtypes]
    for p in params:
        p.grad = (torch.randn(5, generator=gen) * 100).to(p.dtype)
    before = [(p.detach().clone(), p.grad.clone(), p.grad._version) for p in params]
    scaler, opt = gradfuse.GradScaler("cpu"), torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        FP16_CALLS[call](scaler, opt)
    for p, (w, g, version) in zip(params, before, strict=True):
        assert same_bits(p.detach(), w) and same_bits(p.grad, g) and p.grad._version == version
    # A disabled scaler does not refuse (nor unscale): torch's rule.
    assert gradfuse.GradScaler("cpu", enabled=False).unscale_and_clip_(opt, 1e9).isfinite()


SPAN_CALLS = {
    "unscale_": lambda scaler, opt: scaler.unscale_(opt),
    "unscale_and_clip_": lambda scaler, opt: scaler.unscale_and_clip_(opt, 0.1),
    "unscale_and_clip_ fused": lambda scaler, opt: scaler.unscale_and_clip_(opt, 0.1),
}


@pytest.mark.parametrize("call", SPAN_CALLS)
def test_gradients_spanning_devices_end_as_when_grouped_first(call, monkeypatch):
    """The scaler tries one device first, unchecked, and groups the gradients by device only when
    the op finds a list that spans devices (before it writes). A list on the CPU and on meta (a
    device gradfuse has no kernels for) must end exactly as when the devices are read first:
    the CPU gradient unscaled once, by torch's path, or the same error."""

    def run(check_first: bool):
        if check_first:  # the scaler's behaviour before: every device read up front
            real = gradfuse.scaler._fused_groups
            checked = lambda t, one_device, plain=False: real(t, False, plain)  # noqa: E731
            monkeypatch.setattr(gradfuse.clip, "_fused_groups", checked)
        gen = torch.Generator().manual_seed(0)
        params = params_of([torch.randn(6, generator=gen) * 8, torch.randn(3, device="meta")])
        opt = torch.optim.AdamW(params, lr=0.1, fused=call.endswith("fused"))
        scaler = gradfuse.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))
        try:
            SPAN_CALLS[call](scaler, opt)
            outcome = ("returned", None)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            outcome = ("raised", f"{type(e).__name__}: {e}")
        monkeypatch.undo()
        return outcome, params[0].grad.clone()

    (kind, how), grad = run(check_first=False)
    (kind2, how2), grad2 = run(check_first=True)
    assert (kind, how) == (kind2, how2)
    assert same_bits(grad, grad2)


@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_other_norm_types(norm_type):
    pair = Pair("cpu", "adamw_fused")
    pair.backward(torch.randn(8, 8))
    t_scaler, g_scaler = pair.scalers
    t_scaler.unscale_(pair.opts[0])
    expected = torch.nn.utils.clip_grad_norm_(pair.models[0].parameters(), 0.01, norm_type)
    torch.testing.assert_close(g_scaler.unscale_and_clip_(pair.opts[1], 0.01, norm_type), expected, rtol=RTOL, atol=0)
    for scaler, opt in zip(pair.scalers, pair.opts, strict=True):
        scaler.step(opt)
        scaler.update()
    pair.assert_same()


@pytest.mark.parametrize("clip", [False, True], ids=["unscale", "unscale_and_clip"])
def test_sparse_gradients_take_torchs_path_with_torchs_answer(clip):
    """gradfuse's kernels take dense gradients; sparse ones are unscaled (and clipped) by torch."""
    models = [torch.nn.Embedding(10, 3, sparse=True) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scalers = torch.amp.GradScaler("cpu", init_scale=4.0), gradfuse.GradScaler("cpu", init_scale=4.0)
    ids = torch.tensor([1, 2, 2, 7])
    for model, scaler in zip(models, scalers, strict=True):
        scaler.scale(model(ids).pow(2).sum()).backward()
    scalers[0].unscale_(opts[0])
    if clip and not TORCH_MEASURES_SPARSE:
        # torch's answer is its error (torch 2.11): after torch's unscale_, its clip raises and the
        # gradients stay unscaled, not clipped; gradfuse's unscale_and_clip_ leaves them the same.
        with pytest.raises(NotImplementedError, match=SPARSE_NORM_ERROR):
            torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.5)
        with pytest.raises(NotImplementedError, match=SPARSE_NORM_ERROR):
            scalers[1].unscale_and_clip_(opts[1], 0.5)
    elif clip:
        expected = torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.5)
        torch.testing.assert_close(scalers[1].unscale_and_clip_(opts[1], 0.5), expected)
    else:
        scalers[1].unscale_(opts[1])
    assert models[1].weight.grad.is_sparse
    torch.testing.assert_close(models[1].weight.grad.to_dense(), models[0].weight.grad.to_dense())
    for scaler, opt in zip(scalers, opts, strict=True):
        scaler.step(opt)
        scaler.update()
    torch.testing.assert_close(models[1].weight, models[0].weight)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("devices", [1, 2])
def test_max_norm_inf_clips_nothing_even_on_an_overflow_step(fused, devices):
    """``max_norm=inf`` (the Trainer's "no clipping"): the gradients of an overflow step are
    left as they were, unscaled, never multiplied by torch's ``inf / inf = NaN`` coefficient,
    which would hide which gradients held the inf. The step is skipped all the same."""
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    params[0].grad = torch.tensor([4.0, math.inf, 8.0])
    params[1].grad = torch.tensor([4.0, 2.0, 6.0])
    if devices == 2:  # two groups (fp32 and fp64): the measure-then-scale branch
        params[1] = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        params[1].grad = torch.tensor([4.0, 2.0, 6.0], dtype=torch.float64)
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused)
    scaler = gradfuse.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))  # the scale exists from the first scale() on, as in torch
    norm = scaler.unscale_and_clip_(opt, math.inf)
    assert math.isinf(norm.item()) and scaler.found_inf(opt).item() == 1.0
    unscaled = [[2.0, math.inf, 4.0], [2.0, 1.0, 3.0]] if not fused else [[4.0, math.inf, 8.0], [4.0, 2.0, 6.0]]
    for p, want in zip(params, unscaled, strict=True):  # fused: unscaled inside the optimizer's read
        assert p.grad.tolist() == want
    scaler.step(opt)
    assert all(not p.detach().any() for p in params)  # skipped


# --- a folded clip is never lost (issue 24.1) ------------------------------------------------


STEPS_24, OVERFLOW_24 = 6, 3


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_fused", "adamw", "adamw_fused"])
@pytest.mark.parametrize("init_scale", [2.0**10, None], ids=["scaled", "disabled"])
@pytest.mark.parametrize("how", ["opt.step", "scaler.step"])
def test_unscale_and_clip_then_either_step_matches_torchs_unscale_clip_step(optimizer, init_scale, how):
    """``unscale_and_clip_`` followed by ``opt.step()`` (torch's own pattern is ``unscale_`` then
    ``opt.step()``) or by ``scaler.step(opt)``, against torch's ``scaler.unscale_`` +
    ``clip_grad_norm_`` + ``opt.step()``, weights compared after every step. Before the fix a
    fused optimizer's direct step ran on the raw gradients: neither unscaled nor clipped.

    The overflow step (an inf in one gradient): torch's direct ``opt.step()`` writes the NaN it
    was given into the weights, and so does gradfuse with a plain optimizer, whose gradients
    it unscaled and clipped in place; a fused optimizer reads the ``found_inf`` handed over with
    the clip and skips the step, as it does under ``scaler.step``, which skips on every path."""
    enabled = init_scale is not None
    kwargs = dict(init_scale=init_scale, growth_interval=2) if enabled else dict(enabled=False)
    pair = Pair("cpu", optimizer, **kwargs)
    (t_opt, g_opt), (t_scaler, g_scaler) = pair.opts, pair.scalers
    gen = torch.Generator().manual_seed(11)
    direct = how == "opt.step"
    for step in range(STEPS_24):
        overflow = step == OVERFLOW_24
        pair.backward(torch.randn(16, 8, generator=gen) * 4, math.inf if overflow else None)
        t_scaler.unscale_(t_opt)
        t_norm = torch.nn.utils.clip_grad_norm_(pair.models[0].parameters(), 0.5)
        g_norm = g_scaler.unscale_and_clip_(g_opt, 0.5)
        if not overflow:
            torch.testing.assert_close(g_norm, t_norm, rtol=RTOL, atol=0)
            assert t_norm > 0.5  # the clip is active
        skips = overflow and (not direct or "fused" in optimizer)
        if not skips:
            t_opt.step()
        if direct:
            g_opt.step()
        else:
            g_scaler.step(g_opt)
        for opt in (t_opt, g_opt):
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf"), "leaked into the next step"
        t_scaler.update()
        g_scaler.update()
        if overflow and not skips:  # torch's NaN, and gradfuse's: the loop cannot go on from there
            assert any(p.isnan().any() for p in pair.models[0].parameters())
            for a, b in zip(pair.models[0].parameters(), pair.models[1].parameters(), strict=True):
                torch.testing.assert_close(b, a, rtol=RTOL, atol=1e-7, equal_nan=True)
            return
        pair.assert_same()
        assert g_scaler.get_scale() == (t_scaler.get_scale() if enabled else 1.0)
    assert not enabled or g_scaler.get_scale() != 2.0**10  # it backed off (and grew) as torch's


@pytest.mark.parametrize("enabled", [True, False])
def test_a_folded_clip_no_step_took_is_written_by_update(enabled):
    """``unscale_and_clip_``, then ``update()`` without any step (a step the caller skipped):
    the fold is not dropped. The gradients end as torch's ``unscale_`` + ``clip_grad_norm_``
    leave them, nothing stays on the optimizer, and the next step is a plain one."""
    kwargs = dict(init_scale=2.0**10) if enabled else dict(enabled=False)
    pair = Pair("cpu", "adamw_fused", **kwargs)
    (t_opt, g_opt), (t_scaler, g_scaler) = pair.opts, pair.scalers
    pair.backward(torch.randn(16, 8) * 4)
    t_scaler.unscale_(t_opt)
    torch.nn.utils.clip_grad_norm_(pair.models[0].parameters(), 0.5)
    g_scaler.unscale_and_clip_(g_opt, 0.5)
    assert hasattr(g_opt, "grad_scale")  # handed over, for whichever step comes
    t_scaler.update()
    g_scaler.update()
    assert not hasattr(g_opt, "grad_scale") and not hasattr(g_opt, "found_inf")
    for p, q in zip(pair.models[0].parameters(), pair.models[1].parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=1e-8)
    # A later plain step reads the gradients as they are, with no leftover scale.
    t_opt.step()
    g_opt.step()
    pair.assert_same()


def test_a_second_step_after_a_direct_one_is_refused_and_a_new_iteration_works():
    """After ``unscale_and_clip_`` + ``opt.step()``, ``scaler.step(opt)`` or ``opt.step()`` would
    step again on the raw gradients: refused with a clear error. With a disabled scaler (no
    ``update()`` needed),
    the next iteration's ``unscale_and_clip_`` + ``opt.step()`` works, and its clip is its own."""
    for enabled in (True, False):
        kwargs = dict(init_scale=2.0**4) if enabled else dict(enabled=False)
        pair = Pair("cpu", "sgd_fused", **kwargs)
        (t_opt, g_opt), (t_scaler, g_scaler) = pair.opts, pair.scalers
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            pair.backward(torch.randn(16, 8, generator=gen) * 4)
            t_scaler.unscale_(t_opt)
            torch.nn.utils.clip_grad_norm_(pair.models[0].parameters(), 0.5)
            t_opt.step()
            g_scaler.unscale_and_clip_(g_opt, 0.5)
            g_opt.step()
            before = [p.detach().clone() for p in pair.models[1].parameters()]
            with pytest.raises(RuntimeError, match="already"):
                g_scaler.step(g_opt)
            with pytest.raises(RuntimeError, match="no backward since the last step"):
                g_opt.step()  # torch would step on its clipped gradients again; these are raw
            assert all(torch.equal(a, b) for a, b in zip(before, pair.models[1].parameters(), strict=True))
            if enabled:
                t_scaler.update()
                g_scaler.update()
            pair.assert_same()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_direct_step_after_scaler_step_of_a_fold_is_refused_until_the_next_backward(enabled):
    """``scaler.step(opt)`` applied the fold; an ``opt.step()`` before the next backward would run
    on the still scaled, unclipped gradients (torch's ``unscale_`` pattern would repeat its
    clipped step): refused, nothing changed. After a backward, steps are the caller's again."""
    kwargs = dict(init_scale=2.0**8) if enabled else dict(enabled=False)
    pair = Pair("cpu", "adamw_fused", **kwargs)
    opt, scaler, model = pair.opts[1], pair.scalers[1], pair.models[1]
    pair.backward(torch.randn(16, 8) * 4)
    scaler.unscale_and_clip_(opt, 0.5)
    scaler.step(opt)
    scaler.update()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="no backward since the last step"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    opt.step()  # refused once, then the caller's decision (torch's rules)
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()  # a plain step on fresh gradients: not refused


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_fused", "adamw", "adamw_fused"])
def test_a_disabled_scaler_needs_no_update_between_direct_steps(optimizer):
    """Clipping without loss scaling, ``unscale_and_clip_`` + ``opt.step()`` every iteration and
    no ``update()`` (a no-op on a disabled scaler, torch's and gradfuse's): every step as torch's
    ``clip_grad_norm_`` + ``opt.step()``. Before the fix a plain optimizer's second iteration
    raised "unscale_and_clip_() has already been called on this optimizer since the last
    step()", although it had stepped (only a fused optimizer's step was seen)."""
    pair = Pair("cpu", optimizer, enabled=False)
    (t_opt, g_opt), (_, g_scaler) = pair.opts, pair.scalers
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        pair.backward(torch.randn(16, 8, generator=gen) * 4)
        t_norm = torch.nn.utils.clip_grad_norm_(pair.models[0].parameters(), 0.5)
        g_norm = g_scaler.unscale_and_clip_(g_opt, 0.5)
        torch.testing.assert_close(g_norm, t_norm, rtol=RTOL, atol=0)
        assert t_norm > 0.5  # the clip is active
        t_opt.step()
        g_opt.step()
        pair.assert_same()
