"""Spike-aware skipping (``gradfuse.train.health``, ``TrainConfig(skip_spikes=...)``).

The windows' statistics are compared with a float64 reference of the rule written in Python
(mean and unbiased standard deviation of the kept values, spikes kept out); the Trainer is run
with an injected loss spike and an injected gradient spike, each of which must be skipped (the
weights do not move over that step), and without spikes, where skipping must change nothing, bit
for bit.
"""

from __future__ import annotations

import io
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from gradfuse.train import TrainConfig, Trainer
from gradfuse.train.health import SpikeSkipper


def reference_spikes(values, window, threshold, warmup):
    """The rule in Python floats: per step, whether (loss, norm) spiked; spikes not kept."""
    kept, out = [], []
    for loss, norm in values:
        spike = False
        if len(kept) >= warmup and all(map(math.isfinite, (loss, norm))):
            last = kept[-window:]
            for i, x in enumerate((loss, norm)):
                col = [v[i] for v in last]
                spike |= x > statistics.fmean(col) + threshold * statistics.stdev(col)
        if not spike and all(map(math.isfinite, (loss, norm))):
            kept.append((loss, norm))
        out.append(spike)
    return out


def test_skipper_matches_the_rule_and_keeps_spikes_out():
    gen = torch.Generator().manual_seed(0)
    values = [
        (2.0 + 0.1 * torch.randn((), generator=gen).item(), 1.0 + 0.05 * torch.rand((), generator=gen).item())
        for _ in range(40)
    ]
    values[12] = (9.0, values[12][1])  # loss spike
    values[20] = (values[20][0], 7.0)  # gradient spike
    values[21] = (values[21][0], 6.5)  # right after: still a spike (the first stayed out)
    values[25] = (math.nan, 1.0)  # non-finite: neither a spike nor kept
    skipper = SpikeSkipper(window=8, threshold=4.0, warmup=5)
    got = [bool(skipper.check_(torch.tensor(loss), torch.tensor(norm)).item()) for loss, norm in values]
    want = reference_spikes(values, 8, 4.0, 5)
    assert got == want
    assert [i for i, s in enumerate(got) if s] == [12, 20, 21]


def test_skipper_state_resumes_exactly():
    values = [(1.0 + 0.01 * i, 2.0 - 0.01 * i) for i in range(30)]
    a, b = SpikeSkipper(6, 3.0, 4), SpikeSkipper(6, 3.0, 4)
    flags_a = [a.check_(torch.tensor(x), torch.tensor(y)).item() for x, y in values]
    flags_b = [b.check_(torch.tensor(x), torch.tensor(y)).item() for x, y in values[:13]]
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c = SpikeSkipper(6, 3.0, 4)
    c.load_state_dict(torch.load(buf))
    flags_b += [c.check_(torch.tensor(x), torch.tensor(y)).item() for x, y in values[13:]]
    assert flags_a == flags_b and torch.equal(a._values, c._values)
    with pytest.raises(ValueError, match="saved with skip_spikes"):
        SpikeSkipper(7, 3.0, 4).load_state_dict(b.state_dict())


def test_config_is_checked_naming_the_field():
    with pytest.raises(ValueError, match=r"TrainConfig.skip_spikes: window"):
        TrainConfig(skip_spikes=(1, 3.0, 1))
    with pytest.raises(ValueError, match=r"TrainConfig.skip_spikes: threshold"):
        TrainConfig(skip_spikes=(8, -1.0, 4))
    with pytest.raises(ValueError, match=r"TrainConfig.skip_spikes: warmup"):
        TrainConfig(skip_spikes=(8, 3.0, 9))
    with pytest.raises(TypeError, match=r"TrainConfig.skip_spikes must be"):
        TrainConfig(skip_spikes=8)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))

    def forward(self, x):
        return self.net(x)


