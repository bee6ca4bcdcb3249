"""No tensor is made without the device it belongs to: the bench's in-process workloads and the
Trainer run on the CPU with torch's default device set to ``meta``.

A tensor made without a device then lands on ``meta``, holding no data: reading it, copying it
to the CPU or summing it with CPU tensors fails. That is what the first GPU run hit with
``python -m gradfuse bench --device cuda``: the trainer workload's hand-written loop summed its
micro-batch losses into ``torch.zeros(())`` (a CPU tensor beside CUDA losses) and died; here the
same code fails on any machine. Workloads that start processes (ddp, fsdp) are left out: a
child process does not inherit the default device.
"""

from __future__ import annotations

import pytest
import torch
from test_trainer import TinyLM, adamw, config, loader, weights

from gradfuse.bench import engine
from gradfuse.bench.measure import Device
from gradfuse.bench.workloads import available
from gradfuse.train import Trainer

IN_PROCESS = [w for w in available("cpu") if w.family not in ("ddp", "fsdp")]


@pytest.fixture
def meta_default():
    """``torch.set_default_device("meta")`` for the test's body, undone at teardown even when
    the test fails (conftest.py also checks that nothing leaks)."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("workload", IN_PROCESS, ids=lambda w: w.name)
def test_bench_workload_makes_every_tensor_on_its_device(workload, meta_default):
    # The workload's own checks run too: its first calls are compared with torch's.
    result = engine.run_workload(workload, Device(quick=True), 1)
    assert {"torch", "gradfuse"} <= set(result.impls)
    assert all(len(r.times_us) == 1 for r in result.impls.values())


def _fit(tmp_path, meta: bool, resume=None, **overrides):
    with torch.device("cpu"):  # the model and its optimizer state on the CPU, as a user makes them
        model = TinyLM()
        optimizer = adamw(model)
    data = list(loader(shuffle=False))  # (torch's DataLoader itself draws its seed on the default device)
    cfg = config(checkpoint_dir=str(tmp_path), save_every=3, metrics_path=str(tmp_path / "metrics.jsonl"), **overrides)
    if meta:
        torch.set_default_device("meta")
    try:
        rows = Trainer(model, optimizer, data, cfg, resume=resume).fit()
    finally:
        torch.set_default_device(None)
    return weights(model), rows


@pytest.mark.parametrize(
    "overrides",
    [
        {"grad_accum_steps": 2, "max_grad_norm": 0.5},
        {"precision": "bf16", "max_grad_norm": None, "clip": "zclip", "skip_spikes": (8, 6.0, 4), "log_grad_norms": 2},
        {"precision": "fp16", "max_grad_norm": 1.0, "lr_schedule": "cosine", "warmup_steps": 2},
    ],
    ids=["fp32-accum-clip", "bf16-zclip-spikes-layer-norms", "fp16-scaler"],
)
def test_trainer_makes_every_tensor_on_its_device(tmp_path, overrides):
    """Under a meta default device the Trainer trains, checkpoints, resumes and logs exactly as
    without one: the same weights bit for bit, the same metrics."""
    plain, plain_rows = _fit(tmp_path / "plain", False, **overrides)
    meta, meta_rows = _fit(tmp_path / "meta", True, **overrides)
    assert all(torch.equal(a, b) for a, b in zip(plain, meta, strict=True))
    drop = {"samples_per_s", "tokens_per_s", "peak_mem_mb"}  # timings
    assert [{k: v for k, v in r.items() if k not in drop} for r in meta_rows] == [
        {k: v for k, v in r.items() if k not in drop} for r in plain_rows
    ]
    # Resumed from the last checkpoint for two more steps, under the meta default too.
    more = {**overrides, "max_steps": 8}
    plain, _ = _fit(tmp_path / "plain", False, resume="latest", **more)
    meta, _ = _fit(tmp_path / "meta", True, resume="latest", **more)
    assert all(torch.equal(a, b) for a, b in zip(plain, meta, strict=True))
