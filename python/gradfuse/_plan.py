"""Plans: what a tensor-list argument is, validated once and kept (:func:`make_plan`).

Every `gradfuse::` op turns each tensor-list argument into a :class:`Plan` before any kernel
runs: dtypes, devices, layouts and (for in-place targets) overlap are checked when a plan is
made, and a bad argument raises an exception naming the op, the argument and the index, with
nothing modified. Plans of contiguous lists are kept, holding no tensor, and confirmed at every
later call in one pass (the Rust core through torch's own attribute getters, or C-level maps):
the same kind of tensors at the same addresses use the plan as it is, at other addresses a moved
copy, anything else a new plan. The scalar-argument checks the ops share live here too.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections import deque
from collections.abc import Iterable
from operator import attrgetter, is_

import torch

from ._layout import find_offsets

Tensor = torch.Tensor

#: dtype -> code understood by the Rust core and the Triton kernels.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
}
ELEMENT_SIZE = {0: 4, 1: 8, 2: 2, 3: 2}
SUPPORTED = "float32, float64, float16 and bfloat16"

_dtype = attrgetter("dtype")
_layout = attrgetter("layout")
_version = attrgetter("_version")
_device = attrgetter("device")
_grad = attrgetter("grad")
_requires_grad = attrgetter("requires_grad")


class UnsupportedTensorError(TypeError):
    """A tensor gradfuse's kernels cannot run (complex or integer dtype, sparse or other
    non-strided layout, memory not aligned to the element size). Raised before anything is
    modified; the drop-in clipping functions catch it and hand the whole call to torch."""


class MixedDevicesError(ValueError):
    """Tensors of one list argument on different devices. Raised before anything is modified;
    the drop-in clipping functions, which try one device first, then group by device."""


class OverlapError(ValueError):
    """In-place targets that share memory with each other or with the call's inputs (the same
    tensor twice, overlapping views of one buffer). Raised before anything is modified. The
    fused ops refuse such calls; the drop-in clipping functions hand them to torch, whose
    element-by-element semantics define what aliasing does."""


class InternalOverlapError(OverlapError, RuntimeError):
    """One in-place target whose own elements share memory (as after ``expand()``). Also a
    RuntimeError, as torch's error for writing such a tensor is."""


class NotPlannable(UnsupportedTensorError):
    """Tensors on a device gradfuse's kernels do not run on (meta, say): the ops' eager entry
    hands the call to the dispatcher, which knows what to do with them (the fake implementation
    for meta tensors); the drop-ins hand it to torch."""


