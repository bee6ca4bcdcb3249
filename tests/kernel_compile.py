"""Every Triton kernel specialization gradfuse's launchers produce, compiled for real GPUs (sm_90:
H100/H200, sm_80: A100) on a machine without one, and what the compiled code shows.

The interpreter checks the kernels' arithmetic, not what the compiler makes of them. Triton
compiles to cubin without a driver (``triton.compile(ASTSource(...), target=GPUTarget(...))``,
its bundled ``ptxas`` doing the last step), so this script:

1. **records** the launches: with a stand-in driver that only names the target, it calls every
   ``gradfuse::`` op (the layer every public API goes through) on small CPU tensors with
   ``GRADFUSE_BACKEND=triton``, over a grid of what callers choose (dtypes, mixed lists,
   alignment, norm orders, flags, list sizes). Triton's own launch path binds each call and
   computes the specialization a GPU would compile (signature, constexprs, 16-byte alignment and
   divisibility attributes, ``== 1`` integers, options); Triton's ``jit_cache_hook`` receives it
   and cancels the compile. Nothing is listed by hand below the ops, so a new kernel flag, a new
   kernel or a new specialization is covered the day a launcher produces it;
2. **compiles** each distinct specialization once per target (worker processes, a fresh Triton
   cache per run: the compile really happens, and ``ptxas``'s own report of registers and spills
   is read from its log);
3. **checks** the PTX and SASS (:data:`RULES`) and prints a table (kernel, specialization, target,
   registers, spills, shared memory).

``python tests/kernel_compile.py`` compiles the full set (``make gpu-compile``), ``--quick`` the
set CI compiles (aligned groups, every dtype and dtype pair, four norm orders); both exit with 1
on a compile error or a broken rule. ``tests/test_compile.py`` runs it (quick unless
``GRADFUSE_COMPILE_ALL=1``) and turns each rule into a test.

Needs Triton >= 3.4 (``triton.knobs``); Triton 3.6 to 3.9 are what it has met.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

if __name__ in ("__main__", "__mp_main__"):
    # Run as the script (or its worker processes): the kernels must be compiled ones, not the
    # interpreter's (conftest.py sets it for the test run), so this comes before triton is
    # imported. Imported as a module (tests/test_compile.py), the rules only are used.
    os.environ["TRITON_INTERPRET"] = "0"

import torch
import triton
import triton.language as tl

TARGETS = {"sm_90": 90, "sm_80": 80}
F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
DTYPE_NAMES = {F32: "fp32", F64: "fp64", F16: "fp16", BF16: "bf16"}
#: The norm orders of the full set: each norm kind, and for the general power both a float64
#: bit pattern divisible by 16 (3.5) and one not (1/3), for a Triton that specializes integer
#: arguments on divisibility (``p_bits``; Triton 3.9 does not), and a negative power.
ORDERS_FULL = (2.0, 1.0, 0.0, math.inf, -math.inf, 3.5, 1 / 3, -1.0)
ORDERS_QUICK = (2.0, 1.0, math.inf, 3.5)

# --- limits of the compiled code, and why ----------------------------------------------------

#: Registers per thread. The chunk kernels run 4 warps (128 threads) per program and are memory
#: bound: at most 128 registers keeps 4 programs (16 warps) resident per SM (64K registers) to
#: hide memory latency. The general-order norm (``KIND`` 5, any p but 0, 1, 2 and +-inf) takes a
#: float64 libdevice ``pow`` per element, inlined: up to 168 (3 programs per SM) for float32 and
#: 16-bit inputs (153 measured, sm_80), up to 224 (2 programs; the hardware's limit is 255) for
#: float64 inputs (192 measured, sm_90). Measured with Triton 3.9 over the full set.
MAX_REGISTERS = 128
MAX_REGISTERS_POW = 168
MAX_REGISTERS_F64_POW = 224
#: Spilled bytes allowed: none. Except where Triton's own ptxas flag causes them: Triton (3.9 here)
#: runs ``ptxas --regAllocOptLevel=2`` (a workaround for a ptxas 13 bug), under which a few sm_90
#: norm variants spill 4-16 bytes. Such a spill is allowed, up to 16 bytes, only when ptxas run
#: on the same PTX without that flag spills nothing (checked for every spilling kernel): then it
#: is the register allocator's choice, not the kernel's block sizes or live values.
MAX_SPILL_BYTES = 0
MAX_SPILL_BYTES_REGALLOC2 = 16
REGALLOC_FLAG = "--regAllocOptLevel=2"
#: Triton 3.6 (the H100 machine's, 2026-11; bundled ptxas 12.8, no --regAllocOptLevel=2) spills in
#: four specializations of the full set that Triton 3.9 compiles without a spill, at 72-96
#: registers (far below the limits): the norm kernel with per-tensor norms on sm_80 (fp32 and fp64
#: order 2, fp16 order 3.5) stores 4 bytes and loads them twice, outside the element loop (one
#: value kept across the per-tensor reduction, once per program); the stats kernel for fp64 and a
#: general order on sm_90 stores 8 bytes (two constants of ``pow``) and loads them only on ``pow``'s
#: path for an infinite input. Triton 3.6's code generation, not its ptxas: ptxas 12.9 spills the
#: same on 3.6's PTX, and ptxas 12.8 spills nothing on 3.9's. Allowed there, up to 8 bytes stored
#: and 32 loaded; any other Triton is held to the limits above.
MAX_SPILL_BYTES_TRITON_3_6 = (8, 32)


# --- the grid of calls ------------------------------------------------------------------------


def _tensor(dtype: torch.dtype, n: int, aligned: bool) -> torch.Tensor:
    """A CPU tensor of ``n`` elements, its address 16-byte aligned or not (a view one element in)."""
    if aligned:
        return torch.zeros(n, dtype=dtype)
    return torch.zeros(n + 1, dtype=dtype)[1:]


def _scalar(dtype: torch.dtype, aligned: bool, value: float = 1.0) -> torch.Tensor:
    return _tensor(dtype, 1, aligned).fill_(value)


@dataclass(frozen=True)
class Call:
    """One call of a ``gradfuse::`` op: ``op`` its name, ``label`` what was chosen."""

    op: str
    label: str
    run: Callable[[], object] = field(compare=False, repr=False)


def _lists(quick: bool) -> list[tuple[str, list[torch.dtype]]]:
    """Dtype lists: one dtype each, and (full set) each with float64 mixed in, which makes the
    norm's total float64 for the other groups too."""
    singles = [(DTYPE_NAMES[d], [d]) for d in (F32, F64, F16, BF16)]
    if quick:
        return singles
    return singles + [(f"{DTYPE_NAMES[d]}+fp64", [d, F64]) for d in (F32, F16, BF16)]


