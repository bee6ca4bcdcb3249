"""The direct launch path of ``gradfuse.kernels._launch``, exercised without a GPU: run as a script
(``python tests/launch_scenarios.py``, compiled Triton, not the interpreter) by tests/test_launch.py.

Triton's JIT binds each launch to a specialization on a stand-in driver that names the target
(sm_90) and launches nothing (its compile hook records what it would compile and cancels); the
recorded specializations are then compiled for real, for sm_90, with Triton's bundled ptxas, and
handed to the launcher as if its first launch had compiled them. A stand-in in place of the
driver's launch call records what the launcher would pass. Prints one JSON object: each check's
name and whether it held (with details where it did not).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import driver

from gradfuse.kernels import ChunkTable, _launch, _scale
from gradfuse.kernels import _chunk_table as ct

TARGET = GPUTarget("cuda", 90, 32)
CHECKS: dict[str, object] = {}


def check(name: str, ok: bool, detail=None) -> None:
    CHECKS[name] = True if ok else {"failed": detail}


class TargetOnlyDriver:
    """Names the target to specialize for; nothing reaches it (the compile hook cancels)."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 90

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@triton.jit
def _probe_kernel(x_ptr, n, m, BLOCK: tl.constexpr):
    """A kernel whose integer ``n`` Triton specializes (equal to 1, divisible by 16) and whose
    ``m`` it does not."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x * m, mask=offs < n)


_probe_kernel_no_spec = triton.jit(_probe_kernel.fn, do_not_specialize=["m"])

RECORDED: list[dict] = []
LAUNCHED: list[tuple] = []


def hook(*, key, fn, compile, **_):
    RECORDED.append(compile)
    return True  # recorded, not compiled


def compile_recorded(fn, rec: dict):
    """The real sm_90 compile of a recorded specialization (as the JIT would have made it)."""
    return triton.compile(
        ASTSource(fn, rec["signature"], rec["constants"], rec["configs"][0]),
        target=TARGET,
        options={"num_warps": rec["num_warps"], "enable_fp_fusion": rec["enable_fp_fusion"]},
    )


def record_launch(compiled, grid, packed, device):
    LAUNCHED.append((compiled, grid, packed, device))


def first_launch(launcher, grid, args, meta, fn):
    """The launcher's first launch of a specialization: through the JIT (recorded, cancelled),
    then compiled for sm_90 and kept as the JIT's compiled kernel would be. Returns the key."""
    RECORDED.clear()
    assert launcher(grid, args, meta, device=0) is None  # the hook cancelled the compile
    key, _ = launcher.bind(args, meta, 0)
    (rec,) = RECORDED
    compiled = compile_recorded(fn, rec)
    ok = launcher._checked(key, compiled)
    launcher.compiled[key] = compiled if ok else None
    return key, compiled, ok


def packed_matches_signature(compiled, packed, pointers: dict) -> list[str]:
    """Problems of ``packed`` as the arguments of ``compiled``'s launcher (one per declared
    parameter, in order): constexpr slots hold their constants, pointers are the integer
    addresses of ``pointers`` (index -> tensor), integers fit their type."""
    signature = list(compiled.src.signature.items())
    problems = []
    if len(packed) != len(signature):
        return [f"{len(packed)} arguments for {len(signature)} parameters"]
    for i, ((name, ty), value) in enumerate(zip(signature, packed, strict=True)):
        if ty == "constexpr":
            if compiled.src.constants.get((i,)) != value:
                problems.append(f"{name}: constexpr {value!r} but compiled with {compiled.src.constants.get((i,))!r}")
        elif ty.startswith("*"):
            if type(value) is not int or (i in pointers and value != pointers[i].data_ptr()):
                problems.append(f"{name}: pointer passed as {value!r}")
        elif ty in ("i32", "i64", "u64"):
            bits = {"i32": 31, "i64": 63, "u64": 64}[ty]
            low = 0 if ty == "u64" else -(2**bits)
            if type(value) is not int or not low <= value < 2**bits:
                problems.append(f"{name}: {value!r} does not fit {ty}")
        elif ty == "fp32":
            if not isinstance(value, float):
                problems.append(f"{name}: {value!r} is not a float")
        else:
            problems.append(f"{name}: unexpected type {ty}")
    return problems


