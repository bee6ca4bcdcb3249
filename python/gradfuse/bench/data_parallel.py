"""The 2-rank data-parallel workload: ``GradBuckets`` against ``DistributedDataParallel``.

Two processes (spawned; gloo over a file rendezvous on this machine, NCCL on two GPUs), one
thread each on the CPU, train copies of the same small transformer on the same per-rank
batches. A timed step is a forward and a backward under one implementation; backward returns
with every gradient averaged over both ranks, so the step is the whole cost of data-parallel
gradient production: compute, bucketing, the overlapped all-reduces and the wait at the end.

- ``torch``: ``DistributedDataParallel`` with its defaults (25 MB buckets, gradients copied
  into and out of them), grads set to None between steps, as ``optimizer.zero_grad()`` does;
- ``torch_bucket_view``: DDP with ``gradient_as_bucket_view=True``;
- ``gradfuse``: ``GradBuckets(model.parameters(), process_group=...)``, ``zero_grad()`` between steps;
- ``comm_only``: the all-reduces alone (GradBuckets' buffers, no backward): the communication
  each step carries, for the per-step communication time.

Every implementation's gradients after one step on identical inputs are compared first. Steps
alternate between implementations (in alternating order), both ranks start each one together
(a barrier, untimed), and rank 0's wall times are reported. The rank count is fixed at two.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .measure import BenchError, Device
from .models import VOCAB, make_model
from .results import ImplResult, WorkloadResult
from .workloads import Workload

WORLD = 2
IMPLS = ("torch", "gradfuse", "torch_bucket_view", "comm_only")


def _batch(rank: int, step: int, quick: bool, device: torch.device):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (4 if quick else 8, 17 if quick else 65), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _worker(rank, init_file, out_file, quick, reps, budget_s, device_type):
    torch.set_num_threads(1)  # two ranks on the machine's cores
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=120)  # a rank left waiting fails instead of hanging
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        result = _measure(rank, quick, reps, budget_s, device)
    except Exception as err:  # reported by the parent
        result = {"error": f"rank {rank}: {type(err).__name__}: {err}"}
    Path(f"{out_file}.{rank}").write_bytes(pickle.dumps(result))
    # DDP's reducer and GradBuckets (its hooks hold it in a reference cycle) keep the process
    # group's threads referenced; left to interpreter exit, that intermittently aborted a rank
    # ("terminate called without an active exception", 1 run in ~6). Free them first.
    gc.collect()
    dist.destroy_process_group()


def _measure(rank: int, quick: bool, reps: int | None, budget_s: float, device: torch.device) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradfuse

    loss_fn = nn.CrossEntropyLoss()
    models = {name: make_model(quick).to(device) for name in IMPLS[:3]}
    ddp = DDP(models["torch"])
    ddp_view = DDP(models["torch_bucket_view"], gradient_as_bucket_view=True)
    buckets = gradfuse.GradBuckets(models["gradfuse"].parameters(), process_group=dist.group.WORLD)
    comm_buffers = [torch.randn_like(b) for b in buckets.buffers]

    def forward_backward(module):
        def step(x, y):
            loss_fn(module(x).flatten(0, 1), y.flatten()).backward()

        return step

    def comm_only(x, y):
        works = [dist.all_reduce(b.div_(WORLD), async_op=True) for b in comm_buffers]
        for work in works:
            work.wait()

    steps = {
        "torch": forward_backward(ddp),
        "gradfuse": forward_backward(models["gradfuse"]),
        "torch_bucket_view": forward_backward(ddp_view),
        "comm_only": comm_only,
    }
    zero = {
        "torch": lambda: models["torch"].zero_grad(set_to_none=True),
        "gradfuse": buckets.zero_grad,
        "torch_bucket_view": lambda: models["torch_bucket_view"].zero_grad(set_to_none=False),
        "comm_only": lambda: None,
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def run(name: str, step: int) -> float:
        zero[name]()
        x, y = _batch(rank, step, quick, device)
        sync()
        dist.barrier()
        start = time.perf_counter()
        steps[name](x, y)
        sync()
        return (time.perf_counter() - start) * 1e6

    # Correctness: one step each on identical inputs; every rank checks, every rank raises.
    for name in IMPLS[:3]:
        run(name, 0)
    ref = [p.grad for p in models["torch"].parameters()]
    for name in IMPLS[1:3]:
        for i, (a, b) in enumerate(zip(models[name].parameters(), ref, strict=True)):
            if not torch.allclose(a.grad, b, rtol=1e-5, atol=1e-7):
                raise BenchError(f"{name}: gradient {i} differs from DDP's by {(a.grad - b).abs().max():.3g}")
    # Warm-up, sizing the timed part on rank 0's round time (the same count on both ranks).
    start = time.perf_counter()
    for i in range(3):
        for name in IMPLS:
            run(name, i + 1)
    if reps is None:
        per_round = (time.perf_counter() - start) / 3
        count = torch.tensor([max(10, min(200, int(budget_s / per_round)))])
        dist.broadcast(count, src=0)
        reps = int(count.item())
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    for i in range(reps):
        for name in IMPLS if i % 2 == 0 else reversed(IMPLS):
            times[name].append(run(name, i + 10))
    return {"times": times, "n_tensors": len(buckets.params), "numel": sum(p.numel() for p in buckets.params)}


def run_ddp(workload: Workload, device: Device, reps: int | None) -> WorkloadResult:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result")
        ctx = mp.start_processes(
            _worker,
            args=(os.path.join(tmp, "rendezvous"), out_file, device.quick, reps, device.budget_s, device.type),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 600
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    raise BenchError("the 2-rank data-parallel benchmark did not finish in 600 s")
        except ProcessException as err:
            raise BenchError(f"a rank of the data-parallel benchmark failed: {err}") from None
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        results = [pickle.loads(Path(f"{out_file}.{r}").read_bytes()) for r in range(WORLD)]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise BenchError("; ".join(errors))
    found = results[0]
    print(
        f"  per step: communication {statistics.median(found['times']['comm_only']) / 1e3:.2f} ms",
        file=sys.stderr,
    )
    return WorkloadResult(
        workload,
        found["n_tensors"],
        found["numel"],
        found["numel"] * workload.dtype.itemsize,  # gradient bytes reduced per step
        1,
        {name: ImplResult(name, times) for name, times in found["times"].items()},
    )
