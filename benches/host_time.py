"""Host time per call (median µs) through the public API alone, so that it runs against any
version of gradfuse: the drop-in clip, `GradBuckets.clip_grad_norm_` and
`GradScaler.unscale_and_clip_` on the same list again (16-element fp32 gradients, an inactive clip,
one thread) at 1, 148, 2000 and 10,000 tensors; and ``moved``, the drop-in clip where each call's
gradients are other tensors at other addresses (set, untimed, from more gradient sets than any
version keeps plans for one list shape: a loop that sets gradients to None between steps); and
``ddp``, the drop-in clip handed the DDP hook's norm (``measured=state``) after each backward (untimed)
of a one-process gloo DDP over the gradients: the check that they are what that backward left,
then the scale pass over DDP's buckets.

Usage: PYTHONPATH=<a checkout>/python taskset -c 1 python benches/host_time.py [--standin] [API ...]
(APIs: clip, buckets, scaler, moved, ddp; all five by default.)

``--standin``: through the Triton backend with the host bench's stand-in launcher (no GPU: each
launch stops at the compiled kernel's launcher; ``gradfuse.bench.host``), the CUDA path's host work.

Run it against two checkouts in turn, alternating, to compare them on one machine.
"""

import os
import statistics
import sys
import time

import torch

import gradfuse

COUNTS = (1, 148, 2000, 10_000)
MAX_NORM = 1e6  # far above the gradients' norm: an inactive clip
#: Gradient sets the ``moved`` rows rotate through: more than the plans any version keeps per key (4, then 8).
MOVED_SETS = 9


def params(n: int) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.zeros(16)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(16) * 1e-2
    return ps


def median_us(call, reps: int, after=None) -> float:
    for _ in range(2):
        call()
        if after:
            after()
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
        if after:
            after()  # untimed
    return statistics.median(times) / 1e3


def main(apis: list[str]) -> None:
    torch.set_num_threads(1)
    for n in COUNTS:
        reps = 2000 if n < 1000 else (300 if n < 5000 else 60)
        row = {}
        if "clip" in apis:
            ps = params(n)
            row["clip"] = median_us(lambda ps=ps: gradfuse.clip_grad_norm_(ps, MAX_NORM), reps)
        if "buckets" in apis:
            buckets = gradfuse.GradBuckets(params(n))
            row["buckets"] = median_us(lambda b=buckets: b.clip_grad_norm_(MAX_NORM), reps)
            buckets.remove()
        if "moved" in apis:
            ps = params(n)
            sets = [[torch.randn(16) * 1e-2 for _ in range(n)] for _ in range(MOVED_SETS)]
            turn = iter(range(10**9))

            def next_set(ps=ps, sets=sets, turn=turn):
                for p, g in zip(ps, sets[next(turn) % MOVED_SETS], strict=True):
                    p.grad = g

            next_set()
            row["moved"] = median_us(lambda ps=ps: gradfuse.clip_grad_norm_(ps, MAX_NORM), reps, next_set)
        if "ddp" in apis:
            row["ddp"] = ddp_handover_us(n, reps)
        if "scaler" in apis:
            ps = params(n)
            opt = torch.optim.SGD(ps, lr=0.0)
            # A loss scale of 1 that never grows: unscaling changes nothing, call after call.
            scaler = gradfuse.GradScaler("cpu", init_scale=1.0, growth_interval=2**30)
            scaler.scale(torch.ones(()))
            row["scaler"] = median_us(lambda s=scaler, o=opt: s.unscale_and_clip_(o, MAX_NORM), reps, scaler.update)
        print(n, {k: round(v, 1) for k, v in row.items()}, flush=True)


class _Many(torch.nn.Module):
    """``n`` parameters of 16 elements, each used in forward."""

    def __init__(self, n: int):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(16) * 1e-2) for _ in range(n))

    def forward(self, x):
        return torch.stack([p.sum() for p in self.ps]).sum() * x


_RENDEZVOUS: list = []


def ddp_handover_us(n: int, reps: int) -> float:
    import tempfile

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        _RENDEZVOUS.append(tempfile.TemporaryDirectory())  # removed at exit
        rendezvous = os.path.join(_RENDEZVOUS[0].name, "rendezvous")  # a fresh file: one process
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    ddp = DistributedDataParallel(_Many(n), gradient_as_bucket_view=True)
    state = gradfuse.register_ddp_hook(ddp)
    ps = list(ddp.module.parameters())
    x = torch.ones(())

    def backward():
        ddp(x).backward()

    backward()
    return median_us(lambda: gradfuse.clip_grad_norm_(ps, MAX_NORM, measured=state), reps, backward)


def standin() -> None:
    from gradfuse.bench.host import _install_standin

    if not _install_standin():
        raise SystemExit("--standin: Triton runs under its interpreter here (TRITON_INTERPRET): no launch path")
    os.environ["GRADFUSE_BACKEND"] = "triton"


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--standin" in args:
        args.remove("--standin")
        standin()
    main(args or ["clip", "buckets", "scaler", "moved", "ddp"])