class Plan:
    """What one tensor-list argument is, validated: the memory the kernels touch and everything
    that follows from it (dtypes, device, sizes, the Rust core's ``TensorList``; the backends keep
    what they derive, a Triton chunk table say, in ``memo``).

    A plan of dense tensors is kept between calls (see :func:`make_plan`) and holds no tensor:
    only addresses, sizes and dtypes, which every later call confirms against its tensors before
    the plan is used; so is a plan of dense tensors used in place while not contiguous
    (``formats``: channels-last ones, and permuted ones whose sizes and strides it keeps). A plan
    that copies is made for one call: ``tensors`` are then what the kernels touch, the caller's
    tensors except that one whose elements are not one dense block (or, for an op that pairs
    elements, not contiguous) is replaced by a contiguous copy (``writeback`` pairs each such
    original with its copy, to be copied back after an in-place op).
    """

    __slots__ = (
        "_addrs",
        "_words",
        "codes",
        "copied",
        "device",
        "device_index",
        "dtypes",
        "empty",
        "formats",
        "inference",
        "inplace",
        "laid_out",
        "memo",
        "name",
        "nbytes",
        "numels",
        "on_cuda",
        "out_dtype",
        "permuted",
        "permuted_layouts",
        "tensor_list",
        "tensors",
        "writeback",
    )

    def __init__(self, name, device, addrs, numels, codes, dtypes, inplace, tensor_list):
        self.name = name
        self.inplace = inplace
        self.device = device
        #: ``device.type == "cuda"``, read once (the getter makes a string: ~150 ns a call).
        self.on_cuda = device.type == "cuda"
        #: What ``Tensor.get_device()`` says of a tensor on ``device`` (-1 for the CPU).
        self.device_index = device.index if self.on_cuda else -1
        self._addrs = addrs
        self._words = None
        self.numels = numels
        self.codes = codes
        self.dtypes = dtypes
        self.nbytes = [n * ELEMENT_SIZE[c] for n, c in zip(numels, codes, strict=True)]
        #: Indices of the tensors without elements (their address says nothing about their device).
        self.empty = [i for i, n in enumerate(numels) if n == 0]
        #: Dtype of norms of these tensors: float64 if any is float64, else float32.
        self.out_dtype = torch.float64 if 1 in codes else torch.float32
        #: The Rust core's description of the same memory (checked aligned, and disjoint when
        #: ``inplace``, as it was made).
        self.tensor_list = tensor_list
        #: Some tensor is an inference tensor, found outside inference mode (see :meth:`before_write`).
        self.inference = False
        #: For kept plans of tensors not all contiguous: the memory format each is contiguous in,
        #: as codes (see ``LAYOUTS``; the elements of each still fill its ``numel`` slots from its
        #: address, so the kernels see it as any dense tensor); None when all are contiguous.
        self.formats = None
        #: Indices of the tensors used in place while not contiguous in torch's format (kept plans:
        #: those of ``formats`` other than 0), for ops on rows to check (:func:`rows_fit`).
        self.laid_out = []
        #: For kept plans: the indices of the tensors dense in an order no memory format names
        #: (``PERMUTED``), and their ``(shape, stride)`` as planned, which a later call compares.
        self.permuted = ()
        self.permuted_layouts = []
        #: For one-call plans: the tensors the kernels touch, and the copies to write back.
        self.tensors = None
        self.writeback = []
        self.copied = False
        #: What the backends derive from the plan and keep with it.
        self.memo = {}

    def __len__(self) -> int:
        return len(self.numels)

    @property
    def addrs(self) -> list[int]:
        """The tensors' data addresses, in order."""
        if self._addrs is None:
            self._addrs = array("Q", self._words).tolist()
        return self._addrs

    @property
    def words(self) -> bytes:
        """:attr:`addrs` as native-endian 64-bit words: what a probe returns for tensors that
        moved, compared with one ``bytes`` equality where a list compares an integer at a time."""
        if self._words is None:
            self._words = as_words(self._addrs)
        return self._words

    def addr_tensor(self) -> Tensor:
        """:attr:`addrs` as a new int64 CPU tensor (from :attr:`words`: ~1 us for 2000 addresses,
        where ``torch.as_tensor`` of the list takes ~80)."""
        words = self.words
        return torch.frombuffer(bytearray(words), dtype=torch.int64) if words else torch.zeros(0, dtype=torch.int64)

    @property
    def cached(self) -> bool:
        return self.tensors is None

    def before_write(self, *others: Tensor) -> None:
        """Called by a backend right before its first write (after any read pass and its
        errors, as torch orders them): refuses inference tensors among the targets (and
        ``others``, further tensors the call writes) as torch does, with nothing modified."""
        if self.inference and not torch.is_inference_mode_enabled():
            raise _inference_update_error()
        if others:
            check_writable(others)

    def finish_inplace(self, originals: list[Tensor]) -> None:
        """After an in-place kernel: copy results into non-dense originals, bump versions."""
        for orig, work in self.writeback:
            orig.copy_(work)
        bump_versions(originals)

    def moved(self, words: bytes, tensor_list) -> Plan:
        """The same plan for the same kind of tensors at other addresses (``words``: see
        :attr:`words`; a new plan: the backends derive again what depends on addresses, from what
        ``memo`` holds)."""
        other = Plan.__new__(Plan)
        for slot in _KEPT_WHEN_MOVED:
            setattr(other, slot, getattr(self, slot))
        other._addrs, other._words, other.tensor_list = None, words, tensor_list
        other.inference, other.tensors, other.writeback, other.copied = False, None, [], False
        # What this plan derived, and what it had still to take from the plan it moved from: one
        # level, so that a list moving at every step (a training loop) keeps no chain of tables.
        inherited = {**self.memo.get("moved_from", {}), **self.memo}
        inherited.pop("moved_from", None)
        other.memo = {"moved_from": inherited}
        return other


#: What a plan moved to other addresses keeps as it is.
_KEPT_WHEN_MOVED = (
    "name", "inplace", "device", "device_index", "on_cuda", "numels", "codes", "dtypes", "nbytes", "empty",
    "formats", "laid_out", "out_dtype", "permuted", "permuted_layouts",
)  # fmt: skip


def bump_versions(tensors: list[Tensor]) -> None:
    """Tell autograd the tensors were modified in place (one C++ call for the whole list), in
    inference mode too, as torch's in-place ops do (inference tensors have no counter: skipped)."""
    if tensors:
        torch._C._increment_version(tensors)


def check_writable(tensors) -> None:
    """torch's rule: outside inference mode an inference tensor cannot be updated in place.

    Reading ``_version`` is the cheapest per-tensor probe there is (a C-level attribute, no
    argument parsing: ~50 ns, where ``is_inference()`` takes ~70 ns and a per-tensor Python
    loop ~150 ns), and it raises exactly for tensors without a version counter: inference
    tensors. torch itself checks only after writing; here nothing has been written yet.
    """
    if torch.is_inference_mode_enabled():
        return
    try:
        deque(map(_version, tensors), maxlen=0)
    except RuntimeError:
        raise _inference_update_error() from None