def scenario_scale_kernel():
    """gradfuse's scale kernel over a chunk table: the first launch compiles, the second with
    the same kinds of arguments launches directly with the arguments the compiled kernel's
    launcher takes; an unaligned factor, or an unaligned group, is not launched with it."""
    launcher = _launch.launcher(_scale._scale_kernel)
    tensors = [torch.zeros(40), torch.zeros(9)]
    table = ChunkTable(torch.device("cpu"), [[t.data_ptr() for t in tensors]], [40, 9], [bytes([0, 0])])
    (group,) = table.groups
    factor = torch.full((), 0.5)
    meta = dict(
        ALIGNED=group.aligned, CHUNK=ct.CHUNK, BLOCK=ct.BLOCK, VEC=ct.VEC, num_warps=ct.NUM_WARPS,
        enable_fp_fusion=False, CODE=0, MODE=_scale.SCALE, FACTOR_CODE=0,
    )  # fmt: skip
    args = (table.addr_args[0], *table.args[:3], factor, factor, group.base, 0, 0)
    key, compiled, ok = first_launch(launcher, group.count, args, meta, _scale._scale_kernel)
    check("scale: the key says what Triton compiled", ok)
    launcher(group.count, args, meta, 0)
    check("scale: the second launch is direct", len(LAUNCHED) == 1 and LAUNCHED[0][0] is compiled)
    pointers = {0: table.addrs[0], 1: table.numel, 2: table.chunk_tensor, 3: table.chunk_index, 4: factor, 5: factor}
    problems = packed_matches_signature(compiled, LAUNCHED[0][2], pointers) if LAUNCHED else ["no launch"]
    check("scale: the packed arguments match the compiled signature", not problems, problems)

    # A factor 4 bytes into its buffer: Triton specializes pointers on 16-byte alignment.
    unaligned = torch.zeros(2)[1:].fill_(0.5)
    before = len(LAUNCHED)
    RECORDED.clear()
    launcher(group.count, (*args[:4], unaligned, unaligned, *args[6:]), meta, 0)
    check(
        "scale: an unaligned factor after an aligned one is not launched with the aligned kernel",
        len(LAUNCHED) == before and len(RECORDED) == 1,
        (len(LAUNCHED) - before, len(RECORDED)),
    )
    other_key, _ = launcher.bind((*args[:4], unaligned, unaligned, *args[6:]), meta, 0)
    check("scale: its key differs", other_key != key)
    check("scale: and the aligned kernel fails the check against it", not launcher._checked(other_key, compiled))

    # Data tensors out of 16-byte alignment form a group of their own (ALIGNED=False).
    base = torch.zeros(41)
    moved = table.moved([[base[1:].data_ptr(), tensors[1].data_ptr()]])
    check("scale: a table whose tensor lost its 16-byte alignment is not moved", moved is None)

    # A launch hook (a profiler's) sends launches through the JIT, which calls it.
    before = len(LAUNCHED)
    RECORDED.clear()
    knobs.runtime.launch_enter_hook = lambda metadata: None
    try:
        launcher(group.count, args, meta, 0)
    finally:
        knobs.runtime.launch_enter_hook = None
    check("scale: with a launch hook set the launch goes through the JIT", len(LAUNCHED) == before)


