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

    __slots__ = ("annotation", "constexpr", "int_spec", "name", "specialize")

    def __init__(self, kp):
        self.name = kp.name
        self.constexpr = kp.is_constexpr
        self.specialize = not kp.do_not_specialize
        self.annotation = kp.annotation_type or ""
        #: The spec of any integer here when it does not depend on the value (an annotated,
        #: unspecialized parameter: see :func:`_arg_spec`); else None.
        self.int_spec = (self.annotation, False, False) if self.annotation and not self.specialize else None


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


def _bind_arg(param: _Param, plain_int: bool, arg) -> tuple[tuple, object]:
    """``(spec, value)`` of one runtime argument: its specialization (:func:`_arg_spec`; a
    pointer's alignment from its address) and the value the compiled kernel's launcher takes (a
    pointer as its integer address). ``plain_int``: an integer there is typed i32 when it fits
    (the parameter is neither specialized nor annotated)."""
    kind = type(arg)
    if kind is Ptr:
        return arg.spec, arg.addr
    if kind is int and plain_int and -_I32 <= arg < _I32:
        return _I32_PLAIN, arg
    if isinstance(arg, _Tensor):
        addr = arg.data_ptr()
        return (_POINTER_TYPES.get(arg.dtype), addr % DIVISIBILITY == 0, False), addr
    return _arg_spec(param, arg), arg


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
        #: Per runtime parameter, its position among the declared ones (in the packed arguments).
        self.packed_pos = [j for j, (constexpr, _) in enumerate(self.layout) if not constexpr]
        #: key -> compiled kernel, or None: launched through the JIT (see :meth:`_checked`).
        self.compiled: dict[tuple, object] = {}
        #: Bumped when ``compiled`` is cleared: what a :class:`Prepared` launch kept is then forgotten.
        self.generation = 0
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
        bound = list(map(_bind_arg, self.runtime, self.plain_ints, args))
        specs = tuple(spec for spec, _ in bound)
        values = [value for _, value in bound]
        if self.tail is not None:
            values += [meta.get(x, _MISSING) for x in self.tail]
            packed = values
        else:
            packed = [meta.get(x, _MISSING) if constexpr else values[x] for constexpr, x in self.layout]
        return (device, tuple(meta.items()), specs), packed

    def __call__(self, grid: int, args: tuple, meta: dict, device: int):
        """Launches ``fn[(grid,)](*args, **meta)``: ``args`` are the runtime arguments in order
        (tensors, :class:`Ptr`, numbers), ``meta`` the constexprs (by name) and compile options;
        ``device`` is the CUDA device the tensors are on (-1 for CPU tensors, which only the
        interpreter runs). Returns the compiled kernel, or None when the launch went through the
        JIT without one (a compile hook cancelled the compile)."""
        if INTERPRET:
            return self._jit(grid, args, meta)
        key, packed = self.bind(args, meta, device)
        return self._launch_bound(grid, args, meta, device, key, packed)

    def _launch_bound(self, grid: int, args: tuple, meta: dict, device: int, key: tuple, packed: list):
        """:meth:`__call__` for arguments already bound (``key``, ``packed``: :meth:`bind`'s)."""
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


#: Marks an argument of a :class:`Prepared` launch that each call gives.
SLOT = type("Slot", (), {"__repr__": lambda self: "SLOT", "__slots__": ()})()
_FIXED_TYPES = (Ptr, int, float, bool)