def check_untracked(op: str, name: str, tensors: list[Tensor], role: str = "updated in place") -> None:
    """Raises when one of ``tensors`` (an op's in-place targets, or what it adds into them)
    requires grad (the caller found grad mode on): gradfuse's ops have no derivative, so autograd
    would not see the update, and gradients through it would be silently wrong. torch raises for
    a leaf target, and records any other update; here each raises, naming the tensor, before
    anything is written (a gradient's update runs under ``torch.no_grad()``, as gradfuse's own
    callers and torch's optimizers run theirs)."""
    if not any(map(_requires_grad, tensors)):
        return
    i = next(i for i, t in enumerate(tensors) if t.requires_grad)
    what = "a leaf tensor" if tensors[i].is_leaf else "a tensor"
    raise RuntimeError(
        f"{op}: {name}[{i}] is {what} that requires grad, {role} while grad mode is on; gradfuse's ops are "
        "not differentiable, so autograd would not see the update: call it under torch.no_grad(), or on "
        "tensors that do not require grad"
    )


def _inference_update_error() -> RuntimeError:
    """torch's own error for an in-place update of an inference tensor, raised by torch on an
    empty one (so the message is the installed torch's)."""
    with torch.inference_mode():
        probe = torch.empty(0)
    try:
        probe.zero_()
    except RuntimeError as e:
        return e
    return RuntimeError("Inplace update to inference tensor outside InferenceMode is not allowed.")


