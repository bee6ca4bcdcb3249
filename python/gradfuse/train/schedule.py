"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay.

``lr_factor`` is the whole rule (nanoGPT's ``get_lr``, as a fraction of the peak learning
rate); ``build_scheduler`` hands it to torch's ``LambdaLR``, whose state dict the checkpoints
carry.
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