def data(n=96, batch=8):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def run(skip_spikes, spike_at=None, kind=None, precision="fp32", steps=24):
    """Trains; returns (rows, weights before/after every step) with a spike injected at step
    ``spike_at`` (1-based): ``loss`` scales the loss by 50 (gradients too), ``grad`` adds a term
    whose value is 0 but whose gradient is large (the loss is unchanged)."""
    model = Regression()
    calls = {"n": 0}

    def loss_fn(model, batch):
        x, y = batch
        pred = model(x)
        loss = F.mse_loss(pred, y)
        calls["n"] += 1
        if calls["n"] == spike_at:
            if kind == "loss":
                loss = loss * 50
            else:
                loss = loss + 200 * (pred - pred.detach()).sum()
        return loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = TrainConfig(max_steps=steps, log_every=1, progress=False, skip_spikes=skip_spikes, precision=precision)
    trainer = Trainer(model, opt, data(), cfg, loss_fn=loss_fn)
    snapshots = [[p.detach().clone() for p in model.parameters()]]
    rows = []
    model.train()
    for _ in range(steps):
        rows.append(trainer.train_step())
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return rows, snapshots


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_an_injected_spike_is_skipped(kind):
    rows, snaps = run((16, 4.0, 8), spike_at=15, kind=kind)
    spiked = [
        r["step"] for r in rows if r["spikes_skipped"] > (rows[r["step"] - 2]["spikes_skipped"] if r["step"] > 1 else 0)
    ]
    assert spiked == [15]
    assert all(torch.equal(a, b) for a, b in zip(snaps[14], snaps[15], strict=True))  # the weights did not move
    assert not all(torch.equal(a, b) for a, b in zip(snaps[15], snaps[16], strict=True))  # training went on
    assert rows[-1]["skipped"] == 0  # not counted as an overflow
    # Without skipping the same spike moves the weights.
    _, plain = run(None, spike_at=15, kind=kind)
    assert not all(torch.equal(a, b) for a, b in zip(plain[14], plain[15], strict=True))


def test_skipping_without_spikes_changes_nothing_bit_for_bit():
    on, snaps_on = run((8, 6.0, 4))
    off, snaps_off = run(None)
    assert on[-1]["spikes_skipped"] == 0
    for a, b in zip(snaps_on[-1], snaps_off[-1], strict=True):
        assert torch.equal(a, b)
    assert [r["loss"] for r in on] == [r["loss"] for r in off]


def test_checkpoint_keeps_the_windows(tmp_path):
    model = Regression()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = TrainConfig(max_steps=6, progress=False, skip_spikes=(8, 6.0, 4), checkpoint_dir=tmp_path)
    trainer = Trainer(model, opt, data(), cfg, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    trainer.fit()
    model2 = Regression()
    resumed = Trainer(
        model2,
        torch.optim.AdamW(model2.parameters(), lr=1e-2),
        data(),
        cfg,
        loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
        resume="latest",
    )
    torch.testing.assert_close(resumed.spikes._values, trainer.spikes._values, rtol=0, atol=0, equal_nan=True)
    assert resumed.spikes._count.item() == trainer.spikes._count.item() == 6


# --- clipping policies in the Trainer -------------------------------------------------------


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def train_with(clip, options, steps=10, **extra):
    model = Regression()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = TrainConfig(
        max_steps=steps, log_every=1, progress=False, clip=clip, clip_options=options, max_grad_norm=None, **extra
    )
    return model, Trainer(model, opt, data(), cfg, loss_fn=mse)


@pytest.mark.parametrize(
    ("clip", "options"),
    [
        ("zclip", {"warmup_steps": 3, "max_grad_norm": None, "z_thresh": 0.5}),
        ("autoclip", {"quantile": 0.3, "history_length": 4}),
    ],
)
def test_trainer_policy_matches_a_hand_written_loop(clip, options):
    import gradfuse
    from gradfuse.clipping import make_policy

    model, trainer = train_with(clip, options)
    rows = trainer.fit()
    ref = Regression()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    policy = make_policy(clip, **options)
    batches = iter(data())
    coefs = []
    for _ in range(10):
        opt.zero_grad()
        mse(ref, next(batches)).backward()
        gradfuse.clip_grad_norm_(ref.parameters(), policy)
        coefs.append(policy.last_coef.item())
        opt.step()
    assert any(c < 1 for c in coefs)  # the policy clipped (a test that can fail)
    assert [r["clip_coef"] for r in rows] == pytest.approx(coefs, rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        # The Trainer folds the coefficient into fused AdamW's grad_scale (a division by 1/coef).
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_trainer_policy_state_resumes_exactly(tmp_path):
    options = {"warmup_steps": 3, "max_grad_norm": None, "z_thresh": 0.5}
    straight, t1 = train_with("zclip", options, steps=8)
    t1.fit()
    _, first_half = train_with("zclip", options, steps=4, checkpoint_dir=tmp_path)
    first_half.fit()
    model = Regression()
    cfg = TrainConfig(
        max_steps=8, progress=False, clip="zclip", clip_options=options, max_grad_norm=None, checkpoint_dir=tmp_path
    )
    t3 = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), data(), cfg, loss_fn=mse, resume="latest"
    )
    assert t3.clip_policy._count.item() == 3 and t3.step == 4
    t3.fit()
    for p, q in zip(straight.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_trainer_agc_clips_unit_wise():
    model, trainer = train_with("agc", {"clip_factor": 0.001}, steps=3)
    rows = trainer.fit()
    plain, t = train_with("norm", None, steps=3)
    t.fit()
    assert all(math.isnan(r["clip_coef"]) for r in rows)  # no single coefficient: said so
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True))


