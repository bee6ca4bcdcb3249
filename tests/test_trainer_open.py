"""gradfuse.Trainer open to the user's own code: a schedule of their own (a torch scheduler or a
``step -> lr`` function), loss-scaler settings, ``torch.compile``, capped evaluations, the best
checkpoint, callbacks, TensorBoard (its event files read back) and token-exact gradient
accumulation against one big batch's token-mean loss.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_trainer import TinyLM, adamw, config, loader

from gradfuse.train import Trainer, list_checkpoints, load_checkpoint
from gradfuse.train.checkpoint import checkpoint_path
from reference import SPARSE_NORM_ERROR, TORCH_MEASURES_SPARSE

# --- scheduler= ----------------------------------------------------------------------------------


def nanogpt_lr(step, *, learning_rate=6e-3, warmup_iters=2, lr_decay_iters=6, min_lr=6e-4):
    """nanoGPT's get_lr, as written there."""
    if step < warmup_iters:
        return learning_rate * (step + 1) / (warmup_iters + 1)
    if step > lr_decay_iters:
        return min_lr
    decay_ratio = (step - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_a_step_to_lr_function_sets_every_steps_lr_and_wins_on_resume(tmp_path):
    model = TinyLM()
    cfg = config(max_steps=8, checkpoint_dir=tmp_path, save_every=4)
    rows = Trainer(model, adamw(model), loader(), cfg, scheduler=nanogpt_lr).fit()
    assert [r["lr"] for r in rows] == pytest.approx([nanogpt_lr(s) for s in range(8)])

    halved = functools.partial(nanogpt_lr, learning_rate=3e-3)
    model = TinyLM()
    trainer = Trainer(model, adamw(model), loader(), cfg, scheduler=halved, resume=checkpoint_path(tmp_path, 4))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(halved(4))  # the very next step's
    assert [r["lr"] for r in trainer.fit()] == pytest.approx([halved(s) for s in range(4, 8)])


def test_a_torch_scheduler_is_stepped_once_per_optimizer_step():
    model = TinyLM()
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    rows = Trainer(model, optimizer, loader(), config(max_steps=6), scheduler=scheduler).fit()
    assert [r["lr"] for r in rows] == pytest.approx([1e-2, 1e-2, 5e-3, 5e-3, 2.5e-3, 2.5e-3])


@pytest.mark.parametrize(
    ("scheduler", "overrides", "error", "match"),
    [
        (nanogpt_lr, {"lr_schedule": "cosine"}, ValueError, r"TrainConfig.lr_schedule='cosine': leave those"),
        (nanogpt_lr, {"lr": 1e-3, "warmup_steps": 2}, ValueError, r"TrainConfig.lr=0.001, TrainConfig.warmup_steps"),
        ("cosine", {}, TypeError, r"a torch LR scheduler .* or a function step -> lr; got str"),
        ("plateau", {}, TypeError, r"got ReduceLROnPlateau"),
        ("other optimizer", {}, ValueError, r"schedules another optimizer"),
    ],
)
def test_a_scheduler_that_would_be_ignored_or_cannot_work_is_refused(scheduler, overrides, error, match):
    model = TinyLM()
    optimizer = adamw(model)
    if scheduler == "plateau":
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    elif scheduler == "other optimizer":
        scheduler = torch.optim.lr_scheduler.StepLR(adamw(TinyLM()), step_size=1)
    with pytest.raises(error, match=match):
        Trainer(model, optimizer, loader(), config(**overrides), scheduler=scheduler)


def test_a_step_to_lr_function_returning_nonsense_is_an_error_naming_the_step():
    model = TinyLM()
    with pytest.raises(ValueError, match=r"scheduler=\.\.\.\) returned nan for step 0"):
        Trainer(model, adamw(model), loader(), config(), scheduler=lambda step: math.nan)


# --- scaler settings, compile --------------------------------------------------------------------


def test_the_loss_scalers_settings_come_from_the_config():
    model = TinyLM()
    cfg = config(precision="fp16", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    trainer = Trainer(model, adamw(model), loader(), cfg)
    assert trainer.scaler.get_scale() == 1024.0
    scales = [(trainer.train_step(), trainer.scaler.get_scale())[1] for _ in range(4)]
    assert scales == [1024.0, 4096.0, 4096.0, 16384.0]
    model.head.bias.register_hook(lambda g: g * math.inf)
    trainer.train_step()
    assert trainer.scaler.get_scale() == 4096.0


@pytest.mark.parametrize("field", ["init_scale", "growth_factor", "backoff_factor", "growth_interval"])
def test_impossible_scaler_settings_name_the_field(field):
    with pytest.raises(ValueError, match=rf"TrainConfig.{field} must be"):
        config(**{field: 0})


def test_compile_runs_the_model_compiled_and_checkpoints_keep_the_modules_names(tmp_path, monkeypatch):
    # The eager backend: dynamo's real OptimizedModule wrapper, without minutes of C++ compilation.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    model = TinyLM()
    trainer = Trainer(model, adamw(model), loader(), config(max_steps=2, compile=True, checkpoint_dir=tmp_path))
    assert type(trainer.net).__name__ == "OptimizedModule" and trainer.model is model
    rows = trainer.fit()
    plain = TinyLM()
    plain_rows = Trainer(plain, adamw(plain), loader(), config(max_steps=2)).fit()
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in plain_rows], rel=1e-6)
    saved = load_checkpoint(list_checkpoints(tmp_path)[-1])["model"]
    assert set(saved) == set(model.state_dict())  # no _orig_mod. prefix

    uncompiled = TinyLM(seed=3)
    resumed = Trainer(
        uncompiled, adamw(uncompiled), loader(), config(max_steps=2), resume=list_checkpoints(tmp_path)[-1]
    )
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.model.parameters(), strict=True))


