"""Scenarios for ``gradfuse.Trainer`` on every rank of a 2-rank gloo process group, run by
``tests/test_train_distributed.py`` through ``tests/multiprocess.py``. Each takes ``(rank,
world)`` and raises on failure. The process group exists before the Trainer is made, so the
Trainer joins it, as it would under torchrun.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradfuse.train import CheckpointError, TrainConfig, Trainer, TrainingInterrupted, list_checkpoints, lr_factor
from gradfuse.train.lock import CheckpointFolderInUse

STEPS, ACCUM, PER_RANK = 4, 2, 4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def combined_batches(n: int, size: int, outputs: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of ``size`` rows of the whole world (``my_share`` cuts this rank's rows);
    ``outputs`` targets per row. Shared with ``fsdp_scenarios.py``."""
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(size, 6, generator=gen), torch.randn(size, outputs, generator=gen)) for _ in range(n)]


def my_share(batches, rank: int, world: int):
    size = len(batches[0][0]) // world
    return [(x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]) for x, y in batches]


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def reference_run(
    ref: nn.Module,
    combined: list,
    accum: int,
    steps: int,
    *,
    loss_fn=None,
    fused: bool = False,
    norm_type: float = 2.0,
    before_clip=None,
) -> tuple[list[float], list[float]]:
    """The reference the Trainer is compared with: ``ref`` trained by hand in one process on the
    combined batches, with the Trainer's cosine schedule (lr 1e-2, one warm-up step), torch's own
    ``clip_grad_norm_`` to 0.05 and AdamW; ``before_clip(ref)`` sees each step's gradients before
    the clip. Returns the losses and the norms of every step."""
    loss_fn = loss_fn or mse
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused)
    losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * lr_factor(step, max_steps=steps, warmup_steps=1, schedule="cosine", min_lr_ratio=0.0)
        opt.zero_grad()
        loss = 0.0
        for micro in range(accum):
            micro_loss = loss_fn(ref, combined[step * accum + micro]) / accum
            micro_loss.backward()
            loss += micro_loss.item()
        if before_clip is not None:
            before_clip(ref)
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type).item())
        opt.step()
        losses.append(loss)
    return losses, norms


def settings(**overrides) -> TrainConfig:
    base = dict(
        max_steps=STEPS, grad_accum_steps=ACCUM, max_grad_norm=0.05, lr=1e-2, lr_schedule="cosine", warmup_steps=1,
        log_every=1, progress=False,
    )  # fmt: skip
    return TrainConfig(**{**base, **overrides})


def shared_folder(name: str) -> Path:
    """A folder both ranks name the same way (their parent is the same pytest process)."""
    return Path(tempfile.gettempdir(), f"gradfuse-train-dist-{os.getppid()}", name)


def two_ranks_match_one_process_on_the_combined_batch(rank, world):
    combined = combined_batches(STEPS * ACCUM, PER_RANK * world)
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    trainer = Trainer(net, opt, my_share(combined, rank, world), settings(), loss_fn=mse)
    rows = trainer.fit()
    # The step's norm is the one gradfuse's DDP hook measured during backward.
    assert rows[-1]["grad_norm"] == trainer.grads.hook.total_norm().item()

    ref = model()  # one process, the combined batches, torch's own clipping
    losses, norms = reference_run(ref, combined, ACCUM, STEPS, fused=True)
    torch.testing.assert_close([r["loss"] for r in rows], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=1e-5, atol=0)
    assert all(r["clip_coef"] < 1 for r in rows)
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def communication_only_on_the_last_micro_step(rank, world):
    """With no_sync on the first micro-steps, 4 micro-steps per step communicate as often as 1."""
    real, calls = dist.all_reduce, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    counts = []
    for accum in (1, 4):
        batches = my_share(combined_batches(3 * accum, 2 * world), rank, world)
        net = model()
        cfg = settings(max_steps=3, grad_accum_steps=accum)
        trainer = Trainer(net, torch.optim.AdamW(net.parameters()), batches, cfg, loss_fn=mse)
        calls.clear()
        dist.all_reduce = counting
        try:
            trainer.fit()
        finally:
            dist.all_reduce = real
        counts.append(len(calls))
    # Per step: the loss's mean, then the one bucket of this small model (by gradfuse's DDP hook).
    assert counts[0] == counts[1] == 3 * 2, counts


