"""``GradBuckets``: one process's gradients in a few contiguous flat buffers.

Every fused op then runs on a handful of tensors whatever the number of parameters. Data
parallelism is not done here: it runs on torch's ``DistributedDataParallel`` with gradfuse's
communication hook (``gradfuse.register_ddp_hook``).

- The layout is planned by the Rust planner (``gradfuse._rust.plan_buckets``, see
  ``rust/bucket.rs``): trainable parameters in reverse registration order (the order backward
  produces their gradients), one dtype per bucket, 64-byte aligned offsets, buckets capped at
  ``bucket_cap_mb`` (a larger parameter alone in its own). Frozen parameters are skipped, as
  DDP skips them; :meth:`GradBuckets.refresh` plans again after an unfreezing (or ``model.to()``).
- Grad-as-view: each ``param.grad`` is a view into its parameter's *slot*, so autograd
  accumulates into the bucket in place. A post-accumulate-grad hook puts a gradient that
  landed elsewhere (after ``zero_grad()``, or a ``.grad`` the user replaced) into the slot and
  re-attaches the view.
- ``grad_dtype`` wider than a parameter's dtype (fp32 for a bf16 model): its gradient
  accumulates in ``param.main_grad`` (Megatron's name), a view into an fp32 bucket, through the
  hook (torch's ``add_`` of the one pair: ``gradfuse.accumulate_``'s sum, for a quarter of its
  host time on one pair); ``param.grad`` is freed as soon as it is folded in.
- Never stale: the methods work on the gradients torch would see. The fast path (the flat
  buffers) is taken only while every gradient is its live slot view (the same object, still
  pointing at the slot); otherwise (``.grad`` replaced or None, a sparse or graph-carrying
  gradient kept outside the buckets, a parameter cast or moved since the plan, a frozen
  parameter that got a gradient) they run over the real gradients, with torch's answer. The
  slots of parameters whose gradient is not in the buckets hold unspecified values.
- A parameter replaced in its module after the plan (``module.weight = nn.Parameter(...)``,
  ``register_parameter``, ``load_state_dict(..., assign=True)``, or its submodule replaced:
  ``model.head = nn.Linear(...)``, ``register_module``, ``model.head = None``) is a different
  tensor, or none, whose gradient the buckets never see: torch's global parameter- and
  module-registration hooks (``register_module_parameter_registration_hook`` and
  ``register_module_module_registration_hook``, registered once, with the first
  ``GradBuckets``) note it at the moment of the replacement, at no cost per call, and the
  methods then raise, saying to call :meth:`GradBuckets.refresh`, which plans the parameters
  the model has now (the replacements, found through the module and name they were registered
  under). A submodule wrapped by its replacement (``model.head = Wrapper(model.head)``) keeps
  its parameters: nothing is replaced. A parameter set on a module by other means (``del`` or
  ``= None`` then a new attribute, a ``module._parameters`` write, ``model.to()`` under
  ``torch.__future__.set_overwrite_module_params_on_conversion(True)``) is not seen: build
  the buckets again, or pass ``refresh(params)``.
"""

from __future__ import annotations

import math
import operator
import warnings
import weakref
from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter

import torch
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _plan as P
from . import distributed as D
from . import ops
from .ops import accumulate_, check_max_norm

Tensor = torch.Tensor

ALIGN_BYTES = 64

#: What ``process_group=`` did before, and what replaces it (shown by the error).
DDP_INSTEAD = (
    "GradBuckets no longer averages gradients across ranks (process_group=); data parallelism runs "
    "on torch's DistributedDataParallel with gradfuse's communication hook:\n"
    "    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)\n"
    "    state = gradfuse.register_ddp_hook(ddp)\n"
    "GradBuckets is for one process (flat buffers, fp32 main_grad); its get_total_norm and "
    "clip_grad_norm_ still take process_group= for gradients sharded across ranks."
)

# Live bucket sets by the id of their first gradient view, for the drop-ins' fast path (the
# ids are of objects the set keeps alive, so they cannot be reused while it lives): weak
# references in a plain dict, whose miss costs ~40 ns where a WeakValueDictionary's raises and
# catches a KeyError (~200 ns) on every drop-in call without buckets.
_LIVE: dict[int, weakref.ref[GradBuckets]] = {}


def _live_set(view: Tensor, buckets: GradBuckets) -> None:
    key = id(view)

    def forget(ref, key=key):
        if _LIVE.get(key) is ref:
            del _LIVE[key]

    _LIVE[key] = weakref.ref(buckets, forget)


