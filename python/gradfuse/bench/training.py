"""Training-step workloads: the optimizer step with clipping, and a whole Trainer step.

* ``step``: clip + fused AdamW step under fp16 loss scaling, on GPT-2's shapes, active
  clipping. torch: ``scaler.unscale_`` + ``clip_grad_norm_`` + ``scaler.step`` + ``update``
  (torch's documented recipe, ``AdamW(fused=True)``); gradfuse: ``GradScaler.unscale_and_clip_``
  + ``step`` + ``update``, the clip folded into the optimizer's read. The gradients are
  restored to their loss-scaled values before every call (untimed; both implementations
  leave them unscaled and clipped), so every call does the same work: same norm, clipping
  active, no overflow (checked). The weights and AdamW's moments move on from call to call;
  the work does not depend on their values.
* ``trainer``: one optimizer step of ``gradfuse.Trainer`` on a small GPT-2-shaped model
  (``gradfuse.demo.GPT``, fp32, 2 micro-batches, active clipping, cosine schedule, fused
  AdamW) against the same step written by hand with torch (``clip_grad_norm_``, ``LambdaLR``,
  the loss read once per step to skip a non-finite one, as the Trainer does). Two more rows
  time the gradient management alone, on the same model after an untimed forward and
  backward: ``torch:grads`` (``clip_grad_norm_``) and ``gradfuse:grads`` (the Trainer's
  ``unscale_and_clip_`` + ``found_inf``); their ``share`` is their fraction of the whole
  step of the same implementation. ``gradfuse_tokens`` is the Trainer's step with
  ``loss_normalization="tokens"`` (summed loss, target tokens counted on the device, the
  division folded into the unscale factor); every micro-batch has the same token count, so
  it takes the same step as the others, and its time against ``gradfuse``'s is the mode's cost.
"""

from __future__ import annotations

import functools
import itertools
import math
from types import SimpleNamespace

import torch

import gradfuse

from .cases import (
    DECAY,
    GRADFUSE_NORM_RTOL,
    LOSS_SCALE,
    RTOL_VS_TORCH,
    SCHEDULE_RTOL,
    Family,
    assert_lists_close,
    pristine,
)
from .measure import BenchError
from .models import model_config

# --- step: clip + fused AdamW ----------------------------------------------------------------


def assert_same_step(name: str, optimizer, reference, rtol: float, coef_rtol: float | None = None) -> None:
    """The weights and AdamW's first moments of two optimizers after one step. The moments
    carry the clipped gradients: one AdamW step moves each weight by ~lr whatever the
    gradient's scale, so the weights alone would not show a clip that was skipped. A weight
    whose gradient is near AdamW's eps moves by an amount proportional to the gradient, whose
    clip coefficient differs from torch's as the norms do (torch's fp32 norm of GPT-2's
    embedding is off by ~2e-3), so weights agree to ``coef_rtol`` (default ``rtol``) of a
    step in absolute terms: measured at full size, 1.9e-8 with a step of 1e-4."""
    ours, theirs = (opt.param_groups[0]["params"] for opt in (optimizer, reference))
    step = reference.param_groups[0]["lr"]
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        try:
            torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=(coef_rtol or rtol) * step)
        except AssertionError as err:
            raise BenchError(f"{name} weights after one step, tensor {i} of {len(theirs)}: {err}") from None
    moments = [[opt.state[p]["exp_avg"] for p in params] for opt, params in ((optimizer, ours), (reference, theirs))]
    assert_lists_close(f"{name} exp_avg after one step", *moments, coef_rtol or rtol)


