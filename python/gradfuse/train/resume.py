"""Resuming: which checkpoint to continue from, and what of it gives way to what the user
passes now.

The checkpoint brings the state (weights, optimizer moments, the schedule's position, the
loss scale, counters, data position, RNG states); the settings are the ones given now: the
config's (lr and the rest of the schedule, clipping, the loss scaler's rule), the optimizer's
hyperparameters, a ``step -> lr`` function. Each function here returns what differed, for the
one warning the Trainer logs. A torch scheduler of the user's resumes from its state dict, as
torch's own recipe does (its settings live there): what it carries that differs is reported.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from . import checkpoint
from .schedule import FunctionLR, lr_factor

logger = logging.getLogger("gradfuse.train")
# Keys of a torch scheduler's state dict that say where it is, not what it is.
PROGRESS_KEYS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial"}


def resolve(resume: str | os.PathLike, folder, announce: bool) -> tuple[Path | None, dict | None]:
    """The checkpoint to resume from: (path, state), or (None, None) to start fresh. A path is
    loaded as it is (``CheckpointError`` if it cannot be); ``"latest"`` is the newest valid
    checkpoint in ``folder``, with a warning naming any newer one refused (``announce``: this
    process logs)."""
    if resume != "latest":
        return Path(resume), checkpoint.load_checkpoint(resume)
    if folder is None:
        raise ValueError("resume='latest' needs TrainConfig.checkpoint_dir: the folder to look in")
    path, state, refused = checkpoint.newest_valid_checkpoint(folder)
    if refused and path is None:
        raise checkpoint.CheckpointError(
            f"resume='latest': no checkpoint in {folder} can be used: " + " ".join(why for _, why in refused)
        )
    if refused and announce:
        names = ", ".join(p.name for p, _ in refused)
        logger.warning(
            f"resume='latest': the newest checkpoint(s) {names} in {folder} cannot be used, resuming from the "
            f"newest valid one, {path.name}. {refused[0][1]}"
        )
    if path is None and announce:
        logger.warning(f"resume='latest': no checkpoint in {folder} yet; starting from step 0")
    return path, state


def config_changes(saved: dict, now: dict) -> list[str]:
    """The config fields that differ from the checkpoint's, as ``name old -> new``."""
    return [f"{key} {saved[key]!r} -> {value!r}" for key, value in now.items() if key in saved and saved[key] != value]


def module_state(saved: dict, model: torch.nn.Module) -> dict:
    """``saved`` with the prefixes ``torch.compile`` (``_orig_mod.``) and DDP (``module.``) add
    removed where the model's own names lack them, so either kind of checkpoint loads."""
    own = set(model.state_dict())
    if set(saved) <= own:
        return saved
    fixed = {}
    for key, value in saved.items():
        while key not in own and key.startswith(("_orig_mod.", "module.")):
            key = key.split(".", 1)[1]
        fixed[key] = value
    return fixed


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> list[str]:
    """The optimizer's state (moments, step counts) from ``saved``; its hyperparameters (weight
    decay, betas, ...) stay the ones it was made with. The learning rates are the schedule's."""
    return keep_optimizer_settings(optimizer, lambda opt: opt.load_state_dict(saved))


def keep_optimizer_settings(optimizer: torch.optim.Optimizer, load: Callable) -> list[str]:
    """``load(optimizer)`` (which brings the saved state and param groups), then the
    hyperparameters it was made with put back; returns what differed."""
    mine = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]
    load(optimizer)
    changed = []
    for i, (group, settings) in enumerate(zip(optimizer.param_groups, mine, strict=True)):
        for key, value in settings.items():
            if key in group and not _same(group[key], value):
                changed.append(f"optimizer param group {i} {key} {group[key]!r} -> {value!r}")
            group[key] = value
    return changed


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings (all but its parameters), to put back with
    ``restore_group_settings``."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> None:
    """The param groups' settings as ``group_settings`` took them (what a schedule added, such as
    ``initial_lr``, removed)."""
    for group, saved in zip(optimizer.param_groups, settings, strict=True):
        for key in [k for k in group if k != "params" and k not in saved]:
            del group[key]
        group.update(saved)


def load_schedule(scheduler, saved: dict, optimizer: torch.optim.Optimizer, base_lrs: list[float]) -> list[str]:
    """The schedule's position from ``saved``. For the config's schedule and a ``step -> lr``
    function, the learning rate of the very next step is recomputed from what is given now
    (``base_lrs``, the peak lrs, and the rule)."""
    if not follows_steps(scheduler):
        before = scheduler.state_dict()
        scheduler.load_state_dict(saved)
        return [
            f"scheduler {key} {value!r} (yours: {before[key]!r}) kept from the checkpoint: a torch scheduler "
            "resumes from its state dict; pass a step -> lr function to change the schedule on resume"
            for key, value in saved.items()
            if key not in PROGRESS_KEYS and key in before and not _same(before[key], value)
        ]
    changed = [
        f"peak lr of param group {i} {old!r} -> {new!r}"
        for i, (old, new) in enumerate(zip(saved.get("base_lrs", []), base_lrs, strict=False))
        if not _same(old, new) and not isinstance(scheduler, FunctionLR)
    ]
    # Only the position: the rule is the one given now (which may be of the other kind, or a torch
    # scheduler's state may have been saved: its settings are not this schedule's).
    scheduler.last_epoch = saved["last_epoch"]
    scheduler._step_count = saved.get("_step_count", saved["last_epoch"] + 1)
    scheduler.base_lrs = list(base_lrs)
    if isinstance(scheduler, FunctionLR):
        lrs = scheduler.get_lr()
    else:
        factors = scheduler.lr_lambdas
        lrs = [base * f(scheduler.last_epoch) for base, f in zip(base_lrs, factors, strict=True)]
    for group, base, lr in zip(optimizer.param_groups, base_lrs, lrs, strict=True):
        group["initial_lr"], group["lr"] = base, lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() reports
    return changed


def follows_steps(scheduler) -> bool:
    """Whether the learning rate of ``scheduler`` is a function of the step alone (the config's
    schedule, a ``step -> lr`` function): a resume takes only its step count."""
    return isinstance(scheduler, FunctionLR) or is_config_schedule(scheduler)


def is_config_schedule(scheduler) -> bool:
    """Whether ``scheduler`` is the config's (``schedule.build_scheduler``), not the user's."""
    return isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and all(
        isinstance(f, functools.partial) and f.func is lr_factor for f in scheduler.lr_lambdas
    )


def scaler_state(saved: dict, growth_interval: int) -> dict:
    """``saved`` (a loss scaler's state dict) ready for a scaler whose growth interval is the
    config's: torch grows the scale when its count of clean steps *equals* the interval, so a
    count already past a shortened interval would never grow it again."""
    saved = dict(saved)
    saved["_growth_tracker"] = min(saved["_growth_tracker"], growth_interval - 1)
    return saved


def _same(a, b) -> bool:
    try:
        return bool(a == b) if not isinstance(a, (tuple, list)) else list(a) == list(b)
    except (RuntimeError, TypeError):  # tensors of several elements
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
