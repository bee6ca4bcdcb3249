"""The 2-rank data-parallel workload: DDP + gradfuse's hook against DDP + torch's clip.

Two processes (spawned; gloo over a file rendezvous on this machine, NCCL on two GPUs), one
thread each on the CPU, train copies of the same small transformer on the same per-rank
batches, both through ``DistributedDataParallel(model, gradient_as_bucket_view=True)`` and a
fused AdamW, with active clipping. A timed step is forward + backward + clip + optimizer step:

- ``torch``: ``torch.nn.utils.clip_grad_norm_`` then ``optimizer.step()``;
- ``gradfuse``: the DDP hook (``gradfuse.register_ddp_hook``) measures each bucket's norm as
  its all-reduce completes, during backward; after backward, ``GradScaler(enabled=False)``'s
  ``unscale_and_clip_(..., measured=hook)`` takes that norm, handed over (no pass over the
  gradients, which nothing touched since backward), and ``step`` folds the clip into fused
  AdamW's read.

Each step is also split, from the same timed runs: ``impl:after_backward`` is the part after
``backward()`` returns (clip + optimizer step), ``impl:clip`` the gradient management alone
(the clip call); their ``share`` is their fraction of the whole step. Bytes read and written
after backward, N the gradients' elements (fp32), recorded per implementation as
``after_backward_bytes``: torch 10N x 4 (the norm's read, the clip's read and write, AdamW's
4 reads and 3 writes); gradfuse 7N x 4 (AdamW's alone). During backward both move the same
bytes: DDP's default reduction divides each bucket before its all-reduce (a read and a write),
the hook multiplies it after, in the same pass that measures it.

Both implementations' gradients, norms and weights after one step on identical inputs are
compared first. Steps alternate between implementations (in alternating order), both ranks
start each one together (a barrier, untimed), and rank 0's wall times are reported. The rank
count is fixed at two.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
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
IMPLS = ("torch", "gradfuse")
PARTS = ("after_backward", "clip")
MAX_NORM = 0.05  # below the model's gradient norm: clipping is active
#: Bytes read and written after backward, per gradient element's bytes (see the module docs).
AFTER_BACKWARD_PASSES = {"torch": 10, "gradfuse": 7}


def _batch(rank: int, step: int, quick: bool, device: torch.device):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (4 if quick else 8, 17 if quick else 65), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _worker(rank, init_file, out_file, quick, reps, budget_s, device_type, measure=None):
    torch.set_num_threads(1)  # two ranks on the machine's cores
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=120)  # a rank left waiting fails instead of hanging
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        result = (measure or _measure)(rank, quick, reps, budget_s, device)
    except Exception as err:  # reported by the parent
        result = {"error": f"rank {rank}: {type(err).__name__}: {err}"}
    Path(f"{out_file}.{rank}").write_bytes(pickle.dumps(result))
    if "error" not in result:
        dist.barrier()  # neither rank tears its connections down while the other still reduces
    # DDP's reducer keeps the process group's threads referenced (a reference cycle); left to
    # interpreter exit, that intermittently aborted a rank ("terminate called without an
    # active exception", 1 run in ~6). Free them first.
    gc.collect()
    dist.destroy_process_group()


def warm_up(run, impls, reps: int | None, budget_s: float) -> int:
    """Three untimed rounds of ``run(name, step)`` (steps 1 to 3) over ``impls``; the timed
    steps' count: ``reps``, or if None sized on rank 0's round time to ``budget_s`` and
    broadcast, so that every rank runs the same number of steps (each one a collective)."""
    start = time.perf_counter()
    for i in range(3):
        for name in impls:
            run(name, i + 1)
    if reps is None:
        per_round = (time.perf_counter() - start) / 3
        count = torch.tensor([max(10, min(200, int(budget_s / per_round)))])
        dist.broadcast(count, src=0)
        reps = int(count.item())
    return reps


def _measure(rank: int, quick: bool, reps: int | None, budget_s: float, device: torch.device) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradfuse
    from gradfuse.ddp_hook import state_for

    loss_fn = nn.CrossEntropyLoss()
    models = {name: make_model(quick).to(device) for name in IMPLS}
    ddps = {name: DDP(models[name], gradient_as_bucket_view=True) for name in IMPLS}
    hook = gradfuse.register_ddp_hook(ddps["gradfuse"])
    optimizers = {name: torch.optim.AdamW(models[name].parameters(), lr=1e-4, fused=True) for name in IMPLS}
    scaler = gradfuse.GradScaler(device.type, enabled=False)  # clipping only, folded into AdamW
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def clip(name: str) -> torch.Tensor:
        if name == "torch":
            return torch.nn.utils.clip_grad_norm_(models["torch"].parameters(), MAX_NORM)
        return scaler.unscale_and_clip_(optimizers["gradfuse"], MAX_NORM, measured=hook)

    def optimizer_step(name: str) -> None:
        if name == "torch":
            optimizers["torch"].step()
        else:
            scaler.step(optimizers["gradfuse"])
            scaler.update()

    def run(name: str, step: int, check=None) -> tuple[float, float, float]:
        """One step: (whole, after backward, clip) in µs."""
        optimizers[name].zero_grad(set_to_none=False)  # the views stay DDP's bucket views
        x, y = _batch(rank, step, quick, device)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        loss_fn(ddps[name](x).flatten(0, 1), y.flatten()).backward()
        sync()
        t1 = time.perf_counter()
        if check is not None:
            check(name)
        norm = clip(name)
        sync()
        t2 = time.perf_counter()
        optimizer_step(name)
        sync()
        t3 = time.perf_counter()
        norms[name] = norm
        return (t3 - t0) * 1e6, (t3 - t1) * 1e6, (t2 - t1) * 1e6

    # Correctness: one step each from the same weights on identical inputs; every rank checks,
    # every rank raises.
    norms: dict[str, torch.Tensor] = {}
    grads: dict[str, list[torch.Tensor]] = {}

    def keep_grads(name):
        grads[name] = [p.grad.clone() for p in models[name].parameters()]
        if name == "gradfuse" and state_for([p.grad for p in models[name].parameters()], 2.0) is not hook:
            raise BenchError("gradfuse: the hook's norm does not cover the gradients after backward")

    for name in IMPLS:
        run(name, 0, check=keep_grads)
    for i, (a, b) in enumerate(zip(grads["gradfuse"], grads["torch"], strict=True)):
        if not torch.equal(a, b):
            raise BenchError(f"gradfuse: gradient {i} differs from DDP's by {(a - b).abs().max():.3g}")
    if not torch.allclose(norms["gradfuse"], norms["torch"].float(), rtol=1e-5):
        raise BenchError(f"gradfuse: norm {norms['gradfuse'].item()} where torch's is {norms['torch'].item()}")
    if not norms["torch"].item() > MAX_NORM:
        raise BenchError(f"clipping is not active (norm {norms['torch'].item()})")
    for i, (a, b) in enumerate(zip(models["gradfuse"].parameters(), models["torch"].parameters(), strict=True)):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-7):
            raise BenchError(f"gradfuse: weight {i} after the step differs from torch's by {(a - b).abs().max():.3g}")
    reps = warm_up(run, IMPLS, reps, budget_s)
    times: dict[str, list[float]] = {n: [] for name in IMPLS for n in (name, *(f"{name}:{p}" for p in PARTS))}
    for i in range(reps):
        for name in IMPLS if i % 2 == 0 else reversed(IMPLS):
            whole, after, clipping = run(name, i + 10)
            times[name].append(whole)
            times[f"{name}:after_backward"].append(after)
            times[f"{name}:clip"].append(clipping)
    params = list(models["torch"].parameters())
    return {"times": times, "n_tensors": len(params), "numel": sum(p.numel() for p in params)}


def run_ranks(measure, device: Device, reps: int | None, what: str) -> dict:
    """``measure(rank, quick, reps, budget_s, device)`` on two spawned ranks (a file rendezvous
    on this machine; the process group made and destroyed around it); rank 0's result. A rank's
    error, a dead rank or a run past 600 s is a ``BenchError`` naming ``what``."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result")
        ctx = mp.start_processes(
            _worker,
            args=(os.path.join(tmp, "rendezvous"), out_file, device.quick, reps, device.budget_s, device.type, measure),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 600
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    raise BenchError(f"the 2-rank {what} benchmark did not finish in 600 s")
        except ProcessException as err:
            raise BenchError(f"a rank of the {what} benchmark failed: {err}") from None
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        results = [pickle.loads(Path(f"{out_file}.{r}").read_bytes()) for r in range(WORLD)]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise BenchError("; ".join(errors))
    return results[0]


def run_ddp(workload: Workload, device: Device, reps: int | None) -> WorkloadResult:
    found = run_ranks(_measure, device, reps, "data-parallel")
    grad_bytes = found["numel"] * workload.dtype.itemsize
    impls = {}
    for name, times in found["times"].items():
        impl = ImplResult(name, times)
        impl.notes["after_backward_bytes"] = AFTER_BACKWARD_PASSES[name.partition(":")[0]] * grad_bytes
        impls[name] = impl
    return WorkloadResult(workload, found["n_tensors"], found["numel"], grad_bytes, 1, impls)
