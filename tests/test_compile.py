"""The Triton kernels compiled for sm_90 (H100/H200) and sm_80 (A100) without a GPU, and what the
compiled code must show (``tests/kernel_compile.py`` records the launchers' specializations,
compiles them and reads PTX, SASS and ptxas's report; see its docstring for how and why).

CI compiles the quick set (aligned groups, every dtype and accumulate pair, four norm orders: about
200 compiles, ~1.5 minutes on 2 cores); ``GRADFUSE_COMPILE_ALL=1`` compiles the full set here, and
``make gpu-compile`` runs the full set and prints the table. A compile error, a launcher call
that fails, or a broken rule fails a test naming the kernel, target and specialization.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

kc = pytest.importorskip("kernel_compile")
pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (bundled ptxas) is needed")

pytestmark = pytest.mark.compile

SCRIPT = Path(kc.__file__)
FULL = os.environ.get("GRADFUSE_COMPILE_ALL", "") not in ("", "0")
#: The quick set takes ~1.5 min on 2 idle cores; the bound leaves room for a loaded CI machine.
TIMEOUT_S = 3600 if FULL else 900


def _triton_has_knobs() -> bool:
    try:
        from triton import knobs  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if not _triton_has_knobs():
        pytest.skip("needs Triton >= 3.4 (triton.knobs: the JIT cache hook that records the launches)")
    out = tmp_path_factory.mktemp("compile") / "report.json"
    cmd = [sys.executable, str(SCRIPT), "--json", str(out), "--no-table", *([] if FULL else ["--quick"])]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if not out.exists():  # the script itself failed (a failed rule still writes the report)
        pytest.fail(f"{' '.join(cmd)} wrote no report (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    print(done.stdout)  # the summary, shown with -s or on failure
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(report) -> list:
    return kc.results_of(report)


def gradfuse_kernels() -> set[str]:
    """The launched kernels of ``gradfuse.kernels``: every ``_*_kernel`` of its modules."""
    import importlib
    import pkgutil

    import gradfuse.kernels as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names |= {n for n, obj in vars(module).items() if n.endswith("_kernel") and hasattr(obj, "fn")}
    return names


def test_every_op_call_launches(report):
    """Every registered ``gradfuse::`` op has calls in the grid, and every call reached its
    kernels' launch (a launcher that raises for some input is a finding too)."""
    assert report["record_errors"] == []


def test_every_kernel_and_both_targets_are_compiled(results):
    assert {r.kernel for r in results} == gradfuse_kernels() | {"_control_kernel"}
    for kernel in gradfuse_kernels():
        targets = {r.target for r in results if r.kernel == kernel}
        assert targets == set(kc.TARGETS), kernel


#: Kernels that never read the gradients, so have no ALIGNED specialization: the one that reads
#: only the per-program partials another kernel wrote (gradfuse's own float32/int64 scratch, always
#: aligned), and GradScaler's inverse scale (three scalars).
PARTIALS_ONLY = frozenset({"_stats_finish_kernel", "_inverse_scale_kernel"})


def test_the_grid_reaches_every_dtype_order_and_flag(results, report):
    """What the launchers chose, seen from the kernels' side: every storage dtype (every pair for
    accumulate_), the norm kinds of the set's orders, both alignments in the full set, and every
    flag value of the norm kernel."""
    seen: dict[tuple[str, str], set] = {}
    for r in results:
        for name, value in r.constexprs.items():
            seen.setdefault((r.kernel, name), set()).add(value)
    for kernel in ("_norm_kernel", "_scale_kernel", "_unscale_kernel", "_clamp_kernel"):
        assert seen[(kernel, "CODE")] == {0, 1, 2, 3}, kernel
    pairs = {(r.constexprs["DST_CODE"], r.constexprs["SRC_CODE"]) for r in results if r.kernel == "_accumulate_kernel"}
    assert pairs == {(d, s) for d in range(4) for s in range(4)}
    from gradfuse.kernels._norm import norm_kind

    orders = kc.ORDERS_QUICK if report["quick"] else kc.ORDERS_FULL
    assert seen[("_norm_kernel", "KIND")] == {norm_kind(p) for p in orders}
    assert seen[("_norm_kernel", "FOUND")] == {0, 1, 2}
    assert seen[("_norm_kernel", "PER_TENSOR")] == seen[("_norm_kernel", "WRITE_PER")] == {False, True}
    assert seen[("_scale_kernel", "MODE")] == {0, 1, 2}
    aligned = {True} if report["quick"] else {True, False}
    for kernel in gradfuse_kernels() - PARTIALS_ONLY:
        assert seen[(kernel, "ALIGNED")] == aligned, kernel


def test_the_checks_find_what_they_look_for(results):
    """The control kernel (a float64 value stored straight into float16 and bfloat16, a plain
    float32 division) compiled by the same path: the rules flag it on both targets. sm_80 has no
    direct float64 -> bfloat16 instruction (it goes through float32); sm_90 has one."""
    control = {r.target: r for r in results if r.kernel == "_control_kernel"}
    assert set(control) == set(kc.TARGETS)
    for target, r in control.items():
        assert "cvt.rn.f16.f64" in r.f64_to_16bit_ptx and "F2F.F16.F64" in r.f64_to_16bit_sass, target
        assert kc.rule_no_direct_f64_to_16bit(r) and kc.rule_no_approx_f32_division(r), target
    assert "cvt.rn.bf16.f64" in control["sm_90"].f64_to_16bit_ptx


