"""``FSDPGradients``: the model sharded across the ranks by FSDP2 (``parallel="fsdp"``).

FSDP2 is torch's ``torch.distributed.fsdp.fully_shard`` (not the older
``FullyShardedDataParallel``): every module named in ``TrainConfig.fsdp_units`` (by class or by
qualified name) is sharded as a unit of its own (its parameters gathered for its forward and
backward, then freed), the modules of a list/tuple entry together as one unit
(``fully_shard([a, b])``), then the root takes the rest. Each parameter becomes a DTensor
sharded on dimension 0 over the ranks; its gradient arrives reduce-scattered, a DTensor shard
as well. A parameter must lie in one unit: tied weights whose modules fall in different units
are refused (``check_ties``) before anything is sharded (torch refuses only at the first
forward, with the model sharded and no way back).

A module FSDP2 shards puts hooks on the tensors of its output that start its backward (gather the
parameters again, then reduce-scatter the gradients). torch 2.11's FSDP2 finds them only in the
containers torch's pytree knows (tuples, NamedTuples, lists, dicts): a dataclass output (such as a
``ModelOutput`` of one's own making) hides them, and backward then fails on freed parameters or,
without the reshard, leaves the gradients unreduced, a silently wrong step. There a sharded
module's first output with tensors needing gradients inside a dataclass is refused with a clear
error; later torch versions look inside dataclasses as well (``_finds_tensors_in_dataclasses``).

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
import dataclasses
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from .config import TrainConfig

#: The dtype FSDP2 gathers the parameters in for forward and backward, per ``precision``; the
#: gradients are reduced in fp32 (a 16-bit reduce-scatter over many ranks loses the small terms).
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


#: A unit FSDP2 shards as one: a module, or several sharded together (``fully_shard([a, b])``).
Unit = torch.nn.Module | list[torch.nn.Module]


def fsdp_units(model: torch.nn.Module, entries: Sequence[str | Sequence[str]]) -> list[Unit]:
    """The units to shard one by one (``TrainConfig.fsdp_units``), innermost first (FSDP2 shards
    a module's descendants before the module); the root is left out (it is sharded last, in any
    case). A name is a module class name or a module's qualified name. A name entry makes each
    module it matches a unit of its own; a list/tuple entry makes all the modules its names
    match ONE unit (returned as a list of modules). Everything that can be wrong is raised (``ValueError``) before
    anything is sharded: a name that matches no module, a name that is a class name and another
    module's qualified name, a module in two units, a group holding a module and its
    descendant, units that each hold a module inside the other."""
    paths = dict(model.named_modules(remove_duplicate=False))  # every path of a shared module
    modules = [m for m in model.modules() if m is not model]  # pre-order, each module once
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted({name for entry in entries for name in _names(entry) if name not in present and name not in paths})
    if missing:
        raise ValueError(
            f"TrainConfig.fsdp_units names {missing}, but the model has no module of that class or qualified name "
            f"(it has: {', '.join(sorted(present))})"
        )
    units: list[list[torch.nn.Module]] = []
    grouped: list[bool] = []  # per unit: made by a list/tuple entry
    taken: dict[int, int] = {}  # id(module) -> the entry that put it in a unit
    for index, entry in enumerate(entries):
        group = not isinstance(entry, str)
        found = list({id(m): m for name in _names(entry) for m in _resolve(model, paths, modules, name)}.values())
        for module in found:
            first = taken.setdefault(id(module), index)
            if first != index and (group or not isinstance(entries[first], str)):
                raise ValueError(
                    f"TrainConfig.fsdp_units entries {first} ({entries[first]!r}) and {index} ({entry!r}) both take "
                    f"the module {_path(model, module)!r}: a module can be in one unit only"
                )
        if group and found:
            _check_group(model, entry, found)
            units.append(found)
            grouped.append(True)
        elif not group:
            fresh = [m for m in found if taken[id(m)] == index]  # the same class or module named again: once
            units += [[m] for m in fresh]
            grouped += [False] * len(fresh)
    order = _innermost_first(model, paths, modules, units)
    return [units[i] if grouped[i] else units[i][0] for i in order]


def check_ties(model: torch.nn.Module, units: Sequence[Unit]) -> None:
    """FSDP2 needs each parameter in one unit: a parameter registered under several names (tied
    weights, a shared module) whose names fall in different units (``units``, then the root for
    what no unit takes) is refused, before anything is sharded, with the grouping that fixes it
    (the modules that hold it, as one unit). torch itself finds it only at the first forward,
    with the model sharded."""
    member_of = {id(m): index for index, unit in enumerate(units) for m in _members(unit)}
    owners: dict[int, dict[int | None, list[str]]] = {}  # id(parameter) -> unit index (None: root) -> names
    holders: dict[int, dict[int, str]] = {}  # id(parameter) -> id(module holding it) -> that module's path
    for path, module in model.named_modules(remove_duplicate=False):
        owner = _owner(model, path, member_of)
        for local, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), {}).setdefault(owner, []).append(f"{path}.{local}" if path else local)
                holders.setdefault(id(param), {}).setdefault(id(module), path)
    problems, group = [], []
    for pid, by_unit in owners.items():
        if len(by_unit) > 1:
            names = (f"{', '.join(names)} (in {_describe(model, units, unit)})" for unit, names in by_unit.items())
            problems.append(" is the same parameter as ".join(names))
            group += [path for path in holders[pid].values() if path]  # "": the root itself holds it
    if problems:
        raise ValueError(
            "TrainConfig.fsdp_units splits tied parameters across FSDP2 units: "
            + "; ".join(problems)
            + ". FSDP2 needs every parameter in one unit (torch would refuse at the first forward, with the model "
            "sharded). Put the modules that hold them in one unit, an fsdp_units entry that is a list of names, e.g. "
            f"{tuple(dict.fromkeys(group))!r} (and no other entry naming them), or leave them all to the root. "
            "Nothing was sharded."
        )


def _names(entry: str | Sequence[str]) -> list[str]:
    return [entry] if isinstance(entry, str) else list(entry)


def _resolve(
    model: torch.nn.Module, paths: dict[str, torch.nn.Module], modules: list[torch.nn.Module], name: str
) -> list[torch.nn.Module]:
    """The modules ``name`` names, the root left out: every module of that class, or the one at
    that qualified name; a name that is both is refused."""
    by_class = [m for m in modules if type(m).__name__ == name]
    at_path = paths.get(name)
    if by_class and at_path is not None and by_class != [at_path]:
        raise ValueError(
            f"TrainConfig.fsdp_units name {name!r} is both a module class and the qualified name of another module; "
            "rename one, or name the modules by their qualified names"
        )
    return by_class if by_class else [m for m in (at_path,) if m is not None and m is not model]


def _check_group(model: torch.nn.Module, entry: Sequence[str], members: list[torch.nn.Module]) -> None:
    for outer in members:
        for inner in members:
            if inner is not outer and any(m is inner for m in outer.modules()):
                raise ValueError(
                    f"TrainConfig.fsdp_units group {entry!r} holds {_path(model, inner)!r}, which is inside "
                    f"{_path(model, outer)!r} of the same group: name the outer module only"
                )


def _innermost_first(
    model: torch.nn.Module,
    paths: dict[str, torch.nn.Module],
    modules: list[torch.nn.Module],
    units: list[list[torch.nn.Module]],
) -> list[int]:
    """The indices of ``units`` in an order where a unit holding a module comes after every unit
    inside that module (FSDP2 shards bottom-up), otherwise in reversed pre-order (as before
    groups existed); units that each hold a module inside the other are refused."""
    position = {id(m): i for i, m in enumerate(reversed(modules))}
    ancestors: dict[int, set[int]] = {}  # id(module) -> ids of the modules above it, on every path
    for path, module in paths.items():
        parts = path.split(".") if path else []
        ancestors.setdefault(id(module), set()).update(id(paths[".".join(parts[:i])]) for i in range(len(parts)))
    member_ids = [{id(m) for m in unit} for unit in units]
    above = [set().union(*(ancestors[id(m)] for m in unit)) for unit in units]
    # unit j must wait for unit i when one of j's modules is above one of i's
    waits = {j: {i for i in range(len(units)) if i != j and member_ids[j] & above[i]} for j in range(len(units))}
    order: list[int] = []
    done: set[int] = set()
    pending = sorted(range(len(units)), key=lambda i: min(position[id(m)] for m in units[i]))
    while pending:
        ready = next((j for j in pending if waits[j] <= done), None)
        if ready is None:
            stuck = ", ".join(repr(tuple(_path(model, m) for m in units[j])) for j in pending)
            raise ValueError(
                f"TrainConfig.fsdp_units: the units {stuck} each hold a module inside another's; FSDP2 shards inner "
                "units first, so no order works: regroup them"
            )
        order.append(ready)
        done.add(ready)
        pending.remove(ready)
    return order


def _members(unit: Unit) -> list[torch.nn.Module]:
    return unit if isinstance(unit, list) else [unit]


def _owner(model: torch.nn.Module, path: str, member_of: dict[int, int]) -> int | None:
    """The unit that takes the parameters of the module at ``path``: the innermost unit on the
    path (sharded first), or None for the root."""
    parts = path.split(".") if path else []
    module = model
    owner = None
    for part in parts:
        module = module.get_submodule(part)
        owner = member_of.get(id(module), owner)
    return owner


def _path(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(path for path, m in model.named_modules(remove_duplicate=False) if m is module)


def _describe(model: torch.nn.Module, units: Sequence[Unit], index: int | None) -> str:
    if index is None:
        return "the root, which takes what no unit does"
    members = _members(units[index])
    if len(members) == 1:
        return f"unit {_path(model, members[0])!r} ({type(members[0]).__name__})"
    return f"unit {tuple(_path(model, m) for m in members)!r}"


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


def _finds_tensors_in_dataclasses() -> bool:
    """Whether this torch's FSDP2 looks for the output tensors its backward hooks go on inside
    dataclasses too (``collect_grad_tensors``, checked on torch 2.15); torch 2.11's
    ``tree_flatten`` takes a dataclass for a leaf (module docs)."""
    try:
        from torch.distributed.fsdp._common_utils import collect_grad_tensors  # noqa: F401
    except ImportError:
        return False
    return True


def _check_first_output(module: torch.nn.Module) -> None:
    """Refuse ``module``'s first output computed with gradients if it hides tensors that need
    them from this torch's FSDP2 inside a dataclass (module docs); then stop checking."""
    from torch.utils._pytree import tree_flatten

    def check(module: torch.nn.Module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        handle.remove()
        hiding = [leaf for leaf in tree_flatten(output)[0] if _grad_tensors_inside(leaf)]
        if hiding:
            raise TypeError(
                f"parallel='fsdp' on torch {torch.__version__}: {type(module).__name__}.forward returns a "
                f"{type(hiding[0]).__name__}, a dataclass holding tensors that need gradients; this torch's FSDP2 "
                "looks for them only in containers torch's pytree knows, so its backward would fail or leave the "
                "gradients unreduced. Return a NamedTuple, a dict or a tuple, or register the class with "
                "torch.utils._pytree.register_dataclass"
            )

    handle = module.register_forward_hook(check)


def _grad_tensors_inside(obj) -> bool:
    """Whether ``obj`` is a dataclass instance holding a tensor that needs gradients, where
    torch's pytree does not look (in a field, or deeper in containers and dataclasses)."""
    from torch.utils._pytree import tree_flatten

    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return False
    leaves = tree_flatten([getattr(obj, field.name) for field in dataclasses.fields(obj)])[0]
    return any((torch.is_tensor(leaf) and leaf.requires_grad) or _grad_tensors_inside(leaf) for leaf in leaves)


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
        check_ties(model, units)
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
        if not _finds_tensors_in_dataclasses():
            for module in [*(m for unit in units for m in _members(unit)), model]:
                _check_first_output(module)

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