def is_dense(t: Tensor) -> bool:
    """Whether the elements of ``t`` fill exactly ``numel`` consecutive slots (any dim order)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def check_dtypes(op: str, name: str, tensors: list[Tensor]) -> bytes:
    """The dtype code of every tensor, one byte each (one C-level pass when they share a dtype,
    the usual case; bytes reach the Rust core without a conversion per element)."""
    dtypes = set(map(_dtype, tensors))
    if len(dtypes) == 1:
        code = DTYPE_CODES.get(next(iter(dtypes)))
        if code is not None:
            return bytes((code,)) * len(tensors)
    codes = list(map(DTYPE_CODES.get, map(_dtype, tensors)))
    if None in codes:
        i = codes.index(None)
        raise UnsupportedTensorError(
            f"{op}: {name}[{i}] has dtype {tensors[i].dtype}; gradfuse works on {SUPPORTED} tensors"
        )
    return bytes(codes)


def check_layouts(op: str, name: str, tensors: list[Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise UnsupportedTensorError(
                f"{op}: {name}[{i}] has layout {t.layout}; gradfuse works on dense (strided) tensors"
            )


def check_device(
    op: str, name: str, tensors: list[Tensor], device: torch.device | None = None, *, strict: bool = False
) -> torch.device:
    """The one device of ``tensors`` (and ``device``, when given), or a ValueError naming the odd one.

    Real kernels only ever see CPU and CUDA tensors (the dispatcher sends any list holding a
    meta tensor to the fake implementation), and get_device() tells those two apart (-1 for
    CPU, the index for CUDA), so one C-level pass decides the common case. Fake
    implementations pass ``strict``: there meta and CPU both report -1.
    """
    first = tensors[0].device if device is None else device
    if not strict and len(set(map(Tensor.get_device, tensors))) == 1 and tensors[0].device == first:
        return first
    if strict and set(map(_device, tensors)) == {first}:
        return first
    for i, t in enumerate(tensors):
        if t.device != first:
            where = f"{name}[0] is on {first}" if device is None else f"the call is on {first}"
            raise MixedDevicesError(
                f"{op}: {name}[{i}] is on {t.device} but {where}; one call takes tensors on one device "
                "(gradfuse.clip_grad_norm_ and friends group by device for you)"
            )
    return first


# --- plans, kept ------------------------------------------------------------------------------

#: Kept plans by (inplace, length, bytes of the first and last tensor); a handful of plans each
#: (lists of the same shape at other addresses), most recently used first. Bounded (oldest key
#: evicted); plans hold no tensors.
_PLANS: dict[tuple, list[Plan]] = {}
#: Keys kept, and plans per key.
CACHE_SIZE = 64
PLANS_PER_KEY = 8
_LOCK = threading.Lock()

_PLAIN = frozenset({Tensor, torch.nn.Parameter})
_data_ptr = Tensor.data_ptr
_is_contiguous = Tensor.is_contiguous
_is_neg = Tensor.is_neg
_nbytes = attrgetter("nbytes")
_shape = attrgetter("shape")
_get_device = Tensor.get_device
#: What a probe of a tensor can raise for tensors a plan cannot describe (sparse, no storage).
_PROBE_ERRORS = (RuntimeError, TypeError, AttributeError, NotImplementedError)


def make_plan(
    op: str,
    name: str,
    tensors: list[Tensor],
    *,
    inplace: bool,
    device=None,
    dense_ok: bool = True,
    signed: bool = False,
) -> Plan:
    """The validated plan of ``tensors`` (a list): a kept one when they are still what it
    describes, else a new one (kept when none is copied). Raises, naming ``op``, ``name`` and
    the index, when the tensors cannot be planned; nothing is modified.

    ``inplace``: the op writes them (they must not overlap, nor be inference tensors outside
    inference mode: found here, raised by :meth:`Plan.before_write`; nor, while grad mode is on,
    require grad: :func:`check_untracked`). ``device``: the device
    the call is on (checked). ``dense_ok``: a non-contiguous tensor whose elements are still one
    dense block (a transpose, say) is used in place; element-wise ops that pair two lists pass
    False, so both sides are walked in the same (row-major) order; ops on rows pass ``ROWS``.

    A tensor with torch's negative bit (a lazily negated view: ``torch._neg_view``,
    ``z.conj().imag``), whose memory holds the negation of its values, is copied (resolved) in
    every new plan, and written back through torch. An op whose results do not change when a
    tensor's memory holds its negation (a norm, a scaling, a symmetric clamp) may still run on one
    that came later through a kept plan (the confirmation does not ask); an op whose results do
    (an addition) passes ``signed``, which asks, for its tensors, on a kept plan too.

    A kept plan is confirmed in one pass of C-level maps over the tensors: each is a plain tensor
    (``torch.Tensor``/``nn.Parameter``) with the plan's dtype and size in bytes, contiguous (in
    its memory format; a permuted one with the sizes and strides the plan keeps, a C-level map
    over those alone), and (``inplace``, outside inference mode) not an inference tensor; its data
    address is then read.
    The same addresses: the plan as it is. Other addresses (a gradient set to None and made again,
    ``.data =``, ``set_``): the plan moved there, checked by the Rust core as a new one is
    (alignment, overlap), and the device of each tensor that moved read. An address identifies its device
    (the host and every GPU share one virtual address space), except for empty tensors, whose
    devices are read at every call. Anything else (a dtype, a size, a layout, the length, a type)
    makes a new plan.
    """
    if inplace and torch.is_grad_enabled():
        check_untracked(op, name, tensors)
    if not tensors:
        return _build(op, name, tensors, inplace, device, dense_ok)
    try:
        if type(tensors[0]) in _PLAIN and type(tensors[-1]) in _PLAIN:
            key = (inplace, len(tensors), tensors[0].nbytes, tensors[-1].nbytes)
            kept = _PLANS.get(key)
            plan = _confirm(kept, tensors, device, dense_ok, signed) if kept else None
            if plan is not None:
                if plan is not kept[0]:
                    with _LOCK:  # the DDP hook plans on its own thread
                        if plan in kept:
                            kept.remove(plan)
                        kept.insert(0, plan)
                        del kept[PLANS_PER_KEY:]
                return plan
    except _PROBE_ERRORS:
        pass  # planned anew, which names the problem
    plan = _build(op, name, tensors, inplace, device, dense_ok)
    if plan.cached and not plan.inference:
        _keep(plan)
    return plan


def _confirm(kept: list[Plan], tensors: list[Tensor], device, dense_ok: bool, signed: bool) -> Plan | None:
    """The kept plan (of one key) that describes ``tensors``, moved to their addresses if they
    moved, or None (and None, with ``signed``, when one is negated: see :func:`make_plan`).
    Plans of channels-last tensors serve calls that take dense tensors as they are (``dense_ok``)
    only."""
    if not dense_ok:
        kept = [p for p in kept if p.formats is None]
    elif dense_ok == ROWS:
        kept = [p for p in kept if not p.permuted]  # a permuted tensor's rows are not blocks
    if not kept:
        return None
    writing = kept[0].inplace and not torch.is_inference_mode_enabled()
    if probes():
        # One pass of the Rust core through torch's own getters: None, True (the same
        # addresses) or the addresses, on the plan's device (read where an address moved); then
        # the sizes and strides of the permuted tensors.
        for plan in kept:
            found = plan.tensor_list.probe(tensors, writing, plan.device_index, signed)
            if found is not None and (not plan.permuted or _same_layouts(plan, tensors)):
                break
        else:
            return None
        if found is True:
            return _checked_devices(plan, tensors, device)
        words, devices_read = found, True
        kinds = [p for p in kept if p is plan or _same_kind(p, plan)]
    else:
        if not set(map(type, tensors)) <= _PLAIN:
            return None
        sizes = list(map(_nbytes, tensors))
        dtypes = list(map(_dtype, tensors))
        kinds = [p for p in kept if p.nbytes == sizes and p.dtypes == dtypes and p.formats is None]
        if not kinds or not all(map(_is_contiguous, tensors)) or (signed and any(map(_is_neg, tensors))):
            return None
        plan = kinds[0]
        if writing:
            deque(map(_version, tensors), maxlen=0)  # raises for an inference tensor: planned anew
        words, devices_read = as_words(map(_data_ptr, tensors)), False
    same = [p for p in kinds if p._words == words]  # every kept plan has them (_keep, Plan.moved)
    if same:
        plan = same[0]
    else:
        if not devices_read and set(map(_get_device, tensors)) != {plan.device_index}:
            return None
        tensor_list = plan.tensor_list.moved(words)
        if tensor_list is None:
            return None
        plan = plan.moved(words, tensor_list)
    return _checked_devices(plan, tensors, device)


def _same_kind(a: Plan, b: Plan) -> bool:
    """Whether two plans describe tensors of the same dtypes, sizes and layouts. A moved plan
    shares these lists with the plan it moved from, so identity answers first (comparing two
    lists of 2000 is ~1.7 us, and a key keeps up to 8 plans)."""
    return (
        (a.nbytes is b.nbytes or a.nbytes == b.nbytes)
        and (a.dtypes is b.dtypes or a.dtypes == b.dtypes)
        and a.formats == b.formats
        and (a.permuted_layouts is b.permuted_layouts or a.permuted_layouts == b.permuted_layouts)
    )


def _checked_devices(plan: Plan, tensors: list[Tensor], device) -> Plan | None:
    """``plan`` when the tensors without elements (whose addresses say nothing) are on its
    device, and it is the call's ``device`` (when given); else None."""
    if plan.empty and any(tensors[i].device != plan.device for i in plan.empty):
        return None
    if device is not None and plan.device != device:
        return None
    return plan


