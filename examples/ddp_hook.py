"""Data-parallel training with torch's DistributedDataParallel and gradfuse's communication
hook, on CPU (gloo) or GPUs (NCCL).

    torchrun --nproc-per-node 2 examples/ddp_hook.py

Each rank trains the same small model on its own batches. DDP averages the gradients across
ranks while backward runs; gradfuse's hook follows each bucket's all-reduce with one fused pass
that also measures its norm and checks it for inf/NaN, so when backward returns the norm is
already on the device. Handed to the scaler's unscale_and_clip_ (measured=hook: nothing
touches the gradients between backward and the clip), it is used instead of reading the
gradients again, and with a fused optimizer the clip is folded into the optimizer's own read.
Accumulation micro-steps skip communication with DDP's no_sync().
"""

import contextlib
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse

ACCUM_STEPS, STEPS = 4, 20


def main() -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)).to(device)
    # DDP broadcasts rank 0's weights; every .grad becomes a view into DDP's bucket buffers.
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    hook = gradfuse.register_ddp_hook(ddp, norm_type=2.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    scaler = gradfuse.GradScaler(device.type, enabled=False)  # bf16/fp32: clipping only
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(1)).to(device)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches

    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(ACCUM_STEPS):
            x = torch.randn(16, 32, generator=data).to(device)
            loss = nn.functional.mse_loss(ddp(x), x @ target) / ACCUM_STEPS
            last = micro == ACCUM_STEPS - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss.backward()  # the last one returns with every gradient averaged and measured
        # The hook's norm, handed over: no pass (only because nothing touched the grads since backward).
        grad_norm = scaler.unscale_and_clip_(optimizer, max_norm=1.0, measured=hook)
        scaler.step(optimizer)  # the clip folded into fused AdamW's read
        scaler.update()
        if rank == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {loss.item() * ACCUM_STEPS:.4f}, grad norm {grad_norm.item():.3f}")

    # Every rank ends with the same weights.
    for p in model.parameters():
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, p.detach())
        assert all(torch.equal(c, copies[0]) for c in copies)
    if rank == 0:
        print(f"{hook}: ranks in sync")
    # DDP's reducer sits in a reference cycle that holds the process group: collected only at
    # interpreter teardown, the group's threads can abort the process ("terminate called
    # without an active exception"). Free it before the group goes.
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
