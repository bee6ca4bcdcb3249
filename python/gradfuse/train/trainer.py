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
``schedule``, ``checkpoint``, ``data``, ``metrics``, ``distributed``, ``health``,
``attribution`` (which parameters and ranks held the inf/NaN of an overflow step), and for the
checkpoint folder ``lock`` (one writer), ``ownership`` (one run) and ``compatibility`` (does a
checkpoint fit, before a resume loads it).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import random
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from ..distributed import is_dtensor
from ..scaler import GradScaler
from . import checkpoint, compatibility, ownership, sharded_checkpoint
from . import resume as resuming
from .attribution import NonfiniteAttribution, describe
from .callbacks import Callbacks
from .config import TrainConfig
from .data import BatchStream, batch_size, to_device, token_count
from .distributed import connect, training_device
from .health import LayerStatsProbe, SpikeSkipper, clip_policy, module_prefix
from .interrupt import StopSignals, TrainingInterrupted
from .lock import FolderLock
from .metrics import Metrics, Throughput, check_tensorboard, peak_memory_mb
from .ranks import agree_on_checkpoint, together
from .schedule import build_scheduler, check_user_scheduler, user_scheduler

LossFn = Callable[[torch.nn.Module, object], torch.Tensor]
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
logger = logging.getLogger("gradfuse.train")
# torch warns when a schedule moves before the optimizer has stepped: a skipped first step does that
# on purpose. The filter's message is a regular expression, hence the escape.
_SCHEDULE_FIRST = re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`")


class NonFiniteLossError(RuntimeError):
    """Training stopped: the loss was inf or NaN for ``max_nan_losses`` steps in a row."""


def model_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """The default loss: ``model(**batch)`` for a dict batch, ``model(batch)`` otherwise; the
    output's ``.loss``, or the output itself when it is a scalar tensor. A tuple or list batch
    (``(x, y)``) is refused: which part is the input is for ``loss_fn`` to say."""
    if isinstance(batch, (tuple, list)):
        raise TypeError(
            f"the batch is a {type(batch).__name__} of {len(batch)}, and the default loss cannot tell the input "
            "from the target (it calls model(**batch) for a dict, model(batch) for a tensor); pass "
            "Trainer(..., loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]))"
        )
    output = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"the model returned {type(output).__name__}, which is neither a scalar tensor nor has a scalar "
            "`.loss`; pass Trainer(..., loss_fn=lambda model, batch: ...) to say how to get the loss"
        )
    return loss


def modules_to_checkpoint(model: torch.nn.Module, class_names: Iterable[str]) -> list[torch.nn.Module]:
    """The modules of ``model`` whose class is named in ``class_names`` (for
    ``checkpoint_activations``); a name that matches no module is an error."""
    wanted = set(class_names)
    present = {type(m).__name__ for m in model.modules()}
    if wanted - present:
        raise ValueError(
            f"TrainConfig.activation_checkpointing names {sorted(wanted - present)}, but the model has no module "
            f"of that class (it has: {', '.join(sorted(present))})"
        )
    return [m for m in model.modules() if type(m).__name__ in wanted]


def checkpoint_activations(modules: Iterable[torch.nn.Module]) -> None:
    """Recompute the activations of ``modules`` in backward instead of keeping them
    (``torch.utils.checkpoint``, non-reentrant)."""
    for module in modules:
        module.forward = functools.partial(torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False)


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``train_data`` as ``config`` says.

    ``train_data`` is any re-iterable of batches (a ``DataLoader``, shuffled or not); it is
    walked epoch after epoch until ``config.max_steps`` optimizer steps are done. ``loss_fn(model,
    batch)`` gives the loss (default: ``model_loss``); with ``loss_normalization="tokens"`` it
    returns ``(summed loss, number of target tokens)``. ``eval_data``, when given, is evaluated
    every ``config.eval_every`` steps and at the end. ``resume`` is a checkpoint path, or
    ``"latest"`` for the newest valid one in ``config.checkpoint_dir`` (none there: start fresh);
    the settings passed now win over the checkpoint's, and what changed is logged; a checkpoint
    of another model, optimizer or schedule is refused before anything is loaded.
    ``start_over=True`` deletes the checkpoints a fresh run finds in ``config.checkpoint_dir``
    (without it, a folder holding another run's checkpoints is refused: ``ownership``). While
    the Trainer runs (from its construction until ``fit()`` returns, or ``close()``), it holds
    the folder's lock: a second writer there is refused (``lock``).
    ``scheduler`` is the user's own learning-rate schedule (a torch LR scheduler over
    ``optimizer``, or a function ``step -> lr``) in place of the config's; ``callbacks`` are
    objects with some of ``on_step_end(row)``, ``on_eval(row)``, ``on_save(path)``.

    Under ``torchrun`` (or with a default process group already made) it trains data-parallel:
    each rank on its own ``train_data``, gradients averaged through DDP and gradfuse's hook (or,
    with ``config.parallel="fsdp"``, the model sharded by FSDP2: ``fsdp.py``), communication on
    the last micro-step only, and rank 0 alone writes checkpoints and metrics. With
    ``parallel="fsdp"`` checkpoints are folders every rank writes its shards into
    (``sharded_checkpoint``), and they resume on any world size.
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
        scheduler=None,
        callbacks: Iterable = (),
        start_over: bool = False,
    ):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a gradfuse.TrainConfig, got {type(config).__name__}")
        _check_start_over(start_over, resume, config)
        # Everything that can be checked before training is, before anything is changed.
        if config.loss_normalization == "tokens" and loss_fn is None:
            raise ValueError(
                "TrainConfig.loss_normalization='tokens' needs a loss_fn returning (summed loss, number of target "
                "tokens); the default loss reads the model's mean loss"
            )
        self.callbacks = Callbacks(callbacks)
        if scheduler is not None:
            check_user_scheduler(optimizer, scheduler, config)
        _check_reiterable("train_data", train_data)
        if eval_data is not None:
            _check_reiterable("eval_data", eval_data)
        elif config.keep_best:
            raise ValueError("TrainConfig.keep_best keeps the checkpoint with the lowest eval loss: it needs eval_data")
        if config.tensorboard_dir is not None:
            check_tensorboard()
        self.config = config
        self.device = training_device(config.device, model)
        self.model = model.to(self.device)  # the user's module: checkpoints hold its state dict
        self.world = connect(self.device)
        self.optimizer = optimizer
        self.loss_fn = loss_fn or model_loss
        self.eval_data = eval_data
        self.batches = BatchStream(train_data)
        recomputed = modules_to_checkpoint(model, config.activation_checkpointing)  # found before FSDP2 renames classes
        self.grads = self.world.gradients(model, optimizer, config)  # zero_grad, no_sync; DDP or FSDP2
        checkpoint_activations(recomputed)  # after the wrap: a refused one leaves the model as it was
        self.net = self.grads.module  # what forward calls go through (DDP's wrapper under data parallelism)
        # FSDP2 (even one process of it): checkpoints are folders every rank writes its shards into.
        self.sharded = getattr(self.grads, "sharded", False) or config.parallel == "fsdp"
        if config.compile:
            self.net = torch.compile(self.net)
        self._given_settings = resuming.group_settings(optimizer)  # put back if the Trainer cannot be made
        if scheduler is None:
            self.scheduler = build_scheduler(optimizer, config)
        else:
            self.scheduler = user_scheduler(optimizer, scheduler, config)
        self._base_lrs = list(self.scheduler.base_lrs)  # the user's peak lrs: they win on resume
        self.scaler = GradScaler(
            self.device.type,
            init_scale=config.init_scale,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
            enabled=config.precision == "fp16",
        )
        self.param_names = {p: name for name, p in model.named_parameters()}
        # Gradient health (health.py): spike-aware skipping, off unless configured.
        self.spikes = SpikeSkipper(*config.skip_spikes) if config.skip_spikes is not None else None
        self.spikes_skipped = 0
        self.clip_policy = clip_policy(config)  # None: the fixed max_grad_norm
        self.probe: LayerStatsProbe | None = None  # per-module statistics of this step (log steps)
        # Which parameters and ranks held inf/NaN on an overflow step (attribution.py).
        self.nonfinite = NonfiniteAttribution(
            model, self.device, getattr(self.world, "group", None), self.world.world_size, config.nonfinite_rerun
        )

        self.step = 0  # optimizer steps done
        self.skipped = 0  # steps skipped because the gradients overflowed
        self.nan_losses = 0  # steps skipped because the loss was not finite
        self.nan_streak = 0
        self.best_eval_loss = math.inf  # for keep_best
        self.resumed_from: Path | None = None
        self._stop: StopSignals | None = None  # set while fit() runs
        self._stopping = False  # a stop signal reached some rank: stop after this step
        self.lock: FolderLock | None = None  # rank 0's hold on checkpoint_dir while the Trainer runs
        self._holding = False  # whether the Trainer (rank 0) holds it, on every rank
        _seed_everything(config.seed)
        self._open_checkpoints(resume, start_over)

    # --- one optimizer step -----------------------------------------------------------------

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns its numbers
        (``step``, ``loss``, ``lr``, ``grad_norm``, ``clip_coef``, ``skipped``, ...). The model
        is trained in whatever mode it is in (``fit`` puts it in training mode)."""
        self.grads.zero_grad()
        self.nonfinite.start_step()
        loss, samples, tokens, divisor = self._forward_backward()
        grad_norm, found_inf = self._unscale_and_clip(divisor)
        # A stop signal rides the loss's all-reduce: every rank stops after the same step.
        stopping = self._stop is not None and self._stop.received is not None
        stop = torch.full((), float(stopping), device=loss.device)  # a fill, not a host-to-device copy
        mean_loss, stop = self.world.mean(torch.stack([loss.float(), stop])).unbind()
        spike = self._check_spikes(mean_loss, grad_norm)  # skips through found_inf, on the device
        coef = self._policy_coef(loss.device)
        on_device = [mean_loss, stop, grad_norm.float().to(loss.device), found_inf.to(loss.device).reshape(())]
        parts = [torch.stack([*on_device, spike.to(loss.device), coef]).double()]
        if divisor is not None:  # tokens: the step's target tokens over every rank
            parts.append((divisor * self.world.world_size).double().reshape(1))
        if self.probe is not None:  # per-module statistics (log steps with log_grad_norms)
            parts.append(self.probe.values(loss.device).double())
        # The step's one host sync: whether to step, and what to report.
        values = torch.cat(parts).tolist()
        loss_value, stop_value, norm_value, overflow, spiked, coef_value = values[:6]
        target_tokens, layers = (values[6:7], values[7:]) if divisor is not None else ([], values[6:])
        self._stopping = stop_value > 0
        row = {"step": self.step + 1, "loss": loss_value, "lr": self.optimizer.param_groups[0]["lr"]}
        if target_tokens:
            row["target_tokens"] = round(target_tokens[0])
        row["grad_norm"] = norm_value
        row["clip_coef"] = min(self._max_norm / (norm_value + 1e-6), 1.0) if math.isfinite(norm_value) else math.nan
        if self.clip_policy is not None:
            row["clip_coef"] = coef_value
        if self.probe is not None:  # per-module gradient norms and largest magnitudes (log steps)
            n = len(self.probe.modules)
            row.update({f"grad_norm/{m}": v for m, v in zip(self.probe.modules, layers[:n], strict=True)})
            row.update({f"grad_amax/{m}": v for m, v in zip(self.probe.modules, layers[n:], strict=True)})
        if not math.isfinite(loss_value):
            self.nan_losses += 1
            self.nan_streak += 1
        else:
            self.nan_streak = 0
            self.spikes_skipped += bool(spiked)
            self.skipped += bool(overflow and not spiked)
            self.scaler.step(self.optimizer)  # skips itself on overflow
            if overflow and not spiked:  # before update(): a recompute scales its losses as this step did
                row.update(self.nonfinite.report(self.step + 1, self._rerun_locally, self.net))
        self.nonfinite.end_step()
        self.scaler.update()
        with warnings.catch_warnings():
            # A skipped first step is intended; torch would warn that the schedule moved first.
            warnings.filterwarnings("ignore", _SCHEDULE_FIRST, UserWarning)
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

    def _forward_backward(self) -> tuple[torch.Tensor, int, int, torch.Tensor | None]:
        """The micro-steps: (the step's loss on the device, samples, tokens in ``input_ids``,
        the divisor of the gradients for ``loss_normalization="tokens"``, else None).

        ``"mean"``: each micro-batch's loss is divided by ``grad_accum_steps``. ``"tokens"``:
        the summed losses are backpropagated as they are, and the target tokens counted on the
        device (all-reduced across ranks while the last backward runs); the gradients, which
        arrive averaged over ranks, are then divided by tokens / world size inside the
        scaler's unscale factor, giving the sum over every micro-batch and rank / all tokens."""
        cfg = self.config
        by_tokens = cfg.loss_normalization == "tokens"
        loss = torch.zeros((), device=self.device)
        target_tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        samples, tokens, reduction = 0, 0, None
        for micro in range(cfg.grad_accum_steps):
            batch = self.batches.next()
            self.nonfinite.keep(batch)  # kept for a recompute of an overflow step
            batch = to_device(batch, self.device)
            samples, tokens = samples + batch_size(batch), tokens + (token_count(batch) or 0)
            last = micro == cfg.grad_accum_steps - 1
            with contextlib.nullcontext() if last else self.grads.no_sync():
                micro_loss, count = self._micro_loss(batch)
                if by_tokens:
                    target_tokens += count
                    if last and self.world.world_size > 1:  # overlaps the last backward
                        group = getattr(self.world, "group", None)
                        reduction = dist.all_reduce(target_tokens, group=group, async_op=True)
                self.scaler.scale(micro_loss).backward()
            loss += micro_loss.detach().float()
        self.nonfinite.step_loss = loss
        if not by_tokens:
            return loss, samples, tokens, None
        if reduction is not None:
            reduction.wait()
        world = self.world.world_size
        # The loss this rank reports: its share of the global token mean (the ranks' mean is the mean).
        return loss * world / target_tokens, samples, tokens, (target_tokens / world).float()

    def _micro_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor | int]:
        """A micro-batch's forward: (the loss to backpropagate, its target tokens)."""
        with self._autocast():
            loss, count = self._loss(self.loss_fn(self.net, batch))
        if self.config.loss_normalization == "mean":
            loss = loss / self.config.grad_accum_steps
        return loss, count

    def _rerun_locally(self, batches: Iterable) -> torch.Tensor:
        """The step's micro-batches again on this rank alone (``no_sync``: no gradient
        communication), for the attribution of an overflow step; returns their summed loss, as
        ``_forward_backward`` adds it up. Each batch is taken from ``batches`` right before its
        forward (the attribution's iterable sets the random states as it yields it)."""
        loss = torch.zeros((), device=self.device)
        with self.grads.no_sync():
            for batch in batches:
                micro_loss, _ = self._micro_loss(to_device(batch, self.device))
                self.scaler.scale(micro_loss).backward()
                loss += micro_loss.detach().float()
        return loss

    def _loss(self, output) -> tuple[torch.Tensor, torch.Tensor | int]:
        """``loss_fn``'s result as (loss, target tokens): the tokens are those ``loss_fn``
        returns under ``loss_normalization="tokens"``, 1 per batch otherwise."""
        if self.config.loss_normalization == "tokens":
            if not (isinstance(output, (tuple, list)) and len(output) == 2):
                raise TypeError(
                    "TrainConfig.loss_normalization='tokens': loss_fn must return (summed loss, number of target "
                    f"tokens), got {type(output).__name__}"
                )
            loss, count = output
            if (
                isinstance(count, bool)
                or not isinstance(count, (int, torch.Tensor))
                or (isinstance(count, torch.Tensor) and count.numel() != 1)
            ):
                raise TypeError(f"loss_fn's token count must be an int or a one-element tensor, got {count!r}")
            count = count.reshape(()).to(self.device, torch.float64) if isinstance(count, torch.Tensor) else count
        else:
            if isinstance(output, (tuple, list)):
                raise TypeError(
                    f"loss_fn returned a {type(output).__name__}; it should return the loss. For (summed loss, "
                    "number of tokens) set TrainConfig(loss_normalization='tokens')"
                )
            loss, count = output, 1
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a scalar tensor as the loss, got {type(loss).__name__}")
        return loss, count

    def _unscale_and_clip(self, divisor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm before clipping, found_inf), on the device. With a fused optimizer nothing is
        written: the unscale and the clip are applied by ``scaler.step`` inside its read. Under
        DDP the norm is the one gradfuse's hook measured in backward, handed over: no user code
        ran since, so nothing can have touched the gradients (nothing reads them either)."""
        limit = self.clip_policy if self.clip_policy is not None else self._max_norm
        self.probe = self._layer_probe(limit)
        grad_norm = self.scaler.unscale_and_clip_(
            self.optimizer, self.probe or limit, self.config.norm_type, divisor=divisor, measured=self.grads.measured
        )
        return grad_norm, self.scaler.found_inf(self.optimizer)

    def _layer_probe(self, limit) -> LayerStatsProbe | None:
        """On a log step with ``log_grad_norms``: the probe that collects per-module statistics
        from the clip's read (health.py)."""
        cfg, step = self.config, self.step + 1
        if cfg.log_grad_norms is None or not (step % cfg.log_every == 0 or step in (1, cfg.max_steps)):
            return None
        from ..clipping import NormClip

        policy = limit if hasattr(limit, "clip_grads_") else NormClip(limit)
        # The scaler reads DTensor gradients (FSDP2) as their local shards: those are the keys
        # then (``_local_tensor`` is the object the DTensor holds, the same on every access).
        prefixes = {
            id(p.grad._local_tensor if is_dtensor(p.grad) else p.grad): module_prefix(n, cfg.log_grad_norms)
            for p, n in self.param_names.items()
            if p.grad is not None
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

    # --- the loop ---------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        """Train to ``config.max_steps`` steps; returns the metrics rows written on the way.

        On SIGINT or SIGTERM the step in flight is finished, a checkpoint written (when
        ``checkpoint_dir`` is set) and ``TrainingInterrupted`` raised, saying how to resume."""
        cfg = self.config
        if self.step >= cfg.max_steps:
            where = f" (resumed from {self.resumed_from})" if self.resumed_from is not None else ""
            logger.warning(
                f"fit(): nothing to train: already at step {self.step} of TrainConfig.max_steps={cfg.max_steps}"
                f"{where}; raise max_steps (dataclasses.replace(config, max_steps=...)) to train further"
            )
            self.close()
            return []
        if cfg.checkpoint_dir is not None and not self._holding:  # let go by an earlier fit()
            self._take_folder()
        self.net.train()
        throughput = Throughput()
        metrics = Metrics(
            cfg.metrics_path, cfg.progress, cfg.max_steps, self.step, self.world.is_main, cfg.tensorboard_dir,
            cfg.log_every,
        )  # fmt: skip
        try:
            with metrics, StopSignals() as self._stop:
                while self.step < cfg.max_steps:
                    self._fit_step(metrics, throughput)
        finally:
            self._stop = None
            self.close()  # the checkpoint folder is free for the next writer, however fit() ends
        return metrics.rows

    def _fit_step(self, metrics: Metrics, throughput: Throughput) -> None:
        cfg = self.config
        row = self.train_step()
        throughput.add(row.pop("samples"), row.pop("tokens"))
        metrics.progress(row["loss"], row["lr"])
        done = self.step == cfg.max_steps
        improved = False
        if self.eval_data is not None and (done or (cfg.eval_every and self.step % cfg.eval_every == 0)):
            row["eval_loss"] = self.evaluate()
            improved = row["eval_loss"] < self.best_eval_loss
            if improved:
                self.best_eval_loss = row["eval_loss"]
        skipped = not math.isfinite(row["loss"]) or "nonfinite_grads" in row
        if skipped:
            metrics.message(self._skip_message(row))
        if done or skipped or "eval_loss" in row or self.step % cfg.log_every == 0 or self.step == 1:
            row.update(throughput.rates(), loss_scale=self.scaler.get_scale())
            row["peak_mem_mb"] = peak_memory_mb(self.device)
            metrics.write(row)
        saved = None
        if cfg.checkpoint_dir is not None and (
            done or self._stopping or (cfg.save_every and self.step % cfg.save_every == 0)
        ):
            saved = self.save()
        if cfg.keep_best and improved:
            self.save(best=True)
        if "eval_loss" in row:
            self.callbacks.eval(row)
        self.callbacks.step_end(row)
        if self.nan_streak >= cfg.max_nan_losses:
            raise NonFiniteLossError(
                f"training stopped at step {self.step}: the loss was not finite in the last "
                f"{self.nan_streak} steps (TrainConfig.max_nan_losses={cfg.max_nan_losses}); "
                f"{self.nan_losses} non-finite losses in all. Lower the learning rate or check the data."
            )
        if self._stopping and not done:
            raise self._interrupted(saved)

    def _interrupted(self, saved: Path | None) -> TrainingInterrupted:
        received = self._stop.received if self._stop is not None and self._stop.received else "a signal on another rank"
        if self.config.checkpoint_dir is None:
            how = "no checkpoint written (TrainConfig.checkpoint_dir is None): this run cannot be resumed"
        else:
            where = saved if saved is not None else checkpoint.checkpoint_path(self.config.checkpoint_dir, self.step)
            how = f"checkpoint {where} written; continue with Trainer(..., resume='latest') (or resume='{where}')"
        message = f"training stopped by {received} after step {self.step} of {self.config.max_steps}: {how}"
        return TrainingInterrupted(message, self.step, saved, received)

    def _skip_message(self, row: dict) -> str:
        if row.get("target_tokens") == 0:  # a token mean over no tokens: 0/0
            return (
                f"step {row['step']}: no target tokens in any micro-batch (loss_fn counted 0); step skipped "
                f"({self.nan_streak} in a row, training stops at {self.config.max_nan_losses})"
            )
        if not math.isfinite(row["loss"]):
            return (
                f"step {row['step']}: the loss is {row['loss']}; step skipped "
                f"({self.nan_streak} in a row, training stops at {self.config.max_nan_losses})"
            )
        note = f" ({row['nonfinite_note']})" if row.get("nonfinite_note") else ""
        return f"step {row['step']}: gradients overflowed (inf/NaN) in {describe(row)}; step skipped{note}"

    @torch.no_grad()
    def evaluate(self) -> float:
        """The loss over ``eval_data`` (at most ``config.eval_batches`` batches; model in eval
        mode, same autocast): the mean of the batches' losses, or with
        ``loss_normalization="tokens"`` the summed losses over the tokens. Data that yields no
        batch is an error, not a loss of 0."""
        self.net.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = 0
        data = self.eval_data
        if self.config.eval_batches is not None:
            data = itertools.islice(data, self.config.eval_batches)
        for batch in data:
            with self._autocast():
                loss, n = self._loss(self.loss_fn(self.net, to_device(batch, self.device)))
            total += loss.double()
            count += n
            batches += 1
        self.net.train()
        empty = torch.full((), float(batches == 0), dtype=torch.float64, device=self.device)
        total, count, empty = self.world.mean(torch.stack([total, count, empty])).tolist()
        if empty > 0:
            on = " on at least one rank" if self.world.world_size > 1 else ""
            raise ValueError(
                f"eval_data yielded no batches{on} at step {self.step}: evaluating it gives no loss. A generator "
                "or iterator is used up by its first evaluation; pass a list or a DataLoader"
            )
        return total / count

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        model = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {**model, **self._shared_state(), **self._rank_state()}

    def _shared_state(self) -> dict:
        """What every rank holds alike (a sharded checkpoint keeps rank 0's)."""
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "counters": {
                "skipped": self.skipped,
                "nan_losses": self.nan_losses,
                "nan_streak": self.nan_streak,
                "best_eval_loss": self.best_eval_loss,
            },
            "spikes": None if self.spikes is None else {**self.spikes.state_dict(), "skipped": self.spikes_skipped},
            "clip": None if self.clip_policy is None else self.clip_policy.state_dict(),
            "config": self.config.to_dict(),
            **compatibility.optimizer_record(self.optimizer, self.param_names),  # checked on resume
        }

    def _rank_state(self) -> dict:
        """What is this rank's own: its data position and RNG states."""
        return {"data": self.batches.state_dict(), "rng": checkpoint.rng_state()}

    def save(self, best: bool = False) -> Path | None:
        """Write a checkpoint of the current step (main process only); returns its path.
        ``best=True`` writes ``best.pt`` instead (``keep_best``). Sharded (FSDP2): a folder,
        written by every rank (each calls this), its path returned on every rank."""
        if self.sharded:
            return self._save_sharded(best)
        if not self.world.is_main:
            return None
        cfg = self.config
        name = checkpoint.BEST if best else None
        path = checkpoint.save_checkpoint(
            cfg.checkpoint_dir, self.step, self.state_dict(), cfg.keep_last, name, lock=self._lock_held()
        )
        self.callbacks.save(path)
        return path

    def _save_sharded(self, best: bool) -> Path:
        cfg = self.config
        path = sharded_checkpoint.save(
            cfg.checkpoint_dir, self.step, self.model, self.optimizer, shared=self._shared_state(),
            own=self._rank_state(), keep_last=cfg.keep_last, group=getattr(self.world, "group", None),
            name=checkpoint.BEST_FOLDER if best else None, lock=self._lock_held(),
        )  # fmt: skip
        if self.world.is_main:
            self.callbacks.save(path)
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Continue from a checkpoint: weights, optimizer state, schedule position, scaler,
        counters, the data position and the RNG states (restored last, after the data has been
        fast-forwarded). The hyperparameters are the ones given now (see ``_load_state``); a
        checkpoint that does not fit is refused before anything is changed."""
        path = Path(path)
        self._load_state(self._check_resume(checkpoint.load_checkpoint(path), path), path)

    def _load_state(self, state: dict, path: Path) -> None:
        """Load ``state`` (checked by ``_check_resume``, its data position already taken); the
        settings given now win where they differ from the saved ones (module ``resume``), and
        what changed is logged once."""
        cfg = self.config
        group = getattr(self.world, "group", None)
        changed = resuming.config_changes(state.get("config", {}), cfg.to_dict())
        if path.is_dir():  # sharded (sharded_checkpoint.py): through DCP, on any world size
            load = functools.partial(sharded_checkpoint.load_model_and_optimizer, path, self.model, group=group)
            changed += resuming.keep_optimizer_settings(self.optimizer, load)
        else:  # a model sharded by FSDP2 was refused a single file (_check_resume)
            self.model.load_state_dict(resuming.module_state(state["model"], self.model))
            changed += resuming.load_optimizer(self.optimizer, state["optimizer"])
        changed += resuming.load_schedule(self.scheduler, state["scheduler"], self.optimizer, self._base_lrs)
        if state["scaler"]:
            # The scale and its growth tracker continue; the rule for them is the config's.
            self.scaler.load_state_dict(resuming.scaler_state(state["scaler"], cfg.growth_interval))
            self.scaler.set_growth_factor(cfg.growth_factor)
            self.scaler.set_backoff_factor(cfg.backoff_factor)
            self.scaler.set_growth_interval(cfg.growth_interval)
        self.step = state["step"]
        counters = state["counters"]
        self.skipped, self.nan_losses, self.nan_streak = (counters[k] for k in ("skipped", "nan_losses", "nan_streak"))
        self.best_eval_loss = counters.get("best_eval_loss", math.inf)
        if self.clip_policy is not None and state.get("clip") is not None:
            self.clip_policy.load_state_dict(state["clip"])
        if self.spikes is not None and state.get("spikes") is not None:
            spikes = dict(state["spikes"])
            self.spikes_skipped = spikes.pop("skipped")
            self.spikes.load_state_dict(spikes)
        checkpoint.set_rng_state(state["rng"])
        self.resumed_from = path
        if changed and self.world.is_main:
            logger.warning(
                f"resuming from {path} (step {self.step}) with settings that differ from the checkpoint's; the ones "
                f"given now apply from step {self.step + 1}: " + "; ".join(changed)
            )

    # --- the checkpoint folder and resuming: each check on every rank together ------------------

    def _open_checkpoints(self, resume, start_over: bool) -> None:
        """Take ``checkpoint_dir`` (rank 0 holds its lock), find the checkpoint to resume from,
        check that it fits this run and that the folder is this run's (``ownership``), then
        load it. A rank that raised alone would leave the others waiting: each check raises on
        every rank. On an error the folder is let go and nothing has been loaded."""
        cfg = self.config
        group, main = getattr(self.world, "group", None), self.world.is_main
        try:
            if cfg.checkpoint_dir is not None:
                self._take_folder()
            path, state = None, None
            if resume is not None:
                find = functools.partial(resuming.resolve, resume, cfg.checkpoint_dir, announce=main)
                path, state = together(group, find, f"could not resume from {resume!r}")
                if state is None:  # "latest" found none here: the ranks must agree on that too
                    agree_on_checkpoint(None, group)
                else:
                    state = self._check_resume(state, path)
            if cfg.checkpoint_dir is not None:
                check = functools.partial(
                    ownership.check_folder, cfg.checkpoint_dir, resumed_from=path,
                    resumed_step=None if state is None else state["step"], latest=resume == "latest",
                    start_over=start_over,
                )  # fmt: skip
                together(group, main and check, f"could not train into {cfg.checkpoint_dir}")
            if state is not None:
                self._load_state(state, path)
        except BaseException:
            self.close()
            resuming.restore_group_settings(self.optimizer, self._given_settings)  # the schedule set its lr
            raise

    def _check_resume(self, state: dict, path: Path) -> dict:
        """Before anything is loaded: every rank resumes alike, and the checkpoint fits the model,
        optimizer, schedule and scaler (``compatibility``); the data is put back at its
        position (which fails if the data is shorter). Returns ``state`` with this rank's own
        part of a sharded checkpoint."""
        group, world = getattr(self.world, "group", None), self.world
        folders_only = "a model sharded by FSDP2" if getattr(self.grads, "sharded", False) else None
        agree_on_checkpoint(path, group, folders_only=folders_only)
        if path.is_dir():  # the saved ranks' own parts: this rank's, or re-split on another world size
            own = sharded_checkpoint.rank_part(
                state["ranks"], world.rank, world.world_size, announce=world.is_main, where=f" from {path}"
            )
            state = {**state, **own}

        def check():
            compatibility.check(
                state, path, model=self.model, optimizer=self.optimizer, names=self.param_names,
                scheduler=self.scheduler, scaler=self.scaler, clip_policy=self.clip_policy, spikes=self.spikes,
            )  # fmt: skip
            self.batches.load_state_dict(state["data"])

        together(group, check, f"could not resume from {path}")
        return state

    def _take_folder(self) -> None:
        """Rank 0 checks that ``checkpoint_dir`` can hold files and takes its lock; every rank
        raises if it could not (another writer holds it: ``lock.CheckpointFolderInUse``)."""
        directory = self.config.checkpoint_dir

        def take() -> FolderLock:
            checkpoint.check_directory(directory)
            return FolderLock(directory, "a gradfuse.Trainer")

        group = getattr(self.world, "group", None)
        self.lock = together(group, self.world.is_main and take, f"could not use {directory}")
        self._holding = True

    def _lock_held(self) -> FolderLock | None:
        """The folder's lock while this Trainer holds it; None after ``fit()`` let it go (a save
        then locks the folder for its own duration)."""
        return self.lock if self.lock is not None and self.lock.held else None

    def close(self) -> None:
        """Let go of ``checkpoint_dir`` (its lock), as ``fit()`` does when it returns; a later
        ``fit()`` takes it again, and ``save()`` for the save alone."""
        if self.lock is not None:
            self.lock.release()
        self._holding = False

    def __repr__(self) -> str:
        return f"Trainer(step={self.step}/{self.config.max_steps}, precision={self.config.precision!r})"


def _check_start_over(start_over, resume, config: TrainConfig) -> None:
    if not isinstance(start_over, bool):
        raise TypeError(f"Trainer(start_over=...) must be True or False, got {start_over!r}")
    if start_over and resume is not None:
        raise ValueError(
            f"Trainer(resume={resume!r}, start_over=True): start_over deletes the checkpoints in "
            "TrainConfig.checkpoint_dir to train from step 0, resume continues from one; pass one of them"
        )
    if start_over and config.checkpoint_dir is None:
        raise ValueError(
            "Trainer(start_over=True) deletes the checkpoints in TrainConfig.checkpoint_dir, which is None"
        )


def _check_reiterable(name: str, data) -> None:
    """``train_data``/``eval_data`` is walked again and again (every epoch, every evaluation, a
    resume): a one-shot iterator would be empty from its second walk on."""
    if isinstance(data, Iterator):
        raise TypeError(
            f"{name} is a one-shot {type(data).__name__}: it is used up by its first pass, and the trainer walks "
            f"{name} again (every epoch, every evaluation, on resume). Pass a list, a DataLoader, or an object "
            "whose __iter__ starts a new pass"
        )
    if not isinstance(data, Iterable) and not hasattr(data, "__getitem__"):
        raise TypeError(f"{name} must be an iterable of batches (a list or a DataLoader), got {type(data).__name__}")
    if isinstance(data, (list, tuple)) and not data:
        raise ValueError(f"{name} is empty: it has no batches")


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)
