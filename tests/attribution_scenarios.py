"""Non-finite attribution on every rank of a 2-rank gloo process group, run by
``tests/test_attribution.py`` through ``tests/multiprocess.py``. Each takes ``(rank, world)``
and raises on failure.

An inf or NaN is put into one parameter's gradient on one rank only, through the loss: a term
``sqrt(w - w.detach())`` is 0 in value (the loss stays finite) and has an infinite gradient in
``w``. It rides on a marked micro-batch, so a recompute of the step meets it again, as it would
meet a batch that overflows.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradfuse.train import TrainConfig, Trainer
from gradfuse.train.attribution import NonfiniteAttribution, nonfinite_report

STEPS, ACCUM, PER_RANK = 4, 2, 4
POISONED = "3.weight"  # the Linear after the BatchNorm


def model() -> nn.Module:
    torch.manual_seed(0)
    # Dropout draws from the RNG and BatchNorm updates buffers in forward: a recompute must put both back.
    return nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2)
    )


def batches(rank: int, poison_at: tuple[int, int] | None, kind: str = "inf") -> list:
    """``STEPS * ACCUM`` micro-batches ``(x, y, poison)`` of this rank; ``poison`` names the
    injection on the micro-batch ``poison_at = (step, micro)`` (steps from 1), else None."""
    gen = torch.Generator().manual_seed(10 + rank)
    out = []
    for step in range(1, STEPS + 1):
        for micro in range(ACCUM):
            x, y = torch.randn(PER_RANK, 6, generator=gen), torch.randn(PER_RANK, 2, generator=gen)
            out.append((x, y, kind if (step, micro) == poison_at else None))
    return out


def poisoned_loss(model, batch):
    x, y, poison = batch
    loss = F.mse_loss(model(x), y)
    w = dict(model.named_parameters())[POISONED] if not hasattr(model, "module") else None
    if w is None:  # DDP's wrapper: the user's module is .module
        w = dict(model.module.named_parameters())[POISONED]
    if poison == "inf":
        loss = loss + (w - w.detach()).sqrt().sum()  # value 0, gradient +inf in every element of w
    elif poison == "huge":
        # value 0; gradient 3e38 after the division by ACCUM: finite, but the sum of two overflows
        loss = loss + (w - w.detach()).mul(3e38).sum() * ACCUM
    return loss


def settings(**overrides) -> TrainConfig:
    base = dict(max_steps=STEPS, grad_accum_steps=ACCUM, max_grad_norm=1.0, lr=1e-2, log_every=1, progress=False)
    return TrainConfig(**{**base, **overrides})


def all_equal_across_ranks(tensors) -> bool:
    mine = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    both = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(both, mine)
    return all(torch.equal(both[0], b) for b in both[1:])


def ddp_inf_on_rank_1_names_the_parameter_and_rank_1(rank, world):
    """Rank 1's second micro-batch of step 2 puts +inf into one gradient. The row of step 2
    names that parameter and rank 1 alone; the step is skipped on both ranks; the recompute
    starts from the step's random state and leaves the random state, the buffers and DDP's
    buffer sync as the step left them; finite steps run nothing extra (no all-gather, no
    second forward)."""
    net = model()
    calls = []  # per loss_fn call: (RNG state on entry, RNG state after the forward, buffers after it)

    def recording_loss(model, batch):
        entry = torch.get_rng_state()
        loss = poisoned_loss(model, batch)
        calls.append((entry, torch.get_rng_state(), [b.detach().clone() for b in net.buffers()]))
        return loss

    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    data = batches(rank, (2, 1) if rank == 1 else None)
    trainer = Trainer(net, opt, data, settings(), loss_fn=recording_loss)
    real_gather, gathers = dist.all_gather, []

    def counting(*args, **kwargs):
        gathers.append(trainer.step + 1)
        return real_gather(*args, **kwargs)

    rows = []
    dist.all_gather = counting
    try:
        for _ in range(STEPS):
            before = [p.detach().clone() for p in net.parameters()]
            rows.append(trainer.train_step())
            if trainer.step == 2:
                assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))  # skipped
                assert torch.equal(torch.get_rng_state(), calls[3][1])  # as the step's last forward left it
                assert all(torch.equal(a, b) for a, b in zip(net.buffers(), calls[3][2], strict=True))
                assert trainer.grads.module.require_forward_param_sync is True
                assert all(p.grad is None for p in net.parameters())
    finally:
        dist.all_gather = real_gather
    bad = rows[1]
    assert bad["nonfinite_grads"] == [POISONED], bad
    assert bad["nonfinite_ranks"] == {POISONED: [1]}, bad
    assert "nonfinite_note" not in bad, bad
    assert [r["skipped"] for r in rows] == [0, 1, 1, 1]
    assert all("nonfinite_grads" not in r for r in rows[:1] + rows[2:])
    # loss_fn: ACCUM calls per step, plus ACCUM for the recompute of step 2 only.
    assert len(calls) == STEPS * ACCUM + ACCUM, len(calls)
    # The recompute (calls 4, 5) started from the step's random state (calls 2, 3): same dropout masks.
    assert torch.equal(calls[4][0], calls[2][0]) and torch.equal(calls[5][0], calls[3][0])
    assert gathers == [2], gathers  # one all-gather, on the flagged step; none on a finite step
    assert all_equal_across_ranks(list(net.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))  # it trains on


class Augmented:
    """``batches`` with noise drawn from torch's global generator as each batch is fetched (an
    augmentation in this process, as a DataLoader with ``num_workers=0`` runs it): the random
    state a forward begins with is the one after its batch was fetched."""

    def __init__(self, data: list):
        self.data = data

    def __iter__(self):
        for x, y, poison in self.data:
            yield x + 0.01 * torch.randn_like(x), y, poison


def ddp_recompute_starts_each_forward_from_its_own_random_state(rank, world):
    """Data that draws from the RNG when fetched (``Augmented``), with dropout in the model: the
    recompute of step 2 reproduces the step (each micro-batch's forward from the random state
    it began with, not the step's start) and names rank 1."""
    net = model()
    data = Augmented(batches(rank, (2, 1) if rank == 1 else None))
    trainer = Trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-2), data, settings(max_steps=2),
                      loss_fn=poisoned_loss)  # fmt: skip
    rows = trainer.fit()
    bad = rows[1]
    assert bad["nonfinite_grads"] == [POISONED] and bad["nonfinite_ranks"] == {POISONED: [1]}, bad
    assert "nonfinite_note" not in bad, bad


