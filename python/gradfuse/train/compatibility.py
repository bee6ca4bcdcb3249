"""Does a checkpoint fit this run? Checked before anything is loaded.

torch loads what it can and complains afterwards: ``load_state_dict`` copies every tensor it
finds before it raises about missing keys, an optimizer of another class takes any state of the
same length and fails at its first step (``KeyError: 'step'``), a shape mismatch stops a load
half done. So a resume first checks the checkpoint against

- the model: the same keys, and every tensor's shape and dtype;
- the optimizer: its class (recorded since this check exists; older checkpoints are checked
  by the settings their param groups carry, e.g. ``momentum`` that AdamW lacks), the number of
  param groups, the parameters of each (how many, and which, by name, where recorded), and the
  shape of every state tensor of torch's optimizers, whose state tensors have their
  parameter's shape;
- the learning-rate schedule, the loss scaler, the clipping policy and spike windows: a state of
  the kind this run's can load;

and ``CheckpointMismatch`` names every difference found (``the optimizer: saved with SGD, this
run uses AdamW``) while nothing has been changed yet. This is about structure: the settings
given now still win over saved hyperparameters (``resume``).

A single-file checkpoint holds the state dicts themselves; a sharded folder is checked through
DCP's metadata (each tensor's full shape and dtype), without reading a shard.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import torch

from . import checkpoint
from .resume import PROGRESS_KEYS, follows_steps, module_state
from .schedule import FunctionLR
from .sharded_checkpoint import read_metadata

# torch's optimizers whose state tensors are each a scalar or of their parameter's shape.
PARAM_SHAPED = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adadelta", "ASGD")
    if hasattr(torch.optim, name)
)
# A group's keys that say nothing about its class: its parameters and learning rate, and what torch's
# schedulers write into it (LRScheduler: initial_lr; OneCycleLR: max_lr, min_lr, max_momentum,
# base_momentum; SWALR: swa_lr), which a resume with a schedule of another kind does not have.
_NOT_SETTINGS = {"params", "lr", "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}
_SHOWN = 6  # differences named per kind; the rest counted


class CheckpointMismatch(checkpoint.CheckpointError):
    """The checkpoint was saved by a run of another model, optimizer or schedule."""


def optimizer_record(optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]) -> dict:
    """What a checkpoint records of ``optimizer`` for this check: its class and the names of
    each param group's parameters (``names``: parameter -> its name in the model)."""
    return {
        "optimizer_class": _class_name(type(optimizer)),
        "optimizer_params": [[names.get(p, "?") for p in group["params"]] for group in optimizer.param_groups],
    }


def check(
    state: dict,
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    names: Mapping[torch.Tensor, str],
    scheduler,
    scaler,
    clip_policy=None,
    spikes=None,
) -> None:
    """``CheckpointMismatch`` naming every way the checkpoint ``state`` (read from ``path``, a
    file or a sharded folder) does not fit this run; nothing is changed."""
    if Path(path).is_dir():
        saved_model, saved_optimizer = _from_metadata(Path(path), state)
    else:
        saved_model = {k: _spec(v) for k, v in module_state(state["model"], model).items()}
        saved_optimizer = _from_state_dict(state["optimizer"], state)
    problems = _model(saved_model, model)
    problems += _optimizer(saved_optimizer, optimizer, names)
    problems += _scheduler(state.get("scheduler"), scheduler)
    problems += _scaler(state.get("scaler"), scaler)
    problems += _dry_run("the clipping policy (TrainConfig.clip)", clip_policy, state.get("clip"))
    if spikes is not None and state.get("spikes") is not None:
        saved = {k: v for k, v in state["spikes"].items() if k != "skipped"}
        problems += _dry_run("spike skipping (TrainConfig.skip_spikes)", spikes, saved)
    if problems:
        raise CheckpointMismatch(
            f"{path} does not fit this run, nothing was loaded: " + "; ".join(problems) + ". Resume with the model, "
            "optimizer and schedule it was saved with, or start a fresh run"
        )


# --- what was saved ---------------------------------------------------------------------------


