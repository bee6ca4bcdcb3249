"""The CUDA tests' own logic, run on the CPU.

A GPU is at hand now and then, for minutes. What test_cuda.py and the other ``cuda`` tests do
that needs no GPU runs here, so that a fault of the test itself shows before a GPU run: inputs
that gradfuse rightly refuses, the profiler and torch.compile raising version-specific warnings
under ``filterwarnings = error``, the sync debug mode left set after a failure, and process
state (environment, default device, signal handlers) leaking into the next test. The same
helpers run on the GPU, where test_cuda.py calls them with CUDA tensors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_cuda import grads_of, profiled_names, sync_free_calls

import gradfuse
import process_state
from reference import params_of

TESTS = Path(__file__).parent


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "cached"])
def test_no_host_sync_calls_run_on_their_inputs(warm, monkeypatch):
    """test_no_host_sync's calls on its own inputs (one of them empty), on the Rust core: none
    is refused, and every norm they return is finite."""
    monkeypatch.delenv("GRADFUSE_BACKEND", raising=False)
    grads = grads_of([torch.float32, torch.bfloat16], device="cpu")
    assert any(g.numel() == 0 for g in grads)  # the case the first GPU run tripped over
    inv, found, total = torch.tensor(0.5), torch.zeros(()), torch.tensor(3.0)
    calls = sync_free_calls(grads, inv, found, total)
    for _ in range(2 if warm else 1):
        outs = [call() for call in calls]
    assert len(outs) == 10
    results = [t for out in outs if out is not None for t in (out if isinstance(out, tuple) else (out,))]
    assert all(torch.isfinite(t).all() for t in results)  # the norms and flags of finite gradients


def test_the_profiler_helper_counts_one_op_per_clip_of_1000_tensors():
    """The profiling helper of the launch-count tests, under this suite's strict warnings (torch
    warns on entering a profile that clears events per cycle, unless told to keep them). On the
    CPU it lists the gradfuse ops dispatched: one for the whole list, as on CUDA one launch
    group."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n) for n in torch.randint(1, 5000, (1000,), generator=gen).tolist()]
    assert profiled_names(lambda: gradfuse.clip_grad_norm_(params_of(grads), 1e-3), device="cpu") == [
        "gradfuse::clip_grad_norm_"
    ]


def test_inductor_imports_under_strict_warnings():
    """test_torch_compile_fullgraph's import of inductor, in a fresh process where every warning
    is an error (torch 2.11 deprecates ``torch.jit.script_method``, which inductor's imports use)."""
    code = "import warnings; warnings.simplefilter('error'); import test_cuda; test_cuda.import_inductor()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


class FakeSyncDebugMode:
    """torch.cuda's sync debug mode as torch 2.11 sets it: the mode is set, then a UserWarning."""

    WARNING = (
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
        "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)"
    )

    def __init__(self, raise_on=None, other_warning=None):
        self.mode, self.raise_on, self.other_warning = 0, raise_on, other_warning

    def get(self):
        return self.mode

    def set(self, mode):
        if mode == self.raise_on:
            raise RuntimeError("setting the mode failed")
        self.mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)
        warnings.warn(self.other_warning or self.WARNING, UserWarning, stacklevel=2)


def test_sync_debug_mode_is_set_and_restored_despite_torch_2_11s_warning(monkeypatch):
    fake = FakeSyncDebugMode()
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", fake.get)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", fake.set)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as the suite's filterwarnings, whatever -W says
        with process_state.sync_debug_mode("error"):
            assert fake.mode == 2
        assert fake.mode == 0
        with pytest.raises(ValueError), process_state.sync_debug_mode("error"):
            raise ValueError("the test body failed")
        assert fake.mode == 0
        # Setting the mode raises: the mode before is put back all the same.
        fake.raise_on = "error"
        fake.mode = 1
        with pytest.raises(RuntimeError, match="setting the mode failed"), process_state.sync_debug_mode("error"):
            pass
        assert fake.mode == 1
        # Only torch's own warning is ignored.
        other = FakeSyncDebugMode(other_warning="something else")
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", other.set)
        with pytest.raises(UserWarning, match="something else"):
            process_state.set_sync_debug_mode("error")


def test_process_state_left_by_a_test_is_named_and_put_back():
    before = process_state.snapshot()
    handler = signal.getsignal(signal.SIGINT)
    os.environ["GRADFUSE_BACKEND"] = "bogus" if os.environ.get("GRADFUSE_BACKEND") != "bogus" else "rust"
    torch.set_default_device("meta")
    signal.signal(signal.SIGINT, signal.SIG_IGN if handler is not signal.SIG_IGN else signal.default_int_handler)
    changed = process_state.restore(before)
    assert len(changed) == 3, changed
    assert changed[0].startswith("$GRADFUSE_BACKEND=") and changed[1].startswith("default device meta")
    assert changed[2].startswith("SIGINT handler")
    assert process_state.snapshot() == before and process_state.restore(before) == []
    assert torch.empty(1).device.type == "cpu" and signal.getsignal(signal.SIGINT) is handler