def ddp_inf_on_both_ranks_names_both_and_leaves_no_trace(rank, world):
    """Both ranks poison the same parameter on step 1 (where DDP then rebuilds its buckets, in
    the recompute's forward): ``[0, 1]``, and the message names them. Three steps with the
    recompute end bit for bit where three steps without it do (the weights, the BatchNorm
    buffers, the random state): it leaves nothing behind."""
    ends = []
    for recompute in (True, False):
        torch.manual_seed(7)  # the same dropout masks in both runs
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)  # not fused: the scaler's own skip
        trainer = Trainer(net, opt, batches(rank, (1, 0)), settings(max_steps=3), loss_fn=poisoned_loss)
        trainer.nonfinite.recompute = recompute  # off: the row names no rank, nothing else differs
        rows = trainer.fit()
        ends.append(([t.detach().clone() for t in [*net.parameters(), *net.buffers()]], torch.get_rng_state()))
        if recompute:
            row = rows[0]
            assert row["nonfinite_ranks"] == {POISONED: [0, 1]} and row["nonfinite_grads"] == [POISONED], row
            message = trainer._skip_message(row)
            want = f"step 1: gradients overflowed (inf/NaN) in {POISONED} (ranks 0, 1); step skipped"
            assert message == want, message
            assert [r["skipped"] for r in rows] == [1, 1, 1]
    (with_it, rng_with), (without, rng_without) = ends
    assert all(torch.equal(a, b) for a, b in zip(with_it, without, strict=True))
    assert torch.equal(rng_with, rng_without)
    assert all_equal_across_ranks(with_it[: len(list(model().parameters()))])


def ddp_overflow_in_the_reduction_is_said_so(rank, world):
    """A gradient of 3e38 on each rank is finite on each, and its sum across ranks overflows: the
    step is skipped, the parameter named, no rank, and the note says why."""
    net = model()
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), batches(rank, (1, 1), "huge"),
                      settings(max_steps=1, max_grad_norm=None), loss_fn=poisoned_loss)  # fmt: skip
    (row,) = trainer.fit()
    assert row["nonfinite_grads"] == [POISONED] and row["nonfinite_ranks"] == {POISONED: []}, row
    assert "the sum across ranks overflowed" in row["nonfinite_note"], row
    assert row["skipped"] == 1