@pytest.mark.parametrize("rule", list(kc.RULES))
def test_compiled_code_keeps_the_rule(results, rule):
    """Each rule of ``kernel_compile.RULES`` over every compiled specialization: it compiles; no
    direct float64 -> 16-bit conversion (PTX ``cvt.rn.f16.f64``/``cvt.rn.bf16.f64``, SASS
    ``F2F.F16.F64``); no approximate float32 division; 128-bit loads for aligned groups;
    registers and spills within the limits stated (and explained) in kernel_compile.py."""
    found = kc.violations(results, rule)
    assert not found, f"{len(found)} violations:\n" + "\n".join(found[:20])


def test_float64_into_16_bits_compiles_through_float32(results):
    """The rounding fix, in the compiled code: accumulate_'s float64 -> float16/bfloat16 pairs on
    both targets convert float64 -> float32 -> 16 bits, never directly."""
    pairs = [
        r
        for r in results
        if r.kernel == "_accumulate_kernel" and r.constexprs["SRC_CODE"] == 1 and r.constexprs["DST_CODE"] in (2, 3)
    ]
    assert {(r.target, r.constexprs["DST_CODE"]) for r in pairs} == {(t, c) for t in kc.TARGETS for c in (2, 3)}
    assert all(not r.error and not r.f64_to_16bit_ptx and not r.f64_to_16bit_sass for r in pairs)


# --- the limits themselves, on made-up results (no compile) ---------------------------------


def made_up(**kw) -> kc.Result:
    base = dict(kernel="_norm_kernel", target="sm_90", spec="", calls=[], constexprs={"KIND": 2, "CODE": 0})
    return kc.Result(**(base | {"registers": 40, "spill_stores": 0, "spill_loads": 0} | kw))


def test_spills_are_allowed_only_when_triton_flag_is_the_cause():
    assert not kc.rule_registers_and_spills(made_up())
    flag_only = dict(regalloc2=True, spill_stores_without_flag=0)
    assert not kc.rule_registers_and_spills(made_up(spill_stores=16, spill_loads=16, **flag_only))
    assert kc.rule_registers_and_spills(made_up(spill_stores=24, spill_loads=24, **flag_only))
    assert kc.rule_registers_and_spills(made_up(spill_stores=8, regalloc2=True, spill_stores_without_flag=8))
    assert kc.rule_registers_and_spills(made_up(spill_stores=8, regalloc2=True, spill_stores_without_flag=None))
    assert kc.rule_registers_and_spills(made_up(spill_stores=4))
    assert kc.rule_registers_and_spills(made_up(spill_stores=None))


def test_triton_3_6_may_spill_up_to_8_bytes_and_load_them_four_times():
    """Triton 3.6's own spills (kernel_compile.MAX_SPILL_BYTES_TRITON_3_6): allowed there only,
    within 8 bytes stored and 32 loaded."""
    assert not kc.rule_registers_and_spills(made_up(spill_stores=8, spill_loads=32, triton="3.6.0"))
    assert not kc.rule_registers_and_spills(made_up(spill_stores=4, spill_loads=8, triton="3.6.0"))
    assert kc.rule_registers_and_spills(made_up(spill_stores=12, spill_loads=12, triton="3.6.0"))
    assert kc.rule_registers_and_spills(made_up(spill_stores=8, spill_loads=40, triton="3.6.0"))
    for other in ("3.9.0", "3.7.0", "3.16.0", ""):
        assert kc.rule_registers_and_spills(made_up(spill_stores=4, spill_loads=8, triton=other)), other


def test_register_limits_depend_on_the_norm_order_and_dtype():
    assert kc.rule_registers_and_spills(made_up(registers=kc.MAX_REGISTERS + 1))
    pow32 = {"KIND": 5, "CODE": 0}
    assert not kc.rule_registers_and_spills(made_up(registers=kc.MAX_REGISTERS_POW, constexprs=pow32))
    assert kc.rule_registers_and_spills(made_up(registers=kc.MAX_REGISTERS_POW + 1, constexprs=pow32))
    pow64 = {"KIND": 5, "CODE": 1}
    assert not kc.rule_registers_and_spills(made_up(registers=kc.MAX_REGISTERS_F64_POW, constexprs=pow64))
    assert kc.rule_registers_and_spills(made_up(registers=kc.MAX_REGISTERS_F64_POW + 1, constexprs=pow64))


def test_aligned_rule_reads_the_alignment_flag():
    assert kc.rule_aligned_groups_load_128_bits(made_up(constexprs={"ALIGNED": True}, v128_loads=0))
    assert not kc.rule_aligned_groups_load_128_bits(made_up(constexprs={"ALIGNED": True}, v128_loads=3))
    assert not kc.rule_aligned_groups_load_128_bits(made_up(constexprs={"ALIGNED": False}, v128_loads=0))