def rank_0_writes_and_every_rank_resumes(rank, world):
    folder = shared_folder("resume")
    batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
    mine = folder / f"rank{rank}"  # rank 1 is told to write here too: it must not
    cfg = settings(checkpoint_dir=mine / "checkpoints", save_every=2, metrics_path=mine / "metrics.jsonl")

    def run(crash_at=None, resume=None):
        net = model()

        def loss_fn(model, batch):
            if trainer.step == crash_at:
                raise RuntimeError("crash")
            return mse(model, batch)

        opt = torch.optim.AdamW(net.parameters(), fused=True)
        trainer = Trainer(net, opt, batches, cfg, loss_fn=loss_fn, resume=resume)
        trainer.fit()
        return trainer

    try:
        straight = [p.detach().clone() for p in run().model.parameters()]
        if rank == 0:
            assert len(list((mine / "checkpoints").iterdir())) == 2 and (mine / "metrics.jsonl").is_file()
        else:
            assert not mine.exists()
        cfg = settings(checkpoint_dir=folder / "rank0" / "crash", save_every=2)  # every rank reads rank 0's
        try:
            run(crash_at=2)
        except RuntimeError as err:
            assert str(err) == "crash"
        dist.barrier()  # rank 0 has written its checkpoint of step 2
        resumed = run(resume="latest")
        assert resumed.step == STEPS
        for a, b in zip(straight, resumed.model.parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder.parent, ignore_errors=True)


def token_exact_accumulation_over_ranks_and_micro_batches(rank, world):
    """``loss_normalization="tokens"``: the micro-batches of each rank hold different numbers of
    counted rows (the "tokens"), and the step's gradient is the mean over every counted row of
    every micro-batch on every rank, as one process on the combined batch gives (float64)."""
    gen = torch.Generator().manual_seed(11)
    counted = [[4, 1], [2, 3]]  # [rank][micro]: rows counted out of 4 in each micro-batch
    combined = []
    for r in range(world):
        for micro in range(ACCUM):
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
            combined.append((r, x, y, torch.arange(4) < counted[r % 2][micro]))

    def summed(model, batch):
        x, y, mask = batch
        return ((model(x) - y) ** 2).sum(-1)[mask].sum(), mask.sum()

    net = model()
    mine = [(x, y, mask) for r, x, y, mask in combined if r == rank]
    cfg = settings(max_steps=1, max_grad_norm=None, loss_normalization="tokens")
    (row,) = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.0), mine, cfg, loss_fn=summed).fit()

    ref = model().double()
    per_row = torch.cat([((ref(x.double()) - y.double()) ** 2).sum(-1)[mask] for _, x, y, mask in combined])
    loss = per_row.mean()
    loss.backward()
    assert abs(row["loss"] - loss.item()) <= 1e-6 * loss.item(), (row["loss"], loss.item())
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-5, atol=1e-7)