def ddp_recompute_that_does_not_reproduce_names_no_rank(rank, world):
    """A loss_fn that is not the same function twice (its loss depends on how often it was called,
    and the inf rides on that count, not on the batch): the recompute differs, the row says so
    and names no rank; the step is still skipped and training goes on."""
    net = model()
    count = {"n": 0}

    def drifting_loss(model, batch):
        count["n"] += 1
        x, y, _ = batch
        poison = "inf" if rank == 1 and count["n"] == 3 else None  # step 2, first micro-step, first time only
        return poisoned_loss(model, (x, y, poison)) * (1 + 1e-3 * count["n"])

    trainer = Trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True), batches(rank, None),
                      settings(max_steps=3), loss_fn=drifting_loss)  # fmt: skip
    rows = trainer.fit()
    bad = rows[1]
    assert bad["nonfinite_grads"] == [POISONED] and bad["nonfinite_ranks"] is None, bad
    assert "did not reproduce it on rank 0, 1 (its loss differed)" in bad["nonfinite_note"], bad
    assert [r["skipped"] for r in rows] == [0, 1, 1]
    assert all_equal_across_ranks(list(net.parameters()))


class Tracking(nn.Module):
    """``model()`` whose forward keeps a running mean of its hidden activations in a registered
    buffer by *replacing* it (``self.ema = 0.9 * self.ema + ...``: a new tensor each time, as
    much user code does), and, with ``draws``, scales its input by numbers drawn from Python's
    ``random`` and numpy's global generator."""

    def __init__(self, draws: bool = False):
        super().__init__()
        self.net = model()
        self.register_buffer("ema", torch.zeros(16))
        self.draws = draws

    def forward(self, x):
        if self.draws:
            x = x * (1 + 0.1 * random.random()) + 0.01 * float(np.random.standard_normal())
        h = self.net[0](x)
        with torch.no_grad():
            self.ema = 0.9 * self.ema + 0.1 * h.mean(0)
        for layer in self.net[1:]:
            h = layer(h)
        return h


def tracking_loss(model, batch):
    x, y, poison = batch
    loss = F.mse_loss(model(x), y)
    inner = model.module if hasattr(model, "module") else model
    w = inner.net[3].weight  # POISONED
    if poison == "inf":
        loss = loss + (w - w.detach()).sqrt().sum()
    return loss


def _with_and_without_rerun(rank: int, draws: bool) -> list:
    """3 steps of ``Tracking`` with rank 1's step-2 gradient poisoned, the recompute on and off
    (the same seeds): (rows, parameters and buffers, torch/Python/numpy RNG states) of each."""
    runs = []
    for rerun in (True, False):
        torch.manual_seed(7)
        random.seed(7)
        np.random.seed(7)
        net = Tracking(draws)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        data = batches(rank, (2, 1) if rank == 1 else None)
        trainer = Trainer(net, opt, data, settings(max_steps=3), loss_fn=tracking_loss)
        trainer.nonfinite.recompute = rerun  # off: nothing is run again (TrainConfig(nonfinite_rerun=False))
        rows = trainer.fit()
        state = [t.detach().clone() for t in [*net.parameters(), *net.buffers()]]
        rngs = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
        runs.append((rows, state, rngs, net))
    return runs


def _assert_no_trace(runs) -> None:
    (rows, with_it, rngs_with, net), (_, without, rngs_without, _) = runs
    assert rows[1]["nonfinite_ranks"] == {"net.3.weight": [1]} and "nonfinite_note" not in rows[1], rows[1]
    names = [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()]
    differ = [n for n, a, b in zip(names, with_it, without, strict=True) if not torch.equal(a, b)]
    assert not differ, f"the recompute left its trace in {differ}"
    assert torch.equal(rngs_with[0], rngs_without[0]) and rngs_with[1] == rngs_without[1]
    assert (rngs_with[2] == rngs_without[2]).all()