def test_a_checkpoint_keyed_with_compile_or_ddp_prefixes_loads(tmp_path):
    model = TinyLM()
    Trainer(model, adamw(model), loader(), config(max_steps=1, checkpoint_dir=tmp_path)).fit()
    path = list_checkpoints(tmp_path)[-1]
    state = load_checkpoint(path)
    state["model"] = {f"module._orig_mod.{k}": v for k, v in state["model"].items()}
    from gradfuse.train.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, 1, {k: v for k, v in state.items() if k not in ("format", "version")}, keep_last=1)
    other = TinyLM(seed=5)
    Trainer(other, adamw(other), loader(), config(max_steps=1), resume=path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))


# --- keep_best, callbacks, TensorBoard ----------------------------------------------------------


class Recorder:
    def __init__(self):
        self.steps, self.evals, self.saves = [], [], []

    def on_step_end(self, row):
        self.steps.append(row)

    def on_eval(self, row):
        self.evals.append(row)

    def on_save(self, path):
        assert path.is_file()
        self.saves.append(path.name)


def test_keep_best_and_callbacks(tmp_path):
    recorder = Recorder()
    model = TinyLM()
    eval_data = list(loader(16, 8, shuffle=False))
    cfg = config(max_steps=6, eval_every=1, checkpoint_dir=tmp_path, save_every=2, keep_last=1, keep_best=True, lr=0.3)
    rows = Trainer(model, adamw(model), loader(), cfg, eval_data=eval_data, callbacks=[recorder]).fit()
    eval_losses = [r["eval_loss"] for r in rows]
    best_step = 1 + min(range(6), key=eval_losses.__getitem__)
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["step"] == best_step and best["counters"]["best_eval_loss"] == min(eval_losses)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "step-00000006.pt"]
    assert [r["step"] for r in recorder.steps] == list(range(1, 7))
    assert [r["eval_loss"] for r in recorder.evals] == eval_losses
    improved = [s for s in range(1, 7) if eval_losses[s - 1] == min(eval_losses[:s])]
    saves = sorted([f"step-{s:08d}.pt" for s in (2, 4, 6)] + ["best.pt"] * len(improved))
    assert sorted(recorder.saves) == saves


def test_keep_best_without_eval_data_and_a_callback_with_no_hook_are_refused(tmp_path):
    model = TinyLM()
    with pytest.raises(ValueError, match=r"TrainConfig.keep_best .* needs eval_data"):
        Trainer(model, adamw(model), loader(), config(checkpoint_dir=tmp_path, keep_best=True))
    with pytest.raises(ValueError, match=r"TrainConfig.keep_best is set but checkpoint_dir is None"):
        config(keep_best=True)

    class Misspelt:
        def on_step(self, row):
            pass

    with pytest.raises(TypeError, match=r"callbacks=\.\.\.\)\[1\] \(Misspelt\) has none of the methods"):
        Trainer(model, adamw(model), loader(), config(), callbacks=[Recorder(), Misspelt()])


def test_tensorboard_event_files_hold_the_metrics_rows(tmp_path):
    try:  # in the test extra, so that CI writes and reads real event files
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        pytest.fail("tensorboard is needed to test the TensorBoard output: pip install '.[test]'")

    model = TinyLM()
    cfg = config(max_steps=4, eval_every=2, tensorboard_dir=tmp_path / "tb")
    rows = Trainer(model, adamw(model), loader(), cfg, eval_data=list(loader(16, 8))).fit()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)  # stored as fp32
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert [e.step for e in events.Scalars("eval/loss")] == [s for s, _ in evals] == [2, 4]
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([v for _, v in evals], rel=1e-6)
    assert {"train/lr", "train/grad_norm", "train/clip_coef"} <= set(events.Tags()["scalars"])