def _sizes(quick: bool, chunk: int) -> dict[str, list[int]]:
    """Tensor sizes per list structure ("tensors x chunks"). The norm kernel takes the tensor and
    chunk counts as integer arguments, which a Triton that specializes integers compiles apart
    (``== 1`` a constant, a multiple of 16 an attribute; Triton 3.9 specializes neither, and these
    collapse into one): the full set has each combination, the quick set three tensors of one
    chunk each."""
    base = {"3x1": [5, 5, 5]}
    if quick:
        return base
    return base | {
        "1x1": [5],
        "1x3": [2 * chunk + 5],
        "1x16": [15 * chunk + 5],
        "3x16": [5, 5, 14 * chunk + 5],
        "16x16": [5] * 16,
        "16x17": [5] * 15 + [chunk + 5],
    }


def calls(quick: bool) -> dict[str, list[Call]]:
    """Op name -> its calls. The full set: for the norm-based ops, every dtype list x alignment x
    order on three tensors, plus every list structure x order on aligned float32; for the others
    every dtype (pair) x alignment x flag; scalars (scale, inv_scale, found_inf, total_norm) both
    aligned and not. The quick set: aligned groups, single dtypes (every pair for accumulate_,
    alpha 1), four orders, aligned float32 scalars."""
    from gradfuse.kernels import _chunk_table as ct

    ops = torch.ops.gradfuse
    out: dict[str, list[Call]] = {}
    aligns = (True,) if quick else (True, False)
    orders = ORDERS_QUICK if quick else ORDERS_FULL
    sizes = _sizes(quick, ct.CHUNK)

    def add(op: str, label: str, fn: Callable[[], object]) -> None:
        out.setdefault(op, []).append(Call(op, label, fn))

    def tensors(dtypes, n, aligned):
        return [_tensor(dtypes[i % len(dtypes)], k, aligned) for i, k in enumerate(n)]

    # Norm-based ops, one structure x every dtype list, alignment and order; then every structure.
    norm_cases = [(name, dts, "3x1", a) for name, dts in _lists(quick) for a in aligns]
    norm_cases += [("fp32", [F32], s, True) for s in sizes if s != "3x1"]
    for (name, dts, s, a), p in itertools.product(norm_cases, orders):
        n = sizes[s]
        tag = f"{name} {'aligned' if a else 'unaligned'} {s} p={p:g}"

        def args(dts=dts, n=n, a=a):
            return tensors(dts, n, a)

        for per in (False, True):
            add(
                "multi_tensor_norm",
                f"{tag} per_tensor={per}",
                lambda p=p, per=per, args=args: ops.multi_tensor_norm(args(), p, per),
            )
        add("clip_grad_norm_", tag, lambda p=p, args=args: ops.clip_grad_norm_(args(), 1.0, p, False))
        add("unscale_check_norm", tag, lambda p=p, args=args: ops.unscale_check_norm(args(), _scalar(F32, True), p))
        add(
            "unscale_and_clip_",
            tag,
            lambda p=p, args=args: ops.unscale_and_clip_(args(), _scalar(F32, True), _scalar(F32, True, 0.0), 1.0, p),
        )
        add("multi_tensor_stats", tag, lambda p=p, args=args: ops.multi_tensor_stats(args(), p))
        add(
            "unscale_norm_",
            tag,
            lambda p=p, args=args: ops.unscale_norm_(args(), _scalar(F32, True), _scalar(F32, True, 0.0), p),
        )

    # Scalars out of alignment (a view), on aligned float32 at order 2.
    if not quick:
        g = [_tensor(F32, 5, True) for _ in range(3)]
        add("unscale_check_norm", "unaligned inv_scale", lambda: ops.unscale_check_norm(g, _scalar(F32, False), 2.0))
        add(
            "unscale_and_clip_",
            "unaligned inv_scale, found_inf",
            lambda: ops.unscale_and_clip_(g, _scalar(F32, False), _scalar(F32, False, 0.0), 1.0, 2.0),
        )
        add(
            "unscale_and_check_",
            "unaligned inv_scale, found_inf",
            lambda: ops.unscale_and_check_(g, _scalar(F32, False), _scalar(F32, False, 0.0)),
        )

    # Element-wise ops: every dtype x alignment; the scale factor and total norm in every dtype.
    for d, a in itertools.product((F32, F64, F16, BF16), aligns):
        tag = f"{DTYPE_NAMES[d]} {'aligned' if a else 'unaligned'}"
        for fd in (F32, F64, F16, BF16) if not quick else (F32,):
            for sa in aligns:
                extra = "" if sa else " (unaligned scalar)"
                add(
                    "multi_tensor_scale_",
                    f"{tag} scale {DTYPE_NAMES[fd]}{extra}",
                    lambda d=d, a=a, fd=fd, sa=sa: ops.multi_tensor_scale_([_tensor(d, 5, a)], _scalar(fd, sa, 0.5)),
                )
                add(
                    "clip_grads_with_norm_",
                    f"{tag} total_norm {DTYPE_NAMES[fd]}{extra}",
                    lambda d=d, a=a, fd=fd, sa=sa: ops.clip_grads_with_norm_(
                        [_tensor(d, 5, a)], 1.0, _scalar(fd, sa, 2.0)
                    ),
                )
        add(
            "unscale_and_check_",
            tag,
            lambda d=d, a=a: ops.unscale_and_check_(
                [_tensor(d, 5, a)], _scalar(F32, True, 0.5), _scalar(F32, True, 0.0)
            ),
        )
        add("clamp_", tag, lambda d=d, a=a: ops.clamp_([_tensor(d, 5, a)], -1.0, 1.0))
        # AGC's two passes: per-unit norms (its order 2, every order in the full set), per-unit scale;
        # units of 8 elements keep every unit 16-byte aligned when the tensor is.
        for p in (2.0,) if quick else orders:
            add(
                "unit_norms",
                f"{tag} 2 units p={p:g}",
                lambda d=d, a=a, p=p: ops.unit_norms([_tensor(d, 16, a), _tensor(d, 8, a)], [2, 1], p),
            )
        for fd in (F32,) if quick else (F32, F64):
            add(
                "scale_units_",
                f"{tag} factors {DTYPE_NAMES[fd]}",
                lambda d=d, a=a, fd=fd: ops.scale_units_(
                    [_tensor(d, 16, a), _tensor(d, 8, a)], [2, 1], torch.ones(3, dtype=fd)
                ),
            )
        # accumulate_: every (dst, src) pair, alpha 1 (no multiply) and not; both sides aligned or not.
        for s, alpha in itertools.product((F32, F64, F16, BF16), (1.0,) if quick else (1.0, 0.5)):
            add(
                "accumulate_",
                f"{DTYPE_NAMES[d]} += {DTYPE_NAMES[s]} {'aligned' if a else 'unaligned'} alpha={alpha:g}",
                lambda d=d, s=s, a=a, alpha=alpha: ops.accumulate_([_tensor(d, 5, a)], [_tensor(s, 5, a)], alpha),
            )
    # GradScaler's inverse scale (one launch of its own, not an op): its three scalars aligned or not.
    from gradfuse.kernels import _unscale

    for a in aligns:
        add(
            "inverse_scale",
            "aligned" if a else "unaligned",
            lambda a=a: _unscale.inverse_scale(_scalar(F32, a, 2.0), _scalar(F32, a), _scalar(F32, a, 0.0)),
        )
    return out


