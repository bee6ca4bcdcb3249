"""The kernels' direct launch path (``gradfuse.kernels._launch``) without a GPU.

``tests/launch_scenarios.py`` runs in a subprocess with compiled (not interpreted) Triton on a
stand-in driver for sm_90: first launches go through the JIT, whose specializations are compiled
for real with Triton's ptxas; later launches go to a stand-in for the driver's launch call. Each
of its checks is a test here: the launcher's key says exactly what Triton compiled (pointer
alignment, integers equal to 1 or divisible by 16, constexprs), a kernel compiled for one key is
refused for another (an unaligned tensor after an aligned one), the arguments it passes match the
compiled signature, and a launch hook sends launches back through the JIT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def scenarios() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, str(HERE / "launch_scenarios.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


EXPECTED = [
    "this Triton's launch call is known",
    "scale: the key says what Triton compiled",
    "scale: the second launch is direct",
    "scale: the packed arguments match the compiled signature",
    "scale: an unaligned factor after an aligned one is not launched with the aligned kernel",
    "scale: its key differs",
    "scale: and the aligned kernel fails the check against it",
    "scale: a table whose tensor lost its 16-byte alignment is not moved",
    "scale: with a launch hook set the launch goes through the JIT",
    "integers: n=33 has the key of n=17 (same specialization)",
    "integers: n=33 launches the n=17 kernel directly, with 33",
    "integers: a do_not_specialize integer equal to 1 is no constant",
    "integers: nor does divisibility by 16 make another key",
    "prepared: the key of its arguments says what Triton compiled",
    "prepared: a later call with other arguments of the same kinds launches directly",
    "prepared: it passes what the launcher's own launch would",
    "prepared: the packed arguments match the compiled signature",
    "prepared: an unaligned factor after aligned ones is not launched with their kernel",
    "prepared: a float64 factor after float32 ones is not launched with their kernel",
    "prepared: another value of an unspecialized integer launches directly, with that value",
    "prepared: a tensor among the fixed arguments raises",
    "prepared: a call with too few values raises",
    "prepared: moved to another table it launches directly",
    "prepared: moved, it passes the new table's addresses",
    "prepared: after clear() a call goes through the JIT again",
]


@pytest.mark.parametrize("name", EXPECTED)
def test_launch_scenario(scenarios, name):
    assert name in scenarios["checks"], sorted(scenarios["checks"])
    assert scenarios["checks"][name] is True, scenarios["checks"][name]


def test_every_integer_specialization_is_told_apart(scenarios):
    checks = {k: v for k, v in scenarios["checks"].items() if k.startswith("integers: ")}
    assert len(checks) >= 16  # four values, each checked against its own and every other compile
    assert all(v is True for v in checks.values()), {k: v for k, v in checks.items() if v is not True}


def test_a_triton_of_unknown_launch_shape_launches_through_the_jit(monkeypatch):
    """A Triton whose compiled kernels may take another launch call keeps every launch on the
    JIT path: no compiled kernel is kept for direct launches."""
    from gradfuse.kernels import _launch

    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(_launch, "_SHAPE_KNOWN", False)

    class Fn:
        params = ()
        calls = 0

        def __getitem__(self, grid):
            def run(*args, **meta):
                Fn.calls += 1
                return object()  # a compiled kernel

            return run

    launcher = _launch.Launcher(Fn())
    for _ in range(3):
        launcher(1, (), {}, 0)
    assert Fn.calls == 3 and launcher.direct == 0
    assert list(launcher.compiled.values()) == [None]


def test_a_pointer_of_a_dtype_triton_does_not_know_is_never_launched_directly():
    from gradfuse.kernels import _launch

    class Param:
        name, constexpr, specialize, annotation = "x", False, True, ""

    launcher = _launch.Launcher.__new__(_launch.Launcher)
    launcher.fn, launcher.params, launcher.runtime, launcher.layout = None, [Param()], [Param()], [(False, 0)]
    launcher.plain_ints, launcher.tail = [False], []
    key, _ = launcher.bind((torch.zeros(2, dtype=torch.complex64),), {}, 0)
    assert key[2][0][0] is None
    assert not launcher._checked(key, object())