def _live_drop(view: Tensor, buckets: GradBuckets) -> None:
    ref = _LIVE.get(id(view))
    if ref is not None and ref() is buckets:
        del _LIVE[id(view)]


# Which set holds each parameter, by the parameter's id (kept alive by that set).
_OWNERS: weakref.WeakValueDictionary[int, GradBuckets] = weakref.WeakValueDictionary()

#: torch's global parameter- and module-registration hooks (``_on_parameter_registered``,
#: ``_on_module_registered``), once registered.
_WATCHING = None

_grad = attrgetter("grad")
_main_grad = attrgetter("main_grad")
_PLAIN = frozenset({Tensor, torch.nn.Parameter})


def _describe(i: int, p: Tensor) -> str:
    return f"params[{i}] (shape {tuple(p.shape)}, {str(p.dtype).removeprefix('torch.')})"


def _watch_replacements() -> None:
    """Registers :func:`_on_parameter_registered` and :func:`_on_module_registered` with
    torch, once (the first GradBuckets)."""
    global _WATCHING
    if _WATCHING is None:
        _WATCHING = (
            register_module_parameter_registration_hook(_on_parameter_registered),
            register_module_module_registration_hook(_on_module_registered),
        )


def _on_parameter_registered(module: torch.nn.Module, name: str, param) -> None:
    """torch calls this whenever any module registers a parameter (``module.x = Parameter``,
    ``register_parameter``, ``load_state_dict(assign=True)``), before storing it: the parameter
    it replaces, if a GradBuckets holds it, is noted there (held weakly: ``_OWNERS``)."""
    old = module._parameters.get(name)
    if old is None or old is param:
        return
    owner = _OWNERS.get(id(old))
    if owner is not None:
        owner._note_replaced(old, module, name)


def _on_module_registered(module: torch.nn.Module, name: str, submodule) -> None:
    """torch calls this whenever any module registers a submodule (``module.x = Module``,
    ``add_module``/``register_module``, ``module.x = None``), before storing it: the
    parameters of the submodule it replaces that the new one does not hold (a wrapper holds
    them) have left the model, and are noted where a GradBuckets holds them."""
    old = module._modules.get(name)
    if old is None or old is submodule or not _OWNERS:
        return
    kept = set() if submodule is None else set(map(id, submodule.parameters()))
    for path, p in old.named_parameters():
        if id(p) not in kept:
            owner = _OWNERS.get(id(p))
            if owner is not None:
                owner._note_replaced(p, module, f"{name}.{path}")


def _parameter_at(module: torch.nn.Module, name: str) -> Tensor | None:
    """The parameter ``module`` holds under the dotted ``name`` now, or None."""
    *path, leaf = name.split(".")
    for part in path:
        module = module._modules.get(part)
        if module is None:
            return None
    return module._parameters.get(leaf)


