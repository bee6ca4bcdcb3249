"""One process or several: where the trainer runs, and who holds the gradients.

The trainer touches gradient management in three places besides clipping (which goes through
the scaler): it calls ``grads.module`` for the loss, it zeroes the gradients before a step, and
it lets backward skip communication on every micro-step but the last (``grads.no_sync()``).
``LocalGradients`` does that for one process (the model itself, torch's own ``zero_grad``,
nothing to skip); ``DDPGradients`` for data parallelism: torch's ``DistributedDataParallel``
with ``gradient_as_bucket_view=True`` and gradfuse's communication hook, which measures the
gradients' norm while backward runs, so that the scaler's clip reads no gradient afterwards
(``measured``: the Trainer hands the hook's state to the scaler, which is sound only there);
``FSDPGradients`` (``fsdp.py``, ``TrainConfig.parallel="fsdp"``) for a model sharded by FSDP2.
``World.gradients`` is the one place that picks among them.

``connect`` gives the ``World``: a single process, or, when a default process group exists
(made by the caller, or here from torchrun's environment: gloo on CPU, NCCL on GPU), this
rank of it. Rank 0 is the one that writes checkpoints, metrics and the progress bar. Each
rank trains on its own ``train_data`` (shard it, e.g. with ``DistributedSampler``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..ddp_hook import register_ddp_hook
from .config import TrainConfig
from .fsdp import FSDPGradients

# The start of DDP's error when a parameter got no gradient in the step before (c10d's reducer.cpp).
_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"


class LocalGradients:
    """Gradients as autograd leaves them in ``param.grad``; nothing to communicate."""

    sharded = False  # every rank holds whole tensors (FSDPGradients: a shard of each)
    measured = None  # no measurement taken during backward: the scaler reads the gradients

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.module = model
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class TrainerDDP(DistributedDataParallel):
    """torch's ``DistributedDataParallel``, unchanged, except that its error about parameters
    that received no gradient in the previous step names the ``TrainConfig`` field that fixes it
    (DDP's own message names DDP's keyword, which the Trainer passes for you)."""

    def forward(self, *inputs, **kwargs):
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as err:
            if _UNFINISHED_REDUCTION not in str(err):
                raise
            raise RuntimeError(
                "DistributedDataParallel: some parameters of the model received no gradient in the previous step, "
                "so its gradient reduction never finished. Set TrainConfig(find_unused_parameters=True) (each "
                "backward then finds the unused parameters), or TrainConfig(static_graph=True) if the same "
                "parameters go unused in every step; or make the loss depend on every parameter (or freeze the "
                f"unused ones with requires_grad_(False)). DDP's message: {err}"
            ) from err


class DDPGradients:
    """Gradients averaged across ``group`` by ``DistributedDataParallel`` (which also broadcasts
    rank 0's weights and buffers), measured by gradfuse's hook as each bucket is reduced.
    ``find_unused_parameters`` and ``static_graph`` are DDP's options, passed as they are."""

    sharded = False  # every rank holds whole tensors

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        group,
        norm_type: float,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
    ):
        device = next(model.parameters()).device
        self.module = TrainerDDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group,
            gradient_as_bucket_view=True,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
        )
        self.hook = register_ddp_hook(self.module, norm_type=norm_type)
        self.optimizer = optimizer

    @property
    def measured(self):
        """The hook's state, for the scaler's clip to take the norm and inf/NaN flag it measured
        during backward (``unscale_and_clip_(..., measured=)``): inside the Trainer's step no
        user code runs between backward and the clip, so nothing can have touched the gradients."""
        return self.hook

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.module.no_sync()


class World:
    """A single process: rank 0 of 1."""

    rank = 0
    world_size = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` averaged over the ranks (a scalar on the training device)."""
        return value

    def gradients(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig):
        """Who holds the gradients: ``.module`` (what forward calls), ``.zero_grad()``,
        ``.no_sync()``. One process trains the plain model, whatever ``config.parallel`` says
        (nothing to shard over: see ``fsdp.py``)."""
        return LocalGradients(model, optimizer)


class ProcessGroupWorld(World):
    """This rank of a ``torch.distributed`` process group."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)  # a sum: gloo has no average
        return total / self.world_size

    def gradients(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig):
        """FSDP2 for ``parallel="fsdp"``; otherwise DDP with gradfuse's hook, which measures
        the ``config.norm_type``-norm in backward (another order would read the gradients)."""
        if config.parallel == "fsdp":
            return FSDPGradients(model, optimizer, self.group, config)
        return DDPGradients(
            model, optimizer, self.group, config.norm_type,
            find_unused_parameters=config.find_unused_parameters, static_graph=config.static_graph,
        )  # fmt: skip


def training_device(requested: str | None, model: torch.nn.Module) -> torch.device:
    """``requested``, or where the model is; a CUDA device without an index is this rank's
    (torchrun's ``LOCAL_RANK``) or the current one."""
    device = torch.device(requested) if requested else next(model.parameters()).device
    if device.type == "cuda" and device.index is None:
        local_rank = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _destroy_process_group() -> None:
    # DDP's reducer sits in a reference cycle and keeps the process group referenced: freed
    # only at interpreter teardown, the group's threads could abort the process ("terminate
    # called without an active exception", seen in the 2-rank bench).
    gc.collect()
    dist.destroy_process_group()


def connect(device: torch.device) -> World:
    """The ``World`` this process trains in (see the module docs). A process group made here
    from torchrun's environment is destroyed when the process exits."""
    if not dist.is_available():
        return World()
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return World()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(_destroy_process_group)
    if dist.get_world_size() == 1:
        return World()
    return ProcessGroupWorld(dist.group.WORLD)
