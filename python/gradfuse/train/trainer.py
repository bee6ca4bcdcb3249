"""``Trainer``: the training loop, top to bottom.

One optimizer step (``train_step``) is: zero the gradients; for each of ``grad_accum_steps``
micro-batches, forward under autocast and backward of ``scaler.scale(loss / grad_accum_steps)``
(communication only on the last, through ``no_sync``); then ``scaler.unscale_and_clip_``
(unscale, inf/NaN check, norm and clip: for a fused optimizer one read-only pass, the clip
applied inside the optimizer's own read); one host sync to read the loss, the norm and the
overflow flag; ``scaler.step`` unless the loss was not finite; ``scaler.update``; the
learning-rate schedule. ``fit`` repeats that to ``max_steps``, logging, evaluating and saving
checkpoints on the way.

The scaler is a ``gradfuse.GradScaler`` in every precision: enabled (dynamic loss scaling)
for fp16, disabled for bf16 and fp32, where it still clips through the optimizer and skips a
step whose gradients hold inf or NaN. The other parts live next door: ``config``,
``schedule``, ``checkpoint``, ``data``, ``metrics``, ``distributed``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.utils.checkpoint

from ..ops import multi_tensor_norm
from ..scaler import GradScaler
from . import checkpoint
from .config import TrainConfig
from .data import BatchStream, batch_size, to_device, token_count
from .distributed import connect, training_device
from .health import LayerStatsProbe, SpikeSkipper, clip_policy, module_prefix
from .metrics import Metrics, Throughput, peak_memory_mb
from .schedule import build_scheduler

LossFn = Callable[[torch.nn.Module, object], torch.Tensor]
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class NonFiniteLossError(RuntimeError):
    """Training stopped: the loss was inf or NaN for ``max_nan_losses`` steps in a row."""


def model_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """The default loss: ``model(**batch)`` for a dict batch, ``model(batch)`` otherwise; the
    output's ``.loss``, or the output itself when it is a scalar tensor."""
    output = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"the model returned {type(output).__name__}, which is neither a scalar tensor nor has a scalar "
            "`.loss`; pass Trainer(..., loss_fn=lambda model, batch: ...) to say how to get the loss"
        )
    return loss