def _check_params(params, owner: GradBuckets | None = None) -> list[Tensor]:
    """The parameters to plan, checked: ``params`` a tensor, an iterable of tensors or a
    ``Module`` (its parameters). Those ``owner`` holds already may be given again."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    if isinstance(params, Tensor):
        params = [params]
    params = list(params)
    if not params:
        raise ValueError("GradBuckets: no parameters given")
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"GradBuckets: params[{i}] is a {type(p).__name__}, not a tensor")
        if not p.is_leaf:
            raise ValueError(f"GradBuckets: params[{i}] (shape {tuple(p.shape)}) is not a leaf tensor (a parameter)")
        if id(p) in seen:
            raise ValueError(f"GradBuckets: params[{seen[id(p)]}] and params[{i}] are the same parameter")
        seen[id(p)] = i
        held_by = _OWNERS.get(id(p))
        if held_by is not None and held_by is not owner:
            raise ValueError(
                f"GradBuckets: {_describe(i, p)} already has its gradient in another GradBuckets, whose hooks "
                "would fire too; call .remove() on that one first (or .refresh() it to follow a changed model)"
            )
    _check_kinds(params)
    return params


def _check_kinds(params: list[Tensor]) -> None:
    """The parameters that will be planned: dense plain tensors of a supported dtype, one device."""
    trainable = [(i, p) for i, p in enumerate(params) if p.requires_grad]
    for i, p in trainable:
        if p.layout != torch.strided or type(p) not in _PLAIN:
            raise TypeError(
                f"GradBuckets: params[{i}] is a {type(p).__name__} with layout {p.layout}; buckets hold dense "
                "gradients of plain tensors (use FSDP2's own buffers for DTensor parameters)"
            )
        if p.dtype not in P.DTYPE_CODES:
            raise TypeError(f"GradBuckets: params[{i}] has dtype {p.dtype}; gradfuse works on {P.SUPPORTED}")
        if p.device != trainable[0][1].device:
            raise ValueError(
                f"GradBuckets: params[{i}] is on {p.device} but params[{trainable[0][0]}] is on "
                f"{trainable[0][1].device}; one GradBuckets holds the gradients of one device"
            )


def _check_cap(bucket_cap_mb) -> int:
    cap = float(bucket_cap_mb)
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"GradBuckets: bucket_cap_mb must be a positive number, got {bucket_cap_mb}")
    return max(1, int(cap * 1024 * 1024))


def _slot_dtype(p: Tensor, grad_dtype: torch.dtype | None) -> tuple[torch.dtype, bool]:
    """The dtype of ``p``'s slot, and whether it is ``main_grad``: ``grad_dtype`` when given and
    not ``p.dtype`` (``main_grad``), else the dtype autograd gives ``p.grad`` (``p.grad_dtype``
    when it is set)."""
    if grad_dtype is not None and grad_dtype != p.dtype:
        return grad_dtype, True
    own = getattr(p, "grad_dtype", None)
    return (own if own is not None else p.dtype), False


def _slot(buffer: Tensor, offset: int, p: Tensor) -> Tensor:
    """``p``'s slot at ``offset`` in ``buffer``, with ``p``'s strides when its elements are one
    dense block (channels_last included: autograd gives the gradient the parameter's layout,
    as DDP's bucket views do), else contiguous."""
    if P.is_dense(p):
        return buffer.as_strided(p.shape, p.stride(), offset)
    return buffer.narrow(0, offset, p.numel()).view(p.shape)


def _fits(grad: Tensor, slot: Tensor) -> bool:
    """Whether ``grad`` can be put into ``slot`` as is: dense, plain, no autograd graph (a
    ``backward(create_graph=True)`` gradient keeps its ``grad_fn`` outside the buckets), and
    the slot's dtype, shape and device (a parameter cast or moved since the plan does not)."""
    return (
        grad.layout == torch.strided
        and type(grad) in _PLAIN
        and not grad.requires_grad
        and grad.dtype == slot.dtype
        and grad.shape == slot.shape
        and grad.device == slot.device
    )


def _combine(parts: list[Tensor], norm_type: float) -> Tensor:
    """The norm over several groups of tensors from each group's norm (on the first's device):
    the norm of the groups' norms, as torch combines per-tensor norms; for order 0 the groups'
    counts of non-zero tensors add up."""
    if len(parts) == 1:
        return parts[0]
    dtype = parts[0].dtype
    for t in parts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    stacked = torch.stack([t.to(parts[0].device, dtype) for t in parts])
    return stacked.sum() if norm_type == 0 else torch.linalg.vector_norm(stacked, norm_type)


class GradBuckets:
    """The gradients of ``params`` (one process) in a few flat buffers (see the module docs).

    ``params``: tensors on one device, or a ``Module`` (its parameters; :meth:`refresh` then
    takes the module's parameters as they are at that time); those that do not require grad
    are skipped (as DDP does) and brought in by :meth:`refresh` once they do.
    ``bucket_cap_mb``: the bucket size cap. ``grad_dtype``: the dtype gradients accumulate
    in; a parameter of another dtype gets its gradient in ``param.main_grad`` (``param.grad``
    is freed). ``main_grad`` is cleared by :meth:`zero_grad` alone, not by
    ``optimizer.zero_grad()`` (Megatron's ``zero_grad_buffer`` convention): a backward after
    an optimizer step without ``buckets.zero_grad()`` in between warns, since it adds to the
    last step's gradients.

    A parameter belongs to one ``GradBuckets`` at a time (:meth:`remove` the first).
    ``process_group=`` is gone: data parallelism runs on ``DistributedDataParallel`` with
    ``gradfuse.register_ddp_hook`` (the error says how).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | torch.nn.Module,
        *,
        bucket_cap_mb: float = 25.0,
        grad_dtype: torch.dtype | None = None,
        process_group=None,
    ) -> None:
        if process_group is not None:
            raise TypeError(DDP_INSTEAD)
        #: The module the parameters were taken from, if one was given (weakly).
        self._module = weakref.ref(params) if isinstance(params, torch.nn.Module) else None
        given = _check_params(params)
        self._cap_bytes = _check_cap(bucket_cap_mb)
        if grad_dtype is not None and grad_dtype not in P.DTYPE_CODES:
            raise TypeError(f"GradBuckets: grad_dtype must be one of {P.SUPPORTED}, got {grad_dtype}")
        self._grad_dtype = grad_dtype
        #: Every parameter given, trainable or not (frozen ones are planned by ``refresh``).
        self._given = given
        self._handles: list = []
        #: Indices (in the ``params`` given) already warned about, once per plan.
        self._warned: set[int] = set()
        #: An optimizer stepped over a ``main_grad`` parameter since the last ``zero_grad``.
        self._stepped = False
        self._checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._step_handle = None
        #: Parameters replaced in their module since the plan: index in ``_given`` -> (the
        #: module, weakly; the name). Non-empty: the methods raise until ``refresh``.
        self._replaced: dict[int, tuple[weakref.ref, str]] = {}
        self._given_at = {id(p): i for i, p in enumerate(given)}
        self._plan()
        for p in given:
            _OWNERS[id(p)] = self
        _watch_replacements()

    # --- layout ----------------------------------------------------------------------------

    def _plan(self) -> None:
        """Plans buckets for the parameters that require grad, as they are now, allocates them
        and attaches the views, carrying over the gradients already there (``main_grad`` and
        ``grad``); a gradient that cannot live in a slot (sparse, graph-carrying) stays where it is."""
        at = [i for i, p in enumerate(self._given) if p.requires_grad]
        params = [self._given[i] for i in at]
        frozen = [p for p in self._given if not p.requires_grad]
        dtypes, main = (
            map(list, zip(*(_slot_dtype(p, self._grad_dtype) for p in params), strict=True)) if params else ([], [])
        )
        device = params[0].device if params else self._given[0].device
        from . import _rust

        numels = [p.numel() for p in params]
        slots, buckets = _rust.plan_buckets(
            numels,
            [P.DTYPE_CODES[g] for g in dtypes],
            list(reversed(range(len(params)))),
            self._cap_bytes,
            self._cap_bytes,
            ALIGN_BYTES,
            1,
        )
        by_code = {code: dtype for dtype, code in P.DTYPE_CODES.items()}
        buffers = [torch.zeros(numel, dtype=by_code[code], device=device) for code, numel, _ in buckets]
        slot_views = [_slot(buffers[b], offset, p) for (b, offset), p in zip(slots, params, strict=True)]
        views = [s.view(s.shape) for s in slot_views]
        ours = {id(v) for v in getattr(self, "_views", ())}
        with ops.no_grad():
            for p, is_main, slot, view in zip(params, main, slot_views, views, strict=True):
                grad = p.grad
                old = getattr(p, "main_grad", None)
                carried = isinstance(old, Tensor) and old.shape == slot.shape and (is_main or id(old) in ours)
                if carried:  # main_grad from an earlier plan, or a main_grad parameter no longer one
                    slot.copy_(old)
                if not is_main and id(old) in ours:
                    del p.main_grad
                    if grad is None:
                        p.grad = view
                if is_main:
                    if grad is not None:
                        if grad.layout == torch.strided:
                            accumulate_(slot, grad)
                        else:
                            slot.add_(grad.to(slot.dtype))
                        p.grad = None
                    p.main_grad = view
                elif grad is not None and _fits(grad, slot):
                    # A parameter without a gradient keeps none until backward gives it one.
                    if carried:
                        slot.add_(grad)
                    else:
                        slot.copy_(grad)
                    p.grad = view
        self._clear_registration()
        for p in frozen:
            if id(getattr(p, "main_grad", None)) in ours:
                del p.main_grad  # a frozen parameter has no gradient in the buckets
        self.params = params
        #: Each planned parameter's index in the ``params`` given (for messages).
        self._at = at
        self.device = device
        self.grad_dtypes = dtypes
        self._frozen = frozen
        self._frozen_at = [(i, p) for i, p in enumerate(self._given) if not p.requires_grad]
        self._main = main
        self._buffers = buffers
        self._slots = slot_views
        self._views = views
        self._ptrs = [s.data_ptr() for s in slot_views]
        self._bucket_of = [b for b, _ in slots]
        # Views and parameters split by where the gradient lives, for the C-level checks.
        self._grad_params = [p for p, m in zip(params, main, strict=True) if not m]
        self._main_params = [p for p, m in zip(params, main, strict=True) if m]
        self._grad_views = [v for v, m in zip(views, main, strict=True) if not m]
        self._main_views = [v for v, m in zip(views, main, strict=True) if m]
        # Their slots' addresses, which the views must still have (a view re-pointed with
        # ``.data =`` or ``set_`` does not).
        self._grad_addrs = P.Addresses(a for a, m in zip(self._ptrs, main, strict=True) if not m)
        self._main_addrs = P.Addresses(a for a, m in zip(self._ptrs, main, strict=True) if m)
        #: Parameter index -> its position in ``_grad_views`` or ``_main_views``.
        counts = [0, 0]
        self._split_at = []
        for m in main:
            self._split_at.append(counts[m])
            counts[m] += 1
        self._main_ids = frozenset(map(id, self._main_params))
        self._warned.clear()
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]
        if views:
            _live_set(views[0], self)
        if self._main_params:
            self._step_handle = register_optimizer_step_post_hook(_StepWatch(self))
            weakref.finalize(self, self._step_handle.remove)  # torch's hook list outlives the set

    def _clear_registration(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._step_handle is not None:
            self._step_handle.remove()
            self._step_handle = None
        views = getattr(self, "_views", None)
        if views:
            _live_drop(views[0], self)

    def _set_view(self, i: int) -> Tensor:
        """A fresh view of slot ``i`` (the old view object was re-pointed with ``.data =``)."""
        view = self._slots[i].view(self._slots[i].shape)
        (self._main_views if self._main[i] else self._grad_views)[self._split_at[i]] = view
        if i == 0:
            _live_drop(self._views[0], self)
            _live_set(view, self)
        self._views[i] = view
        return view

    def refresh(self, params: Iterable[Tensor] | torch.nn.Module | None = None) -> None:
        """Plans the buckets again for the parameters as they are now: those that require grad
        (follow an unfreezing schedule), with their current dtype, shape and device (after
        ``model.to()``, ``.half()``, channels_last, ``grad_dtype``), and the parameters that
        replaced some of them in their modules (``module.weight = nn.Parameter(...)``,
        ``load_state_dict(..., assign=True)``; the old ones are let go). The gradients are
        carried over; read :attr:`buffers` again afterwards.

        ``params``: plan these instead (tensors, or a ``Module``'s parameters); by default the
        module's parameters when the buckets were built from a module, else those given, with
        the replacements. Nothing changes when they cannot be planned (the error says why).
        (Under torch's ``set_overwrite_module_params_on_conversion(True)``, ``model.to()`` makes
        new parameter objects without telling anyone: pass them here, or build the buckets
        again; the optimizer needs them too.)"""
        module = self._module() if self._module is not None else None
        if params is not None:
            given = _check_params(params, owner=self)
        elif module is not None:
            given = _check_params(module, owner=self)
        else:
            given = _check_params(self._current_given(), owner=self)
        _check_kinds(given)
        if isinstance(params, torch.nn.Module):
            self._module = weakref.ref(params)
        kept = {id(p) for p in given}
        for p in self._given:
            if id(p) not in kept and _OWNERS.get(id(p)) is self:
                del _OWNERS[id(p)]
        for p in given:
            _OWNERS[id(p)] = self
        self._given = given
        self._given_at = {id(p): i for i, p in enumerate(given)}
        self._replaced.clear()
        self._plan()

    def _current_given(self) -> list[Tensor]:
        """The parameters given, each replaced one by what its module holds under its name now
        (left out if the module is gone or holds none; each parameter once)."""
        given, seen = [], set()
        for i, p in enumerate(self._given):
            if i in self._replaced:
                module, name = self._replaced[i]
                module = module()
                p = None if module is None else _parameter_at(module, name)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                given.append(p)
        return given

    def _note_replaced(self, old: Tensor, module: torch.nn.Module, name: str) -> None:
        """``module`` registers a new parameter (or submodule) at the dotted ``name``, replacing
        ``old`` (ours)."""
        i = self._given_at.get(id(old))
        if i is not None:
            self._replaced[i] = (weakref.ref(module), name)

    def _check_not_replaced(self) -> None:
        if self._replaced:
            i, (module, name) = next(iter(self._replaced.items()))
            module = module()
            where = f"{type(module).__name__}.{name}" if module is not None else name
            more = f" (and {len(self._replaced) - 1} more)" if len(self._replaced) > 1 else ""
            raise RuntimeError(
                f"GradBuckets: {_describe(i, self._given[i])}{more} was replaced in its module ({where}: a new "
                "nn.Parameter, a new submodule, or load_state_dict(..., assign=True)) after the buckets were "
                "planned; the new parameter's gradient never reaches them. Call buckets.refresh() to plan the "
                "parameters the model has now (an optimizer built before holds the old ones too)"
            )

    @property
    def buffers(self) -> list[Tensor]:
        """The flat bucket tensors (after :meth:`refresh`, new ones: read it again)."""
        return list(self._buffers)

    @property
    def grads(self) -> list[Tensor]:
        """Every planned parameter's gradient view, in ``params`` order (``main_grad`` where it is used)."""
        return list(self._views)

    def bucket_index(self, i: int) -> int:
        """The bucket holding parameter ``i``'s gradient."""
        return self._bucket_of[i]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.numel()}x{str(b.dtype).removeprefix('torch.')}" for b in self._buffers)
        frozen = f", {len(self._frozen)} frozen" if self._frozen else ""
        return f"GradBuckets({len(self.params)} params in {len(self._buffers)} buckets: {sizes}{frozen})"

    # --- backward --------------------------------------------------------------------------

    def _make_hook(self, i: int):
        def hook(param: Tensor) -> None:
            self._landed(i, param)

        return hook

    def _landed(self, i: int, param: Tensor) -> None:
        """Backward has accumulated into ``param.grad``: bring it into slot ``i``."""
        grad, slot = param.grad, self._slots[i]
        if self._main[i]:
            if self._stepped:
                self._stepped = False
                warnings.warn(
                    "GradBuckets: a backward after optimizer.step() without buckets.zero_grad() in between: "
                    "main_grad adds to the last step's gradients (main_grad is cleared by buckets.zero_grad() "
                    "alone, not by optimizer.zero_grad())",
                    stacklevel=2,
                )
            if grad.requires_grad:
                raise RuntimeError(
                    f"GradBuckets: {_describe(self._at[i], param)} got a gradient with an autograd graph "
                    "(backward(create_graph=True)); folding it into main_grad would drop the graph. "
                    "Use GradBuckets without grad_dtype (or none) for double backward"
                )
            if grad.shape != slot.shape or grad.device != slot.device:
                raise RuntimeError(
                    f"GradBuckets: {_describe(self._at[i], param)} is now {tuple(grad.shape)} on {grad.device}, "
                    f"but its main_grad was planned as {tuple(slot.shape)} on {slot.device}; call buckets.refresh() "
                    "after moving the model (or remove() the buckets and build new ones)"
                )
            with ops.no_grad():
                # One pair: torch's own add (the sum formed in fp32, rounded once, as accumulate_
                # forms it) costs one op, ~2 us a parameter on the CPU where a call of accumulate_
                # (its two plans, its checks) costs ~8.
                slot.add_(grad if grad.layout == torch.strided else grad.to(slot.dtype))
            param.grad = None
            return
        view = self._views[i]
        if grad is view and view.data_ptr() == self._ptrs[i]:
            return  # accumulated in place
        if not _fits(grad, slot) or param.stride() != slot.stride():
            # Sparse, graph-carrying, or cast/moved/reformatted since the plan: it stays in
            # .grad, where torch put it, and the methods include it from there.
            if grad.layout == torch.strided and not grad.requires_grad and self._at[i] not in self._warned:
                self._warned.add(self._at[i])
                warnings.warn(
                    f"GradBuckets: {_describe(self._at[i], param)} got a {str(grad.dtype).removeprefix('torch.')} "
                    f"gradient of shape {tuple(grad.shape)} on {grad.device}, but its slot is "
                    f"{str(slot.dtype).removeprefix('torch.')} {tuple(slot.shape)} with strides {slot.stride()} "
                    f"on {slot.device} (the model was cast, moved or changed memory format after the buckets "
                    "were built); it is kept outside the buckets. "
                    "Call buckets.refresh() to plan them again",
                    stacklevel=2,
                )
            return
        with ops.no_grad():
            slot.copy_(grad)
        if view.data_ptr() != self._ptrs[i]:
            view = self._set_view(i)
        param.grad = view

    # --- where the gradients are -----------------------------------------------------------

    def _all_live(self) -> bool:
        """Whether every gradient is its live slot view (and no frozen parameter has one): the
        buffers then hold exactly the gradients, and gaps are zero."""
        if not P.grads_are(self._grad_params, self._grad_views, self._grad_addrs):
            return False
        if self._main_params:
            try:
                if not all(map(operator.is_, map(_main_grad, self._main_params), self._main_views)):
                    return False
            except AttributeError:  # a main_grad deleted
                return False
            if not P.addrs_are(self._main_views, self._main_addrs):
                return False
        return not self._frozen or all(map(operator.is_, map(_grad, self._frozen), repeat(None)))

    def _gradients(self) -> tuple[list[Tensor], list[Tensor]]:
        """The gradients torch would see, wherever they are: ``dense`` (live slots, and dense
        plain tensors outside the buckets, for the fused ops) and ``odd`` (sparse,
        graph-carrying or subclass gradients, for torch)."""
        dense: list[Tensor] = []
        odd: list[Tensor] = []
        current = [getattr(p, "main_grad", None) if m else p.grad for p, m in zip(self.params, self._main, strict=True)]
        for i, grad in enumerate(current):
            if grad is None:
                continue
            if grad is self._views[i] and grad.data_ptr() == self._ptrs[i]:
                dense.append(self._slots[i])
            else:
                (dense if self._plain(grad) else odd).append(grad)
        for i, p in self._frozen_at:
            grad = p.grad
            if grad is None:
                continue
            if i not in self._warned:
                self._warned.add(i)
                warnings.warn(
                    f"GradBuckets: {_describe(i, p)} was frozen when the buckets were planned and now has a "
                    "gradient; it is included from outside the buckets. Call buckets.refresh() after "
                    "unfreezing to plan it into them",
                    stacklevel=3,
                )
            (dense if self._plain(grad) else odd).append(grad)
        return dense, odd

    @staticmethod
    def _plain(grad: Tensor) -> bool:
        return (
            grad.layout == torch.strided
            and type(grad) in _PLAIN
            and not grad.requires_grad
            and grad.dtype in P.DTYPE_CODES
            and grad.device.type in ("cpu", "cuda")
        )

    def _norm_of(self, dense: list[Tensor], odd: list[Tensor], norm_type: float) -> Tensor | None:
        """The norm over ``dense`` (fused) and ``odd`` (torch), or None when both are empty."""
        parts = []
        if dense:
            try:
                parts.append(ops.multi_tensor_norm_op(dense, norm_type, False)[0])
            except (P.UnsupportedTensorError, P.MixedDevicesError, NotImplementedError):
                odd = dense + odd
        if odd:
            parts.append(torch.nn.utils.get_total_norm(odd, norm_type))
        return _combine(parts, norm_type) if parts else None

    # --- public API --------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears every gradient, as ``optimizer.zero_grad(set_to_none)`` does over these
        parameters: the buffers are zero-filled (one fill per bucket) and, by default, each
        ``.grad`` is set to None, so that a parameter that gets no gradient in the next backward
        has none (an optimizer leaves it alone, as torch's); the hook re-attaches the view when
        a gradient arrives. ``set_to_none=False`` zeroes the gradients in place. ``main_grad`` is
        cleared here and only here (Megatron's ``zero_grad_buffer``)."""
        self._check_not_replaced()
        if self._buffers:
            torch._foreach_zero_(self._buffers)
        self._stepped = False
        with ops.no_grad():
            for i, p in enumerate(self.params):
                live = self._views[i].data_ptr() == self._ptrs[i]
                if self._main[i]:
                    if getattr(p, "main_grad", None) is not self._views[i] or not live:
                        p.main_grad = self._set_view(i)
                elif p.grad is self._views[i] and live:
                    if set_to_none:
                        p.grad = None
                    continue
                if p.grad is not None:
                    p.grad = None if set_to_none else p.grad.zero_()
            for p in self._frozen:
                if p.grad is not None:
                    p.grad = None if set_to_none else p.grad.zero_()

    def get_total_norm(self, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, process_group=None) -> Tensor:
        """The total norm of the gradients, as ``torch.nn.utils.get_total_norm`` of them: one
        fused pass over the buffers while every gradient is its live view, else over the real
        gradients (see the module docs). ``process_group``: the gradients are shards (ZeRO,
        FSDP) and the norm is over every rank's shard (identical on every rank; every rank must
        call it, with or without gradients)."""
        norm_type = P.check_norm_type("GradBuckets.get_total_norm", norm_type)
        self._check_not_replaced()
        with ops.no_grad():
            if self._all_live():
                # Zero gaps do not change a norm of positive order; they would change the count
                # of non-zero tensors (0), a minimum (-inf) and negative orders.
                dense, odd = (self._buffers if norm_type > 0 else self._slots), []
            else:
                dense, odd = self._gradients()
            return self._total(dense, odd, norm_type, error_if_nonfinite, process_group)

    def _total(self, dense, odd, norm_type: float, error_if_nonfinite: bool, process_group) -> Tensor:
        total = self._norm_of(dense, odd, norm_type)
        if process_group is not None:
            # Every rank takes part in the collective, with or without gradients.
            if total is None:
                total = D.norm_of_nothing(norm_type, D.collective_device(process_group, self.device))
            total = D.combine_norm(total, norm_type, [process_group])
        if total is None:
            return torch.zeros((), device=self.device)
        if error_if_nonfinite and not torch.isfinite(total):
            raise P.nonfinite_total_error(norm_type)
        return total

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, process_group=None
    ) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the gradients: while every gradient is its live
        view, one norm pass and one scale pass over the buffers (the scale skipped when the
        coefficient is exactly 1) whatever the number of parameters, no host sync; otherwise
        the same over the real gradients, wherever they are (torch's answer). Returns the total
        norm (before clipping)."""
        max_norm = check_max_norm("GradBuckets.clip_grad_norm_", max_norm)
        norm_type = P.check_norm_type("GradBuckets.clip_grad_norm_", norm_type)
        self._check_not_replaced()
        with ops.no_grad():
            if self._all_live():
                if process_group is None and norm_type > 0 and self._buffers:
                    return ops.clip_grad_norm_op(self._buffers, max_norm, norm_type, error_if_nonfinite)
                total = self._total(
                    self._buffers if norm_type > 0 else self._slots, [], norm_type, error_if_nonfinite, process_group
                )
                self._scale(self._buffers, [], max_norm, total)
            else:
                dense, odd = self._gradients()
                total = self._total(dense, odd, norm_type, error_if_nonfinite, process_group)
                self._scale(dense, odd, max_norm, total)
        return total

    def _scale(self, dense: list[Tensor], odd: list[Tensor], max_norm: float, total: Tensor) -> None:
        if dense:
            try:
                ops.clip_grads_with_norm_op(dense, max_norm, total.to(dense[0].device))
            except (P.UnsupportedTensorError, P.OverlapError, P.MixedDevicesError, NotImplementedError):
                odd = dense + odd  # nothing was modified; torch's per-tensor rule below
        if odd:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in odd:
                g.mul_(coef.to(g.device))

    def owns(self, grads: list[Tensor]) -> bool:
        """Whether ``grads`` are exactly this set's gradient views, in order, still pointing
        into the buckets (a ``.grad`` the user replaced, or re-pointed with ``.data =``, is
        not), and no frozen parameter has a gradient the set's methods would add."""
        return (
            not self._replaced
            and len(grads) == len(self._views)
            and all(map(operator.is_, grads, self._views))
            and list(map(Tensor.data_ptr, grads)) == self._ptrs
            and (not self._frozen or all(map(operator.is_, map(_grad, self._frozen), repeat(None))))
        )

    def remove(self) -> None:
        """Detaches the hooks; the gradients stay where they are, and the parameters may go
        into another ``GradBuckets``."""
        self._clear_registration()
        for p in self._given:
            if _OWNERS.get(id(p)) is self:
                del _OWNERS[id(p)]


class _StepWatch:
    """``torch.optim``'s global step post-hook for one ``GradBuckets`` with ``main_grad``
    parameters (held weakly): records that an optimizer over them stepped."""

    def __init__(self, buckets: GradBuckets) -> None:
        self._buckets = weakref.ref(buckets)

    def __call__(self, optimizer, args, kwargs) -> None:
        buckets = self._buckets()
        if buckets is None:
            return
        groups = len(optimizer.param_groups)
        known = buckets._checked_optimizers.get(optimizer)
        if known is None or known[0] != groups:
            ours = any(id(p) in buckets._main_ids for g in optimizer.param_groups for p in g["params"])
            known = buckets._checked_optimizers[optimizer] = (groups, ours)
        if known[1]:
            buckets._stepped = True


def owner_of(grads: list[Tensor]) -> GradBuckets | None:
    """The live ``GradBuckets`` whose gradient views ``grads`` are, all of them in order, or None."""
    if not grads:
        return None
    ref = _LIVE.get(id(grads[0]))
    if ref is None:
        return None
    buckets = ref()
    return buckets if buckets is not None and buckets.owns(grads) else None