def registered_ops() -> set[str]:
    """The ``gradfuse::`` op names (without the namespace) registered in this process."""
    import gradfuse.ops

    try:
        names = torch._C._dispatch_get_all_op_names()
    except AttributeError:  # an older torch: the library object's own list
        names = gradfuse.ops._LIB._op_defs
    return {n.split("::", 1)[1] for n in names if n.startswith("gradfuse::")}


# --- recording the launches ----------------------------------------------------------------


class _TargetOnlyDriver:
    """Stands in for Triton's CUDA driver while launches are recorded: names the target to
    specialize for, and a device number of its own per target (Triton keeps its per-device
    binders apart by it). No launch reaches it: the cache hook cancels each compile first."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = arch

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@dataclass
class Spec:
    """One specialization of one kernel for one target, as Triton's launch path computed it."""

    module: str
    kernel: str
    target: str
    signature: dict  # parameter name -> Triton type ("*fp32", "i32", "constexpr")
    constexprs: dict  # (parameter index,) -> value
    attrs: dict  # (parameter index,) -> [["tt.divisibility", 16], ...]
    options: dict  # compile options (num_warps, enable_fp_fusion, ...)
    calls: list = field(default_factory=list)  # labels of the op calls that produced it

    def describe(self, varying: set[str] | None = None) -> str:
        """The specialization in words: constexprs, integer and alignment specializations and
        pointer types, limited to the parameters in ``varying`` when given."""
        from gradfuse._plan import DTYPE_CODES

        code_names = {code: DTYPE_NAMES[d] for d, code in DTYPE_CODES.items() if d in DTYPE_NAMES}
        names = list(self.signature)
        parts = []
        for i, name in enumerate(names):
            if varying is not None and name not in varying:
                continue
            ty = self.signature[name]
            if (i,) in self.constexprs:
                value = self.constexprs[(i,)]
                if name.endswith("CODE") and value in code_names:
                    value = code_names[value]
                parts.append(f"{name}={value}" if ty == "constexpr" else f"{name}=={value}")
            elif ty.startswith("*"):
                aligned = any(a[0] == "tt.divisibility" for a in self.attrs.get((i,), []))
                parts.append(f"{name}:{ty}{'' if aligned else ' unaligned'}")
            else:
                div = any(a[0] == "tt.divisibility" for a in self.attrs.get((i,), []))
                parts.append(f"{name}%16==0" if div else f"{name}:{ty}")
        return " ".join(parts)

    def facets(self) -> dict[str, str]:
        """Per parameter, what this specialization fixed about it (for finding what varies)."""
        return {name: self.describe({name}) for name in self.signature}


