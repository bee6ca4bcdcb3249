"""Scenarios for ``gradfuse.Trainer`` with ``parallel="fsdp"`` (FSDP2's ``fully_shard``) on every
rank of a 2-rank gloo process group, run by ``tests/test_trainer_fsdp.py`` through
``tests/multiprocess.py``. Each takes ``(rank, world)`` and raises on failure.

Why the comparisons are not bitwise: FSDP2 reduce-scatters the gradients where DDP all-reduces
them (another summation order, and a pre-division by the world size), the total norm adds the
ranks' shards in another order, and one process sums the combined batch's rows in one matmul
where two ranks sum half each; fp32 rounding differs at the level of 1e-7 relative per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from gradfuse.train import TrainConfig, Trainer, lr_factor

STEPS, ACCUM, PER_RANK = 3, 2, 4


class Block(nn.Module):
    """The unit FSDP2 shards on its own (``fsdp_units=["Block"]``)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def model() -> nn.Module:
    torch.manual_seed(0)
    # 3 outputs: the last layer's rows shard unevenly over 2 ranks (FSDP2 pads the second).
    return nn.Sequential(nn.Linear(6, 16), Block(16), Block(16), nn.Linear(16, 3))


def combined_batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(size, 6, generator=gen), torch.randn(size, 3, generator=gen)) for _ in range(n)]


def my_share(batches, rank: int, world: int):
    size = len(batches[0][0]) // world
    return [(x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]) for x, y in batches]


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def settings(**overrides) -> TrainConfig:
    base = dict(
        max_steps=STEPS, grad_accum_steps=ACCUM, max_grad_norm=0.05, lr=1e-2, lr_schedule="cosine", warmup_steps=1,
        log_every=1, progress=False, parallel="fsdp", fsdp_units=["Block"],
    )  # fmt: skip
    return TrainConfig(**{**base, **overrides})


def full(params) -> list[torch.Tensor]:
    """The whole tensors, gathered from every rank's shard (a collective: every rank calls it)."""
    return [p.full_tensor().detach().clone() if isinstance(p, DTensor) else p.detach().clone() for p in params]


def train(parallel: str, precision: str, rank: int, world: int, optimizer=None, **overrides):
    """(trainer, rows, the whole weights after) of a Trainer run on this rank's share."""
    net = model()
    opt = (optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True)))(net.parameters())
    if parallel == "ddp":
        overrides["fsdp_units"] = []
    cfg = settings(parallel=parallel, precision=precision, **overrides)
    batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
    trainer = Trainer(net, opt, batches, cfg, loss_fn=mse)
    rows = trainer.fit()
    return trainer, rows, full(net.parameters())


def one_process(world: int, loss_fn=mse):
    """The reference: one process on the combined batches, torch's own clip and fused AdamW."""
    combined = combined_batches(STEPS * ACCUM, PER_RANK * world)
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    losses, norms = [], []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * lr_factor(step, max_steps=STEPS, warmup_steps=1, schedule="cosine", min_lr_ratio=0.0)
        opt.zero_grad()
        loss = 0.0
        for micro in range(ACCUM):
            micro_loss = loss_fn(ref, combined[step * ACCUM + micro]) / ACCUM
            micro_loss.backward()
            loss += micro_loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
        opt.step()
        losses.append(loss)
    return losses, norms, [p.detach() for p in ref.parameters()]


def fsdp_matches_ddp_and_one_process_fp32(rank, world):
    trainer, rows, weights = train("fsdp", "fp32", rank, world)
    assert trainer.grads.sharded
    assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
    # The user's optimizer was carried over to the sharded parameters: it steps the model's own.
    assert [id(p) for p in trainer.optimizer.param_groups[0]["params"]] == [id(p) for p in trainer.model.parameters()]
    _, ddp_rows, ddp_weights = train("ddp", "fp32", rank, world)
    losses, norms, ref_weights = one_process(world)
    assert all(r["clip_coef"] < 1 for r in rows)  # the clip was active: the folded clip was exercised
    for other_losses, other_norms, other_weights in (
        ([r["loss"] for r in ddp_rows], [r["grad_norm"] for r in ddp_rows], ddp_weights),
        (losses, norms, ref_weights),
    ):
        torch.testing.assert_close([r["loss"] for r in rows], other_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close([r["grad_norm"] for r in rows], other_norms, rtol=1e-5, atol=0)
        for a, b in zip(weights, other_weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def fsdp_matches_ddp_and_one_process_bf16(rank, world):
    """bf16: FSDP2 gathers bf16 parameters (its MixedPrecisionPolicy) where DDP's autocast casts
    the fp32 ones per op; both round the same fp32 weights to the same bf16 values and compute
    the same per-rank bf16 gradients, reduced in fp32: FSDP2 vs DDP stays within fp32
    tolerance. One process sums the combined batch's rows in a single bf16 matmul where each
    rank sums its half and the halves are added in fp32: a bf16 rounding apart (2**-8), hence
    the looser tolerance against it."""
    _, rows, weights = train("fsdp", "bf16", rank, world)
    _, ddp_rows, ddp_weights = train("ddp", "bf16", rank, world)
    torch.testing.assert_close([r["loss"] for r in rows], [r["loss"] for r in ddp_rows], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ddp_rows], rtol=1e-5, atol=0)
    for a, b in zip(weights, ddp_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def autocast_mse(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mse(model, batch)

    losses, norms, ref_weights = one_process(world, autocast_mse)
    torch.testing.assert_close([r["loss"] for r in rows], losses, rtol=2e-2, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=2e-2, atol=0)
    for a, b in zip(weights, ref_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