def scenario_specialized_integers():
    """Integers Triton specializes: equal to 1 (a constant), divisible by 16, other; each a key
    of its own, each key checked against its own compile, and never against another's."""
    launcher = _launch.launcher(_probe_kernel)
    x = torch.zeros(64)
    meta = {"BLOCK": 64, "num_warps": 4, "enable_fp_fusion": False}
    compiled = {}
    for n in (1, 16, 17, 2**31 + 5):
        key, kernel, ok = first_launch(launcher, 1, (x, n, 3), meta, _probe_kernel)
        compiled[n] = (key, kernel)
        check(f"integers: n={n} checked against its own compile", ok)
    for a in compiled:
        for b in compiled:
            if a != b:
                wrong = launcher._checked(compiled[a][0], compiled[b][1])
                check(f"integers: the kernel for n={b} is refused for the key of n={a}", not wrong)
    key_33, _ = launcher.bind((x, 33, 3), meta, 0)
    check("integers: n=33 has the key of n=17 (same specialization)", key_33 == compiled[17][0])
    before = len(LAUNCHED)
    launcher(1, (x, 33, 3), meta, 0)
    ok = len(LAUNCHED) == before + 1 and LAUNCHED[-1][0] is compiled[17][1] and LAUNCHED[-1][2][1] == 33
    check("integers: n=33 launches the n=17 kernel directly, with 33", ok)

    # A prepared launch with n in a slot takes, per call, the kernel of n's own specialization.
    prepared = _launch.Prepared(launcher, 1, (_launch.Ptr(x), ct.SLOT, 3), meta, 0)
    for n, like in ((17, 17), (33, 17), (32, 16), (1, 1), (49, 17), (16, 16)):
        before = len(LAUNCHED)
        prepared(n)
        ok = len(LAUNCHED) == before + 1 and LAUNCHED[-1][0] is compiled[like][1] and LAUNCHED[-1][2][1] == n
        check(f"integers: a prepared launch with n={n} launches the n={like} kernel, with {n}", ok)

    unspecialized = _launch.launcher(_probe_kernel_no_spec)
    key_m1, _, ok = first_launch(unspecialized, 1, (x, 17, 1), meta, _probe_kernel_no_spec)
    check("integers: a do_not_specialize integer equal to 1 is no constant", ok)
    key_m16, _ = unspecialized.bind((x, 17, 16), meta, 0)
    check("integers: nor does divisibility by 16 make another key", key_m16 == key_m1)


