"""``GradBuckets``: a model's gradients in a few contiguous flat buffers.

Every fused op then runs on a handful of tensors whatever the number of parameters, and the
same layout serves data parallelism (one all-reduce per bucket, overlapping backward).

- The layout is planned once by the Rust planner (``gradfuse._rust.plan_buckets``, see
  ``rust/bucket.rs``): parameters in reverse registration order (the order backward produces
  their gradients), one dtype per bucket, 64-byte aligned offsets, buckets capped at
  ``bucket_cap_mb`` (a larger parameter alone in its own), padded to a multiple of the world size.
- Grad-as-view: each ``param.grad`` is a view into its bucket, so autograd accumulates into the
  bucket in place. A post-accumulate-grad hook puts a gradient that landed elsewhere (after
  ``zero_grad(set_to_none=True)``, or a ``.grad`` the user replaced) back into the view.
- ``grad_dtype`` wider than a parameter's dtype (fp32 for a bf16 model): its gradient
  accumulates in ``param.main_grad`` (Megatron's name), a view into an fp32 bucket, through the
  hook (``gradfuse.accumulate_``); ``param.grad`` is freed as soon as it is folded in.
- Invariant the fused methods rely on: after backward, the buckets hold exactly the gradients
  (a parameter without one has zeros in its slot; gaps and padding are zero), so a norm over
  the buffers is the norm over the gradients for every ``norm_type > 0``.
"""

from __future__ import annotations

import contextlib
import math
import operator
import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from . import _plan as P
from . import distributed as D
from .ops import accumulate_, check_max_norm

Tensor = torch.Tensor

ALIGN_BYTES = 64
#: DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``): small, so that communication
#: starts while most of backward is still to run.
FIRST_BUCKET_BYTES = 1 << 20

# Live bucket sets by the id of their first gradient view, for the drop-ins' fast path (the
# ids are of objects the set keeps alive, so they cannot be reused while it lives).
_LIVE: weakref.WeakValueDictionary[int, GradBuckets] = weakref.WeakValueDictionary()


def _check_params(params) -> list[Tensor]:
    if isinstance(params, Tensor):
        params = [params]
    params = list(params)
    if not params:
        raise ValueError("GradBuckets: no parameters given")
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"GradBuckets: params[{i}] is a {type(p).__name__}, not a tensor")
        if not p.requires_grad:
            raise ValueError(
                f"GradBuckets: params[{i}] (shape {tuple(p.shape)}) does not require grad; pass only "
                "trainable parameters, e.g. [p for p in model.parameters() if p.requires_grad]"
            )
        if id(p) in seen:
            raise ValueError(f"GradBuckets: params[{seen[id(p)]}] and params[{i}] are the same parameter")
        seen[id(p)] = i
        if p.layout != torch.strided or type(p) not in (Tensor, torch.nn.Parameter):
            raise TypeError(
                f"GradBuckets: params[{i}] is a {type(p).__name__} with layout {p.layout}; buckets hold dense "
                "gradients of plain tensors (use FSDP2's own buffers for DTensor parameters)"
            )
        if p.dtype not in P.DTYPE_CODES:
            raise TypeError(f"GradBuckets: params[{i}] has dtype {p.dtype}; gradfuse works on {P.SUPPORTED}")
        if p.device != params[0].device:
            raise ValueError(
                f"GradBuckets: params[{i}] is on {p.device} but params[0] is on {params[0].device}; "
                "one GradBuckets holds the gradients of one device"
            )
    return params


def _check_cap(bucket_cap_mb) -> int:
    cap = float(bucket_cap_mb)
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"GradBuckets: bucket_cap_mb must be a positive number, got {bucket_cap_mb}")
    return max(1, int(cap * 1024 * 1024))


