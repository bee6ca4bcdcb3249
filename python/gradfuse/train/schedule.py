"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay.

``lr_factor`` is the whole rule (nanoGPT's ``get_lr``, as a fraction of the peak learning
rate); ``build_scheduler`` hands it to torch's ``LambdaLR``, whose state dict the checkpoints
carry. ``user_scheduler`` takes the user's own instead (``Trainer(scheduler=...)``): a torch
scheduler, or a ``step -> lr`` function run by ``FunctionLR``.
"""

from __future__ import annotations

import functools
import math

import torch

from .config import TrainConfig


def lr_factor(step: int, *, max_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based), as a fraction of the peak.

    Warmup climbs linearly to 1 over ``warmup_steps`` steps (the first step already gets
    ``1 / warmup_steps``, not 0); then ``constant`` stays at 1, ``linear`` and ``cosine`` go
    from 1 down to ``min_lr_ratio``, which they would reach at step ``max_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following ``config``; ``config.lr``, when set, becomes
    every param group's peak learning rate. Call its ``step()`` after each optimizer step."""
    if config.lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = config.lr
            group.pop("initial_lr", None)
    # A partial, not a callable object: LambdaLR saves an object's attributes in its state dict
    # and a resumed run would get the old run's schedule back; the config is what says it.
    factor = functools.partial(
        lr_factor,
        max_steps=config.max_steps,
        warmup_steps=config.warmup_steps,
        schedule=config.lr_schedule,
        min_lr_ratio=config.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class FunctionLR(torch.optim.lr_scheduler.LRScheduler):
    """The learning rate of every param group is ``lr_at(step)`` (0-based optimizer step), a
    user's function such as nanoGPT's ``get_lr``. Its state dict holds the step count only:
    on resume the function the user passes now is the schedule."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_at):
        self.lr_at = lr_at
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self.lr_of(self.last_epoch)] * len(self.optimizer.param_groups)

    def lr_of(self, step: int) -> float:
        """The function's learning rate for ``step``, checked (``ValueError`` for a value that is
        not a learning rate)."""
        lr = self.lr_at(step)
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < math.inf:
            raise ValueError(
                f"Trainer(scheduler=...) returned {lr!r} for step {step}: a learning rate must be a "
                "non-negative finite number"
            )
        return float(lr)

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_at")}


def user_scheduler(optimizer: torch.optim.Optimizer, scheduler, config: TrainConfig):
    """``Trainer(scheduler=...)``: a torch LR scheduler over ``optimizer`` as it is, or a
    ``step -> lr`` function run by ``FunctionLR``. Checked first by ``check_user_scheduler``."""
    check_user_scheduler(optimizer, scheduler, config)
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return scheduler
    return FunctionLR(optimizer, scheduler)


def check_user_scheduler(optimizer: torch.optim.Optimizer, scheduler, config: TrainConfig) -> None:
    """The config's own schedule fields must be at their defaults (both would set the learning
    rate, and one would be silently ignored); a scheduler must step on steps, over ``optimizer``."""
    clashes = {
        name: getattr(config, name)
        for name, default in (("lr", None), ("lr_schedule", "constant"), ("warmup_steps", 0), ("min_lr_ratio", 0.0))
        if getattr(config, name) != default
    }
    if clashes:
        settings = ", ".join(f"TrainConfig.{k}={v!r}" for k, v in clashes.items())
        raise ValueError(
            f"Trainer(scheduler=...) sets the learning rate, and so would {settings}: leave those at their "
            "defaults when you bring your own schedule (or drop scheduler= to use the config's)"
        )
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)  # steps on a metric
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and not plateau:
        if scheduler.optimizer is not optimizer:
            raise ValueError("Trainer(scheduler=...) schedules another optimizer than the one given to the Trainer")
    elif plateau or not callable(scheduler):
        raise TypeError(
            f"Trainer(scheduler=...) must be a torch LR scheduler stepped once per optimizer step, or a function "
            f"step -> lr; got {type(scheduler).__name__}"
        )
