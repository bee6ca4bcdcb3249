"""gradfuse.Trainer against plain torch: each feature on a tiny model, compared with a
hand-written torch loop or with the same trainer run another way.

fp32 on the CPU is deterministic, so most comparisons are exact or within a few ulps: the
trainer's clip is folded into fused AdamW's read (one rounding where torch's loop has two),
and accumulation sums micro-batch losses in a different order than one large batch.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import gradfuse
from gradfuse.train import NonFiniteLossError, TrainConfig, Trainer, lr_factor

VOCAB, CTX = 17, 6


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.mlp(self.norm(x)))


class TinyLM(torch.nn.Module):
    """Embedding, two residual MLP blocks with dropout, an LM head: returns ``.loss`` for a
    ``{"input_ids", "labels"}`` batch, as transformers models do."""

    def __init__(self, d: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.blocks = torch.nn.Sequential(Block(d), Block(d))
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.blocks(self.embed(input_ids)))
        return SimpleNamespace(loss=F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, CTX + 1), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def loader(n: int = 48, batch: int = 8, shuffle: bool = True):
    return torch.utils.data.DataLoader(Tokens(n), batch_size=batch, shuffle=shuffle)


def adamw(model, fused: bool = True):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)


def config(**overrides) -> TrainConfig:
    return TrainConfig(**{"max_steps": 6, "log_every": 1, "progress": False, **overrides})


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --- against a hand-written torch loop ------------------------------------------------------


def test_losses_match_a_hand_written_torch_loop():
    """Accumulation, clipping, warmup + cosine with a floor, dropout and a shuffled loader."""
    steps, accum, max_norm, peak, warmup, floor = 8, 2, 0.5, 1e-2, 3, 0.1
    cfg = config(
        max_steps=steps, grad_accum_steps=accum, max_grad_norm=max_norm, lr=peak, lr_schedule="cosine",
        warmup_steps=warmup, min_lr_ratio=floor, seed=7,
    )  # fmt: skip
    model = TinyLM()
    rows = Trainer(model, adamw(model), loader(), cfg).fit()

    ref = TinyLM()
    opt = torch.optim.AdamW(ref.parameters(), lr=peak, weight_decay=0.1, fused=True)
    torch.manual_seed(7)
    batches = iter(loader())
    losses, norms = [], []
    for step in range(steps):  # nanoGPT's get_lr, written out
        if step < warmup:
            lr = peak * (step + 1) / warmup
        else:
            ratio = (step - warmup) / (steps - warmup)
            lr = peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * ratio)))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        total = 0.0
        for _ in range(accum):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(loader())
                batch = next(batches)
            loss = ref(**batch).loss / accum
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
        opt.step()
        losses.append(total)

    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    torch.testing.assert_close([r["loss"] for r in rows], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=1e-5, atol=0)
    assert rows[0]["lr"] == pytest.approx(peak / warmup) and rows[-1]["lr"] > floor * peak
    assert any(r["clip_coef"] < 1 for r in rows)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_accumulating_4_batches_of_8_equals_one_batch_of_32():
    runs = []
    for accum, batch in ((4, 8), (1, 32)):
        model = TinyLM()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0  # the two runs see their samples in different micro-batches
        cfg = config(max_steps=3, grad_accum_steps=accum, max_grad_norm=None, lr=1e-2)
        rows = Trainer(model, adamw(model), loader(96, batch, shuffle=False), cfg).fit()
        runs.append((rows, weights(model)))
    (rows4, w4), (rows1, w1) = runs
    torch.testing.assert_close([r["loss"] for r in rows4], [r["loss"] for r in rows1], rtol=1e-6, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows4], [r["grad_norm"] for r in rows1], rtol=1e-5, atol=0)
    torch.testing.assert_close(w4, w1, rtol=1e-5, atol=1e-7)
    assert w4[0].ne(TinyLM().embed.weight).any()  # it trained


# --- precision ------------------------------------------------------------------------------


def test_fp16_overflow_skips_the_step_backs_off_and_names_the_parameter():
    model = TinyLM()
    poison = {"at_step": 3}
    trainer = Trainer(model, adamw(model), loader(), config(max_steps=4, precision="fp16"))
    model.head.bias.register_hook(lambda g: g * math.inf if trainer.step + 1 == poison["at_step"] else g)
    rows, before = [], None
    for _ in range(4):
        if trainer.step + 1 == poison["at_step"]:
            before, scale_before = weights(model), trainer.scaler.get_scale()
            steps_before = [trainer.optimizer.state[p]["step"].item() for p in model.parameters()]
        rows.append(trainer.train_step())
        if trainer.step == poison["at_step"]:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            assert [trainer.optimizer.state[p]["step"].item() for p in model.parameters()] == steps_before
            assert trainer.scaler.get_scale() == scale_before / 2
    bad = rows[poison["at_step"] - 1]
    assert bad["nonfinite_grads"] == ["head.bias"] and bad["skipped"] == 1 and math.isfinite(bad["loss"])
    assert rows[-1]["skipped"] == 1 and "nonfinite_grads" not in rows[-1]
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # step 4 trained


def test_fp16_trainer_matches_torch_amp_recipe():
    """The fp16 trainer against torch's documented recipe: autocast, GradScaler, unscale_,
    clip_grad_norm_, step, update. Same weights, same scale."""
    model = TinyLM()
    cfg = config(max_steps=4, precision="fp16", max_grad_norm=0.5, lr=1e-2)
    rows = Trainer(model, adamw(model), loader(shuffle=False), cfg).fit()

    ref = TinyLM()
    opt, scaler = adamw(ref), torch.amp.GradScaler("cpu")
    torch.manual_seed(0)
    for batch in list(loader(shuffle=False))[:4]:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
    assert rows[-1]["loss_scale"] == scaler.get_scale()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bf16_runs_under_autocast():
    model = TinyLM()
    seen = []
    model.head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    rows = Trainer(model, adamw(model), loader(), config(max_steps=2, precision="bf16")).fit()
    assert seen == [torch.bfloat16, torch.bfloat16] and all(r["loss_scale"] == 1.0 for r in rows)


# --- non-finite losses ----------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_nan_losses_are_skipped_counted_and_stop_training_when_in_a_row(fused):
    model = TinyLM()
    nan_at = {2, 4, 5, 6}  # one alone, then three in a row

    def loss_fn(model, batch):
        loss = model(**batch).loss
        return loss * math.nan if trainer.step + 1 in nan_at else loss

    trainer = Trainer(model, adamw(model, fused), loader(), config(max_steps=10, max_nan_losses=3), loss_fn=loss_fn)
    snapshots = {}
    real_step = trainer.train_step

    def recording_step():
        before = weights(model)
        row = real_step()
        snapshots[row["step"]] = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        return row

    trainer.train_step = recording_step
    with pytest.raises(NonFiniteLossError, match=r"step 6: the loss was not finite in the last 3 steps"):
        trainer.fit()
    assert trainer.nan_losses == 4 and trainer.skipped == 0 and trainer.step == 6
    assert {s for s, unchanged in snapshots.items() if unchanged} == nan_at


# --- activation checkpointing -----------------------------------------------------------------


def test_activation_checkpointing_gives_the_same_gradients_and_recomputes():
    grads, calls = [], []
    for names in ((), ["Block"]):
        model = TinyLM()
        model.blocks[0].mlp.register_forward_hook(lambda *args: calls.append(len(grads)))
        trainer = Trainer(model, adamw(model), loader(), config(activation_checkpointing=names, max_grad_norm=None))
        trainer.train_step()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert calls.count(0) == 1 and calls.count(1) == 2  # forward once, then again in backward


def test_activation_checkpointing_of_an_absent_class_is_an_error():
    model = TinyLM()
    with pytest.raises(ValueError, match=r"activation_checkpointing names \['Blok'\].*Block"):
        Trainer(model, adamw(model), loader(), config(activation_checkpointing=["Blok"]))


# --- schedule, metrics, evaluation -------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedule_endpoints(schedule):
    settings = {"max_steps": 10, "warmup_steps": 4, "schedule": schedule, "min_lr_ratio": 0.2}
    factors = [lr_factor(s, **settings) for s in range(10)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert lr_factor(10, **settings) == pytest.approx(1.0 if schedule == "constant" else 0.2)


def test_metrics_rows_and_json_lines(tmp_path):
    model = TinyLM()
    path = tmp_path / "metrics.jsonl"
    cfg = config(max_steps=5, log_every=2, metrics_path=path, eval_every=4)
    rows = Trainer(model, adamw(model), loader(), cfg, eval_data=list(loader(16, shuffle=False))).fit()
    assert [r["step"] for r in rows] == [1, 2, 4, 5]  # the first, every 2nd, and the last
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    for row in rows:
        assert {"loss", "lr", "grad_norm", "clip_coef", "skipped", "loss_scale", "peak_mem_mb"} <= set(row)
        assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * CTX) and row["peak_mem_mb"] > 0
    assert ["eval_loss" in r for r in rows] == [False, False, True, True]
    assert 0 < rows[-1]["eval_loss"] < 2 * math.log(VOCAB)


def test_default_loss_needs_a_scalar_or_a_loss_attribute():
    model = torch.nn.Linear(CTX, 2)
    data = [torch.randn(4, CTX)] * 2
    with pytest.raises(TypeError, match=r"neither a scalar tensor nor has a scalar `\.loss`; pass"):
        Trainer(model, adamw(model), data, config()).fit()


def test_a_scalar_output_is_the_loss_and_lr_overrides_the_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(CTX, 1), torch.nn.Flatten(0))
    data = [torch.randn(4, CTX) for _ in range(3)]
    trainer = Trainer(
        torch.nn.Sequential(model, _Mean()), adamw(model), data, config(max_steps=4, lr=0.5, max_grad_norm=None)
    )
    rows = trainer.fit()
    assert [r["lr"] for r in rows] == [0.5] * 4 and rows[-1]["loss"] < rows[0]["loss"]


class _Mean(torch.nn.Module):
    def forward(self, x):
        return x.mean()


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("max_steps", -3, ValueError, "max_steps must be at least 1, got -3"),
        ("max_steps", 2.5, TypeError, "max_steps must be an integer"),
        ("grad_accum_steps", 0, ValueError, "grad_accum_steps must be at least 1"),
        ("precision", "fp8", ValueError, "precision must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
        ("lr_schedule", "step", ValueError, "lr_schedule must be one of"),
        ("warmup_steps", 11, ValueError, "warmup_steps is longer than training: 11 > max_steps=10"),
        ("max_grad_norm", -1.0, ValueError, "max_grad_norm must be a positive finite number"),
        ("norm_type", math.nan, ValueError, "norm_type must be a real number"),
        ("lr", -1e-3, ValueError, "lr must be a non-negative finite number"),
        ("min_lr_ratio", 1.5, ValueError, "min_lr_ratio must be between 0 and 1"),
        ("activation_checkpointing", "Block", TypeError, "activation_checkpointing must be a list of module class"),
        ("keep_last", 0, ValueError, "keep_last must be at least 1"),
        ("log_every", 0, ValueError, "log_every must be at least 1"),
        ("save_every", 5, ValueError, "save_every is set but checkpoint_dir is None"),
        ("device", "gpu:0", ValueError, "device is not a torch device"),
        ("progress", "yes", TypeError, "progress must be True or False"),
        ("max_nan_losses", 0, ValueError, "max_nan_losses must be at least 1"),
        ("nonfinite_rerun", 1, TypeError, "nonfinite_rerun must be True or False, got 1"),
        ("find_unused_parameters", "yes", TypeError, "find_unused_parameters must be True or False"),
        ("static_graph", None, TypeError, "static_graph must be True or False"),
    ],
)
def test_impossible_config_values_are_rejected_naming_the_field(field, value, error, message):
    with pytest.raises(error, match="TrainConfig." + message.replace("(", r"\(")):
        TrainConfig(max_steps=10, **{field: value}) if field != "max_steps" else TrainConfig(max_steps=value)


@pytest.mark.parametrize("field", ["find_unused_parameters", "static_graph"])
def test_ddp_options_are_refused_under_fsdp(field):
    """FSDP2 reduces the gradients it has: DDP's options would be silently ignored there."""
    with pytest.raises(ValueError, match=f"TrainConfig.{field} applies to parallel='ddp' only .*parallel='fsdp'"):
        TrainConfig(parallel="fsdp", **{field: True})
    assert getattr(TrainConfig(**{field: True}), field) is True  # parallel="ddp", the default


def test_a_static_graph_is_refused_with_accumulation():
    """torch's DDP breaks under no_sync() with static_graph=True (pytorch/pytorch#143580)."""
    with pytest.raises(ValueError, match=r"TrainConfig.static_graph cannot be combined with grad_accum_steps=2"):
        TrainConfig(static_graph=True, grad_accum_steps=2)


def test_trainer_wants_a_trainconfig():
    model = TinyLM()
    with pytest.raises(TypeError, match=r"config must be a gradfuse\.TrainConfig, got dict"):
        Trainer(model, adamw(model), loader(), {"max_steps": 3})


def test_exports():
    assert gradfuse.Trainer is Trainer and gradfuse.TrainConfig is TrainConfig


def test_a_missing_tqdm_is_a_clear_warning_and_training_goes_on(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setattr(gradfuse.train.metrics, "_is_terminal", lambda stream: True)  # the bar is for terminals
    model = TinyLM()
    with pytest.warns(UserWarning, match=r"progress=True needs tqdm \(pip install tqdm\)"):
        rows = Trainer(model, adamw(model), loader(), config(max_steps=2, progress=True)).fit()
    assert [r["step"] for r in rows] == [1, 2]
