"""How a kernel runs: each specialization compiled once, then launched directly.

Triton's ``kernel[grid](*args)`` (``JITFunction.run``) binds every argument, computes the
specialization (each pointer's dtype and 16-byte alignment, each integer's width and whether it is
1 or a multiple of 16), looks up or compiles that specialization, and launches it: 6-13 us per
launch, most of a small call's host time. A :class:`Launcher` does the first launch of each
specialization through that path (which compiles it and returns the compiled kernel), keeps the
compiled kernel under a key of its own that says everything the specialization assumed, and
launches the later calls with that key through the compiled kernel's launcher
(``CompiledKernel.run``: the same C launcher the JIT calls last), with pointers as plain
integers.

The key is checked once against what Triton compiled (the compiled source's signature, alignment
attributes and constants): a key that does not say exactly what the specialization assumed (a
Triton that specializes differently, say) keeps launching through ``JITFunction.run``, never
through a kernel compiled for other arguments. So does every launch under the interpreter, while a
launch hook is set (``triton.knobs.runtime.launch_enter_hook``/``launch_exit_hook``: profilers),
and with a Triton whose compiled kernel has no ``run(grid_x, grid_y, grid_z, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` launcher (Triton 3.6 to 3.9 have
it). ``direct`` counts the direct launches (tests and the host bench read it).

The caller must launch on the device the tensors are on (the current CUDA device when the
kernel was compiled is part of the key, as in Triton's own caches).
"""

from __future__ import annotations

import os

import torch

#: Runs kernels under Triton's interpreter (CPU tensors, numpy arithmetic): always the JIT path.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Triton's name for the element type of a torch dtype (``triton._utils.canonicalize_dtype``).
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "u1",
}
#: Triton's name for a pointer to each dtype's elements.
_POINTER_TYPES = {dtype: "*" + ty for dtype, ty in TRITON_TYPES.items()}
DIVISIBILITY = 16
_I32 = 2**31
_I64 = 2**63
_Tensor = torch.Tensor


class _Param:
    """What the launcher needs to know of one kernel parameter."""

    __slots__ = ("annotation", "constexpr", "name", "specialize")

    def __init__(self, kp):
        self.name = kp.name
        self.constexpr = kp.is_constexpr
        self.specialize = not kp.do_not_specialize
        self.annotation = kp.annotation_type or ""