def probes() -> bool:
    """Whether the Rust core probes tensors through torch's getters (set up on first use)."""
    global _PROBES
    if _PROBES is None:
        _PROBES = _set_probes()
    return _PROBES


def grads_of(params: list, without: torch.dtype | None = None) -> list[Tensor] | None:
    """The gradients of ``params`` (a list) that are not None, in order, each a plain tensor
    (``torch.Tensor``/``nn.Parameter``): one Rust pass through torch's ``grad`` getter. None
    where that pass cannot answer (no probes, a subclass among the parameters or gradients, a
    getter that raises) and, with ``without``, where some gradient has that dtype (read in the
    same pass): the caller then reads them itself, as torch would, and refuses that dtype."""
    return rust_core().grads_of(params, without) if probes() else None


def as_words(addrs: Iterable[int]) -> bytes:
    """Addresses as native-endian 64-bit words, the form the Rust core reads and returns them in
    (``bytes``: compared in one equality, read without a Python integer per tensor)."""
    return array("Q", addrs).tobytes()


class Addresses:
    """Data addresses to confirm tensors against (:func:`grads_are`, :func:`addrs_are`): kept
    as a list and as the native 64-bit words the Rust pass reads without converting a Python
    integer per tensor."""

    __slots__ = ("list", "words")

    def __init__(self, addrs: Iterable[int]):
        self.list = list(addrs)
        self.words = as_words(self.list)


def grads_are(params: list, grads: list, addrs: Addresses | None = None) -> bool:
    """Whether ``params[i].grad is grads[i]`` for every ``i`` and, with ``addrs``, whether
    ``grads[i].data_ptr() == addrs[i]`` too: one Rust pass through torch's getters, or C-level
    maps."""
    if probes():
        return rust_core().grads_are(params, grads, None if addrs is None else addrs.words)
    return (
        len(params) == len(grads)
        and all(map(is_, map(_grad, params), grads))
        and (addrs is None or list(map(_data_ptr, grads)) == addrs.list)
    )


def addrs_are(tensors: list, addrs: Addresses) -> bool:
    """Whether ``tensors[i].data_ptr() == addrs[i]`` for every ``i`` (one pass, as above)."""
    if probes():
        return rust_core().addrs_are(tensors, addrs.words)
    return list(map(_data_ptr, tensors)) == addrs.list


def _set_probes() -> bool:
    """Hands the Rust core torch's attribute getters for :func:`_confirm` (False: a Python or
    torch where they cannot be called directly; the probes are then C-level maps), and where
    this torch keeps a tensor's pointers, for the prefetches of its walks (``_layout``)."""
    try:
        ok = rust_core().set_probes(
            [Tensor.dtype, Tensor.nbytes, Tensor._version, Tensor.grad, Tensor.shape],
            [Tensor.data_ptr, Tensor.is_contiguous, Tensor.get_device, Tensor.is_neg],
            list(DTYPE_CODES),
            [Tensor, torch.nn.Parameter],
            [{"memory_format": layout} for layout in LAYOUTS[1:]],
        )
    except (AttributeError, TypeError, ValueError):
        return False
    if ok:
        offsets = find_offsets()
        if offsets is not None:
            rust_core().prefetch(offsets)
    return ok