class GradBuckets:
    """The gradients of ``params`` in a few flat buffers (see the module docs).

    ``params``: trainable tensors on one device. ``bucket_cap_mb``: the bucket size cap.
    ``grad_dtype``: the dtype gradients accumulate in; a parameter of another dtype gets its
    gradient in ``param.main_grad`` (``param.grad`` is freed). ``process_group``: average the
    gradients across its ranks during backward, as ``DistributedDataParallel`` does (every rank
    must pass the same parameters; rank 0's parameter values are broadcast at construction).
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        bucket_cap_mb: float = 25.0,
        grad_dtype: torch.dtype | None = None,
        process_group=None,
    ) -> None:
        params = _check_params(params)
        self._cap_bytes = _check_cap(bucket_cap_mb)
        if grad_dtype is not None and grad_dtype not in P.DTYPE_CODES:
            raise TypeError(f"GradBuckets: grad_dtype must be one of {P.SUPPORTED}, got {grad_dtype}")
        self.params = params
        self.device = params[0].device
        self.grad_dtypes = [grad_dtype or p.dtype for p in params]
        #: Per parameter: its gradient lives in ``main_grad`` (wider dtype), not ``grad``.
        self._main = [g != p.dtype for g, p in zip(self.grad_dtypes, params, strict=True)]
        self.process_group = process_group
        self._reducer = None
        world = 1
        if process_group is not None:
            world = dist.get_world_size(process_group)
            description = [
                (self._cap_bytes, world, str(self.device.type)),
                *((p.numel(), str(p.dtype), str(g)) for p, g in zip(params, self.grad_dtypes, strict=True)),
            ]
            D.check_same_layout(description, process_group, self.device)
        self._world = world
        self._first_cap = min(FIRST_BUCKET_BYTES, self._cap_bytes) if process_group is not None else self._cap_bytes
        self._sync = True
        self._layout(list(reversed(range(len(params)))))
        if process_group is not None:
            D.broadcast_parameters(params, process_group)
            self._reducer = D.BucketReducer(process_group, self._buffers)
        self._used = bytearray(len(params))  # which parameters got a gradient since the last reduction
        self._fired = bytearray(len(params))  # ... in the current backward
        self._task = None  # the backward (autograd graph task) that state belongs to
        # With a process group: the order in which gradients become ready, recorded until the
        # first synchronised backward ends and the buckets are rebuilt in it.
        self._order: dict[int, None] | None = {} if process_group is not None else None
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    # --- layout ----------------------------------------------------------------------------

    def _layout(self, order: list[int]) -> None:
        """Plans buckets for parameters placed in ``order``, allocates them and attaches the
        views (carrying over the gradients already there)."""
        numels = [p.numel() for p in self.params]
        codes = [P.DTYPE_CODES[g] for g in self.grad_dtypes]
        from . import _rust

        slots, buckets = _rust.plan_buckets(
            numels, codes, order, self._cap_bytes, self._first_cap, ALIGN_BYTES, self._world
        )
        dtypes = {code: dtype for dtype, code in P.DTYPE_CODES.items()}
        buffers = [torch.zeros(numel, dtype=dtypes[code], device=self.device) for code, numel, _ in buckets]
        views = [
            buffers[b].narrow(0, offset, n).view(p.shape)
            for (b, offset), n, p in zip(slots, numels, self.params, strict=True)
        ]
        old = getattr(self, "_views", None)
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(self.params, views, strict=True)):
                if old is not None:
                    view.copy_(old[i])
                    if self._main[i]:
                        p.main_grad = view
                    elif p.grad is not None:
                        p.grad = view
                elif self._main[i]:
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = None
                    p.main_grad = view
                elif p.grad is not None:
                    # A parameter without a gradient keeps none until backward gives it one.
                    view.copy_(p.grad)
                    p.grad = view
        self._placed_order = list(order)
        self._buffers = buffers
        self._views = views
        self._view_ptrs = [v.data_ptr() for v in views]
        self._bucket_of = [b for b, _ in slots]
        self._bucket_params = [params for _, _, params in buckets]
        self._pending = [len(ps) for ps in self._bucket_params]
        if old is not None:
            _LIVE.pop(id(old[0]), None)
        _LIVE[id(views[0])] = self
        if self._reducer is not None:
            self._reducer.set_buffers(buffers)

    @property
    def buffers(self) -> list[Tensor]:
        """The flat bucket tensors (after a bucket rebuild, new ones: read it again)."""
        return list(self._buffers)

    @property
    def grads(self) -> list[Tensor]:
        """Every parameter's gradient view, in ``params`` order (``main_grad`` where it is used)."""
        return list(self._views)

    def bucket_index(self, i: int) -> int:
        """The bucket holding parameter ``i``'s gradient."""
        return self._bucket_of[i]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.numel()}x{str(b.dtype).removeprefix('torch.')}" for b in self._buffers)
        return f"GradBuckets({len(self.params)} params in {len(self._buffers)} buckets: {sizes}; world {self._world})"

    # --- backward --------------------------------------------------------------------------

    def _make_hook(self, i: int):
        def hook(param: Tensor) -> None:
            view = self._views[i]
            grad = param.grad
            if self._main[i]:
                accumulate_(view, grad)
                param.grad = None
            elif grad is not view:
                # The gradient landed outside the bucket: .grad was None (set_to_none) or replaced.
                with torch.no_grad():
                    view.copy_(grad)
                param.grad = view
            self._ready(i)

        return hook

    def _ready(self, i: int) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first gradient of a new backward
            self._task = task
            self._pending = [len(ps) for ps in self._bucket_params]
            self._fired = bytearray(len(self.params))
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._fired[i] = self._used[i] = 1
        if self._order is not None:
            self._order.setdefault(i)
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0 and self._sync and self._reducer is not None:
            self._reducer.ready(b)

    def _end_of_backward(self) -> None:
        """Queued on the autograd engine by the first hook of each backward; runs before
        ``backward()`` returns: settles the parameters that got no gradient, then (synchronised,
        with a process group) finishes the reduction."""
        self._task = None
        unfired = [
            i for b, left in enumerate(self._pending) if left for i in self._bucket_params[b] if not self._fired[i]
        ]
        with torch.no_grad():
            for i in unfired:
                self._settle(i)
        if self._reducer is None or not self._sync:
            return
        device = D.collective_device(self.process_group, self.device)
        used = self._reducer.finish(torch.frombuffer(self._used, dtype=torch.uint8).to(device, torch.int32))
        self._used = bytearray(len(self.params))
        missing = [i for i in unfired if not self._main[i] and self.params[i].grad is None]
        if missing:
            used = used.tolist()
            for i in missing:
                if used[i]:  # used on another rank: it gets the average, as under DDP
                    self.params[i].grad = self._views[i]
        if self._order is not None:
            self._rebuild()

    def _settle(self, i: int) -> None:
        """Parameter ``i`` got no gradient in this backward: its slot keeps what ``.grad``
        holds (an accumulated gradient), or zeros when it has none, so that the buckets hold
        exactly the gradients."""
        if self._main[i]:
            return
        grad = self.params[i].grad
        if grad is None:
            self._views[i].zero_()
        elif grad is not self._views[i]:
            self._views[i].copy_(grad)
            self.params[i].grad = self._views[i]

    def _rebuild(self) -> None:
        """After the first synchronised backward: lay the buckets out again in the order in
        which gradients became ready (rank 0's, on every rank), as DDP does, so that each
        bucket is complete as early as possible. Parameters that got no gradient go last."""
        seen, self._order = self._order, None
        rest = [i for i in reversed(range(len(self.params))) if i not in seen]
        order = self._reducer.broadcast_order([*seen, *rest], self.device)
        if order != self._placed_order:
            self._layout(order)

    # --- public API --------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without communicating; the next
        backward outside reduces everything accumulated (``DistributedDataParallel.no_sync``)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self) -> None:
        """Zeros every gradient: one fill per bucket; the views stay valid."""
        torch._foreach_zero_(self._buffers)

    def _uses_buffers(self, norm_type: float) -> bool:
        # Zero gaps and slots do not change a norm of positive order; they would change the
        # count of non-zero tensors (0), a minimum (-inf) and negative orders.
        return norm_type > 0

    def _present(self) -> list[Tensor]:
        """The gradient views torch's functions would see (``None`` grads skipped)."""
        return [
            v for v, p, main in zip(self._views, self.params, self._main, strict=True) if main or p.grad is not None
        ]

    def get_total_norm(self, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, process_group=None) -> Tensor:
        """The total norm of the gradients, as ``torch.nn.utils.get_total_norm`` of them, in one
        fused pass over the buffers. ``process_group``: the gradients are shards (ZeRO, FSDP)
        and the norm is over every rank's shard (identical on every rank)."""
        norm_type = P.check_norm_type("GradBuckets.get_total_norm", norm_type)
        tensors = self._buffers if self._uses_buffers(norm_type) else self._present()
        if not tensors:
            return torch.zeros((), device=self.device)
        with torch.no_grad():
            total = torch.ops.gradfuse.multi_tensor_norm(tensors, norm_type, False)[0]
            if process_group is not None:
                total = D.combine_norm(total, norm_type, [process_group])
        if error_if_nonfinite and not torch.isfinite(total):
            raise P.nonfinite_total_error(norm_type)
        return total

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, process_group=None
    ) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the gradients, run over the buffers: one norm
        pass and one scale pass (skipped when the coefficient is exactly 1) whatever the
        number of parameters, no host sync. Returns the total norm (before clipping)."""
        max_norm = check_max_norm("GradBuckets.clip_grad_norm_", max_norm)
        norm_type = P.check_norm_type("GradBuckets.clip_grad_norm_", norm_type)
        with torch.no_grad():
            if process_group is None and self._uses_buffers(norm_type):
                return torch.ops.gradfuse.clip_grad_norm_(self._buffers, max_norm, norm_type, error_if_nonfinite)
            total = self.get_total_norm(norm_type, error_if_nonfinite, process_group=process_group)
            torch.ops.gradfuse.clip_grads_with_norm_(self._buffers, max_norm, total)
        return total

    def owns(self, grads: list[Tensor]) -> bool:
        """Whether ``grads`` are exactly this set's gradient views, in order, still pointing
        into the buckets (a ``.grad`` the user replaced, or re-pointed with ``.data =``, is not)."""
        return (
            len(grads) == len(self._views)
            and all(map(operator.is_, grads, self._views))
            and list(map(Tensor.data_ptr, grads)) == self._view_ptrs
        )

    def remove(self) -> None:
        """Detaches the hooks; the gradients stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _LIVE.pop(id(self._views[0]), None)


def owner_of(grads: list[Tensor]) -> GradBuckets | None:
    """The live ``GradBuckets`` whose gradient views ``grads`` are, all of them in order, or None."""
    if not grads:
        return None
    buckets = _LIVE.get(id(grads[0]))
    return buckets if buckets is not None and buckets.owns(grads) else None
