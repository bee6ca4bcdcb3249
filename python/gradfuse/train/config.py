"""``TrainConfig``: every knob of the trainer, checked when it is made.

A frozen dataclass: a config that exists is a valid one, and ``dataclasses.replace(config,
max_steps=...)`` checks again. An impossible value raises at construction with a message that
names the field (``TypeError`` for a wrong type, ``ValueError`` for a value out of range).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from .health import check_clip, check_log_grad_norms, check_skip_spikes

PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "linear", "cosine")
LOSS_NORMALIZATIONS = ("mean", "tokens")
PARALLELS = ("ddp", "fsdp")


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 1000  # optimizer steps to train for
    grad_accum_steps: int = 1  # micro-batches per optimizer step; each loss is divided by this
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 adds dynamic loss scaling)
    max_grad_norm: float | None = 1.0  # clip the total gradient norm to this; None: no clipping
    norm_type: float = 2.0  # order of that norm (any real, inf included)
    lr: float | None = None  # peak learning rate of every param group; None: the optimizer's own
    lr_schedule: str = "constant"  # after warmup: constant | linear | cosine, down to min_lr_ratio * lr
    warmup_steps: int = 0  # linear warmup from lr / warmup_steps to lr
    min_lr_ratio: float = 0.0  # the final learning rate of linear and cosine, as a fraction of lr
    activation_checkpointing: Sequence[str] = ()  # module class names to recompute in backward
    checkpoint_dir: str | os.PathLike | None = None  # where checkpoints go; None: no checkpoints
    save_every: int | None = None  # steps between checkpoints (and one at the end); None: at the end only
    keep_last: int = 2  # newest checkpoints kept; older ones are deleted
    log_every: int = 10  # steps between metrics rows (overflow and non-finite-loss steps always log)
    metrics_path: str | os.PathLike | None = None  # JSON lines file of the metrics rows; None: not written
    progress: bool = True  # a progress bar (tqdm)
    seed: int = 0  # seeds torch, random and numpy when training starts (a resume restores their states)
    device: str | None = None  # where to train; None: where the model already is
    eval_every: int | None = None  # steps between evaluations on eval_data; None: at the end only
    max_nan_losses: int = 5  # non-finite losses in a row before training stops
    eval_batches: int | None = None  # batches of eval_data per evaluation; None: all of them
    keep_best: bool = False  # also keep best.pt, the checkpoint with the lowest eval loss so far
    loss_normalization: str = "mean"  # mean: loss / grad_accum_steps | tokens: summed loss / the step's tokens
    compile: bool = False  # run the model through torch.compile (checkpoints keep the module's own names)
    tensorboard_dir: str | os.PathLike | None = None  # TensorBoard event files of the metrics rows (needs tensorboard)
    # The fp16 loss scaler's settings (torch.amp.GradScaler's); unused in fp32 and bf16.
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    # Gradient health (train/health.py): (window, threshold in standard deviations, warmup) to skip
    # steps whose loss or gradient norm spikes above the window's statistics; None: off.
    skip_spikes: tuple[int, float, int] | None = None
    # Clipping policy (gradfuse.clipping): norm (max_grad_norm) | zclip | autoclip | agc; the others
    # take their arguments from clip_options and need max_grad_norm=None.
    clip: str = "norm"
    clip_options: dict | None = None
    # Per-module gradient norms and largest magnitudes (module names cut at this depth) in the
    # metrics rows of log steps, from the clip's own read; None: off.
    log_grad_norms: int | None = None
    # Under DDP, on a step whose gradients overflowed, re-run its micro-batches on each rank alone to
    # name the ranks whose own gradients held the inf/NaN (train/attribution.py; one more forward and
    # backward on that step, which forward hooks and the user's own counters see); False: the row
    # names the parameters only.
    nonfinite_rerun: bool = True
    # Parallelism (train/fsdp.py): under torchrun, ddp (DistributedDataParallel + gradfuse's hook)
    # or fsdp (FSDP2's fully_shard: each module whose class is named in fsdp_units, then the root).
    parallel: str = "ddp"
    # Sharded one by one before the root: each entry a module class name (every module of that
    # class a unit of its own) or a module's qualified name ("lm_head"); an entry that is a list
    # or tuple of such names makes all the modules it names ONE unit (fully_shard([a, b]): tied
    # weights must share a unit).
    fsdp_units: Sequence[str | Sequence[str]] = ()
    reshard_after_forward: bool = True  # fsdp: free the gathered parameters after forward (gather again in backward)
    cpu_offload: bool = False  # fsdp: keep the sharded parameters, gradients and optimizer state in CPU memory
    # ddp: DistributedDataParallel's own options. find_unused_parameters for a model with parameters
    # that some steps do not use (each backward then walks the graph to find them); static_graph when
    # the set of used parameters and the graph are the same every step (not with grad_accum_steps > 1:
    # torch's DDP breaks under no_sync with a static graph).
    find_unused_parameters: bool = False
    static_graph: bool = False

    def __post_init__(self) -> None:
        for name in ("max_steps", "grad_accum_steps", "keep_last", "log_every", "max_nan_losses"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("save_every", "eval_every", "eval_batches"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        _check_int("warmup_steps", self.warmup_steps, minimum=0)
        _check_int("growth_interval", self.growth_interval, minimum=1)
        _check_int("seed", self.seed, minimum=None)
        if self.warmup_steps > self.max_steps:
            _fail("warmup_steps", f"is longer than training: {self.warmup_steps} > max_steps={self.max_steps}")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check_choice("loss_normalization", self.loss_normalization, LOSS_NORMALIZATIONS)
        for name, low, high in (("init_scale", 0, math.inf), ("growth_factor", 1, math.inf), ("backoff_factor", 0, 1)):
            value = getattr(self, name)
            _check_real(name, value)
            if not low < value < high:
                _fail(name, f"must be between {low} and {high} (exclusive), got {value!r}")
        if self.max_grad_norm is not None:
            _check_real("max_grad_norm", self.max_grad_norm)
            if not 0 < self.max_grad_norm < math.inf:
                _fail("max_grad_norm", f"must be a positive finite number or None, got {self.max_grad_norm!r}")
        _check_real("norm_type", self.norm_type)
        if math.isnan(self.norm_type):
            _fail("norm_type", "must be a real number, got nan")
        if self.lr is not None:
            _check_real("lr", self.lr)
            if not 0 <= self.lr < math.inf:
                _fail("lr", f"must be a non-negative finite number or None, got {self.lr!r}")
        _check_real("min_lr_ratio", self.min_lr_ratio)
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("min_lr_ratio", f"must be between 0 and 1, got {self.min_lr_ratio!r}")
        names = self.activation_checkpointing
        if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
            _fail("activation_checkpointing", f"must be a list of module class names, got {names!r}", TypeError)
        for name in ("checkpoint_dir", "metrics_path", "tensorboard_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                _fail(name, f"must be a path or None, got {type(value).__name__}", TypeError)
        if self.save_every is not None and self.checkpoint_dir is None:
            _fail("save_every", "is set but checkpoint_dir is None: where should the checkpoints go?")
        for name in ("progress", "keep_best", "compile", "nonfinite_rerun"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"must be True or False, got {getattr(self, name)!r}", TypeError)
        if self.keep_best and self.checkpoint_dir is None:
            _fail("keep_best", "is set but checkpoint_dir is None: where should the best checkpoint go?")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as err:
                _fail("device", f"is not a torch device: {self.device!r} ({err})")
        check_skip_spikes(self.skip_spikes)  # gradient health: these raise naming the field
        check_clip(self.clip, self.clip_options, self.max_grad_norm)
        check_log_grad_norms(self.log_grad_norms, self.clip, self.norm_type)
        self._check_parallel()

    def _check_parallel(self) -> None:
        _check_choice("parallel", self.parallel, PARALLELS)
        units = self.fsdp_units
        _check_fsdp_units(units)
        for name in ("reshard_after_forward", "cpu_offload", "find_unused_parameters", "static_graph"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"must be True or False, got {getattr(self, name)!r}", TypeError)
        if self.parallel != "fsdp":  # an FSDP setting under DDP would be silently ignored
            set_here = {"fsdp_units": bool(units), "reshard_after_forward": not self.reshard_after_forward}
            set_here["cpu_offload"] = self.cpu_offload
            for name in (name for name, is_set in set_here.items() if is_set):
                _fail(name, f"applies to parallel='fsdp' only, but parallel={self.parallel!r}")
        if self.static_graph and self.grad_accum_steps > 1:
            # DDP's static graph and no_sync() (communication on the last micro-step only): torch's reducer
            # fails an internal assert on the first backward, and the fix found it would then stop reducing
            # (pytorch/pytorch#143580, #187732).
            _fail(
                "static_graph",
                f"cannot be combined with grad_accum_steps={self.grad_accum_steps}: torch's DDP with a static graph "
                "breaks under no_sync(), which accumulation uses (pytorch/pytorch#143580); use "
                "find_unused_parameters=True instead",
            )
        if self.parallel != "ddp":  # and a DDP setting under FSDP2 (which needs neither: it reduces what it has)
            for name in ("find_unused_parameters", "static_graph"):
                if getattr(self, name):
                    _fail(name, f"applies to parallel='ddp' only (DistributedDataParallel's option), but "
                          f"parallel={self.parallel!r}")  # fmt: skip

    def to_dict(self) -> dict:
        """The fields as plain values (paths as strings), for checkpoints and logs."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = os.fspath(value) if isinstance(value, os.PathLike) else value
        out["activation_checkpointing"] = list(self.activation_checkpointing)
        out["fsdp_units"] = [unit if isinstance(unit, str) else list(unit) for unit in self.fsdp_units]
        return out


