"""Validation of tensor-list arguments and the memory description both backends consume.

Every `gradfuse::` op turns each tensor-list argument into a :class:`Plan` before any kernel
runs: dtypes, devices, layouts and (for in-place targets) overlap are checked here, and a bad
argument raises an exception naming the op, the argument and the index, with nothing modified.
The per-tensor work is done with C-level ``map`` over tensor methods: at 2000 tensors each
attribute costs ~100 us, so the plan reads as few as it can (measured on the CI machine).
"""

from __future__ import annotations

import math
from operator import attrgetter

import torch

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


class UnsupportedTensorError(TypeError):
    """A tensor gradfuse's kernels cannot run (complex or integer dtype, sparse or other
    non-strided layout). Raised before anything is modified; the drop-in clipping functions
    catch it and hand the whole call to torch."""


class Plan:
    """The validated memory of one tensor-list argument.

    ``tensors`` are what the kernels touch: the caller's tensors, except that a tensor whose
    elements are not one dense block is replaced by a contiguous copy (``writeback`` pairs each
    such original with its copy, to be copied back after an in-place op).
    """

    __slots__ = ("addrs", "codes", "device", "inplace", "name", "numels", "tensors", "writeback")

    def __init__(self, name, tensors, device, addrs, numels, codes, writeback, inplace):
        self.name = name
        self.inplace = inplace
        self.tensors = tensors
        self.device = device
        self.addrs = addrs
        self.numels = numels
        self.codes = codes
        self.writeback = writeback

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def out_dtype(self) -> torch.dtype:
        """Dtype of norms of these tensors: float64 if any is float64, else float32."""
        return torch.float64 if 1 in self.codes else torch.float32

    def finish_inplace(self, originals: list[Tensor]) -> None:
        """After an in-place kernel: copy results into non-dense originals, bump versions."""
        for orig, work in self.writeback:
            orig.copy_(work)
        bump_versions(originals)


def bump_versions(tensors: list[Tensor]) -> None:
    """Tell autograd the tensors were modified in place (one C++ call for the whole list).

    Inference tensors have no version counter and are skipped. torch itself refuses in-place
    writes to them outside inference mode; checking for that costs ~140 us per call at 2000
    tensors (measured) and gradients are never inference tensors, so gradfuse does not.
    """
    if tensors and not torch.is_inference_mode_enabled():
        torch._C._increment_version(tensors)


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


def span_bytes(t: Tensor) -> int:
    """Bytes from the first element of ``t`` to the end of its last one (0 when empty)."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def check_dtypes(op: str, name: str, tensors: list[Tensor]) -> list[int]:
    """The dtype code of every tensor (one C-level pass when they share a dtype, the usual case)."""
    dtypes = set(map(_dtype, tensors))
    if len(dtypes) == 1:
        code = DTYPE_CODES.get(next(iter(dtypes)))
        if code is not None:
            return [code] * len(tensors)
    codes = list(map(DTYPE_CODES.get, map(_dtype, tensors)))
    if None in codes:
        i = codes.index(None)
        raise UnsupportedTensorError(
            f"{op}: {name}[{i}] has dtype {tensors[i].dtype}; gradfuse works on {SUPPORTED} tensors"
        )
    return codes


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
    for i, t in enumerate(tensors):
        if t.device != first:
            where = f"{name}[0] is on {first}" if device is None else f"the call is on {first}"
            raise ValueError(
                f"{op}: {name}[{i}] is on {t.device} but {where}; one call takes tensors on one device "
                "(gradfuse.clip_grad_norm_ and friends group by device for you)"
            )
    return first


def make_plan(op: str, name: str, tensors: list[Tensor], *, inplace: bool, device=None, dense_ok: bool = True) -> Plan:
    """Validates ``tensors`` and describes their memory.

    ``inplace``: the op writes them. ``dense_ok``: a non-contiguous tensor whose elements are
    still one dense block (a transpose, say) is used in place; element-wise ops that pair two
    lists pass False, so both sides are walked in the same (row-major) order.
    """
    tensors = list(tensors)
    codes = check_dtypes(op, name, tensors)
    if not tensors:
        return Plan(name, tensors, device, [], [], [], [], inplace)
    device = check_device(op, name, tensors, device)
    writeback = []
    try:
        contiguous = all(map(Tensor.is_contiguous, tensors))
    except RuntimeError:
        # Sparse and other non-strided layouts have no strides to ask about.
        check_layouts(op, name, tensors)
        raise
    if not contiguous:
        check_layouts(op, name, tensors)
        tensors, writeback = _densify(op, name, tensors, inplace, dense_ok)
    addrs = list(map(Tensor.data_ptr, tensors))
    numels = list(map(Tensor.numel, tensors))
    return Plan(name, tensors, device, addrs, numels, codes, writeback, inplace)


def _densify(op: str, name: str, tensors: list[Tensor], inplace: bool, dense_ok: bool):
    work = list(tensors)
    writeback = []
    for i, t in enumerate(tensors):
        if t.is_contiguous() or t.numel() == 0:
            continue
        if inplace and torch._debug_has_internal_overlap(t) == 1:
            raise RuntimeError(
                f"{op}: {name}[{i}] has internal overlap (several of its elements share memory, as after "
                "expand()); it cannot be written in place"
            )
        if not (dense_ok and is_dense(t)):
            work[i] = t.contiguous()
            if inplace:
                writeback.append((t, work[i]))
    if writeback:
        # The copies never overlap anything; the originals they are copied back into might.
        starts = list(map(Tensor.data_ptr, tensors))
        ends = [s + span_bytes(t) for s, t in zip(starts, tensors, strict=True)]
        hit = _rust().find_overlap(starts, ends, [True] * len(tensors))
        if hit is not None:
            raise ValueError(
                f"{op}: {name}[{hit[0]}] and {name}[{hit[1]}] overlap in memory; in-place targets must not overlap"
            )
    return work, writeback


def _rust():
    from gradfuse import _rust

    return _rust


def check_same_length(op: str, a_name: str, a: list, b_name: str, b: list) -> None:
    if len(a) != len(b):
        raise ValueError(f"{op}: {a_name} has {len(a)} tensors but {b_name} has {len(b)}")


def check_same_shapes(op: str, a_name: str, a: list[Tensor], b_name: str, b: list[Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
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