class Ptr:
    """A tensor passed as a pointer argument, its address and spec read once (a chunk table's
    buffers, which live as long as the table): what :class:`Launcher` reads of a tensor
    argument, without asking the tensor at every launch."""

    __slots__ = ("addr", "spec", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.addr = tensor.data_ptr()
        ty = TRITON_TYPES.get(tensor.dtype)
        self.spec = ("*" + ty if ty else None, self.addr % DIVISIBILITY == 0, False)


_I32_PLAIN = ("i32", False, False)


def _arg_spec(param: _Param, arg) -> tuple:
    """``(triton type, divisible by 16, equal to 1)`` of one non-tensor runtime argument as
    Triton's JIT specializes it (``triton.runtime.jit.create_function_from_signature``)."""
    if isinstance(arg, bool):
        return ("u1", False, False)
    if isinstance(arg, int):
        if param.annotation:
            ty = param.annotation
        elif -_I32 <= arg < _I32:
            ty = "i32"
        elif _I64 <= arg < 2 * _I64:
            ty = "u64"
        elif -_I64 <= arg < _I64:
            ty = "i64"
        else:
            return (None, False, False)
        if not param.specialize or ty == "u1" or ty[:2] in ("fp", "bf"):
            return (ty, False, False)
        return (ty, arg % DIVISIBILITY == 0, arg == 1)
    if isinstance(arg, float):
        return (param.annotation or "fp32", False, False)
    return (None, False, False)


class Launcher:
    """The compiled specializations of one ``@triton.jit`` kernel and their direct launches."""

    def __init__(self, fn):
        self.fn = fn
        # The interpreter's functions have no parameter list: it launches through the JIT alone.
        self.params = [] if INTERPRET else [_Param(kp) for kp in fn.params]
        self.runtime = [p for p in self.params if not p.constexpr]
        #: Per declared parameter: (True, name) for a constexpr, (False, index among the runtime ones).
        runtime_index = {id(p): i for i, p in enumerate(self.runtime)}
        self.layout = [(True, p.name) if p.constexpr else (False, runtime_index[id(p)]) for p in self.params]
        #: Per runtime parameter: an integer there is typed i32 when it fits (neither specialized
        #: nor annotated), read once here rather than at every launch.
        self.plain_ints = [not p.specialize and not p.annotation for p in self.runtime]
        #: The constexprs' names when every runtime parameter comes first, in order (the packed
        #: arguments are then the runtime values followed by the constexprs'); else None.
        n = len(self.runtime)
        head, tail = self.layout[:n], self.layout[n:]
        in_order = [x for _, x in head] == list(range(n)) and not any(c for c, _ in head)
        self.tail = [name for _, name in tail] if in_order and all(c for c, _ in tail) else None
        #: key -> compiled kernel, or None: launched through the JIT (see :meth:`_checked`).
        self.compiled: dict[tuple, object] = {}
        #: Launches that went straight to the compiled kernel (for tests and benches).
        self.direct = 0

    def bind(self, args: tuple, meta: dict, device: int) -> tuple[tuple, list]:
        """``(key, packed)``: the key of the specialization these arguments need (the device, the
        meta-parameters by name, and per runtime argument its Triton type and whether it is
        divisible by 16 or equal to 1, as the JIT decides them: a pointer's alignment from its
        address) and every declared argument in order as the compiled kernel's launcher takes
        them (pointers as integers, constexpr slots with their values, which it skips)."""
        if len(args) != len(self.runtime):
            raise TypeError(f"{self.fn.__name__}: {len(args)} arguments for {len(self.runtime)} parameters")
        specs = []
        values = []
        spec, value = specs.append, values.append
        for p, plain, a in zip(self.runtime, self.plain_ints, args, strict=True):
            kind = type(a)
            if kind is Ptr:
                spec(a.spec)
                value(a.addr)
            elif kind is int and plain and -_I32 <= a < _I32:
                spec(_I32_PLAIN)
                value(a)
            elif isinstance(a, _Tensor):
                addr = a.data_ptr()
                spec((_POINTER_TYPES.get(a.dtype), addr % DIVISIBILITY == 0, False))
                value(addr)
            else:
                spec(_arg_spec(p, a))
                value(a)
        if self.tail is not None:
            values += [meta.get(x, _MISSING) for x in self.tail]
            packed = values
        else:
            packed = [meta.get(x, _MISSING) if constexpr else values[x] for constexpr, x in self.layout]
        return (device, tuple(meta.items()), tuple(specs)), packed

    def __call__(self, grid: int, args: tuple, meta: dict, device: int):
        """Launches ``fn[(grid,)](*args, **meta)``: ``args`` are the runtime arguments in order
        (tensors, :class:`Ptr`, numbers), ``meta`` the constexprs (by name) and compile options;
        ``device`` is the CUDA device the tensors are on (-1 for CPU tensors, which only the
        interpreter runs). Returns the compiled kernel, or None when the launch went through the
        JIT without one (a compile hook cancelled the compile)."""
        if INTERPRET:
            return self._jit(grid, args, meta)
        key, packed = self.bind(args, meta, device)
        compiled = self.compiled.get(key, _MISSING)
        if compiled is _MISSING:
            compiled = self._jit(grid, args, meta)
            if compiled is not None:
                self.compiled[key] = compiled if _SHAPE_KNOWN and self._checked(key, compiled) else None
            return compiled
        if compiled is None or not _hooks_unset():
            return self._jit(grid, args, meta)
        launch(compiled, grid, packed, device)
        self.direct += 1
        return compiled

    def _jit(self, grid: int, args: tuple, meta: dict):
        args = [a.tensor if type(a) is Ptr else a for a in args]
        if INTERPRET:
            import numpy as np

            # inf * 0 and friends are meant here: the GPU is silent about them, and the test
            # suite turns numpy's warnings into errors.
            with np.errstate(all="ignore"):
                return self.fn[(grid,)](*args, **meta)
        return self.fn[(grid,)](*args, **meta)

    def _checked(self, key: tuple, compiled) -> bool:
        """Whether ``key`` says exactly what ``compiled`` was specialized for (its source's
        signature, constants and divisibility attributes), so that later calls with this key may
        be launched directly."""
        if not hasattr(type(compiled), "run") or not all(
            hasattr(compiled, a) for a in ("function", "packed_metadata", "src")
        ):
            return False
        src = compiled.src
        signature, constants, attrs = (getattr(src, a, None) for a in ("signature", "constants", "attrs"))
        if not isinstance(signature, dict) or not isinstance(constants, dict) or not isinstance(attrs, dict):
            return False
        if list(signature) != [p.name for p in self.params]:
            return False
        meta = dict(key[1])
        specs = iter(key[2])
        for i, p in enumerate(self.params):
            ty = signature[p.name]
            divisible = any(_is_divisibility(a) for a in attrs.get((i,), ()))
            if p.constexpr:
                if ty != "constexpr" or constants.get((i,), _MISSING) != meta.get(p.name, _MISSING):
                    return False
                continue
            want, div, one = next(specs)
            if want is None:
                return False
            if one:
                if ty != "constexpr" or constants.get((i,), _MISSING) != 1:
                    return False
            elif ty != want or divisible != div or (i,) in constants:
                return False
        return True


def _is_divisibility(attr) -> bool:
    return (
        isinstance(attr, list | tuple) and len(attr) == 2 and attr[0] == "tt.divisibility" and attr[1] == DIVISIBILITY
    )


def _known_launch_shape() -> bool:
    """Whether this Triton's compiled kernels take the launch call :func:`launch` makes (3.6 to
    3.9 do; another version keeps every launch on the JIT path until checked)."""
    import triton

    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (3, 6) <= (major, minor) <= (3, 9)


_SHAPE_KNOWN = _known_launch_shape()


_MISSING = object()


def _hooks_unset() -> bool:
    """Whether no launch hook is set: None, or (Triton 3.6-3.9) an empty ``HookChain``."""
    runtime = _runtime_knobs()
    return _unset(runtime.launch_enter_hook) and _unset(runtime.launch_exit_hook)


def _runtime_knobs():
    if not _KNOBS:
        from triton import knobs

        _KNOBS.append(knobs.runtime)
    return _KNOBS[0]


_KNOBS: list = []


def _unset(hook) -> bool:
    return hook is None or (type(hook).__name__ == "HookChain" and not getattr(hook, "calls", True))


def launch(compiled, grid: int, packed: list, device: int) -> None:
    """``compiled``'s launcher on the current stream of ``device``, no hooks, no launch metadata:
    ``run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
    enter_hook, exit_hook, *args)``, the call ``JITFunction.run`` makes."""
    compiled.run(grid, 1, 1, _stream(device), compiled.function, compiled.packed_metadata, None, None, None, *packed)


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


_LAUNCHERS: dict = {}


def launcher(fn) -> Launcher:
    """The launcher of ``fn`` (one per kernel, made on first use)."""
    found = _LAUNCHERS.get(fn)
    if found is None:
        found = _LAUNCHERS[fn] = Launcher(fn)
    return found


def clear() -> None:
    """Forgets every kept specialization (Triton keeps its own compiled kernels)."""
    for found in _LAUNCHERS.values():
        found.compiled.clear()
