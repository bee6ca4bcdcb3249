"""The 2-rank FSDP2 workload: gradfuse's clip and Trainer on sharded gradients against torch's.

Two ranks (``data_parallel.run_ranks``: spawned, gloo on the CPU, NCCL on two GPUs) train
copies of the data-parallel benchmark's transformer, each ``TransformerEncoderLayer`` sharded
as a unit by FSDP2's ``fully_shard`` and then the root, with a fused AdamW built after it and
active clipping. A timed step is forward + backward + clip + optimizer step + the schedule,
the loss averaged over the ranks and read once (what the Trainer reports):

- ``torch``: the hand-written FSDP2 loop, torch's ``clip_grad_norm_`` over the DTensor
  gradients (``_foreach_norm`` over DTensors, the total, then the scale pass), ``step``;
- ``gradfuse``: the same loop, ``GradScaler(enabled=False).unscale_and_clip_``: one fused
  read of the local shards, the norm and the inf/NaN flag in one all-reduce, the clip folded
  into fused AdamW's read;
- ``trainer``: ``gradfuse.Trainer(..., TrainConfig(parallel="fsdp"))``'s ``train_step``, which
  does the same through its own FSDP2 wrapping.

``impl:clip`` is the clip call alone and ``impl:after_backward`` everything after backward,
from the same timed steps. Memory per rank, recorded on every row (``notes``): the bytes of
the parameters, gradients and optimizer state this rank holds (``state_mb``), with FSDP2 and
with DDP (``ddp_state_mb``) on the same model; on CUDA also the peak allocated during a step
(``peak_mem_mb``, ``ddp_peak_mem_mb``). The first steps check that the three give the same
norms and weights. Steps alternate between implementations, both ranks start each together
(a barrier, untimed), and rank 0's wall times are reported.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from .data_parallel import WORLD, _batch, run_ranks, warm_up
from .measure import BenchError, Device
from .models import make_model
from .results import ImplResult, WorkloadResult
from .workloads import Workload

IMPLS = ("torch", "gradfuse", "trainer")
PARTS = ("after_backward", "clip")
MAX_NORM = 0.05  # below the model's gradient norm: clipping is active
LR = 1e-4
UNIT = "TransformerEncoderLayer"  # the model's blocks, sharded one by one


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in [m for m in model.modules() if type(m).__name__ == UNIT]:
        fully_shard(block)
    return fully_shard(model)


def _state_mb(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """MiB of parameters, gradients and optimizer state held by this rank (DTensors: their shard)."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in model.parameters())
    total += sum(local(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    return total / 2**20


class _Loop:
    """One hand-written FSDP2 training step, with torch's clip or gradfuse's."""

    def __init__(self, clip: str, quick: bool, device: torch.device):
        import gradfuse

        self.model = _shard(make_model(quick).to(device))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.scaler = gradfuse.GradScaler(device.type, enabled=False) if clip == "gradfuse" else None
        self.params = list(self.model.parameters())

    def forward_backward(self, x, y) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return loss.detach()

    def clip(self) -> torch.Tensor:
        if self.scaler is None:
            return torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM).full_tensor()
        return self.scaler.unscale_and_clip_(self.optimizer, MAX_NORM)

    def finish(self, loss: torch.Tensor) -> float:
        """The step after the clip: the mean loss over the ranks read once, step, schedule."""
        dist.all_reduce(loss)
        value = loss.item() / WORLD
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()
        return value


def _trainer(quick: bool, device: torch.device, batches):
    from gradfuse.train import TrainConfig, Trainer

    model = make_model(quick).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    config = TrainConfig(
        max_steps=10**6, max_grad_norm=MAX_NORM, lr=LR, log_every=10**6, progress=False, seed=0,
        parallel="fsdp", fsdp_units=[UNIT],
    )  # fmt: skip

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    return Trainer(model, optimizer, batches, config, loss_fn=loss_fn)


def _full(params) -> list[torch.Tensor]:
    return [p.full_tensor() for p in params]


def _measure(rank: int, quick: bool, reps: int | None, budget_s: float, device: torch.device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    loops = {name: _Loop(name, quick, device) for name in ("torch", "gradfuse")}
    n_batches = 1000  # the Trainer walks its data in order: step i's batch is batches[i]
    batches = [_batch(rank, step, quick, device) for step in range(n_batches)]
    trainer = _trainer(quick, device, batches)

    def run(name: str, step: int) -> tuple[float, float, float, float]:
        """One step: (whole, after backward, clip) in µs, and the norm."""
        sync()
        dist.barrier()
        if name == "trainer":
            t0 = time.perf_counter()
            row = trainer.train_step()
            sync()
            whole = (time.perf_counter() - t0) * 1e6
            return whole, None, None, row["grad_norm"]
        loop = loops[name]
        x, y = batches[step % n_batches]
        t0 = time.perf_counter()
        loss = loop.forward_backward(x, y)
        sync()
        t1 = time.perf_counter()
        norm = loop.clip()
        sync()
        t2 = time.perf_counter()
        loop.finish(loss)
        sync()
        t3 = time.perf_counter()
        return (t3 - t0) * 1e6, (t3 - t1) * 1e6, (t2 - t1) * 1e6, norm.item()

    # Correctness: the first step of each from the same weights on the same batch (the
    # Trainer's first batch is batches[0]); every rank checks, every rank raises.
    norms = {name: run(name, 0)[3] for name in IMPLS}
    for name in ("gradfuse", "trainer"):
        if not abs(norms[name] - norms["torch"]) <= 1e-5 * norms["torch"]:
            raise BenchError(f"{name}: norm {norms[name]} where torch's is {norms['torch']}")
    if not norms["torch"] > MAX_NORM:
        raise BenchError(f"clipping is not active (norm {norms['torch']})")
    reference = _full(loops["torch"].params)
    for name, params in (("gradfuse", loops["gradfuse"].params), ("trainer", list(trainer.model.parameters()))):
        for i, (a, b) in enumerate(zip(_full(params), reference, strict=True)):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-7):
                raise BenchError(f"{name}: weight {i} after the step differs from torch's by {(a - b).abs().max():.3g}")
    reps = warm_up(run, IMPLS, reps, budget_s)
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    times.update({f"{name}:{part}": [] for name in ("torch", "gradfuse") for part in PARTS})
    for i in range(reps):
        for name in IMPLS if i % 2 == 0 else reversed(IMPLS):
            whole, after, clipping, _ = run(name, i + 4)
            times[name].append(whole)
            if after is not None:
                times[f"{name}:after_backward"].append(after)
                times[f"{name}:clip"].append(clipping)
    memory = _memory(quick, device, trainer, functools.partial(run, "trainer", 0))
    params = list(make_model(quick).parameters())
    return {"times": times, "n_tensors": len(params), "numel": sum(p.numel() for p in params), "memory": memory}


def _memory(quick: bool, device: torch.device, trainer, trainer_step) -> dict:
    """Per rank, FSDP2 (the Trainer's model) against DDP on the same model: the state held
    (MiB) and, on CUDA, the peak allocated during one step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = device.type == "cuda"
    found = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer_step()
    if cuda:
        found["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    found["state_mb"] = _state_mb(trainer.model, trainer.optimizer)
    model = make_model(quick).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    x, y = _batch(0, 0, quick, device)
    for _ in range(2):  # the second step holds the optimizer state already
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        optimizer.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    if cuda:
        torch.cuda.synchronize(device)
        found["ddp_peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    found["ddp_state_mb"] = _state_mb(model, optimizer)
    return found


def run_fsdp(workload: Workload, device: Device, reps: int | None) -> WorkloadResult:
    found = run_ranks(_measure, device, reps, "FSDP2")
    grad_bytes = found["numel"] * workload.dtype.itemsize
    impls = {}
    for name, times in found["times"].items():
        impl = ImplResult(name, times)
        impl.notes.update({key: round(value, 3) for key, value in found["memory"].items()})
        impls[name] = impl
    return WorkloadResult(workload, found["n_tensors"], found["numel"], grad_bytes, 1, impls)