def test_tensorboard_dir_without_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    model = TinyLM()
    with pytest.raises(
        ImportError, match=r"tensorboard package is not installed: pip install 'gradfuse\[tensorboard\]'"
    ):
        Trainer(model, adamw(model), loader(), config(tensorboard_dir=tmp_path))


# --- token-exact accumulation -------------------------------------------------------------------

PAD = -100  # cross_entropy's ignore_index


class TokenLM(torch.nn.Module):
    """An embedding and a head: deterministic (no dropout), logits per position."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(17, 12)
        self.head = torch.nn.Linear(12, 17)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.embed(input_ids)))


def padded_batches(lengths_per_batch, width=9, seed=4):
    """Micro-batches of sequences of the given lengths, labels padded with -100 to ``width``."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for lengths in lengths_per_batch:
        ids = torch.randint(0, 17, (len(lengths), width), generator=gen)
        labels = torch.randint(0, 17, (len(lengths), width), generator=gen)
        for row, n in enumerate(lengths):
            labels[row, n:] = PAD
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def summed_loss(model, batch):
    logits = model(batch["input_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=PAD, reduction="sum")
    return loss, (batch["labels"] != PAD).sum()


def mean_loss(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=PAD)


LENGTHS = [[9, 1], [2, 2, 3], [8]]  # 10, 7 and 8 target tokens: very unequal micro-batches


def big_batch_gradient(batches):
    """The gradient of the token-mean loss over all micro-batches as one batch, in float64."""
    ref = TokenLM().double()
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    loss = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten(), ignore_index=PAD)
    loss.backward()
    return loss.item(), [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("normalization", ["tokens", "mean"])
def test_token_exact_accumulation_gives_the_big_batchs_gradient(normalization):
    batches = padded_batches(LENGTHS)
    model = TokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # in-place unscale: p.grad is the step's gradient
    cfg = config(max_steps=1, grad_accum_steps=3, max_grad_norm=None, loss_normalization=normalization)
    loss_fn = summed_loss if normalization == "tokens" else mean_loss
    (row,) = Trainer(model, optimizer, batches, cfg, loss_fn=loss_fn).fit()
    ref_loss, ref_grads = big_batch_gradient(batches)
    if normalization == "mean":  # what a per-micro-batch mean gives instead: visibly not the big batch's
        assert not all(
            torch.allclose(p.grad.double(), g, rtol=1e-3) for p, g in zip(model.parameters(), ref_grads, strict=True)
        )
        return
    assert row["loss"] == pytest.approx(ref_loss, rel=1e-6) and row["target_tokens"] == 25
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad.double(), g, rtol=1e-5, atol=1e-7)  # fp32 sums of ~25 terms


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_token_exact_accumulation_through_fused_adamw_and_loss_scaling(precision):
    """The division folded into the fused optimizer's read: the step equals torch's AdamW step
    on the big batch's gradient, clipping included."""
    batches = padded_batches(LENGTHS)
    model = TokenLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    # A summed loss is larger than a mean by the token count: the fp16 loss scale that fits is smaller.
    cfg = config(
        max_steps=1, grad_accum_steps=3, max_grad_norm=0.05, loss_normalization="tokens", precision=precision,
        init_scale=2.0**8,
    )  # fmt: skip
    (row,) = Trainer(model, opt, batches, cfg, loss_fn=summed_loss).fit()
    _, ref_grads = big_batch_gradient(batches)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads])).item()
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-3 if precision == "fp16" else 1e-5)
    ref = TokenLM()
    for p, g in zip(ref.parameters(), ref_grads, strict=True):
        p.grad = (g * min(1.0, 0.05 / (norm + 1e-6))).float()
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 if precision == "fp16" else 1e-6)


def test_tokens_mode_wants_a_loss_fn_returning_loss_and_count():
    model = TokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"loss_normalization='tokens' needs a loss_fn returning"):
        Trainer(model, optimizer, padded_batches(LENGTHS), config(loss_normalization="tokens"))
    trainer = Trainer(model, optimizer, padded_batches(LENGTHS), config(loss_normalization="tokens"), loss_fn=mean_loss)
    with pytest.raises(TypeError, match=r"loss_fn must return \(summed loss, number of target tokens\), got Tensor"):
        trainer.train_step()
    trainer = Trainer(model, optimizer, padded_batches(LENGTHS), config(), loss_fn=summed_loss)
    with pytest.raises(TypeError, match=r"loss_fn returned a tuple.*loss_normalization='tokens'"):
        trainer.train_step()