def _keep(plan: Plan) -> None:
    key = (plan.inplace, len(plan), plan.nbytes[0], plan.nbytes[-1])
    plan.words  # noqa: B018 (made now: every kept plan has its words, which _confirm compares)
    with _LOCK:
        kept = _PLANS.pop(key, [])
        kept.insert(0, plan)
        del kept[PLANS_PER_KEY:]
        while len(_PLANS) >= CACHE_SIZE:
            del _PLANS[next(iter(_PLANS))]  # the least recently made or moved key
        _PLANS[key] = kept


def clear_plans() -> None:
    """Forgets every kept plan."""
    _PLANS.clear()


def _build(op: str, name: str, tensors: list[Tensor], inplace: bool, device, dense_ok: bool) -> Plan:
    """Validates ``tensors`` and describes their memory (see :func:`make_plan`)."""
    tensors = list(tensors)
    if not set(map(type, tensors)) <= _PLAIN and _overrides_torch(tensors):
        raise NotPlannable(
            f"{op}: {name} hold a tensor subclass with a __torch_function__ or __torch_dispatch__ of its own, "
            "which decides what the op does on it"
        )
    codes = check_dtypes(op, name, tensors)
    if not tensors:
        plan = Plan(name, device, [], [], b"", [], inplace, None)
        plan.tensors = tensors
        return plan
    device = check_device(op, name, tensors, device, strict=True)
    if device.type not in ("cpu", "cuda"):
        raise NotPlannable(f"{op}: {name} are on {device}; gradfuse's kernels run on CPU and CUDA tensors")
    writeback = []
    try:
        contiguous = all(map(Tensor.is_contiguous, tensors))
    except RuntimeError:
        # Sparse and other non-strided layouts have no strides to ask about.
        check_layouts(op, name, tensors)
        raise
    negated = any(map(_is_neg, tensors))
    originals = tensors
    formats = None
    if not contiguous or negated:
        check_layouts(op, name, tensors)
        tensors, writeback = _densify(op, name, tensors, inplace, dense_ok)
        if tensors is originals and probes():
            formats = _formats(tensors)  # all dense and used in place: kept, with each one's format
    addrs = list(map(Tensor.data_ptr, tensors))
    numels = list(map(Tensor.numel, tensors))
    try:
        tensor_list = rust_core().TensorList(name, addrs, numels, codes, inplace, formats)
    except (OverlapError, UnsupportedTensorError) as e:
        raise type(e)(f"{op}: {e}") from None
    plan = Plan(name, device, addrs, numels, codes, list(map(_dtype, tensors)), inplace, tensor_list)
    if inplace:
        try:
            check_writable(originals)
        except RuntimeError:
            plan.inference = True
    if formats is not None:
        plan.formats = formats
        plan.laid_out = [i for i, code in enumerate(formats) if code]
        plan.permuted = tuple(i for i, code in enumerate(formats) if code == PERMUTED)
        plan.permuted_layouts = _layouts(tensors, plan.permuted)
    elif not contiguous or negated:
        plan.tensors, plan.writeback, plan.copied = tensors, writeback, tensors is not originals
        if dense_ok == ROWS:
            plan.laid_out = [i for i, t in enumerate(tensors) if t.numel() and not t.is_contiguous()]
    return plan


#: ``dense_ok`` of the ops on units, groups of whole rows along dim 0 in logical order (AGC's): a
#: tensor contiguous in a channels-last format is used in place (dim 0 is outermost there, so each
#: row is one block of memory, its elements in another order), any other non-contiguous one copied;
#: the op then checks with :func:`rows_fit` that its units are whole rows.
ROWS = "rows"


def rows_fit(plan: Plan, tensors: list[Tensor], units: list[int]) -> bool:
    """Whether each unit of the tensors ``plan`` uses in place in a channels-last layout is whole
    rows along dim 0 (``units[i]`` divides the first size, or the tensor is empty): only then is a
    unit one block of its memory."""
    return all(units[i] == 0 or tensors[i].shape[0] % units[i] == 0 for i in plan.laid_out)


#: The memory formats a kept plan's tensors may be contiguous in, by code (channels-last
#: convolution weights and their gradients, the usual non-contiguous dense tensors).
LAYOUTS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
#: The format code of a tensor dense in an order none of ``LAYOUTS`` names (a transpose, a
#: permutation): its plan is kept with its sizes and strides, which every later call compares
#: (:func:`_same_layouts`; the Rust core's probe does not ask its contiguity).
PERMUTED = len(LAYOUTS)


def _layouts(tensors: list[Tensor], indices) -> list[tuple]:
    """``(shape, stride)`` of ``tensors[i]`` for each of ``indices``."""
    picked = [tensors[i] for i in indices]
    return list(zip(map(_shape, picked), map(Tensor.stride, picked), strict=True))


def _same_layouts(plan: Plan, tensors: list[Tensor]) -> bool:
    """Whether the tensors ``plan`` holds as permuted have the sizes and strides it planned."""
    try:
        return _layouts(tensors, plan.permuted) == plan.permuted_layouts
    except _PROBE_ERRORS:
        return False