def scenario_prepared_launch():
    """A prepared launch (what ``ct.run`` makes per table): the table's arguments bound once, each
    call's own at the call. Its direct launches pass what the launcher's own would, under the same
    key rules; a call whose own arguments need another specialization is not launched with this
    one, nor is any call once the kept specializations are cleared."""
    launcher = _launch.launcher(_scale._scale_kernel)
    tensors = [torch.zeros(40), torch.zeros(9)]
    table = ChunkTable(torch.device("cpu"), [[t.data_ptr() for t in tensors]], [40, 9], [bytes([0, 0])])
    (group,) = table.groups
    meta = ct._meta(group, False, {"CODE": 0, "MODE": _scale.CLIP, "FACTOR_CODE": 0})
    fixed = (table.addr_args[0], *table.args[:3], ct.SLOT, ct.SLOT, group.base, ct.SLOT, ct.f64_bits(1e-6))
    prepared = _launch.Prepared(launcher, group.count, fixed, meta, 0)
    factor = torch.full((), 0.5)
    values = (factor, factor, ct.f64_bits(1.0))
    _, compiled, ok = first_launch(launcher, group.count, prepared._args(values), meta, _scale._scale_kernel)
    check("prepared: the key of its arguments says what Triton compiled", ok)

    before = len(LAUNCHED)
    prepared(*values)  # the launcher's direct launch, which the prepared launch then keeps
    other = torch.full((), 0.25)
    values = (other, other, ct.f64_bits(2.0))
    direct = launcher.direct
    prepared(*values)
    ok = len(LAUNCHED) == before + 2 and LAUNCHED[-1][0] is compiled and launcher.direct == direct + 1
    check("prepared: a later call with other arguments of the same kinds launches directly", ok)
    want = launcher.bind(prepared._args(values), meta, 0)[1] if LAUNCHED else None
    check("prepared: it passes what the launcher's own launch would", LAUNCHED and LAUNCHED[-1][2] == want)
    pointers = {0: table.addrs[0], 1: table.numel, 2: table.chunk_tensor, 3: table.chunk_index, 4: other, 5: other}
    problems = packed_matches_signature(compiled, LAUNCHED[-1][2], pointers) if LAUNCHED else ["no launch"]
    check("prepared: the packed arguments match the compiled signature", not problems, problems)

    for name, odd in (
        ("an unaligned factor after aligned ones", torch.zeros(2)[1:].fill_(0.5)),
        ("a float64 factor after float32 ones", torch.full((), 0.5, dtype=torch.float64)),  # aligned too
    ):
        before = len(LAUNCHED)
        RECORDED.clear()
        prepared(odd, odd, ct.f64_bits(1.0))
        check(
            f"prepared: {name} is not launched with their kernel",
            len(LAUNCHED) == before and len(RECORDED) == 1,
            (len(LAUNCHED) - before, len(RECORDED)),
        )
    before = len(LAUNCHED)
    prepared(factor, factor, ct.f64_bits(1.1))  # max_norm_bits is not specialized: any value
    ok = len(LAUNCHED) == before + 1 and LAUNCHED[-1][0] is compiled and LAUNCHED[-1][2][7] == ct.f64_bits(1.1)
    check("prepared: another value of an unspecialized integer launches directly, with that value", ok)

    for name, bad in (
        (
            "a tensor among the fixed arguments",
            lambda: _launch.Prepared(launcher, 1, (tensors[0], *fixed[1:]), meta, 0),
        ),
        ("a call with too few values", lambda: prepared(factor, factor)),
    ):
        try:
            bad()
        except TypeError:
            check(f"prepared: {name} raises", True)
        else:
            check(f"prepared: {name} raises", False, "no TypeError")

    # Moved to a table of the same tensors at other addresses: launched directly, on the new ones.
    others = [torch.zeros(40), torch.zeros(9)]
    moved_table = table.moved([[t.data_ptr() for t in others]])
    replace = {id(table.addr_args[0]): moved_table.addr_args[0]}
    allowed = {id(p) for p in (*moved_table.args, *moved_table.addr_args)}
    moved = prepared.moved(replace, allowed)
    before = len(LAUNCHED)
    if moved is not None:
        moved(*values)
    ok = moved is not None and len(LAUNCHED) == before + 1 and LAUNCHED[-1][0] is compiled
    check("prepared: moved to another table it launches directly", ok)
    want = launcher.bind(moved._args(values), meta, 0)[1] if ok else None
    ok = ok and LAUNCHED[-1][2] == want and LAUNCHED[-1][2][0] == moved_table.addrs[0].data_ptr()
    check("prepared: moved, it passes the new table's addresses", ok)

    # Last: clearing forgets every kept specialization, the launchers' and the prepared launches'.
    _launch.clear()
    before = len(LAUNCHED)
    RECORDED.clear()
    prepared(*values)
    check(
        "prepared: after clear() a call goes through the JIT again",
        len(LAUNCHED) == before and len(RECORDED) == 1,
        (len(LAUNCHED) - before, len(RECORDED)),
    )


def main() -> None:
    driver.set_active(TargetOnlyDriver())
    knobs.runtime.jit_cache_hook = hook
    _launch.launch = record_launch
    check("this Triton's launch call is known", _launch._SHAPE_KNOWN)
    scenario_scale_kernel()
    scenario_specialized_integers()
    scenario_prepared_launch()
    json.dump({"triton": triton.__version__, "checks": CHECKS}, sys.stdout)


if __name__ == "__main__":
    main()