def _spec(value) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(shape, dtype) of a tensor (a DTensor's full shape), None for anything else."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    return None


def _from_state_dict(saved: dict, state: dict) -> dict:
    """The optimizer as a single-file checkpoint holds it: class, groups, state by (group, position)."""
    groups, state_by_slot = [], {}
    index_to_slot = {}
    for g, group in enumerate(saved.get("param_groups", [])):
        groups.append({"settings": set(group) - _NOT_SETTINGS, "count": len(group["params"])})
        for j, index in enumerate(group["params"]):
            index_to_slot[index] = (g, j)
    for index, values in saved.get("state", {}).items():
        slot = index_to_slot.get(index)
        if slot is not None:
            state_by_slot[slot] = {k: _spec(v) for k, v in values.items()}
    return _with_record({"groups": groups, "state": state_by_slot}, state)


def _from_metadata(folder: Path, state: dict) -> tuple[dict, dict]:
    """The model and optimizer as DCP's metadata of a sharded folder describes them; the state
    is keyed by parameter name there."""
    metadata = read_metadata(folder)
    model, settings, state_by_name = {}, {}, {}
    for key, where in (metadata.planner_data or {}).items():
        entry = metadata.state_dict_metadata.get(key)
        size = getattr(entry, "size", None)
        spec = (tuple(size), entry.properties.dtype) if size is not None else None
        if where[0] == "model" and len(where) == 2:
            model[where[1]] = spec
        elif where[:2] == ("optimizer", "state") and len(where) == 4:
            state_by_name.setdefault(where[2], {})[where[3]] = spec
        elif where[:2] == ("optimizer", "param_groups") and len(where) == 4:
            settings.setdefault(where[2], set()).add(where[3])
    groups = [{"settings": settings[g] - _NOT_SETTINGS, "count": None} for g in sorted(settings)]
    return model, _with_record({"groups": groups, "state": state_by_name}, state)


def _with_record(optimizer: dict, state: dict) -> dict:
    """Adds what the Trainer recorded (``optimizer_record``), absent from older checkpoints."""
    optimizer["class"] = state.get("optimizer_class")
    params = state.get("optimizer_params")
    optimizer["params"] = params
    if params is not None and len(params) == len(optimizer["groups"]):
        for group, names in zip(optimizer["groups"], params, strict=True):
            group["count"] = len(names)
    return optimizer


# --- the checks -------------------------------------------------------------------------------


def _model(saved: dict, model: torch.nn.Module) -> list[str]:
    mine = {k: _spec(v) for k, v in model.state_dict().items()}
    problems = []
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    if missing:
        problems.append(f"the model has {_list(missing)}, which the checkpoint lacks")
    if extra:
        problems.append(f"the checkpoint has {_list(extra)}, which the model lacks")
    shapes, dtypes = [], []
    for key, spec in mine.items():
        theirs = saved.get(key)
        if spec is None or theirs is None:
            continue
        if spec[0] != theirs[0]:
            shapes.append(f"{key} saved {_shape(theirs[0])}, now {_shape(spec[0])}")
        elif spec[1] != theirs[1]:
            dtypes.append(f"{key} saved as {theirs[1]}, now {spec[1]}")
    if shapes:
        problems.append("model shapes differ: " + _list(shapes))
    if dtypes:
        problems.append("model dtypes differ: " + _list(dtypes))
    return problems


def _optimizer(saved: dict, optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]) -> list[str]:
    now_class = _class_name(type(optimizer))
    if saved["class"] is not None and saved["class"] != now_class:
        before, now = _short(saved["class"], now_class), _short(now_class, saved["class"])
        return [f"the optimizer: saved with {before}, this run uses {now}"]
    groups = optimizer.param_groups
    if len(saved["groups"]) != len(groups):
        return [f"the optimizer: saved with {len(saved['groups'])} param group(s), this one has {len(groups)}"]
    problems = []
    for g, (theirs, group) in enumerate(zip(saved["groups"], groups, strict=True)):
        if saved["class"] is None:  # older checkpoints: another class shows in the settings it carries
            foreign = sorted(theirs["settings"] - (set(group) - _NOT_SETTINGS))
            if foreign:
                problems.append(
                    f"the optimizer: param group {g} was saved with settings {', '.join(foreign)}, which "
                    f"{type(optimizer).__name__} does not have (saved with another optimizer class)"
                )
                continue
        if theirs["count"] is not None and theirs["count"] != len(group["params"]):
            problems.append(
                f"the optimizer: param group {g} was saved over {theirs['count']} parameter(s), this one holds "
                f"{len(group['params'])} (an optimizer over other parameters)"
            )
        elif saved["params"] is not None:
            now = [names.get(p, "?") for p in group["params"]]
            moved = [f"{a} (now {b})" for a, b in zip(saved["params"][g], now, strict=True) if a != b]
            if moved:
                problems.append(f"the optimizer: param group {g} was saved over other parameters: {_list(moved)}")
    if problems:
        return problems
    return _optimizer_state(saved, optimizer, names)


