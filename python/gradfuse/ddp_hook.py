"""A ``DistributedDataParallel`` communication hook that measures the gradients while backward
runs: ``state = gradfuse.register_ddp_hook(ddp_model, norm_type=2.0)``.

DDP hands each bucket of gradients (one flat tensor whose slices every ``param.grad`` views,
with ``gradient_as_bucket_view=True``) to its communication hook as soon as backward has
produced it. This hook starts the bucket's all-reduce and chains on its future one fused pass
over the reduced bucket, which runs as soon as the reduction completes, while backward goes on:

- gloo (no average op): a sum all-reduce, then ``gradfuse::unscale_norm_`` with
  ``inv_scale = 1 / world``: one read-write pass that averages the bucket in place and gives
  its partial norm and inf/NaN flag. For two ranks ``(a + b) / 2`` is bit for bit DDP's
  ``a / 2 + b / 2`` (halving is exact, barring subnormals); for other world sizes the two
  round differently in the last bit. fp16 buckets are divided before the sum instead, as DDP's default hook
  does: a sum of fp16 gradients can overflow where their average does not.
- NCCL: an average all-reduce (``ReduceOp.AVG``), then a read-only pass for the partial norm
  and the flag.

For orders <= 0 the pass reads the bucket's per-parameter views (the count of non-zero tensors,
a minimum and negative orders are not those of the flat buffer as a whole). The state keeps
the per-bucket partials and flags of the last synchronised backward; they are reset by the
first bucket of every synchronised backward, and sealed after DDP has finished the backward
(a callback queued behind DDP's own): only then does ``total_norm()`` answer, and a backward
that failed part-way leaves nothing usable behind.

**When the measurement is used.** Only where nothing can have touched the gradients since it
was taken, which gradfuse cannot check on its own: writes through ``.data``, a NumPy view or a
collective (``dist.all_reduce(p.grad)``) change no version counter, so gradients that look
untouched may not be. So the norm and ``found_inf`` are used in two places only:

- inside the Trainer's own step (``gradfuse.Trainer`` under DDP), where no user code runs
  between backward and the clip;
- where the user hands the state over explicitly, promising that nothing touched the
  gradients since backward: ``scaler.unscale_and_clip_(optimizer, max_norm, measured=state)``
  or ``gradfuse.clip_grad_norm_(ddp.parameters(), max_norm, measured=state)``. A handover
  that is visibly stale (the gradients are not the tensors the backward left, no longer view
  their buckets, or were modified in place since: their version counters moved) raises
  ``RuntimeError`` instead of being used; where the last synchronised backward left no
  measurement (see :meth:`DDPHookState.total_norm`), the gradients are read.

Everywhere else the drop-ins and the scaler read the gradients, and give torch's answer.
``total_norm()`` and ``found_inf()`` stay what the backward measured, whatever came after.
What is always used is DDP's bucket buffers as the *targets* of a scale pass (the clip's,
``unscale_``'s), where the gradients are provably views of them (:func:`state_for`): that
changes where a pass runs, not what it computes.
"""

from __future__ import annotations

import math
import operator
import weakref
from array import array
from itertools import repeat
from operator import attrgetter, itemgetter

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import _plan as P
from . import ops

Tensor = torch.Tensor

__all__ = ["DDPHookState", "handed_over", "register_ddp_hook", "state_for"]

_OP = "gradfuse.register_ddp_hook"
_deref = weakref.ref.__call__
_layout = attrgetter("layout")
_first_of, _second_of = itemgetter(0), itemgetter(1)

#: Every live hook state, for the clip and the scaler to find the buckets their gradients view.
_LIVE: weakref.WeakSet[DDPHookState] = weakref.WeakSet()


def _combine(partials: list[Tensor], norm_type: float) -> Tensor:
    """The norm over every bucket from the buckets' norms (counts of non-zero tensors add up)."""
    if len(partials) == 1:
        return partials[0]
    stacked = torch.stack(partials)
    return stacked.sum() if norm_type == 0 else torch.linalg.vector_norm(stacked, norm_type)