def record(quick: bool, targets: list[str], only: list[str] | None = None) -> tuple[list[Spec], list[str]]:
    """The distinct specializations the ops' calls produce for each target (of the ops in ``only``
    when given), and the calls that raised (as messages)."""
    from triton import knobs
    from triton.runtime import driver

    import gradfuse  # noqa: F401  (registers the ops)

    os.environ["GRADFUSE_BACKEND"] = "triton"
    specs: dict[tuple, Spec] = {}
    errors: list[str] = []
    current: list = [None, None]  # target name, call label

    def hook(*, key, fn, compile, **_):
        target, label = current
        k = (target, str(key))
        if k not in specs:
            info = json.loads(compile["specialization_data"]) if "specialization_data" in compile else {}
            jit = getattr(fn, "jit_function", None)
            specs[k] = Spec(
                module=getattr(jit, "module", None) or fn.module,
                kernel=fn.name,
                target=target,
                signature=dict(compile["signature"]),
                constexprs=dict(compile["constants"]),
                attrs=dict(compile["configs"][0]),
                options={k: tuple(v) if isinstance(v, list) else v for k, v in info.get("options", {}).items()}
                or {"num_warps": compile["num_warps"], "enable_fp_fusion": compile["enable_fp_fusion"]},
            )
        specs[k].calls.append(label)
        return True  # compiled later, per target, in worker processes

    grid = calls(quick)
    missing = registered_ops() - set(grid)
    if missing:
        errors.append(f"ops with no calls in the grid (add them to calls()): {sorted(missing)}")
    if only:
        unknown = set(only) - set(grid)
        if unknown:
            raise ValueError(f"--ops: no such op {sorted(unknown)}; the ops are {sorted(grid)}")
        grid = {op: grid[op] for op in only}
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        for target in targets:
            driver.set_active(_TargetOnlyDriver(TARGETS[target]))
            for call in itertools.chain.from_iterable(grid.values()):
                current[:] = [target, f"{call.op}({call.label})"]
                try:
                    call.run()
                except Exception as err:  # a launcher that fails to launch is a finding too
                    errors.append(f"{target} {call.op}({call.label}): {type(err).__name__}: {err}")
            current[:] = [target, "control"]
            _control_kernel[(1,)](
                torch.zeros(256), torch.ones(256), torch.zeros(768, dtype=F16), BLOCK=256, enable_fp_fusion=False
            )
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(specs.values()), errors