def _torch_step(s, max_norm: float):
    s.scaler.unscale_(s.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(s.params, max_norm)
    s.scaler.step(s.optimizer)
    s.scaler.update()
    return norm


def _gradfuse_step(s, max_norm: float):
    norm = s.scaler.unscale_and_clip_(s.optimizer, max_norm)
    s.scaler.step(s.optimizer)
    s.scaler.update()
    return norm


class StepFamily(Family):
    """See the module docstring (``step``)."""

    restore_every = 1  # the gradients are loss-scaled again before every call
    rotate_sets = False

    def __init__(self, workload, device, quick):
        super().__init__(workload, device, quick)
        self.pristine = pristine(workload, quick, workload.dtype, device, LOSS_SCALE)
        self.max_norm = DECAY * self.pristine.norm  # active: every call clips by DECAY

    def impls(self):
        return {"torch": _torch_step, "gradfuse": _gradfuse_step}

    def new_set_for(self, impl: str):
        grads = self.pristine.clone()
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        make_scaler = torch.amp.GradScaler if impl == "torch" else gradfuse.GradScaler
        # A growth interval that is never reached: the scale stays put, as verify checks.
        scaler = make_scaler(self.device.type, init_scale=LOSS_SCALE, growth_interval=2**30)
        scaler.scale(torch.ones((), device=self.device))  # creates the scale tensor
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
        return SimpleNamespace(params=params, optimizer=optimizer, scaler=scaler)

    @property
    def set_bytes(self):
        return self.numel * self.workload.dtype.itemsize * 4  # weights, gradients, two moments

    @property
    def bytes_moved(self):
        # The least: one read of the gradients for the norm, then AdamW reads weights,
        # gradients and moments and writes weights and moments (the clip inside that read).
        return self.numel * self.workload.dtype.itemsize * 8

    def bind(self, fn, s, k):
        return lambda: fn(s, self.max_norm)

    def verify(self, out, s, k):
        total = float(out)
        if not math.isclose(total, self.pristine.norm, rel_tol=SCHEDULE_RTOL):
            raise BenchError(f"returned norm {total:.6g}, the gradients' is {self.pristine.norm:.6g}")
        if s.scaler.get_scale() != LOSS_SCALE:
            raise BenchError(f"the loss scale moved to {s.scaler.get_scale()}: a step was skipped as an overflow")

    def restore(self, s):
        self.pristine.restore([p.grad for p in s.params])

    def compare(self, outs, buffers):
        exact = self.pristine.norm
        if not math.isclose(float(outs["gradfuse"]), exact, rel_tol=GRADFUSE_NORM_RTOL):
            raise BenchError(f"gradfuse returned norm {float(outs['gradfuse']):.9g}, the fp64 norm is {exact:.9g}")
        if not math.isclose(float(outs["gradfuse"]), float(outs["torch"]), rel_tol=RTOL_VS_TORCH[self.workload.dtype]):
            raise BenchError(f"gradfuse returned norm {float(outs['gradfuse']):.8g}, torch {float(outs['torch']):.8g}")
        coef_rtol = RTOL_VS_TORCH[self.workload.dtype]
        assert_same_step("gradfuse", buffers["gradfuse"].optimizer, buffers["torch"].optimizer, 1e-5, coef_rtol)


# --- trainer: a whole optimizer step ------------------------------------------------------------

ACCUM_STEPS = 2
MAX_NORM = 0.5  # below the models' gradient norms at the start (~1 quick, ~4.5 full): clipping is active
LR = 1e-3
N_BATCHES = 8


def _schedule(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    factor = functools.partial(
        gradfuse.train.lr_factor, max_steps=10**6, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class HandLoop:
    """The Trainer's step written out with torch, feature for feature."""

    def __init__(self, model, optimizer, batches):
        self.model, self.optimizer = model, optimizer
        self.params = list(model.parameters())
        self.device = self.params[0].device
        self.scheduler = _schedule(optimizer)
        self.batches = itertools.cycle(batches)
        self.norm = None

    def forward_backward(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=self.device)  # on the model's device, as the micro-losses it sums
        for _ in range(ACCUM_STEPS):
            micro = self.model(**next(self.batches)).loss / ACCUM_STEPS
            micro.backward()
            loss += micro.detach()
        return loss

    def clip(self) -> torch.Tensor:
        self.norm = torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        return self.norm

    def step(self) -> float:
        loss = self.forward_backward()
        self.clip()
        loss = loss.item()  # read once a step: to skip a non-finite loss, and to report it
        if math.isfinite(loss):
            self.optimizer.step()
        self.scheduler.step()
        return loss


def _torch_trainer_step(loop: HandLoop):
    return loop.step()


def _gradfuse_trainer_step(trainer):
    return trainer.train_step()["loss"]


def _summed_loss(model, batch):
    """``loss_normalization="tokens"``: the summed loss and the target tokens, counted on the device."""
    labels = batch["labels"]
    logits = model(batch["input_ids"]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss, (labels != -100).sum()


def _torch_grads(loop: HandLoop):
    return loop.clip()


def _gradfuse_grads(trainer):
    return trainer._unscale_and_clip()[0]


def new_model(config, device: torch.device) -> torch.nn.Module:
    """The workload's GPT, the same weights for every implementation, made on ``device``
    itself (no tensor of the step is made anywhere else: ``tests/test_bench.py`` runs these
    workloads with the default device set to ``meta`` to prove it)."""
    from ..demo import GPT

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(config)


class TrainerFamily(Family):
    """See the module docstring (``trainer``)."""

    rotate_sets = False

    def __init__(self, workload, device, quick):
        super().__init__(workload, device, quick)
        self.gpt, batch = model_config(quick)
        gen = torch.Generator().manual_seed(3)  # the same tokens on every device: drawn on the CPU
        tokens = torch.randint(0, self.gpt.vocab, (N_BATCHES, batch, self.gpt.ctx + 1), generator=gen, device="cpu")
        self.batches = [{"input_ids": t[:, :-1].to(device), "labels": t[:, 1:].to(device)} for t in tokens]

    def impls(self):
        return {
            "torch": _torch_trainer_step,
            "gradfuse": _gradfuse_trainer_step,
            "gradfuse_tokens": _gradfuse_trainer_step,
            "torch:grads": _torch_grads,
            "gradfuse:grads": _gradfuse_grads,
        }

    def new_set_for(self, impl: str):
        model = new_model(self.gpt, self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
        if impl.startswith("torch"):
            return HandLoop(model, optimizer, self.batches)
        config = gradfuse.TrainConfig(
            max_steps=10**6, grad_accum_steps=ACCUM_STEPS, max_grad_norm=MAX_NORM, lr=LR, lr_schedule="cosine",
            min_lr_ratio=0.1, progress=False, loss_normalization="tokens" if impl == "gradfuse_tokens" else "mean",
        )  # fmt: skip
        loss_fn = _summed_loss if impl == "gradfuse_tokens" else None
        return gradfuse.Trainer(model, optimizer, self.batches, config, loss_fn=loss_fn)

    @property
    def set_bytes(self):
        return self.numel * 4

    @property
    def bytes_moved(self):
        return self.numel * 4  # the gradients' bytes: a step's cost is not a count of bytes

    def bind(self, fn, state, k):
        if fn is _torch_grads:  # the gradients of a fresh forward and backward, untimed
            state.forward_backward()
        elif fn is _gradfuse_grads:
            state.scaler.update()  # forget the previous call's clip, which no step applied
            state.grads.zero_grad()
            state._forward_backward()
        return lambda: fn(state)

    def verify(self, out, state, k):
        if not math.isfinite(float(out)):
            raise BenchError(f"a non-finite result ({float(out)}): the step did not train")

    def compare(self, outs, buffers):
        (name,) = outs.keys() - {"torch"}
        reference = buffers["torch"]
        if name in ("gradfuse", "gradfuse_tokens"):  # the same first step from the same weights
            if not math.isclose(outs[name], outs["torch"], rel_tol=1e-6):
                raise BenchError(f"the Trainer's loss {outs[name]:.8g} ({name}), the torch loop's {outs['torch']:.8g}")
            assert_same_step("Trainer", buffers[name].optimizer, reference.optimizer, 1e-4)
        elif not math.isclose(float(outs[name]), float(reference.norm), rel_tol=1e-5):
            raise BenchError(
                f"{name} measured norm {float(outs[name]):.8g}, the torch loop {float(reference.norm):.8g}"
            )


TRAINING_FAMILIES = {"step": StepFamily, "trainer": TrainerFamily}