class DDPHookState:
    """What the gradfuse hook knows about the last synchronised backward of one DDP model.

    Made by :func:`register_ddp_hook`. ``total_norm()`` and ``found_inf()`` are device tensors
    (no host sync); ``buffers`` are DDP's bucket buffers, which every gradient views.
    """

    def __init__(self, ddp_model: DistributedDataParallel, norm_type: float) -> None:
        self.norm_type = norm_type
        self.process_group = ddp_model.process_group
        self.world = dist.get_world_size(self.process_group)
        # NCCL averages inside the all-reduce; gloo has no average op.
        self._average_op = "nccl" in str(dist.get_backend(self.process_group)).lower()
        self._params = list(ddp_model.module.parameters())
        self._scalars: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._recent_refs: list[weakref.ref] = []
        self._reset(tracking=False)
        self._why = "no synchronised backward has run since the hook was registered"
        _LIVE.add(self)

    # --- one backward ---------------------------------------------------------------------

    def _reset(self, tracking: bool) -> None:
        self._tracking = tracking  # False: hooks run outside backward (a joined rank's shadow)
        self._partials: dict[int, Tensor] = {}
        self._found: dict[int, Tensor] = {}
        self._buffers: dict[int, Tensor] = {}
        self._bucket_params: dict[int, list[Tensor]] = {}
        self._slots = 0  # parameter views in the buckets
        self._n_buckets: int | None = None
        self._failure: str | None = None
        self._sealed = False
        self._grads: dict[int, tuple[weakref.ref, int]] = {}
        #: The same gradients in parameter order, for the one-pass check of a list in that order
        #: (:meth:`_mismatch`): their weak references and addresses.
        self._in_order: tuple[list[weakref.ref], P.Addresses] | None = None
        self._versions: list[tuple[weakref.ref, int]] = []
        self._total: Tensor | None = None
        self._found_any: Tensor | None = None
        self._why = "the last synchronised backward did not complete"

    def _on_forward(self, ddp_model: DistributedDataParallel, args) -> None:
        """A forward that DDP prepares a synchronised backward for: from here on the last
        synchronised backward is that one, and until it completes there is no norm (a backward
        that fails before its first bucket must not leave the previous one's norm behind)."""
        if ddp_model.require_backward_grad_sync and torch.is_grad_enabled():
            self._reset(tracking=False)
            self._why = "the last synchronised backward did not complete"

    def _scalars_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(1 / world, 1) as float32 scalars on ``device``, made once."""
        if device not in self._scalars:
            inv = torch.full((), 1.0 / self.world, dtype=torch.float32, device=device)
            self._scalars[device] = (inv, torch.ones((), dtype=torch.float32, device=device))
        return self._scalars[device]

    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        index = bucket.index()
        in_backward = torch._C._current_graph_task_id() != -1
        if index == 0:
            self._reset(tracking=in_backward)
        buffer = bucket.buffer()
        self._bucket_params[index] = bucket.parameters()
        views = bucket.gradients() if self.norm_type <= 0 and buffer.layout == torch.strided else None
        if views is not None and self.norm_type < 0 and not all(v.numel() for v in views):
            # torch's norm of an empty gradient in a negative order raises: let it.
            self._failure = "a gradient is empty, and the norm's order is negative"
        if bucket.is_last() and self._tracking:
            self._n_buckets = index + 1
            # Runs before DDP's own end-of-backward callback (queued after this hook returns);
            # it queues the seal behind it.
            torch.autograd.Variable._execution_engine.queue_callback(self._queue_seal)
        if buffer.layout != torch.strided:  # a sparse bucket: DDP's own arithmetic, no norm
            self._failure = "a bucket holds sparse gradients"
            buffer.div_(self.world)
            return dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future().then(_first)
        average_first = not self._average_op and buffer.dtype == torch.float16 and self.world > 1
        if self._average_op:
            work = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=self.process_group, async_op=True)
        else:
            if average_first:
                buffer.div_(self.world)
            work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        averaged = self._average_op or average_first
        tracking = self._tracking

        def measure(fut: torch.futures.Future) -> Tensor:
            reduced = fut.value()[0]
            tensors = [reduced] if views is None else views
            inv, one = self._scalars_on(reduced.device)
            try:
                with torch.no_grad():
                    if averaged:
                        partial, found = ops.unscale_check_norm_op(tensors, one, self.norm_type)
                    else:
                        found = torch.zeros((), dtype=torch.float32, device=reduced.device)
                        partial = ops.unscale_norm_op(tensors, inv, found, self.norm_type)
            except Exception as err:  # the gradients are still DDP's; only the measure is lost
                if not averaged:
                    reduced.mul_(inv)
                if tracking:
                    self._failure = f"measuring bucket {index} failed ({type(err).__name__}: {err})"
                return reduced
            if tracking:
                self._partials[index], self._found[index] = partial, found
                self._buffers[index] = reduced
                self._slots += len(views) if views is not None else 0
            return reduced

        return work.get_future().then(measure)

    def _queue_seal(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._seal)

    def _seal(self) -> None:
        """After DDP has finished the backward (every bucket reduced and measured, every
        ``.grad`` pointed at its bucket view): record which gradients the partials describe."""
        n = self._n_buckets
        if self._failure is not None:
            self._why = self._failure
            return
        if not self._tracking or n is None or sorted(self._partials) != list(range(n)):
            self._why = "the last synchronised backward did not reduce every bucket"
            return
        buffers = [self._buffers[b] for b in range(n)]
        spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers)
        empty = self._record_grads(spans)
        if empty and self.norm_type == math.inf:
            self._why = "a gradient is empty, and torch refuses the inf-norm of an empty tensor"
            self._grads.clear()
            return
        if self.norm_type >= 0 and not self._gradless_slots_are_zero(buffers):
            self._why = (
                "a parameter unused on every rank has no gradient here but a non-zero slot (another "
                "rank's stale gradient, summed into it by DDP)"
            )
            self._grads.clear()
            return
        if self.norm_type < 0 and len(self._grads) < self._slots:
            # A parameter without a gradient has zeros in its slot, and a zero decides a
            # minimum or a negative order: the partials are not those of the gradients.
            self._why = "some parameters have no gradient, and the norm's order is negative"
            self._grads.clear()
            return
        entries = list(self._grads.values())  # in parameter order (insertion order)
        self._in_order = (list(map(_first_of, entries)), P.Addresses(map(_second_of, entries)))
        self._versions = [(weakref.ref(b), b._version) for b in buffers]
        self._buffers, self._bucket_params = {}, {}  # weak from here on: a rebuild frees the old buffers
        # Combined here, before backward returns: after it, nothing is left to compute.
        with torch.no_grad():
            self._total = _combine([self._partials[b] for b in range(n)], self.norm_type)
            found = [self._found[b] for b in range(n)]
            self._found_any = found[0] if n == 1 else torch.stack(found).amax()
        self._sealed = True

    def _record_grads(self, spans: list[tuple[int, int]]) -> bool:
        """Records the parameters' gradients that view a bucket (``spans``: each bucket's bytes,
        in address order), in parameter order, and the empty ones (which have no element in any
        bucket: their address says nothing, and they change no norm of positive order nor the
        count of order 0); returns whether there was an empty one. Sparse gradients, and dense
        ones elsewhere, are left out. One Rust pass reads the gradients, C-level maps their
        addresses, and the bucket's bounds (one bucket) or tensor ops (several) find the ones
        outside (2000 parameters: ~1.1 ms per backward, where a Python loop took ~1.8)."""
        grads = P.grads_of(self._params)
        if grads is None or not all(map(operator.is_, map(_layout, grads), repeat(torch.strided))):
            return self._record_each(spans)  # gradients of a tensor subclass, sparse ones
        if not grads:
            return False
        addrs = array("q", map(Tensor.data_ptr, grads))  # a bucket view's first element lies in its bucket
        if len(spans) == 1:  # one bucket (a small model's): its bounds against the extremes
            ((start, end),) = spans
            inside = start <= min(addrs) and max(addrs) < end
            outside = [] if inside else [i for i, a in enumerate(addrs) if not start <= a < end]
        else:
            at = torch.frombuffer(addrs, dtype=torch.int64)
            starts = torch.tensor([start for start, _ in spans], dtype=torch.int64)
            ends = torch.tensor([end for _, end in spans], dtype=torch.int64)
            bucket = torch.searchsorted(starts, at, right=True) - 1  # the last bucket starting at or below
            outside = ((bucket < 0) | (at >= ends[bucket.clamp(min=0)])).nonzero().flatten().tolist()
        empty = False
        if outside:
            drop = {i for i in outside if grads[i].numel()}
            empty = len(drop) < len(outside)
            grads = [g for i, g in enumerate(grads) if i not in drop]
            addrs = [a for i, a in enumerate(addrs) if i not in drop]
        refs = list(map(weakref.ref, grads))
        self._grads = dict(zip(map(id, grads), zip(refs, addrs, strict=True), strict=True))
        # Kept past the next forward's reset: while a reference to a tensor lives, Python hands
        # it out again for the same tensor (~30 ns, where making one costs ~200): DDP's bucket
        # views are the same gradients step after step.
        self._recent_refs = refs
        return empty

    def _record_each(self, spans: list[tuple[int, int]]) -> bool:
        """:meth:`_record_grads`, parameter by parameter (gradients the one-pass reads refuse)."""
        empty = False
        for p in self._params:
            g = p.grad
            if g is None or g.layout != torch.strided:
                continue
            address = g.data_ptr()
            if any(start <= address < end for start, end in spans):
                self._grads[id(g)] = (weakref.ref(g), address)
            elif not g.numel():
                self._grads[id(g)] = (weakref.ref(g), address)
                empty = True
        return empty

    def _gradless_slots_are_zero(self, buffers: list[Tensor]) -> bool:
        """Whether the bucket slots of parameters left without a gradient hold zeros, so that
        a norm of positive order over the flat buffers (or the count of non-zero views, for
        order 0) is the norm over the gradients. DDP
        zeroes such a slot, unless another rank still had a gradient there (a parameter unused
        everywhere, with a stale gradient on some rank): the sum then lands in the slot. On the
        CPU a read of those few slots; on CUDA, a host sync, paid only when some parameter got
        no gradient on any rank."""
        gradless = []
        for b, params in self._bucket_params.items():
            grads = P.grads_of(params)  # one Rust pass: the usual bucket, every gradient there
            if grads is not None and len(grads) == len(params):
                continue
            offset = 0
            for p in params:
                if p.grad is None:
                    gradless.append(buffers[b].narrow(0, offset, p.numel()))
                offset += p.numel()
        if not gradless:
            return True
        return not bool(torch.cat(gradless).any())

    # --- what the clip and the scaler read --------------------------------------------------

    def _check_sealed(self) -> None:
        if not self._sealed:
            raise RuntimeError(f"gradfuse DDP hook: no norm available: {self._why}")

    def total_norm(self) -> Tensor:
        """The ``norm_type``-norm of the gradients of the last synchronised backward, as that
        backward left them (a 0-d fp32 tensor, fp64 for fp64 gradients, on the gradients'
        device; no host sync): what the gradients were then, whatever touched them since.
        Raises ``RuntimeError`` if that backward did not complete or left no measurement (a
        sparse bucket; a negative order with parameters left without a gradient, or the inf or a
        negative order with an empty gradient, which torch refuses; another rank's stale
        gradient in the slot of a parameter unused everywhere)."""
        self._check_sealed()
        return self._total

    def found_inf(self) -> Tensor:
        """1.0 if a gradient of the last synchronised backward held inf or NaN, else 0.0 (a 0-d
        float32 device tensor)."""
        self._check_sealed()
        return self._found_any

    @property
    def buffers(self) -> list[Tensor]:
        """DDP's bucket buffers as of the last synchronised backward (``[]`` when they are gone)."""
        buffers = [ref() for ref, _ in self._versions]
        return buffers if all(b is not None for b in buffers) else []

    def covers(self, grads: list[Tensor], norm_type: float | None = None) -> bool:
        """Whether ``grads`` are exactly the gradients the last synchronised backward left
        (in any order), views of its buckets, with no version counter moved since (any order:
        only the buffers are asked for). Writes that bypass version counters cannot be seen:
        this alone never licenses using the measurement (see the module docs)."""
        if not self._sealed:
            return False
        if norm_type is not None and norm_type != self.norm_type:
            return False
        return self._mismatch(grads) is None

    def _mismatch(self, grads: list[Tensor]) -> str | None:
        """Why ``grads`` are visibly not what the sealed backward left, or None."""
        if len(grads) != len(self._grads):
            return f"{len(grads)} gradients were given, and the backward left {len(self._grads)}"
        refs, addrs = self._in_order or ([], None)  # as many as self._grads (made from it)
        # In parameter order (the usual list), one C-level pass and one Rust pass: the same
        # objects, at the same addresses; otherwise (another order, or a change) each is looked up.
        if not (addrs is not None and all(map(operator.is_, grads, map(_deref, refs))) and P.addrs_are(grads, addrs)):
            seen = set()
            for i, g in enumerate(grads):
                entry = self._grads.get(id(g))
                if entry is None or entry[0]() is not g:
                    return f"gradient {i} (shape {tuple(g.shape)}) is not one the backward left (replaced or set since)"
                if g.data_ptr() != entry[1]:
                    return f"gradient {i} (shape {tuple(g.shape)}) no longer views its bucket (re-pointed since)"
                seen.add(id(g))
            if len(seen) != len(grads):
                return "a gradient was given twice"
        for ref, version in self._versions:
            buffer = ref()
            if buffer is None:
                return "DDP's bucket buffers were replaced (a bucket rebuild)"
            if buffer._version != version:
                return "the gradients were modified in place since the backward (their version counters moved)"
        return None

    def __repr__(self) -> str:
        status = "sealed" if self._sealed else self._why
        return f"DDPHookState(norm_type={self.norm_type}, world={self.world}, {status})"