def ddp_recompute_puts_back_a_buffer_forward_replaces(rank, world):
    """A registered buffer that forward replaces (``self.ema = 0.9 * self.ema + ...``): after
    the recompute of the flagged step the module holds the buffer it held before, with its
    values; three steps end bit for bit where they end without the recompute (a96b1fb kept the
    recompute's buffer, off by 1e-3)."""
    _assert_no_trace(_with_and_without_rerun(rank, draws=False))


def ddp_recompute_puts_back_python_and_numpy_random(rank, world):
    """A forward that draws from Python's ``random`` and numpy's generator: the recompute starts
    each forward from the states its forward began with (so it reproduces the step and names
    rank 1), and puts them back after: the weights end bit for bit as without the recompute
    (a96b1fb: "not reproduced", and the weights 4.8e-3 apart after two steps)."""
    _assert_no_trace(_with_and_without_rerun(rank, draws=True))


def nonfinite_rerun_off_runs_nothing_again(rank, world):
    """``TrainConfig(nonfinite_rerun=False)``: a forward hook counts 8 calls in 4 steps of 2
    micro-batches (10 with the recompute of the flagged step); the row names the parameter and
    says that no rank was looked for."""
    calls = []
    for rerun in (False, True):
        net = model()
        hook = net.register_forward_hook(lambda module, args, out, rerun=rerun: calls.append(rerun))
        data = batches(rank, (2, 1) if rank == 1 else None)
        cfg = settings(nonfinite_rerun=rerun)
        rows = Trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-2), data, cfg, loss_fn=poisoned_loss).fit()
        hook.remove()
        bad = rows[1]
        assert bad["nonfinite_grads"] == [POISONED], bad
        if rerun:
            assert bad["nonfinite_ranks"] == {POISONED: [1]}, bad
        else:
            assert bad["nonfinite_ranks"] is None and "TrainConfig.nonfinite_rerun=False" in bad["nonfinite_note"], bad
    assert calls.count(False) == STEPS * ACCUM == 8 and calls.count(True) == STEPS * ACCUM + ACCUM == 10, calls


def fsdp2_shards_report_the_ranks_that_hold_them(rank, world):
    """A real FSDP2 model (``fully_shard``): rank 0 puts +inf into the output gradient of units
    12..23 of ``body.0``; after the reduce-scatter those rows are rank 1's shard (Shard(0), 24 rows).
    ``nonfinite_report`` names ``body.0.weight`` and ``body.0.bias`` on rank 1 alone; the
    Trainer's attribution in its DTensor mode gives the same, with its note."""
    from torch.distributed.fsdp import fully_shard

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 24), nn.LayerNorm(24), nn.Tanh(), nn.Linear(24, 24))
            self.head = nn.Linear(24, 1)  # one row: rank 1's shards of head.weight and head.bias are empty

        def forward(self, x):
            h = self.body[0](x)
            if rank == 0:
                h.register_hook(lambda g: g.index_fill(1, torch.arange(12, 24), math.inf))
            for layer in self.body[1:]:
                h = layer(h)
            return self.head(h)

    torch.manual_seed(0)
    net = Net()
    for layer in net.body:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    net(torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))).square().mean().backward()

    named = [(n, p.grad) for n, p in net.named_parameters()]
    before = [g.to_local().clone() for _, g in named]
    report = nonfinite_report(named)
    assert report == {"body.0.weight": [1], "body.0.bias": [1]}, report
    # The same from torch: which ranks' local shards hold a non-finite element.
    for name, grad in named:
        local = torch.tensor([float((~torch.isfinite(grad.to_local())).any())])
        held = [torch.empty(1) for _ in range(world)]
        dist.all_gather(held, local)
        assert [r for r, h in enumerate(held) if h.item()] == report.get(name, []), name
    attribution = NonfiniteAttribution(net, torch.device("cpu"), None, world)
    assert not attribution.recompute  # DTensor parameters: the shards tell, nothing is recomputed
    row = attribution.report(1)
    assert row["nonfinite_grads"] == ["body.0.weight", "body.0.bias"] and row["nonfinite_ranks"] == report, row
    assert "shards" in row["nonfinite_note"]
    for (_, grad), saved in zip(named, before, strict=True):  # nothing changed
        assert torch.equal(grad.to_local().nan_to_num(), saved.nan_to_num())