class Prepared:
    """One launch of a kernel, on one grid and device with one set of meta-parameters, whose
    arguments are known but for a few (``SLOT`` in ``args``) that each call gives: the known ones
    (chunk-table buffers as :class:`Ptr`, numbers; never a tensor, whose address may change) are
    bound once (at the first launch, which binds every argument as any launch did), so that a
    later call binds its own arguments alone, looks the specialization up by
    their specs alone, and launches it directly (:meth:`Launcher.__call__`'s rules: the first call
    of each specialization, every call under the interpreter or while a launch hook is set, and a
    specialization the check refused, go through :meth:`Launcher.__call__`)."""

    __slots__ = (
        "args", "device", "generation", "grid", "kernels", "launcher", "meta", "packed", "ptr_index", "slot_bind",
        "slot_index",
    )  # fmt: skip

    def __init__(self, launcher: Launcher, grid: int, args: tuple, meta: dict, device: int):
        if not all(a is SLOT or type(a) in _FIXED_TYPES for a in args):
            raise TypeError(f"{launcher.fn.__name__}: a prepared launch's fixed arguments are Ptr or numbers")
        self.launcher, self.grid, self.args, self.meta, self.device = launcher, grid, tuple(args), meta, device
        #: Per slot: its index among the runtime arguments.
        self.slot_index = [i for i, a in enumerate(args) if a is SLOT]
        #: The indices of the fixed pointers (what :meth:`moved` may replace).
        self.ptr_index = [i for i, a in enumerate(args) if type(a) is Ptr]
        #: Per slot: ``(its parameter, whether an integer there is a plain i32, its position in the
        #: packed arguments)``.
        self.slot_bind = []
        if not INTERPRET:  # under the interpreter every launch goes through the JIT: nothing is bound
            if len(args) != len(launcher.runtime):
                raise TypeError(f"{launcher.fn.__name__}: {len(args)} arguments for {len(launcher.runtime)} parameters")
            runtime, plain, pos = launcher.runtime, launcher.plain_ints, launcher.packed_pos
            self.slot_bind = [(runtime[i], plain[i], pos[i]) for i in self.slot_index]
        #: The packed arguments of the first launch (the fixed ones bound; each call puts its own
        #: in the slots), from its full binding: None until then.
        self.packed = None
        #: The slots' key (:meth:`_bind_slots`) -> the compiled kernel (None: through the JIT), as
        #: ``launcher.compiled`` holds it for the whole key.
        self.kernels: dict[tuple, object] = {}
        self.generation = launcher.generation

    def __call__(self, *values):
        """Launches with ``values`` in the slots, in order; returns what :meth:`Launcher.__call__`
        returns."""
        if len(values) != len(self.slot_index):
            raise TypeError(f"{self.launcher.fn.__name__}: {len(values)} values for {len(self.slot_index)} slots")
        launcher = self.launcher
        if INTERPRET:
            return launcher(self.grid, self._args(values), self.meta, self.device)
        if self.generation != launcher.generation:
            self.kernels.clear()
            self.generation = launcher.generation
        if self.packed is None:
            return self._through_launcher(values)
        packed = self.packed.copy()
        compiled = self.kernels.get(self._bind_slots(values, packed), _MISSING)
        if compiled is _MISSING or compiled is None or not _hooks_unset():
            return self._through_launcher(values)
        launch(compiled, self.grid, packed, self.device)
        launcher.direct += 1
        return compiled

    def _bind_slots(self, values: tuple, packed: list) -> tuple:
        """Puts ``values`` into ``packed`` (a tensor as its address) and returns the key of the
        specialization they need, flat: per tensor its dtype and whether its address is 16-byte
        aligned (which say its Triton pointer type and divisibility), per other value its spec
        (:func:`_bind_arg`). The caller checked that there is a value per slot (a strict zip
        costs ~0.25 us more, most of a one-slot binding)."""
        key = ()
        for (p, plain, pos), a in zip(self.slot_bind, values, strict=False):
            if isinstance(a, _Tensor):  # the usual slot: a tensor made for the call
                addr = packed[pos] = a.data_ptr()
                key += (a.dtype, addr % DIVISIBILITY == 0)
            elif type(a) is int and p.int_spec is not None:  # a number's bits, say
                packed[pos] = a
                key += (p.int_spec,)
            else:
                spec, packed[pos] = _bind_arg(p, plain, a)
                key += (spec,)
        return key

    def moved(self, replace: dict[int, Ptr], allowed: set[int]) -> Prepared | None:
        """This launch with the fixed :class:`Ptr` arguments ``replace`` names (by id) replaced by
        theirs (another table's buffers: the same kernel and specializations, other addresses),
        or None when a replacement's spec differs, or a fixed ``Ptr`` left is not one of
        ``allowed`` (ids): it would launch on a buffer that is not the new table's."""
        args = list(self.args)
        packed = None if self.packed is None else self.packed.copy()
        pos = self.launcher.packed_pos if packed is not None else None
        for i in self.ptr_index:
            a = args[i]
            new = replace.get(id(a), a)
            if id(new) not in allowed or new.spec != a.spec:
                return None
            args[i] = new
            if pos is not None:
                packed[pos[i]] = new.addr
        other = Prepared.__new__(Prepared)
        other.launcher, other.grid, other.meta, other.device = self.launcher, self.grid, self.meta, self.device
        other.slot_index, other.ptr_index, other.slot_bind = self.slot_index, self.ptr_index, self.slot_bind
        # The kept specializations are shared: the same launcher, meta and specs, so the same keys.
        other.kernels, other.generation = self.kernels, self.generation
        other.args, other.packed = tuple(args), packed
        return other

    def _args(self, values: tuple) -> tuple:
        """Every runtime argument: the fixed ones with ``values`` in the slots."""
        it = iter(values)
        return tuple(next(it) if a is SLOT else a for a in self.args)

    def _through_launcher(self, values: tuple):
        """The launch by :meth:`Launcher.__call__` (which compiles, checks and keeps the
        specialization), and what it decided kept for these specs; the first one's binding is
        kept as the packed arguments of the later ones."""
        launcher, args = self.launcher, self._args(values)
        key, packed = launcher.bind(args, self.meta, self.device)
        if self.packed is None:
            self.packed = packed.copy()
        compiled = launcher._launch_bound(self.grid, args, self.meta, self.device, key, packed)
        slots = self._bind_slots(values, packed.copy())
        if slots not in self.kernels:
            decided = launcher.compiled.get(key, _MISSING)
            if decided is not _MISSING:
                self.kernels[slots] = decided
        return compiled


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
    runtime, chain = _KNOBS if _KNOBS else _runtime_knobs()
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or (type(enter) is chain and not enter.calls)) and (
        exit_ is None or (type(exit_) is chain and not exit_.calls)
    )