@triton.jit
def _control_kernel(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    """A kernel that breaks the rules on purpose, compiled with the others: a float64 value
    stored straight into float16 and bfloat16, and a plain float32 division (approximate). The
    checks must find both, or they could not find them in gradfuse's kernels either."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    tl.store(out_ptr + offs, (x.to(tl.float64) * 3.0).to(tl.float16))
    tl.store(out_ptr + BLOCK + offs, (x.to(tl.float64) * 5.0).to(tl.bfloat16).to(tl.float16))
    tl.store(out_ptr + 2 * BLOCK + offs, (x / y).to(tl.float16))


# --- compiling and reading the result --------------------------------------------------------


@dataclass
class Result:
    kernel: str
    target: str
    spec: str  # Spec.describe(): the whole specialization
    calls: list
    constexprs: dict  # parameter name -> value
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    shared: int | None = None
    regalloc2: bool = False  # ptxas ran with --regAllocOptLevel=2 (Triton's flag)
    spill_stores_without_flag: int | None = None  # spilled bytes of ptxas on the same PTX without it
    seconds: float = 0.0
    error: str | None = None
    f64_to_16bit_ptx: list = field(default_factory=list)  # direct conversions found
    f64_to_16bit_sass: list = field(default_factory=list)
    approx_div: list = field(default_factory=list)
    v128_loads: int = 0
    v128_stores: int = 0
    varying: str = ""  # the part of spec that differs between this kernel's specializations
    triton: str = ""  # the Triton version that compiled it


_PTX_F64_TO_16 = re.compile(r"\bcvt(?:\.\w+)*\.b?f16(?:x2)?\.f64\b")
_SASS_F64_TO_16 = re.compile(r"\bF2F(?:\.\w+)*\.B?F16(?:_V2)?\.F64\b")
_PTX_APPROX_DIV = re.compile(r"\bdiv\.(?:approx|full)(?:\.ftz)?\.f32\b")
# 128-bit global accesses: four 32-bit, two 64-bit or eight 16-bit lanes.
_V128 = r"(?:\.\w+)*\.(?:v4\.[bfus]32|v2\.[bfus]64|v8\.[bf]16)\b"
_PTX_V128_LOAD = re.compile(r"\bld\.global" + _V128)
_PTX_V128_STORE = re.compile(r"\bst\.global" + _V128)
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _sass(cubin: bytes) -> str:
    """The SASS of a cubin, by the cuobjdump Triton bundles ('' when it is not there)."""
    try:
        from triton import knobs

        tool = knobs.nvidia.cuobjdump.path
    except Exception:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=False)
    return done.stdout


def compile_spec(spec: Spec) -> Result:
    """Compiles one specialization (in a worker process) and reads its code and resources."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(spec.signature)
    result = Result(
        kernel=spec.kernel,
        target=spec.target,
        spec=spec.describe(),
        calls=spec.calls[:3] + ([f"... {len(spec.calls) - 3} more"] if len(spec.calls) > 3 else []),
        constexprs={names[path[0]]: _plain(v) for path, v in spec.constexprs.items()},
        triton=triton.__version__,
    )
    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        knobs.nvidia.dump_ptxas_log = True  # ptxas's -v report, printed by Triton after its run
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                ASTSource(fn, spec.signature, spec.constexprs, spec.attrs),
                target=GPUTarget("cuda", TARGETS[spec.target], 32),
                options=spec.options,
            )
    except Exception as err:
        result.error = f"{type(err).__name__}: {err}"[:4000]
        return result
    finally:
        result.seconds = time.perf_counter() - start
    result.regalloc2 = REGALLOC_FLAG.lstrip("-") in _compiler_source()
    ptx = kernel.asm["ptx"]
    text = log.getvalue()
    regs, spills = _PTXAS_REGS.search(text), _PTXAS_SPILLS.search(text)
    if regs and spills:  # the report of Triton's own ptxas run
        report = (int(regs.group(1)), *map(int, spills.groups()))
    else:  # a Triton without TRITON_DUMP_PTXAS_LOG: the same ptxas again, with -v
        report = _ptxas_report(ptx, spec, [REGALLOC_FLAG] if result.regalloc2 else [])
    if report:
        result.registers, result.stack, result.spill_stores, result.spill_loads = report
    result.shared = int(getattr(kernel.metadata, "shared", 0) or 0)
    result.f64_to_16bit_ptx = sorted(set(_PTX_F64_TO_16.findall(ptx)))
    result.approx_div = sorted(set(_PTX_APPROX_DIV.findall(ptx)))
    result.v128_loads = len(_PTX_V128_LOAD.findall(ptx))
    result.v128_stores = len(_PTX_V128_STORE.findall(ptx))
    result.f64_to_16bit_sass = sorted(set(_SASS_F64_TO_16.findall(_sass(kernel.asm["cubin"]))))
    if result.regalloc2 and (result.spill_stores or result.spill_loads):
        without = _ptxas_report(ptx, spec, [])
        result.spill_stores_without_flag = None if without is None else max(without[2], without[3])
    return result