def _format(t: Tensor) -> int | None:
    """The code of the memory format ``t`` is contiguous in (see ``LAYOUTS``), or None."""
    return next((code for code, layout in enumerate(LAYOUTS) if t.is_contiguous(memory_format=layout)), None)


def _formats(tensors: list[Tensor]) -> bytes | None:
    """The code of the memory format each tensor is contiguous in (see ``LAYOUTS``), ``PERMUTED``
    for one dense in another order; None when one is not dense (its plan is made for one call)."""
    codes = bytearray()
    for t in tensors:
        code = _format(t)
        if code is None:
            if not is_dense(t):
                return None
            code = PERMUTED
        codes.append(code)
    return bytes(codes)


_PYTHON_KEY = torch._C.DispatchKey.Python


def _overrides_torch(tensors: list[Tensor]) -> bool:
    """Whether a tensor subclass among ``tensors`` would be handed this call: one with a
    ``__torch_function__`` of its own while torch functions are enabled, or with a
    ``__torch_dispatch__`` (the Python dispatch key) while that key is not excluded. Never so
    inside the subclass's own handler, which runs with them disabled or excluded: there (the
    dispatcher's kernel) its tensors are planned as any. Only the eager entry, which skips the
    dispatcher, finds it so, and hands the call to the dispatcher (NotPlannable)."""
    odd = [t for t in tensors if type(t) not in _PLAIN]
    if torch._C._is_torch_function_enabled() and any(
        type(t).__torch_function__ is not torch._C._disabled_torch_function_impl for t in odd
    ):
        return True
    if torch._C._dispatch_tls_is_dispatch_key_excluded(_PYTHON_KEY):
        return False
    return any(torch._C._dispatch_keys(t).has(_PYTHON_KEY) for t in odd)


def _densify(op: str, name: str, tensors: list[Tensor], inplace: bool, dense_ok: bool):
    """Contiguous copies of the tensors whose elements are not one dense block, or whose memory
    holds the negation of their values (torch's negative bit; the others are used as they are:
    ``tensors`` itself when there is no copy) and, for in-place targets, the ``(original,
    copy)`` pairs to copy back (torch's ``copy_`` writes a negated view's memory as it must)."""
    to_copy = []
    for i, t in enumerate(tensors):
        if t.numel() == 0 or (t.is_contiguous() and not t.is_neg()):
            continue
        if inplace and torch._debug_has_internal_overlap(t) == 1:
            raise InternalOverlapError(internal_overlap_message(op, name, i))
        if t.is_neg():
            in_place = False
        elif dense_ok == ROWS:
            in_place = _format(t) in (1, 2)  # channels-last: every row along dim 0 one block
        else:
            in_place = dense_ok and is_dense(t)
        if not in_place:
            to_copy.append(i)
    if not to_copy:
        return tensors, []
    if inplace:
        # The copies will overlap nothing; the originals they are copied back into might.
        # Checked first, so that a refused call (or one handed to torch) copies nothing.
        check_disjoint(op, name, tensors)
    work = list(tensors)
    for i in to_copy:
        # Into a new tensor of torch's own (no negative bit) in one copy, which resolves the bit.
        t = tensors[i]
        work[i] = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t) if t.is_neg() else t.contiguous()
    writeback = [(tensors[i], work[i]) for i in to_copy] if inplace else []
    return work, writeback


def internal_overlap_message(op: str, name: str, i: int) -> str:
    return (
        f"{op}: {name}[{i}] has internal overlap (several of its elements share memory, as after "
        "expand()); it cannot be written in place"
    )


def check_disjoint(
    op: str, name: str, targets: list[Tensor], src_name: str | None = None, sources: list[Tensor] | None = None
) -> None:
    """Raises OverlapError if two in-place ``targets`` share an element, or a target shares one
    with a source other than its own pair (``sources[i] is targets[i]``-like views are fine:
    ``dst[i] += src[i]`` reads each element before writing it). Exact for any strided layout
    (the Rust core's test: spans, then arithmetic, then elements), so views that merely
    interleave, such as the column slices ``W[:, 0:4]`` and ``W[:, 4:8]``, pass."""
    views = list(targets)
    written = [True] * len(views)
    owners = [(name, i) for i in range(len(views))]
    for i, s in enumerate(sources or ()):
        t = targets[i]
        if s.data_ptr() == t.data_ptr() and s.dtype == t.dtype and s.shape == t.shape and s.stride() == t.stride():
            continue
        views.append(s)
        written.append(False)
        owners.append((src_name, i))
    hit = rust_core().find_strided_overlap(
        list(map(Tensor.data_ptr, views)),
        list(map(Tensor.element_size, views)),
        list(map(Tensor.size, views)),
        list(map(Tensor.stride, views)),
        written,
    )
    if hit is None:
        return
    (a_name, a), (b_name, b) = owners[hit[0]], owners[hit[1]]
    if hit[0] == hit[1]:
        raise InternalOverlapError(internal_overlap_message(op, a_name, a))
    raise OverlapError(
        f"{op}: {a_name}[{a}] and {b_name}[{b}] overlap in memory; in-place targets must not overlap each other "
        "or their inputs"
    )