def _runtime_knobs() -> tuple:
    """``(triton.knobs.runtime, the type of an empty chain of hooks or None)``, kept in ``_KNOBS``."""
    from triton import knobs

    _KNOBS[:] = [knobs.runtime, getattr(knobs, "HookChain", None)]
    return tuple(_KNOBS)


_KNOBS: list = []


def launch(compiled, grid: int, packed: list, device: int) -> None:
    """``compiled``'s launcher on the current stream of ``device``, no hooks, no launch metadata:
    ``run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
    enter_hook, exit_hook, *args)``, the call ``JITFunction.run`` makes."""
    compiled.run(grid, 1, 1, _stream(device), compiled.function, compiled.packed_metadata, None, None, None, *packed)


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


_LAUNCHERS: dict = {}


def launcher(fn) -> Launcher:
    """The launcher of ``fn`` (one per kernel, made on first use; kept by the kernel's id, which
    the launcher's reference to it keeps from being reused: a ``JITFunction`` hashes its source's
    cache key, ~0.5 us)."""
    found = _LAUNCHERS.get(id(fn))
    if found is None:
        found = _LAUNCHERS[id(fn)] = Launcher(fn)
    return found


def clear() -> None:
    """Forgets every kept specialization (Triton keeps its own compiled kernels)."""
    for found in _LAUNCHERS.values():
        found.compiled.clear()
        found.generation += 1