def a_signal_on_one_rank_stops_every_rank_after_the_same_step(rank, world):
    """SIGINT reaches rank 1 only: it rides the step's loss all-reduce, so both ranks finish the
    same step, rank 0 writes the checkpoint of it, and both raise TrainingInterrupted."""
    folder = shared_folder("signal")

    class SignalOnRank1:
        def on_step_end(self, row):
            if rank == 1 and row["step"] == 2:
                os.kill(os.getpid(), signal.SIGINT)

    net = model()
    batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
    cfg = settings(max_steps=50, checkpoint_dir=folder)
    trainer = Trainer(net, torch.optim.AdamW(net.parameters()), batches, cfg, loss_fn=mse, callbacks=[SignalOnRank1()])
    try:
        try:
            trainer.fit()
            raise AssertionError("fit() ran to the end")
        except TrainingInterrupted as stop:
            assert stop.step == trainer.step == 3, stop.step
            assert ("SIGINT" if rank == 1 else "a signal on another rank") in str(stop)
        dist.barrier()
        assert [p.name for p in folder.iterdir()] == ["step-00000003.pt"]
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def health_features_agree_across_ranks(rank, world):
    """skip_spikes + clip="zclip" + log_grad_norms on 2 ranks: a loss spike on rank 1 alone is
    skipped by both (the mean loss spikes), and the weights and per-module norms stay identical."""
    steps = 12
    batches = my_share(combined_batches(steps, PER_RANK * world), rank, world)
    net = model()
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = mse(model, batch)
        return loss * 100 if rank == 1 and calls["n"] == 10 else loss

    cfg = settings(
        max_steps=steps, grad_accum_steps=1, max_grad_norm=None, clip="zclip",
        clip_options={"warmup_steps": 3, "max_grad_norm": None}, skip_spikes=(8, 6.0, 4), log_grad_norms=1,
    )  # fmt: skip
    trainer = Trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True), batches, cfg, loss_fn=loss_fn)
    rows = []
    for step in range(steps):
        before = [p.detach().clone() for p in net.parameters()]
        rows.append(trainer.train_step())
        if step == 9:
            assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert [r["spikes_skipped"] for r in rows] == [0] * 9 + [1] * 3, [r["spikes_skipped"] for r in rows]
    mine = torch.cat([p.detach().reshape(-1) for p in net.parameters()] + [torch.tensor([rows[-1]["grad_norm/0"]])])
    both = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(both, mine)
    assert torch.equal(both[0], both[1])


# --- the checkpoint folder under DDP ------------------------------------------------------------


def ranks_that_find_different_latest_checkpoints_all_raise(rank, world):
    """resume="latest" where rank 0 finds a checkpoint and rank 1 finds none (each rank was given
    its own folder: not a file system they share): every rank raises, naming what each found.
    a96b1fb: rank 1 skipped the load, and rank 0 waited for it in the load's collective."""
    folder = shared_folder(f"latest-rank{rank}")
    batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
    try:
        net = model()
        Trainer(net, torch.optim.AdamW(net.parameters()), batches, settings(max_steps=1, checkpoint_dir=folder),
                loss_fn=mse).fit()  # fmt: skip
        assert [p.name for p in list_checkpoints(folder)] == (["step-00000001.pt"] if rank == 0 else [])
        net = model()
        try:
            Trainer(net, torch.optim.AdamW(net.parameters()), batches, settings(checkpoint_dir=folder), loss_fn=mse,
                    resume="latest")  # fmt: skip
            raise AssertionError("the ranks resumed differently")
        except CheckpointError as err:
            assert "the ranks would not resume alike" in str(err) and "rank 1: no checkpoint" in str(err), err
    finally:
        dist.barrier()
        shutil.rmtree(folder.parent, ignore_errors=True)


def rank_0_holds_the_folder_and_a_second_trainer_is_refused_on_every_rank(rank, world):
    """Rank 0 holds the checkpoint folder's lock while the Trainer runs (the other ranks write
    nothing there); a second Trainer on the folder is refused on every rank at once, and the
    first trains and saves untouched."""
    folder = shared_folder("lock")
    batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
    try:
        net = model()
        first = Trainer(net, torch.optim.AdamW(net.parameters()), batches, settings(checkpoint_dir=folder), loss_fn=mse)
        assert (first.lock is not None and first.lock.held) == (rank == 0)
        other = model()
        try:
            Trainer(other, torch.optim.AdamW(other.parameters()), batches, settings(checkpoint_dir=folder),
                    loss_fn=mse)  # fmt: skip
            raise AssertionError("a second Trainer took the folder")
        except (CheckpointFolderInUse, CheckpointError) as err:
            assert isinstance(err, CheckpointFolderInUse) == (rank == 0), err
            assert f"{folder} is in use by a gradfuse.Trainer (pid" in str(err), err
        first.fit()
        dist.barrier()
        assert [p.name for p in list_checkpoints(folder)] == [f"step-{STEPS:08d}.pt"]
        assert not first.lock or not first.lock.held
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


class WithUnused(nn.Module):
    """``model()`` beside a layer that forward never uses."""

    def __init__(self):
        super().__init__()
        self.used = model()
        self.unused = nn.Linear(6, 2)

    def forward(self, x):
        return self.used(x)