def test_clip_config_is_checked_naming_the_field():
    with pytest.raises(ValueError, match=r"TrainConfig.max_grad_norm must be None with clip='zclip'"):
        TrainConfig(clip="zclip")
    with pytest.raises(ValueError, match=r"TrainConfig.clip must be one of"):
        TrainConfig(clip="clipz", max_grad_norm=None)
    with pytest.raises(ValueError, match=r"TrainConfig.clip_options: .*quantile"):
        TrainConfig(clip="autoclip", clip_options={"quantile": 2.0}, max_grad_norm=None)
    with pytest.raises(ValueError, match=r"TrainConfig.clip_options is for"):
        TrainConfig(clip_options={"quantile": 0.5})


# --- per-module gradient norms ------------------------------------------------------------


def test_module_prefix():
    from gradfuse.train.health import module_prefix

    assert module_prefix("blocks.0.mlp.0.weight", 2) == "blocks.0"
    assert module_prefix("head.weight", 2) == "head"
    assert module_prefix("scale", 1) == "scale"


@pytest.mark.parametrize("clip", ["norm", "zclip"])
def test_layer_norms_from_the_clips_read(clip):
    """Per-module norms and largest magnitudes of the unscaled gradients on log steps, against
    float64 references from gradients captured in a hand-run copy; the step is unchanged."""
    options = {"warmup_steps": 2, "max_grad_norm": None} if clip == "zclip" else None
    max_norm = 0.05 if clip == "norm" else None
    runs = {}
    for depth in (None, 1):
        model = Regression()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        cfg = TrainConfig(
            max_steps=4, log_every=2, progress=False, clip=clip, clip_options=options, max_grad_norm=max_norm,
            log_grad_norms=depth,
        )  # fmt: skip
        trainer = Trainer(model, opt, data(), cfg, loss_fn=mse)
        captured = []
        model.net[0].weight.register_hook(lambda g, out=captured: out.append(g.detach().clone()))
        rows = [trainer.train_step() for _ in range(4)]
        runs[depth] = (model, rows, captured)
    (plain, plain_rows, _), (model, rows, captured) = runs[None], runs[1]
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)  # logging changed nothing
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain_rows]
    logged = [r for r in rows if "grad_norm/net" in r]
    assert [r["step"] for r in logged] == [1, 2, 4]
    assert "grad_norm/net" not in rows[2]
    # One module at depth 1 ("net"): its norm is the total; its largest magnitude is checked
    # against the first layer's weight gradient as autograd produced it (a lower bound, and
    # exact when that tensor holds the largest element).
    for r in logged:
        assert r["grad_norm/net"] == pytest.approx(r["grad_norm"], rel=1e-6)
        assert r["grad_amax/net"] >= captured[r["step"] - 1].abs().max().item() * (1 - 1e-7)


def test_layer_norms_per_module_against_float64():
    from gradfuse.train.health import LayerStatsProbe

    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(5), torch.randn(4, 5), torch.randn(4)]
    grads[2][1, 1] = 40.0
    prefixes = {id(grads[0]): "a", id(grads[1]): "a", id(grads[2]): "b", id(grads[3]): "b"}
    from gradfuse.clipping import NormClip
    from gradfuse.ops import multi_tensor_stats

    for p in (2.0, 1.0, math.inf):
        probe = LayerStatsProbe(NormClip(1.0), prefixes, ["a", "b"], p)
        inv = torch.tensor(0.25)
        probe.observe_stats(grads, multi_tensor_stats(grads, p), inv)
        got = probe.values(torch.device("cpu"))
        for i, members in enumerate([grads[:2], grads[2:]]):
            flat = torch.cat([g.reshape(-1) for g in members]).double() * 0.25
            assert got[i].item() == pytest.approx(torch.linalg.vector_norm(flat, p).item(), rel=2e-6)
            assert got[2 + i].item() == flat.abs().max().item()


def test_demo_chart_draws_the_per_module_norms(tmp_path):
    pytest.importorskip("matplotlib")
    from gradfuse.demo import write_chart

    rows = [
        {
            "step": s,
            "loss": 2.0 / s,
            "lr": 0.1,
            "grad_norm": 1.0 / s,
            "grad_norm/blocks.0": 0.5 / s,
            "grad_norm/wte": 0.2,
        }
        for s in (1, 10, 20)
    ]
    path = write_chart(tmp_path / "c.png", rows, 1.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