def _ptxas_report(ptx: str, spec: Spec, flags: list[str]) -> tuple[int, int, int, int] | None:
    """``(registers, stack, spill stores, spill loads)`` of the target's ptxas (Triton's bundled
    one) run on ``ptx`` with Triton's usual flags plus ``flags``; None when it cannot be run."""
    try:
        from triton.backends.nvidia import compiler as nv

        arch = TARGETS[spec.target]
        try:
            ptxas = nv.get_ptxas(arch).path
        except TypeError:  # Triton < 3.8: one ptxas for every target
            ptxas = nv.get_ptxas().path
        fmad = [] if spec.options.get("enable_fp_fusion", True) else ["--fmad=false"]
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            cmd = [ptxas, "-lineinfo", *fmad, "-v", *flags, f"--gpu-name={nv.sm_arch_from_capability(arch)}", src]
            done = subprocess.run([*cmd, "-o", src + ".o"], capture_output=True, text=True, check=True)
    except Exception:  # another Triton layout: no report
        return None
    text = done.stderr + done.stdout
    regs, spills = _PTXAS_REGS.search(text), _PTXAS_SPILLS.search(text)
    if not (regs and spills):
        return None
    return (int(regs.group(1)), *map(int, spills.groups()))


_COMPILER_SOURCE: list[str] = []