def _first(fut: torch.futures.Future) -> Tensor:
    return fut.value()[0]


def _gradfuse_ddp_hook(state, bucket):
    # No annotations: DDP compares them with its own types, which postponed evaluation breaks.
    return state._on_bucket(bucket)


def register_ddp_hook(ddp_model: DistributedDataParallel, norm_type: float = 2.0) -> DDPHookState:
    """Register gradfuse's communication hook on ``ddp_model`` and return its state.

    ``ddp_model`` must be built with ``gradient_as_bucket_view=True`` (every ``.grad`` a view
    into DDP's bucket buffers, which the clip and the scaler then run over) and have no other
    communication hook. ``norm_type``: the order of the norm the hook measures (any real,
    ``inf``, ``-inf``). The clip and the scaler use the measurement only when it is handed to
    them (``measured=state``, with that order) or inside the Trainer's step; see the module
    docs. Register it before training starts, on every rank.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"{_OP}: ddp_model must be a torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}"
        )
    norm_type = P.check_norm_type(_OP, norm_type)
    if not ddp_model.gradient_as_bucket_view:
        raise ValueError(
            f"{_OP}: ddp_model was built with gradient_as_bucket_view=False; build it with "
            "DistributedDataParallel(model, gradient_as_bucket_view=True), so that every .grad views "
            "DDP's bucket buffers"
        )
    if ddp_model._comm_hooks or getattr(ddp_model, "mixed_precision", None) is not None:
        raise RuntimeError(
            f"{_OP}: ddp_model already has a communication hook (DDP takes one; mixed_precision registers its own)"
        )
    state = DDPHookState(ddp_model, norm_type)
    try:
        ddp_model.register_comm_hook(state, _gradfuse_ddp_hook)
    except RuntimeError as err:  # a built-in hook registered through DDP's private API
        raise RuntimeError(f"{_OP}: DDP refused the hook: {err}") from err
    ddp_model.register_forward_pre_hook(state._on_forward)
    return state


def handed_over(measured, grads: list[Tensor], norm_type: float, op: str) -> DDPHookState | None:
    """The explicit handover ``measured=state`` of ``op`` over ``grads``: the state, when its
    measurement is of these gradients in ``norm_type``; None when the last synchronised
    backward left none (the caller reads the gradients). Raises when the handover is wrong or
    visibly stale, before anything is modified."""
    if not isinstance(measured, DDPHookState):
        raise TypeError(
            f"{op}: measured= takes the state gradfuse.register_ddp_hook returned, got {type(measured).__name__}"
        )
    if norm_type != measured.norm_type:
        raise ValueError(
            f"{op}: the DDP hook measures the {measured.norm_type}-norm, and norm_type={norm_type} was asked for; "
            f"pass norm_type={measured.norm_type}, or drop measured= to read the gradients"
        )
    if not measured._sealed:
        return None
    why = measured._mismatch(grads)
    if why is not None:
        raise RuntimeError(
            f"{op}: measured= hands over the norm the DDP hook measured in the last backward, but the gradients "
            f"changed since: {why}. The measurement holds only while nothing touches the gradients between "
            "backward and the clip; drop measured= to read them"
        )
    return measured


def state_for(grads: list[Tensor], norm_type: float | None = None) -> DDPHookState | None:
    """The hook state whose last synchronised backward left exactly ``grads`` (views of its
    buckets, no version counter moved since), measured in ``norm_type`` (None: any); None when
    there is none. Proves only that ``grads`` view the state's ``buffers``, which may therefore
    be the targets of a pass; never that its measurement is still theirs (module docs)."""
    if not grads or not _LIVE:
        return None
    first = id(grads[0])
    for state in list(_LIVE):
        if first in state._grads and state.covers(grads, norm_type):
            return state
    return None