def _check_fsdp_units(units) -> None:
    """``fsdp_units``: a list of names (class or qualified module names), an entry a name or a
    non-empty list/tuple of names (one unit of several modules)."""
    what = (
        "must be a list of module class names or qualified module names, each entry a name or a list/tuple of "
        "names (modules sharded together as one unit)"
    )
    if isinstance(units, str) or not isinstance(units, Sequence):
        _fail("fsdp_units", f"{what}, got {units!r}", TypeError)
    for index, unit in enumerate(units):
        if isinstance(unit, str):
            if not unit:
                _fail("fsdp_units", f"entry {index} is an empty name")
            continue
        if not isinstance(unit, (list, tuple)) or not all(isinstance(name, str) for name in unit):
            _fail("fsdp_units", f"{what}; entry {index} is {unit!r}", TypeError)
        if not unit or not all(unit):
            _fail("fsdp_units", f"entry {index} ({unit!r}) must name at least one module, and no name may be empty")


def _fail(name: str, problem: str, kind: type[Exception] = ValueError):
    raise kind(f"TrainConfig.{name} {problem}")


def _check_int(name: str, value, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, f"must be an integer, got {value!r}", TypeError)
    if minimum is not None and value < minimum:
        _fail(name, f"must be at least {minimum}, got {value}")


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, f"must be a number, got {value!r}", TypeError)


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
