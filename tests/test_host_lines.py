"""No Python statement per tensor on the hot paths (issue 23): a call's own Python, the lines of
gradfuse's code that run (``sys.settrace``), is the same for 4 tensors and for 64. A loop, a
comprehension or a generator over the tensors in gradfuse's code fails this; the per-tensor work
is left to the Rust core's passes and C-level maps (timed in ``benches/host_time.py``). The calls
are those a training step makes, each after warm-up (plans kept), on the Rust backend."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

import gradfuse
import gradfuse.agc
from gradfuse import _plan

GRADFUSE_DIR = os.path.dirname(gradfuse.__file__)
COUNTS = (4, 64)


def lines_run(call) -> int:
    """Lines of gradfuse's own code that ``call()`` runs."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def new_frame(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(GRADFUSE_DIR) else None

    gc.collect()  # no collection (and no finalizer of gradfuse's) inside the traced call
    gc.disable()
    previous = sys.gettrace()
    sys.settrace(new_frame)
    try:
        call()
    finally:
        sys.settrace(previous)
        gc.enable()
    return count


def params(n: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(n)
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(4, generator=gen)
    return ps


def warm(call, times: int = 3):
    for _ in range(times):
        call()
    return call


def drop_in_clip(n):
    ps = params(n)
    return warm(lambda: gradfuse.clip_grad_norm_(ps, 1e6))


def bucket_clip(n):
    buckets = gradfuse.GradBuckets(params(n))
    return warm(lambda: buckets.clip_grad_norm_(1e6))


def scaler_unscale_and_clip(n):
    ps = params(n)
    opt = torch.optim.SGD(ps, lr=0.0)
    scaler = gradfuse.GradScaler("cpu", init_scale=1.0, growth_interval=2**30)
    scaler.scale(torch.ones(()))

    def step():
        scaler.unscale_and_clip_(opt, 1e6)
        scaler.update()

    return warm(step)


def scaler_with_a_policy(n):
    """``unscale_and_clip_`` with a clipping policy (ZClip) in place of ``max_norm``."""
    from gradfuse.clipping import ZClip

    ps = params(n)
    opt = torch.optim.SGD(ps, lr=0.0)
    scaler = gradfuse.GradScaler("cpu", init_scale=1.0, growth_interval=2**30)
    scaler.scale(torch.ones(()))
    policy = ZClip()

    def step():
        scaler.unscale_and_clip_(opt, policy)
        scaler.update()

    return warm(step, 5)


def moved_clip(n):
    """The gradients made again at other addresses before the call (the plan moves)."""
    ps = params(n)
    warm(lambda: gradfuse.clip_grad_norm_(ps, 1e6))
    for p in ps:
        p.grad = p.grad.clone()
    return lambda: gradfuse.clip_grad_norm_(ps, 1e6)


def agc(n):
    ps = params(n)
    return warm(lambda: gradfuse.agc.adaptive_clip_grad_(ps, 0.01))


PATHS = [drop_in_clip, bucket_clip, scaler_unscale_and_clip, scaler_with_a_policy, moved_clip, agc]


@pytest.fixture(autouse=True)
def rust_backend(monkeypatch):
    monkeypatch.setenv("GRADFUSE_BACKEND", "rust")
    # Plans other tests kept for lists of these lengths would add their own (bounded) lines to
    # one count and not the other: each count starts from none.
    _plan.clear_plans()


@pytest.mark.parametrize("path", PATHS, ids=lambda f: f.__name__)
def test_a_calls_python_does_not_grow_with_its_tensors(path):
    lines = {n: lines_run(path(n)) for n in COUNTS}
    assert lines[COUNTS[0]] > 0  # the tracer sees gradfuse's code
    assert lines[COUNTS[0]] == lines[COUNTS[1]], lines


class _Many(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(n))

    def forward(self, x):
        return torch.stack([p.sum() for p in self.ps]).sum() * x


def test_the_ddp_hooks_record_and_handover_do_not_grow_with_the_parameters(tmp_path):
    """The backward's record of its gradients (the hook's seal) and the ``measured=`` handover's
    check, on a one-process gloo DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        lines = {}
        for n in COUNTS:
            ddp = DistributedDataParallel(_Many(n), gradient_as_bucket_view=True)
            state = gradfuse.register_ddp_hook(ddp)
            x = torch.ones(())
            backward = warm(lambda ddp=ddp, x=x: ddp(x).backward())
            ps = list(ddp.module.parameters())
            lines[n] = (
                lines_run(backward),
                lines_run(lambda ps=ps, state=state: gradfuse.clip_grad_norm_(ps, 1e6, measured=state)),
            )
        assert lines[COUNTS[0]] == lines[COUNTS[1]], lines
    finally:
        dist.destroy_process_group()
