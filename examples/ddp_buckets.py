"""Data-parallel training with gradfuse.GradBuckets, on CPU (gloo) or GPUs (NCCL).

    torchrun --nproc-per-node 2 examples/ddp_buckets.py

Each rank trains the same small model on its own batches. GradBuckets lays the gradients out
in a few flat buffers and averages them across ranks while backward runs (as
DistributedDataParallel does); accumulation micro-steps skip communication with no_sync(),
and clipping runs over the buffers: two passes, whatever the number of parameters.
"""

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

import gradfuse

ACCUM_STEPS, STEPS = 4, 20


def main() -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # GradBuckets also broadcasts rank 0's weights, as DDP does
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)).to(device)
    buckets = gradfuse.GradBuckets(model.parameters(), bucket_cap_mb=0.05, process_group=dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(1)).to(device)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches

    for step in range(STEPS):
        for micro in range(ACCUM_STEPS):
            x = torch.randn(16, 32, generator=data).to(device)
            loss = nn.functional.mse_loss(model(x), x @ target) / ACCUM_STEPS
            last = micro == ACCUM_STEPS - 1
            with contextlib.nullcontext() if last else buckets.no_sync():
                loss.backward()  # the last one returns with every gradient averaged
        grad_norm = buckets.clip_grad_norm_(1.0)
        optimizer.step()
        buckets.zero_grad()
        if rank == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {loss.item() * ACCUM_STEPS:.4f}, grad norm {grad_norm.item():.3f}")

    # Every rank ends with the same weights.
    for p in model.parameters():
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, p.detach())
        assert all(torch.equal(c, copies[0]) for c in copies)
    if rank == 0:
        print(f"{buckets}: ranks in sync")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