def one_process_with_unused(combined: list, accum: int) -> tuple[nn.Module, list[float], list[float]]:
    """``WithUnused`` trained by hand in one process on the combined batches (torch's clip; the
    unused parameters have no gradient): (model, losses, norms)."""
    ref = WithUnused()
    losses, norms = reference_run(ref, combined, accum, STEPS)
    assert ref.unused.weight.grad is None
    return ref, losses, norms


def unused_parameters_train_with_the_ddp_option_and_its_error_names_the_field(rank, world):
    """A model with an unused parameter: with TrainConfig(find_unused_parameters=True) (and
    accumulation), or static_graph=True (one micro-batch a step), it trains on 2 ranks as one
    process does on the combined batch: the losses, the norm gradfuse's hook measured with the
    unused parameter's slot in its bucket, the weights (the unused ones untouched). Without
    either, DDP's error at the second step names the TrainConfig field (a96b1fb: DDP's own
    message, naming a keyword the Trainer did not take)."""
    for option, accum in (("find_unused_parameters", ACCUM), ("static_graph", 1)):
        combined = combined_batches(STEPS * accum, PER_RANK * world)
        ref, losses, norms = one_process_with_unused(combined, accum)
        net = WithUnused()
        unused = [p.detach().clone() for p in net.unused.parameters()]
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        cfg = settings(grad_accum_steps=accum, **{option: True})
        rows = Trainer(net, opt, my_share(combined, rank, world), cfg, loss_fn=mse).fit()
        torch.testing.assert_close([r["loss"] for r in rows], losses, rtol=1e-5, atol=0)
        torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=1e-5, atol=0)
        for a, b in zip(net.used.parameters(), ref.used.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(unused, net.unused.parameters(), strict=True)), option
    net = WithUnused()
    combined = combined_batches(STEPS * ACCUM, PER_RANK * world)
    trainer = Trainer(net, torch.optim.AdamW(net.parameters()), my_share(combined, rank, world), settings(),
                      loss_fn=mse)  # fmt: skip
    try:
        trainer.fit()
        raise AssertionError("DDP trained a model with an unused parameter without find_unused_parameters")
    except RuntimeError as err:
        assert "TrainConfig(find_unused_parameters=True)" in str(err), err
        assert "Expected to have finished reduction" in str(err), err  # DDP's own message follows
        assert trainer.step == 1, trainer.step


class Sometimes(nn.Module):
    """``model()`` and a last layer that forward uses only when told (``use``)."""

    def __init__(self):
        super().__init__()
        self.used = model()
        self.extra = nn.Linear(2, 2)

    def forward(self, x, use: bool):
        h = self.used(x)
        return self.extra(h) if use else h


def a_parameter_used_on_one_rank_only_gives_one_process_result(rank, world):
    """find_unused_parameters=True with a layer that rank 0 uses and rank 1 does not: DDP
    reduces rank 0's gradient with rank 1's zero slot, and the norm gradfuse's hook measures
    (a gradient present on one rank, absent on the other) and the weights are those of one
    process on both halves of the batch (torch's clip)."""

    def loss_fn(model, batch):
        x, y, use = batch
        return F.mse_loss(model(x, use), y)

    combined = combined_batches(STEPS * ACCUM, PER_RANK * world)
    halves = [my_share(combined, r, world) for r in range(world)]
    net = Sometimes()
    mine = [(x, y, rank == 0) for x, y in halves[rank]]
    cfg = settings(find_unused_parameters=True)
    rows = Trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-2), mine, cfg, loss_fn=loss_fn).fit()
    ref = Sometimes()
    # One process on every rank's micro-batch of each step (the mean over the ranks, as DDP's).
    both = [[(x, y, r == 0) for r, (x, y) in enumerate(pair)] for pair in zip(*halves, strict=True)]
    _, norms = reference_run(
        ref, both, ACCUM, STEPS, loss_fn=lambda model, batch: sum(loss_fn(model, b) for b in batch) / world
    )
    torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=1e-5, atol=0)
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