def test_tokens_mode_evaluates_the_token_mean():
    batches = padded_batches(LENGTHS)
    model = TokenLM()
    cfg = config(max_steps=1, loss_normalization="tokens")
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.0), batches, cfg, loss_fn=summed_loss, eval_data=batches
    )
    ref_loss, _ = big_batch_gradient(batches)
    assert trainer.evaluate() == pytest.approx(ref_loss, rel=1e-6)


def test_a_step_without_target_tokens_is_skipped_and_said(caplog):
    batches = padded_batches([[0, 0]])
    model = TokenLM()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = config(max_steps=1, loss_normalization="tokens")
    with caplog.at_level("WARNING", "gradfuse.train"):
        (row,) = Trainer(model, optimizer, batches, cfg, loss_fn=summed_loss).fit()
    assert row["target_tokens"] == 0 and row["nan_losses"] == 1  # a mean over no tokens: 0/0
    assert "step 1: no target tokens in any micro-batch" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_readmes_nanogpt_example_schedule_and_loss_fn_train():
    """The README's nanoGPT-style example, its get_lr and loss_fn as written, on a model that
    returns (logits, loss) for (x, y) batches as nanoGPT's does."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "def get_lr" in b]
    namespace = {}
    exec(block.split("config = ")[0], namespace)  # the constants and get_lr
    loss_fn = eval(re.search(r"loss_fn=(lambda .*?),\n", block).group(1))

    class NanoGPTLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = TokenLM()

        def forward(self, idx, targets=None):
            logits = self.lm(idx)
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    gen = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(0, 17, (2, 5), generator=gen), torch.randint(0, 17, (2, 5), generator=gen)) for _ in range(4)
    ]
    model = NanoGPTLike()
    steps = [0, 199, 200, 2600, 5000, 5001]
    trainer = Trainer(model, adamw(model), data, config(max_steps=6000), loss_fn=loss_fn, scheduler=namespace["get_lr"])
    with warnings.catch_warnings():  # the schedule alone (no optimizer step): training 5000 steps is not the point
        warnings.simplefilter("ignore", UserWarning)
        for step in range(max(steps) + 2):
            if step in steps:
                assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(namespace["get_lr"](step))
            trainer.scheduler.step()
    (row,) = Trainer(
        model, adamw(model), data, config(max_steps=1), loss_fn=loss_fn, scheduler=namespace["get_lr"]
    ).fit()
    assert row["lr"] == pytest.approx(6e-4 / 201) and math.isfinite(row["loss"])


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("sparse", [False, True])
def test_unscale_and_clip_divisor_divides_the_gradients_in_the_same_pass(enabled, sparse):
    """``GradScaler.unscale_and_clip_(..., divisor=d)``: norm, clip and gradients of grad / d
    (sparse gradients take torch's path, with the division as one more pass)."""
    emb = torch.nn.Embedding(10, 4, sparse=sparse)
    lin = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD([*emb.parameters(), *lin.parameters()], lr=0.1)
    scaler = __import__("gradfuse").GradScaler("cpu", init_scale=8.0, enabled=enabled)
    loss = lin(emb(torch.tensor([1, 2, 2, 7]))).pow(2).sum()
    scaler.scale(loss).backward()
    scale = 8.0 if enabled else 1.0
    expected = [
        (p.grad.to_dense() if p.grad.is_sparse else p.grad).double() / (scale * 5.0)
        for p in optimizer.param_groups[0]["params"]
    ]
    norm_ref = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected]))
    divisor = torch.tensor(5.0)
    if sparse and not TORCH_MEASURES_SPARSE:
        # torch's answer is its error (torch 2.11): as torch's unscale_, the division, then its
        # clip_grad_norm_ raising, the gradients are left unscaled and divided, not clipped.
        with pytest.raises(NotImplementedError, match=SPARSE_NORM_ERROR):
            scaler.unscale_and_clip_(optimizer, max_norm=0.5 * norm_ref.item(), divisor=divisor)
        for p, g in zip(optimizer.param_groups[0]["params"], expected, strict=True):
            got = p.grad.to_dense() if p.grad.is_sparse else p.grad
            torch.testing.assert_close(got.double(), g, rtol=1e-5, atol=1e-7)
        return
    norm = scaler.unscale_and_clip_(optimizer, max_norm=0.5 * norm_ref.item(), divisor=divisor)
    assert norm.item() == pytest.approx(norm_ref.item(), rel=1e-5)
    for p, g in zip(optimizer.param_groups[0]["params"], expected, strict=True):
        got = p.grad.to_dense() if p.grad.is_sparse else p.grad
        torch.testing.assert_close(got.double(), g * 0.5, rtol=1e-5, atol=1e-7)