def _compiler_source() -> str:
    """The NVIDIA backend's source, to see which ptxas flags this Triton passes."""
    if not _COMPILER_SOURCE:
        try:
            import triton.backends.nvidia.compiler as nv

            with open(nv.__file__) as f:
                _COMPILER_SOURCE.append(f.read())
        except Exception:
            _COMPILER_SOURCE.append("")
    return _COMPILER_SOURCE[0]


def _plain(v):
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


# --- rules -----------------------------------------------------------------------------------


def _is_control(r: Result) -> bool:
    return r.kernel == "_control_kernel"


def rule_compiles(r: Result) -> list[str]:
    return [f"does not compile: {r.error}"] if r.error else []


def rule_no_direct_f64_to_16bit(r: Result) -> list[str]:
    """torch and the Rust core round float64 -> float16/bfloat16 through float32; a direct
    conversion rounds once and gives another value near 16-bit midpoints."""
    found = r.f64_to_16bit_ptx + r.f64_to_16bit_sass
    return [f"direct float64 -> 16-bit conversion: {', '.join(found)}"] if found else []


def rule_no_approx_f32_division(r: Result) -> list[str]:
    """torch divides exactly (the clip coefficient, ``max_norm / (norm + 1e-6)``)."""
    return [f"approximate float32 division: {', '.join(r.approx_div)}"] if r.approx_div else []


def rule_aligned_groups_load_128_bits(r: Result) -> list[str]:
    """A group whose addresses are 16-byte aligned (``ALIGNED``) must read them 16 bytes at a time."""
    if r.constexprs.get("ALIGNED") is True and r.v128_loads == 0:
        return ["an aligned group without 128-bit global loads"]
    return []


def register_limit(r: Result) -> int:
    if r.constexprs.get("KIND") != 5:
        return MAX_REGISTERS
    return MAX_REGISTERS_F64_POW if r.constexprs.get("CODE") == 1 else MAX_REGISTERS_POW


def spill_limit(r: Result) -> tuple[int, int]:
    """(bytes stored, bytes loaded) that ``r`` may spill (see the limits above)."""
    if r.regalloc2 and r.spill_stores_without_flag == 0:
        return MAX_SPILL_BYTES_REGALLOC2, MAX_SPILL_BYTES_REGALLOC2
    if re.match(r"3\.6\.", r.triton):
        return MAX_SPILL_BYTES_TRITON_3_6
    return MAX_SPILL_BYTES, MAX_SPILL_BYTES


def rule_registers_and_spills(r: Result) -> list[str]:
    if r.error:
        return []
    if r.registers is None or r.spill_stores is None:
        return ["no ptxas report of registers and spills"]
    out = []
    if r.registers > register_limit(r):
        out.append(f"{r.registers} registers (limit {register_limit(r)})")
    stores, loads = spill_limit(r)
    if r.spill_stores > stores or r.spill_loads > loads:
        limit = str(stores) if stores == loads else f"{stores} stored, {loads} loaded"
        out.append(f"spills {r.spill_stores} bytes stored, {r.spill_loads} loaded (limit {limit})")
    return out


RULES = {
    "compiles": rule_compiles,
    "no_direct_f64_to_16bit": rule_no_direct_f64_to_16bit,
    "no_approx_f32_division": rule_no_approx_f32_division,
    "aligned_groups_load_128_bits": rule_aligned_groups_load_128_bits,
    "registers_and_spills": rule_registers_and_spills,
}