def checkpoint_activations(model: torch.nn.Module, class_names: Iterable[str]) -> int:
    """Recompute the activations of every module whose class is named in ``class_names`` in
    backward instead of keeping them (``torch.utils.checkpoint``, non-reentrant). Returns how
    many modules were wrapped; a name that matches no module is an error."""
    wanted = set(class_names)
    present = {type(m).__name__ for m in model.modules()}
    if wanted - present:  # checked before anything is wrapped
        raise ValueError(
            f"TrainConfig.activation_checkpointing names {sorted(wanted - present)}, but the model has no module "
            f"of that class (it has: {', '.join(sorted(present))})"
        )
    wrapped = [m for m in model.modules() if type(m).__name__ in wanted]
    for module in wrapped:
        module.forward = functools.partial(torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False)
    return len(wrapped)


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``train_data`` as ``config`` says.

    ``train_data`` is any re-iterable of batches (a ``DataLoader``, shuffled or not); it is
    walked epoch after epoch until ``config.max_steps`` optimizer steps are done. ``loss_fn(model,
    batch)`` gives the loss (default: ``model_loss``). ``eval_data``, when given, is evaluated
    every ``config.eval_every`` steps and at the end. ``resume`` is a checkpoint path, or
    ``"latest"`` for the newest in ``config.checkpoint_dir`` (none there: start fresh).

    Under ``torchrun`` (or with a default process group already made) it trains data-parallel:
    each rank on its own ``train_data``, gradients averaged through ``gradfuse.GradBuckets``,
    communication on the last micro-step only, and rank 0 alone writes checkpoints and metrics.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Iterable,
        config: TrainConfig,
        *,
        loss_fn: LossFn | None = None,
        eval_data: Iterable | None = None,
        resume: str | os.PathLike | None = None,
    ):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a gradfuse.TrainConfig, got {type(config).__name__}")
        self.config = config
        self.device = training_device(config.device, model)
        self.model = model.to(self.device)
        self.world = connect(self.device)
        self.optimizer = optimizer
        self.loss_fn = loss_fn or model_loss
        self.eval_data = eval_data
        self.batches = BatchStream(train_data)
        checkpoint_activations(model, config.activation_checkpointing)
        self.grads = self.world.gradients(model, optimizer)  # zero_grad, no_sync
        self.scheduler = build_scheduler(optimizer, config)
        self.scaler = GradScaler(self.device.type, enabled=config.precision == "fp16")
        self.param_names = {p: name for name, p in model.named_parameters()}
        # Gradient health (health.py): spike-aware skipping, off unless configured.
        self.spikes = SpikeSkipper(*config.skip_spikes) if config.skip_spikes is not None else None
        self.spikes_skipped = 0
        self.clip_policy = clip_policy(config)  # None: the fixed max_grad_norm
        self.probe: LayerStatsProbe | None = None  # per-module statistics of this step (log steps)

        self.step = 0  # optimizer steps done
        self.skipped = 0  # steps skipped because the gradients overflowed
        self.nan_losses = 0  # steps skipped because the loss was not finite
        self.nan_streak = 0
        _seed_everything(config.seed)
        path = self._resolve(resume) if resume is not None else None
        if path is not None:
            self.load(path)

    # --- one optimizer step -----------------------------------------------------------------

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns its numbers
        (``step``, ``loss``, ``lr``, ``grad_norm``, ``clip_coef``, ``skipped``, ...). The model
        is trained in whatever mode it is in (``fit`` puts it in training mode)."""
        self.grads.zero_grad()
        loss, samples, tokens = self._forward_backward()
        grad_norm, found_inf = self._unscale_and_clip()
        mean_loss = self.world.mean(loss).float()
        spike = self._check_spikes(mean_loss, grad_norm)  # skips through found_inf, on the device
        coef = self._policy_coef(loss.device)
        # The step's one host sync: whether to step, and what to report.
        values = torch.stack(
            [mean_loss, grad_norm.float().to(loss.device), found_inf.to(loss.device), spike.to(loss.device), coef]
        )
        layers = self.probe.values(loss.device) if self.probe is not None else None
        values = values.tolist() if layers is None else torch.cat([values.double(), layers]).tolist()
        loss_value, norm_value, overflow, spiked, coef_value = values[:5]
        row = {"step": self.step + 1, "loss": loss_value, "lr": self.optimizer.param_groups[0]["lr"]}
        row["grad_norm"] = norm_value
        row["clip_coef"] = min(self._max_norm / (norm_value + 1e-6), 1.0) if math.isfinite(norm_value) else math.nan
        if self.clip_policy is not None:
            row["clip_coef"] = coef_value
        if self.probe is not None:  # per-module gradient norms and largest magnitudes (log steps)
            n = len(self.probe.modules)
            row.update({f"grad_norm/{m}": v for m, v in zip(self.probe.modules, values[5 : 5 + n], strict=True)})
            row.update({f"grad_amax/{m}": v for m, v in zip(self.probe.modules, values[5 + n :], strict=True)})
        if not math.isfinite(loss_value):
            self.nan_losses += 1
            self.nan_streak += 1
        else:
            self.nan_streak = 0
            self.spikes_skipped += bool(spiked)
            if overflow and not spiked:
                self.skipped += 1
                row["nonfinite_grads"] = self._nonfinite_grad_names()
            self.scaler.step(self.optimizer)  # skips itself on overflow
        self.scaler.update()
        with warnings.catch_warnings():
            # A skipped first step is intended; torch would warn that the schedule moved first.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before", UserWarning)
            self.scheduler.step()
        self.step += 1
        world = self.world.world_size  # every rank takes batches of the same size
        row.update(skipped=self.skipped, nan_losses=self.nan_losses, samples=samples * world, tokens=tokens * world)
        if self.spikes is not None:
            row["spikes_skipped"] = self.spikes_skipped
        return row

    def _check_spikes(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """0-d flag, 1.0 if this step spiked (then marked skipped in the scaler's found_inf)."""
        if self.spikes is None:
            return torch.zeros((), device=loss.device)
        flag = self.spikes.check_(loss, grad_norm)
        self.scaler.skip_step_(self.optimizer, flag)
        return flag

    def _forward_backward(self) -> tuple[torch.Tensor, int, int]:
        """The micro-steps: (the step's loss on the device, samples, tokens)."""
        cfg = self.config
        loss = torch.zeros((), device=self.device)
        samples, tokens = 0, 0
        for micro in range(cfg.grad_accum_steps):
            batch = to_device(self.batches.next(), self.device)
            samples, tokens = samples + batch_size(batch), tokens + (token_count(batch) or 0)
            last = micro == cfg.grad_accum_steps - 1
            with contextlib.nullcontext() if last else self.grads.no_sync():
                with self._autocast():
                    micro_loss = self.loss_fn(self.model, batch) / cfg.grad_accum_steps
                self.scaler.scale(micro_loss).backward()
            loss += micro_loss.detach()
        return loss, samples, tokens

    def _unscale_and_clip(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm before clipping, found_inf), on the device. With a fused optimizer nothing is
        written: the unscale and the clip are applied by ``scaler.step`` inside its read."""
        limit = self.clip_policy if self.clip_policy is not None else self._max_norm
        self.probe = self._layer_probe(limit)
        grad_norm = self.scaler.unscale_and_clip_(self.optimizer, self.probe or limit, self.config.norm_type)
        return grad_norm, self.scaler.found_inf(self.optimizer)

    def _layer_probe(self, limit) -> LayerStatsProbe | None:
        """On a log step with ``log_grad_norms``: the probe that collects per-module statistics
        from the clip's read (health.py)."""
        cfg, step = self.config, self.step + 1
        if cfg.log_grad_norms is None or not (step % cfg.log_every == 0 or step in (1, cfg.max_steps)):
            return None
        from ..clipping import NormClip

        policy = limit if hasattr(limit, "clip_grads_") else NormClip(limit)
        prefixes = {
            id(p.grad): module_prefix(n, cfg.log_grad_norms) for p, n in self.param_names.items() if p.grad is not None
        }
        return LayerStatsProbe(policy, prefixes, list(dict.fromkeys(prefixes.values())), cfg.norm_type)

    def _policy_coef(self, device: torch.device) -> torch.Tensor:
        """The clip coefficient a norm policy applied this step (AGC clips per unit: NaN)."""
        coef = getattr(self.clip_policy, "last_coef", None)
        return torch.full((), math.nan, device=device) if coef is None else coef.float().to(device)

    @property
    def _max_norm(self) -> float:
        return self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf

    def _autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.config.precision)
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def _nonfinite_grad_names(self) -> list[str]:
        """The parameters whose gradients hold inf or NaN, from the per-tensor norms."""
        by_device: dict[torch.device, list[torch.nn.Parameter]] = {}
        for p in self.param_names:
            if p.grad is not None:
                by_device.setdefault(p.grad.device, []).append(p)
        names = []
        for params in by_device.values():
            _, per_tensor = multi_tensor_norm([p.grad for p in params], per_tensor=True)
            finite = torch.isfinite(per_tensor).tolist()
            names += [self.param_names[p] for p, ok in zip(params, finite, strict=True) if not ok]
        return names

    # --- the loop ---------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        """Train to ``config.max_steps`` steps; returns the metrics rows written on the way."""
        cfg = self.config
        self.model.train()
        throughput = Throughput()
        with Metrics(cfg.metrics_path, cfg.progress, cfg.max_steps, self.step, self.world.is_main) as metrics:
            while self.step < cfg.max_steps:
                row = self.train_step()
                throughput.add(row.pop("samples"), row.pop("tokens"))
                metrics.progress(row["loss"], row["lr"])
                done = self.step == cfg.max_steps
                if self.eval_data is not None and (done or (cfg.eval_every and self.step % cfg.eval_every == 0)):
                    row["eval_loss"] = self.evaluate()
                skipped = not math.isfinite(row["loss"]) or "nonfinite_grads" in row
                if skipped:
                    metrics.message(self._skip_message(row))
                if done or skipped or "eval_loss" in row or self.step % cfg.log_every == 0 or self.step == 1:
                    row.update(throughput.rates(), loss_scale=self.scaler.get_scale())
                    row["peak_mem_mb"] = peak_memory_mb(self.device)
                    metrics.write(row)
                if cfg.checkpoint_dir is not None and (done or (cfg.save_every and self.step % cfg.save_every == 0)):
                    self.save()
                if self.nan_streak >= cfg.max_nan_losses:
                    raise NonFiniteLossError(
                        f"training stopped at step {self.step}: the loss was not finite in the last "
                        f"{self.nan_streak} steps (TrainConfig.max_nan_losses={cfg.max_nan_losses}); "
                        f"{self.nan_losses} non-finite losses in all. Lower the learning rate or check the data."
                    )
        return metrics.rows

    def _skip_message(self, row: dict) -> str:
        if not math.isfinite(row["loss"]):
            return (
                f"step {row['step']}: the loss is {row['loss']}; step skipped "
                f"({self.nan_streak} in a row, training stops at {self.config.max_nan_losses})"
            )
        names = row["nonfinite_grads"]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return f"step {row['step']}: gradients overflowed (inf/NaN) in {shown}; step skipped"

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss over ``eval_data`` (model in eval mode, same autocast)."""
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        for batch in self.eval_data:
            with self._autocast():
                total += self.loss_fn(self.model, to_device(batch, self.device)).float()
            count += 1
        self.model.train()
        return self.world.mean(total / max(count, 1)).item()

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "counters": {"skipped": self.skipped, "nan_losses": self.nan_losses, "nan_streak": self.nan_streak},
            "spikes": None if self.spikes is None else {**self.spikes.state_dict(), "skipped": self.spikes_skipped},
            "clip": None if self.clip_policy is None else self.clip_policy.state_dict(),
            "data": self.batches.state_dict(),
            "rng": checkpoint.rng_state(),
            "config": self.config.to_dict(),
        }

    def save(self):
        """Write a checkpoint of the current step (main process only); returns its path."""
        if self.world.is_main:
            return checkpoint.save_checkpoint(
                self.config.checkpoint_dir, self.step, self.state_dict(), self.config.keep_last
            )
        return None

    def load(self, path: str | os.PathLike) -> None:
        """Continue from a checkpoint: weights, optimizer, schedule, scaler, counters, the data
        position and the RNG states (restored last, after the data has been fast-forwarded)."""
        state = checkpoint.load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.skipped, self.nan_losses, self.nan_streak = (
            state["counters"][k] for k in ("skipped", "nan_losses", "nan_streak")
        )
        if self.clip_policy is not None and state.get("clip") is not None:
            self.clip_policy.load_state_dict(state["clip"])
        if self.spikes is not None and state.get("spikes") is not None:
            spikes = dict(state["spikes"])
            self.spikes_skipped = spikes.pop("skipped")
            self.spikes.load_state_dict(spikes)
        self.batches.load_state_dict(state["data"])
        checkpoint.set_rng_state(state["rng"])

    def _resolve(self, resume: str | os.PathLike) -> str | os.PathLike | None:
        if resume != "latest":
            return resume
        if self.config.checkpoint_dir is None:
            raise ValueError("resume='latest' needs TrainConfig.checkpoint_dir: the folder to look in")
        return checkpoint.latest_checkpoint(self.config.checkpoint_dir)

    def __repr__(self) -> str:
        return f"Trainer(step={self.step}/{self.config.max_steps}, precision={self.config.precision!r})"


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)