def _optimizer_state(saved: dict, optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]) -> list[str]:
    if not isinstance(optimizer, PARAM_SHAPED):
        return []
    by_name = {names.get(p): p for group in optimizer.param_groups for p in group["params"]}
    wrong, unknown = [], []
    for where, values in saved["state"].items():
        if isinstance(where, tuple):  # (group, position): a single file
            param = optimizer.param_groups[where[0]]["params"][where[1]]
            name = names.get(param, f"parameter {where[1]} of param group {where[0]}")
        else:  # a parameter name: a sharded folder
            param, name = by_name.get(where), where
            if param is None:
                unknown.append(where)
                continue
        for key, spec in values.items():
            if spec is None or spec[0] in ((), (1,)) or spec[0] == tuple(param.shape):
                continue
            wrong.append(f"{key} of {name} saved {_shape(spec[0])}, the parameter is {_shape(tuple(param.shape))}")
    problems = []
    if unknown:
        problems.append(f"the optimizer state has {_list(unknown)}, which this optimizer does not hold")
    if wrong:
        problems.append("optimizer state shapes differ: " + _list(wrong))
    return problems


def _scheduler(saved, scheduler) -> list[str]:
    if saved is None:
        return []
    if follows_steps(scheduler):  # the config's schedule or a step -> lr function: the step count is all
        if not isinstance(saved.get("last_epoch"), int):
            return ["the learning-rate schedule's saved state has no step count (last_epoch)"]
        if isinstance(scheduler, FunctionLR):  # it must have a learning rate for the step resumed at
            try:
                scheduler.lr_of(saved["last_epoch"])
            except ValueError as err:
                return [f"the learning-rate schedule: {err}"]
            except Exception as err:
                return [
                    f"the learning-rate schedule: the step -> lr function raised {type(err).__name__} for step "
                    f"{saved['last_epoch']}, where this run resumes: {err}"
                ]
        return []
    now = set(scheduler.state_dict()) - PROGRESS_KEYS
    theirs = set(saved) - PROGRESS_KEYS
    if now != theirs:
        return [
            f"the learning-rate schedule: this run's {type(scheduler).__name__} resumes from its own state dict, and "
            f"the checkpoint's was saved by another scheduler (it holds {_list(sorted(theirs)) or 'no settings'}, "
            f"{type(scheduler).__name__} holds {_list(sorted(now)) or 'none'}); pass a step -> lr function "
            "(Trainer(scheduler=...)) or the config's lr_schedule to change the schedule on resume"
        ]
    return []


def _scaler(saved, scaler) -> list[str]:
    if not saved or not scaler.is_enabled():
        return []  # nothing saved (fp32/bf16): the scale starts fresh; disabled: nothing to load
    lacking = [k for k in ("scale", "_growth_tracker") if k not in saved]
    if lacking:
        return [f"the loss scaler's saved state lacks {', '.join(lacking)}"]
    return []


def _dry_run(what: str, component, saved) -> list[str]:
    """Load ``saved`` into a copy of ``component``: its own checks, without touching it."""
    if component is None or saved is None:
        return []
    try:
        copy.deepcopy(component).load_state_dict(saved)
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        return [f"{what}: {err}"]
    return []


# --- words ------------------------------------------------------------------------------------


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _short(name: str, other: str) -> str:
    """``SGD`` for ``torch.optim.sgd.SGD``, unless the other name ends the same."""
    short = name.rsplit(".", 1)[-1]
    return name if short == other.rsplit(".", 1)[-1] else short


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"


def _list(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")
