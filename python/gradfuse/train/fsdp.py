"""``FSDPGradients``: the model sharded across the ranks by FSDP2 (``parallel="fsdp"``).

FSDP2 is torch's ``torch.distributed.fsdp.fully_shard`` (not the older
``FullyShardedDataParallel``): every module whose class is named in ``TrainConfig.fsdp_units``
is sharded as a unit of its own (its parameters gathered for its forward and backward, then
freed), then the root takes the rest. Each parameter becomes a DTensor sharded on dimension 0
over the ranks; its gradient arrives reduce-scattered, a DTensor shard as well.

Settings that follow the config: a ``MixedPrecisionPolicy`` from ``precision`` (bf16 and fp16
compute with 16-bit gathered parameters and reduce the gradients in fp32; fp32: none),
``reshard_after_forward``, and ``CPUOffloadPolicy`` when ``cpu_offload`` (torch's offload
moves shards between a GPU and pinned CPU memory: it needs a CUDA device).

The optimizer. ``fully_shard`` replaces every parameter of the module with a new
``nn.Parameter`` holding a DTensor (checked on torch 2.15): an optimizer built over the model
before would keep stepping the old, unsharded tensors, which never receive a gradient again,
and the model would silently not train. torch's advice is to build the optimizer after
``fully_shard``; the Trainer takes the user's optimizer built before it, so here its param
groups are re-pointed, in place and by parameter name, at the sharded parameters (every
hyperparameter of every group kept). That is only correct while the optimizer has no state:
one that has stepped is refused (its state belongs to the unsharded tensors; a resume
restores state into the fresh one).

As ``DistributedDataParallel`` does, rank 0's parameters and buffers are broadcast first, so
every rank starts from the same model whatever its seed.

A single process (no process group, or a group of one) trains the plain model whatever
``parallel`` says: there is nothing to shard over, and its losses are those of the ranks
together (``World.gradients`` decides; ``TrainConfig.parallel`` still tells the checkpoints
that the run is an FSDP2 one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from .config import TrainConfig

#: The dtype FSDP2 gathers the parameters in for forward and backward, per ``precision``; the
#: gradients are reduced in fp32 (a 16-bit reduce-scatter over many ranks loses the small terms).
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_units(model: torch.nn.Module, class_names: Sequence[str]) -> list[torch.nn.Module]:
    """The modules to shard one by one, innermost first (FSDP2 shards a module's descendants
    before the module); the root is left out (it is sharded last, in any case). A name that
    matches no module is an error, raised before anything is sharded."""
    wanted = set(class_names)
    present = {type(m).__name__ for m in model.modules()}
    if wanted - present:
        raise ValueError(
            f"TrainConfig.fsdp_units names {sorted(wanted - present)}, but the model has no module of that class "
            f"(it has: {', '.join(sorted(present))})"
        )
    # Reversed pre-order: every module comes after all of its descendants.
    return [m for m in reversed(list(model.modules())) if type(m).__name__ in wanted and m is not model]


def mixed_precision(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for the trainer's ``precision``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = PARAM_DTYPES.get(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(param) -> the model's name for it, for every parameter of the optimizer; raises when
    the optimizer cannot be carried over to the sharded parameters."""
    if optimizer.state:
        raise ValueError(
            "parallel='fsdp': the optimizer already has state (it has stepped), and that state belongs to the "
            "unsharded parameters FSDP2 is about to replace; pass a freshly built optimizer (a resume restores "
            "the state)"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"parallel='fsdp': optimizer.param_groups[{index}] holds a parameter of shape "
                    f"{tuple(p.shape)} that is not the model's; FSDP2 shards the model's parameters only"
                )
    return names


def _repoint_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], model: torch.nn.Module) -> None:
    """Each group's parameters replaced by the sharded parameters of the same names; the lists
    are changed in place, so whatever holds them (LBFGS keeps its first group's) follows."""
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"][:] = [sharded[names[id(p)]] for p in group["params"]]


@torch.no_grad()
def broadcast_from_first(model: torch.nn.Module, group) -> None:
    """Rank 0's parameters and buffers on every rank of ``group`` (in place)."""
    source = dist.get_global_rank(group, 0)
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.detach(), source, group=group)


class FSDPGradients:
    """Gradients reduce-scattered across ``group`` by FSDP2: each rank holds, as DTensors, the
    shard of every gradient that matches its shard of the parameters. The same interface as
    ``LocalGradients``/``DDPGradients`` (``.module``, ``.zero_grad()``, ``.no_sync()``), plus
    ``sharded = True``. Shards ``model`` in place; re-points ``optimizer`` (module docs)."""

    sharded = True
    measured = None  # no measurement taken during backward: the scaler reads the shards

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group, config: TrainConfig):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        # Everything that can be refused is, before the model is changed.
        if any(hasattr(p, "device_mesh") for p in model.parameters()):
            raise ValueError(
                "parallel='fsdp': the model's parameters are DTensors already (sharded by fully_shard or tensor "
                "parallelism); pass the plain model, and the Trainer shards it as TrainConfig.fsdp_units says"
            )
        units = fsdp_units(model, config.fsdp_units)
        names = _optimizer_names(model, optimizer)
        device = next(model.parameters()).device
        if config.cpu_offload and device.type != "cuda":
            raise ValueError(
                f"TrainConfig.cpu_offload moves FSDP2's shards between a GPU and pinned CPU memory; this model "
                f"trains on {device.type}, where the shards already are in CPU memory"
            )
        broadcast_from_first(model, group)
        settings = dict(
            mesh=DeviceMesh.from_group(group, device.type),
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=mixed_precision(config.precision),
            offload_policy=CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
        )
        for unit in units:
            fully_shard(unit, **settings)
        self.module = fully_shard(model, **settings)  # the same module object, now an FSDPModule
        _repoint_optimizer(optimizer, names, model)
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates the unsharded gradients (in fp32 under a mixed precision
        policy) without reduce-scattering them; the next backward outside reduces the sum."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