def check_reads(
    op: str, dst_name: str, dst: Plan, dst_tensors: list[Tensor], src_name: str, src: Plan, src_tensors: list[Tensor]
) -> None:
    """OverlapError when a source overlaps a target other than its own (``dst[i] += src[i]``
    reads each element before writing it): on the Rust core's descriptions of kept plans (once
    per pair of plans), on the tensors themselves when a plan works on copies. Named after this
    call's arguments: a kept plan may be another op's, named after that op's."""
    if dst.cached and src.cached:
        if dst.memo.get("reads") is src:
            return
        try:
            dst.tensor_list.check_reads(src.tensor_list)
        except OverlapError:
            pass  # found again below, on the tensors, to be named
        else:
            dst.memo["reads"] = src
            return
    check_disjoint(op, dst_name, dst_tensors, src_name, src_tensors)


def check_aligned(op: str, name: str, tensors: list[Tensor]) -> None:
    """UnsupportedTensorError for a tensor whose data is not aligned to its element size (the
    Rust core's own check, for callers that must know before any kernel of a call runs)."""
    for i, t in enumerate(tensors):
        if t.data_ptr() % t.element_size():
            raise UnsupportedTensorError(
                f"{op}: {name}[{i}] starts at address {t.data_ptr():#x}, which is not aligned to its element "
                f"size {t.element_size()}"
            )


_RUST = []


def rust_core():
    """The Rust core, imported on first use and then kept (an import statement at every call
    costs ~1 us)."""
    if not _RUST:
        from gradfuse import _rust

        _RUST.append(_rust)
    return _RUST[0]


def check_same_length(op: str, a_name: str, a: list, b_name: str, b: list) -> None:
    if len(a) != len(b):
        raise ValueError(f"{op}: {a_name} has {len(a)} tensors but {b_name} has {len(b)}")


def check_same_shapes(op: str, a_name: str, a: list[Tensor], b_name: str, b: list[Tensor]) -> None:
    """Raises ValueError naming the first pair ``a[i]``, ``b[i]`` of other shapes: one pass of the
    Rust core through torch's ``shape`` getter (~53 ns a tensor), else (a subclass, say) here."""
    first = rust_core().shape_mismatch(a, b) if probes() and type(a) is list and type(b) is list else None
    if first == -1:
        return
    start = first or 0  # the pair found, or all of them (the Rust pass could not answer)
    for i, (x, y) in enumerate(zip(a[start:], b[start:], strict=True), start):
        if x.shape != y.shape:
            raise ValueError(
                f"{op}: {a_name}[{i}] has shape {tuple(x.shape)} but {b_name}[{i}] has shape {tuple(y.shape)}"
            )


def check_scalar(op: str, name: str, t: Tensor, device: torch.device | None, *, float32: bool = False) -> None:
    """A one-element floating tensor on ``device`` (float32 when ``float32``, as torch's AMP ops need)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must have exactly one element, got shape {tuple(t.shape)}")
    if float32 and t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be a float32 tensor, got {t.dtype}")
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the tensors are on {device}")


def check_norm_type(op: str, norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p):
        raise ValueError(f"{op}: norm_type must be a real number, got nan")
    return p


def check_empty_norm(op: str, name: str, norm_type: float, numels: list[int]) -> None:
    """torch refuses norms without an identity (inf, -inf, negative orders) of empty tensors."""
    if (math.isinf(norm_type) or norm_type < 0) and 0 in numels:
        i = numels.index(0)
        raise RuntimeError(
            f"linalg.vector_norm cannot compute the {format_order(norm_type)} norm on an empty tensor because "
            f"the operation does not have an identity ({op}: {name}[{i}] is empty)"
        )


def format_order(p: float) -> str:
    """A norm order as torch's C++ messages print it: 2, -1, 0.5, inf."""
    return f"{p:g}"


def nonfinite_total_error(norm_type: float) -> RuntimeError:
    """torch's exact error for ``error_if_nonfinite=True`` and a non-finite total norm."""
    return RuntimeError(
        f"The total norm of order {float(norm_type)} for gradients from "
        "`parameters` is non-finite, so it cannot be clipped. To disable "
        "this error and scale the gradients by the non-finite norm anyway, "
        "set `error_if_nonfinite=False`"
    )


#: Whether the Rust core probes kept plans (see :func:`_set_probes`; None: not asked yet).
_PROBES: bool | None = None