def violations(results: list[Result], rule: str) -> list[str]:
    """Messages of every gradfuse kernel result breaking ``rule`` (the control kernel excluded)."""
    check = RULES[rule]
    return [f"{r.kernel} {r.target} [{r.spec}]: {m}" for r in results if not _is_control(r) for m in check(r)]


# --- the run ---------------------------------------------------------------------------------


def run(quick: bool, targets: list[str], jobs: int, only: list[str] | None = None) -> dict:
    start = time.perf_counter()
    specs, record_errors = record(quick, targets, only)
    recorded = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as cache:
        # A fresh cache: every specialization really compiles (and ptxas reports on it).
        os.environ["TRITON_CACHE_DIR"] = cache
        if jobs > 1:
            import multiprocessing

            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                results = list(pool.map(compile_spec, specs, chunksize=4))
        else:
            results = [compile_spec(s) for s in specs]
    by_kernel: dict[tuple, list[tuple[Spec, Result]]] = {}
    for s, r in zip(specs, results, strict=True):
        by_kernel.setdefault(r.kernel, []).append((s, r))
    for pairs in by_kernel.values():
        facets = [s.facets() for s, _ in pairs]
        varying = {n for n in facets[0] if len({f[n] for f in facets}) > 1}
        for s, r in pairs:
            r.varying = s.describe(varying)
    return {
        "quick": quick,
        "targets": targets,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "record_errors": record_errors,
        "record_seconds": recorded,
        "seconds": time.perf_counter() - start,
        "results": [asdict(r) for r in results],
    }


def results_of(report: dict) -> list[Result]:
    return [Result(**r) for r in report["results"]]


def table(report: dict) -> str:
    rows = [("kernel", "specialization", "target", "regs", "spills st/ld", "smem", "s")]
    for r in sorted(results_of(report), key=lambda r: (r.kernel, r.varying, r.target)):
        spills = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        regs = "ERROR" if r.error else str(r.registers)
        rows.append((r.kernel, r.varying, r.target, regs, spills, str(r.shared), f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(report: dict) -> str:
    results = [r for r in results_of(report) if not _is_control(r)]
    lines = [
        f"Triton {report['triton']}, torch {report['torch']}: {'quick' if report['quick'] else 'full'} set, "
        f"{len(results)} compiles in {report['seconds']:.0f} s (recording {report['record_seconds']:.1f} s)"
    ]
    for target in report["targets"]:
        rs = [r for r in results if r.target == target and not r.error]
        if not rs:
            continue
        kernels = sorted({r.kernel for r in rs})
        per = ", ".join(f"{k.strip('_').removesuffix('_kernel')} {sum(r.kernel == k for r in rs)}" for k in kernels)
        regs = [r.registers for r in rs if r.registers is not None]
        spilling = sorted(r.spill_stores for r in rs if (r.spill_stores or 0) > 0)
        spill_text = f"{len(spilling)} spill ({spilling[0]}-{spilling[-1]} bytes)" if spilling else "none spill"
        lines.append(
            f"  {target}: {len(rs)} specializations ({per}); registers {min(regs)}-{max(regs)}; {spill_text}; "
            f"shared memory {min(r.shared for r in rs)}-{max(r.shared for r in rs)} bytes"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the CI set: aligned groups, four norm orders")
    parser.add_argument("--targets", default="sm_90,sm_80", help="comma-separated: sm_90, sm_80")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--ops", help="comma-separated op names: only their calls (default: every op)")
    parser.add_argument("--json", help="write the report (every result) here")
    parser.add_argument("--no-table", action="store_true", help="print the summary and violations only")
    args = parser.parse_args(argv)
    targets = args.targets.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"--targets: unknown {unknown}; choose from {sorted(TARGETS)}")
    report = run(args.quick, targets, max(1, args.jobs), args.ops.split(",") if args.ops else None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not args.no_table:
        print(table(report))
        print()
    print(summary(report))
    results = results_of(report)
    problems = list(report["record_errors"])
    for rule in RULES:
        problems += violations(results, rule)
    for p in problems:
        print("FAIL", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
